"""The tf_keras / TFRS surface under NestPipeStrategy, on any number of workers (tests compare a
2-worker run with a one-process run of this program).

usage: keras_surface.py OUT_DIR [REFERENCE_DIR]
Writes OUT_DIR/rank<r>.npz on every worker r, holding:
- trained/*: whole tables and dense weights of a functional ranker after a 2-epoch fit;
- history/<key>: that fit's history (loss, auc per epoch);
- metric_reads/{packed,original}/<key> and metric_reads/{packed,original}_collectives: after the
  fit, the metrics' results read in a replica step within NestPipeStrategy's packed reads (one
  all-reduce for every metric's state) and without (tf_keras' own: one per state variable read,
  the positive control), and the collectives each step traced;
- fit_metric_reads/*, own_compute_metrics_reads/*: the packed metric reads (strategy
  .extended.metric_read_counts: packs, riding, packed, fresh) the ranker's fit traced, and a
  2-step fit of a ranker with its own compute_metrics (tf_keras' metrics-after-update order);
- write_after_read/*: within the packed reads, the loss read, its tracker updated and read again
  in one step (before, after, auc, collectives, fresh_reads), and the same reads unpacked in the
  next step (loss_unpacked, auc_unpacked);
- predict: model.predict on a global 100-row dataset (batch 16: the last batch is partial);
- files: the files in OUT_DIR after the saves;
- h5_own/*, weights_h5_own/*, keras_own/*: a fresh model after load_weights(<the .h5>),
  load_weights(<the .weights.h5>) and after
  tf_keras.models.load_model(<the .keras>) (whole tables, dense weights, predictions; and for
  the .keras the tables' Adagrad slots, keras_own/slot/*, against trained/slot/*);
- h5_ref/*: with REFERENCE_DIR, a fresh model after load_weights of the reference's .h5
  (written by another worker count; the run waits for REFERENCE_DIR/w0.h5.done, which every
  run writes once its saves are done, so that the reference can run at the same time);
- wrong_size_error: the error loading an .h5 of a table of another size;
- tfrs_metric_reads/{packs,riding,packed,fresh}: the packed reads the TFRS fit and evaluate traced
  (TFRS's own train_step reads `m.result()` for every metric);
- tfrs/<key>, tfrs_lr, tfrs_eval/<key>: a TFRS model's history (loss, regularization_loss,
  total_loss, auc, and their val_ values from validation_data), ReduceLROnPlateau's learning rate per epoch and evaluate's dict;
  tfrs_first/<key>: the same history with distribute_reduction_method="first" (per-worker
  values, the positive control);
- retrieval_global/*, retrieval_local/*: a TFRS two-tower retrieval model after a fit with the
  global batch's in-batch negatives (tnp.global_in_batch_candidates) and with this worker's
  only; retrieval_*_warnings: the Retrieval warnings each fit raised;
- exactness_dbp, exactness_dbp_nosync: tnp.check_exactness's largest difference for
  pipeline="dbp", and with the buffer sync skipped (stale rows: the positive control).
Files (every worker saves to the same path; only worker 0's copy lands there): OUT_DIR/w0.h5,
w0.weights.h5, m0.keras, saved0/ (model.save(dir)), tf_saved/ (tf.saved_model.save), export/
(export_saved_model with the inferred signature), x_predict.npy.
"""
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders as tfrs  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe import keras_hooks  # noqa: E402
from tf_nestpipe.collectives.counting import count_collectives  # noqa: E402

VOCAB_A, VOCAB_B, DIM, NUM_DENSE = 37, 23, 4, 3
GLOBAL_BATCH, STEPS, EPOCHS = 16, 4, 2
TFRS_EPOCHS = 5


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = {"a": rng.integers(0, VOCAB_A, n).astype(np.int64),
         "b": rng.integers(0, VOCAB_B, n).astype(np.int64),
         "dense": rng.normal(size=(n, NUM_DENSE)).astype(np.float32)}
    y = ((x["a"] % 2 == 0) ^ (x["dense"][:, 0] > 0.2)).astype(np.float32)[:, None]
    return x, y


def ranker(vocab_a=VOCAB_A, seed=0):
    """A functional model: two ShardedEmbedding tables and dense features -> one logit."""
    a = tf_keras.Input(shape=(), dtype=tf.int64, name="a")
    b = tf_keras.Input(shape=(), dtype=tf.int64, name="b")
    dense = tf_keras.Input(shape=(NUM_DENSE,), name="dense")
    init = tf_keras.initializers.RandomUniform(-0.2, 0.2, seed=seed)
    ea = tnp.ShardedEmbedding(vocab_a, DIM, embeddings_initializer=init, name="table_a")(a)
    eb = tnp.ShardedEmbedding(VOCAB_B, DIM, embeddings_initializer=init, name="table_b")(b)
    h = tf_keras.layers.Concatenate()([ea, eb, dense])
    h = tf_keras.layers.Dense(8, activation="relu", name="hidden",
                              kernel_initializer=tf_keras.initializers.GlorotUniform(seed + 1))(h)
    out = tf_keras.layers.Dense(1, name="logit",
                                kernel_initializer=tf_keras.initializers.GlorotUniform(seed + 2))(h)
    model = tf_keras.Model({"a": a, "b": b, "dense": dense}, out)
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[tf_keras.metrics.AUC(from_logits=True, name="auc")])
    return model


def per_worker_dataset(strategy, x, y, repeat):
    """Each worker's contiguous slice of every global batch."""
    def fn(context):
        per = GLOBAL_BATCH // context.num_input_pipelines
        lo = context.input_pipeline_id * per
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        ds = ds.map(lambda f, l: tf.nest.map_structure(lambda t: t[lo:lo + per], (f, l)))
        return ds.repeat() if repeat else ds

    return strategy.distribute_datasets_from_function(fn)


def table_slots(model, prefix):
    """The optimizer's slots of the row-sharded tables, whole (a collective), by position."""
    from tf_nestpipe.strategy.nestpipe_strategy import row_shard_layout
    from tf_nestpipe.strategy.row_shard_saving import gather_full_rows

    strategy = model.distribute_strategy
    slots = [v for v in model.optimizer.variables if row_shard_layout(v) is not None]
    assert len(slots) == 2, [v.name for v in model.optimizer.variables]
    return {"%sslot/%d" % (prefix, i): gather_full_rows(v, row_shard_layout(v),
                                                       strategy.extended.collectives,
                                                       "test/slot%d" % i).numpy()
            for i, v in enumerate(slots)}


def state(model, prefix):
    out = {prefix + "table_a": model.get_layer("table_a").full_table(),
           prefix + "table_b": model.get_layer("table_b").full_table()}
    for layer in ("hidden", "logit"):
        for i, w in enumerate(model.get_layer(layer).get_weights()):
            out["%s%s/%d" % (prefix, layer, i)] = w
    return out


class DCNRanker(tfrs.Model):
    """TFRS ranking model with a SUM-reduced task (scaled by the global batch) and an L2
    regularizer: its train step returns raw loss, regularization_loss and total_loss."""

    def __init__(self, num_workers):
        super().__init__()
        init = tf_keras.initializers.RandomUniform(-0.1, 0.1, seed=5)
        self.table = tnp.ShardedEmbedding(VOCAB_A, DIM, embeddings_initializer=init, name="t")
        self.deep = tf_keras.layers.Dense(
            1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=6),
            # Unscaled: the strategy divides TFRS's regularization by the workers, as compile.
            kernel_regularizer=tf_keras.regularizers.L2(0.01))
        self.task = tfrs.tasks.Ranking(
            loss=tf_keras.losses.BinaryCrossentropy(
                from_logits=True, reduction=tf_keras.losses.Reduction.SUM),
            metrics=[tf_keras.metrics.AUC(from_logits=True, name="auc")])

    def call(self, features):
        return self.deep(tf.concat([self.table(features["a"]), features["dense"]], axis=1))

    def compute_loss(self, inputs, training=False):
        features, labels = inputs
        return self.task(labels=labels, predictions=self(features)) / GLOBAL_BATCH


class TwoTower(tfrs.Model):
    """TFRS retrieval with in-batch negatives: this worker's candidates, or with `global_negatives`
    every worker's (tnp.global_in_batch_candidates)."""

    def __init__(self, global_negatives):
        super().__init__()
        init = tf_keras.initializers.RandomUniform(-0.3, 0.3, seed=8)
        self.users = tnp.ShardedEmbedding(VOCAB_A, DIM, embeddings_initializer=init, name="users")
        self.items = tnp.ShardedEmbedding(VOCAB_B, DIM, embeddings_initializer=init, name="items")
        self.item_tower = tf_keras.layers.Dense(
            DIM, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=9), name="item_tower")
        self.global_negatives = global_negatives
        self.task = tfrs.tasks.Retrieval()  # loss: softmax cross-entropy, SUM reduction

    def compute_loss(self, inputs, training=False):
        features, _ = inputs
        query = self.users(features["a"])
        candidates = self.item_tower(self.items(features["b"]))
        if self.global_negatives:
            candidates = tnp.global_in_batch_candidates(candidates)
        return self.task(query, candidates, compute_metrics=False) / GLOBAL_BATCH


def retrieval_run(strategy, x, y, global_negatives):
    """Fits TwoTower for STEPS steps; returns its whole tables and dense weights, and the
    warnings the fit raised."""
    tf_keras.utils.set_random_seed(9)
    with strategy.scope():
        model = TwoTower(global_negatives)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(0.2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(per_worker_dataset(strategy, x, y, True), epochs=1, steps_per_epoch=STEPS,
                  verbose=0)
    out = {"users": model.users.full_table(), "items": model.items.full_table()}
    for i, w in enumerate(model.item_tower.get_weights()):
        out["item_tower/%d" % i] = w
    messages = [str(w.message) for w in caught if "Retrieval" in str(w.message)]
    return out, messages


def tfrs_run(strategy, x, y, test_x, test_y, reduction=None):
    tf_keras.utils.set_random_seed(7)
    with strategy.scope():
        model = DCNRanker(strategy.num_workers)
        model.compile(optimizer=tf_keras.optimizers.SGD(0.5))
    if reduction is not None:
        model.distribute_reduction_method = reduction
    lrs = []
    record = tf_keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: lrs.append(float(model.optimizer.learning_rate.numpy())))
    plateau = tf_keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                   min_delta=0.02, verbose=0)
    history = model.fit(per_worker_dataset(strategy, x, y, True), epochs=TFRS_EPOCHS,
                        steps_per_epoch=STEPS, callbacks=[plateau, record], verbose=0,
                        validation_data=per_worker_dataset(strategy, test_x, test_y, False),
                        validation_steps=2)
    evaluation = model.evaluate(per_worker_dataset(strategy, test_x, test_y, False),
                                steps=2, return_dict=True, verbose=0)
    return history.history, lrs, evaluation


def mixed_precision_run(strategy, x, y):
    """Fits the ranker for STEPS steps under the mixed_bfloat16 policy (row-sharded tables:
    their exchange groups by the rows' stored dtype); returns its loss history and tables."""
    tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        tf_keras.utils.set_random_seed(11)
        with strategy.scope():
            model = ranker(seed=60)
        initial = {table: model.get_layer(table).full_table() for table in ("table_a", "table_b")}
        history = model.fit(per_worker_dataset(strategy, x, y, True), epochs=1,
                            steps_per_epoch=STEPS, verbose=0)
        out = {"bf16/loss": np.array(history.history["loss"]),
               "bf16/output_dtype": np.array(model.get_layer("table_a").compute_dtype)}
        for table in ("table_a", "table_b"):
            out["bf16/" + table] = model.get_layer(table).full_table()
            out["bf16/initial/" + table] = initial[table]
        return out
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def string_lookup_export(strategy, out):
    """Exports (on every worker) a model whose ids come from a StringLookup and an adapted
    IntegerLookup (a static and a mutable hash table the SavedModel must hold); worker 0 serves
    it in this process against the model's predictions. Then an export whose writing worker
    fails (its path is under a file): every worker must raise."""
    with strategy.scope():
        user = tf_keras.Input((), dtype=tf.string, name="user")
        item = tf_keras.Input((), dtype=tf.int64, name="item")
        items = tf_keras.layers.IntegerLookup()
        items.adapt(np.array([7, 9, 11, 9], np.int64))
        users = tf_keras.layers.StringLookup(vocabulary=["ann", "bob", "cy"])
        h = tf_keras.layers.Concatenate()([
            tnp.ShardedEmbedding(4, DIM, name="users")(users(user)),
            tnp.ShardedEmbedding(items.vocabulary_size(), DIM, name="items")(items(item))])
        model = tf_keras.Model({"user": user, "item": item}, tf_keras.layers.Dense(1)(h))
    features = {"user": tf.constant(["bob", "zed", "ann"]), "item": tf.constant([9, 11, 5], tf.int64)}
    expected = model.predict(features, verbose=0)
    directory = tempfile.mkdtemp(prefix="string_export")
    results = {}
    try:
        tnp.export_saved_model(model, os.path.join(directory, "export"))
        results["string_export"] = "ok"
        if strategy.worker_index == 0:
            served = tf.saved_model.load(os.path.join(directory, "export"))
            outputs = served.signatures["serving_default"](**features)["outputs"].numpy()
            results["string_export/served_diff"] = np.abs(outputs - expected).max()
    except Exception as error:  # pylint: disable=broad-except
        results["string_export"] = "error: %r" % error
    with open(os.path.join(directory, "a_file"), "w"):
        pass
    try:  # worker 0 cannot write under a file: no worker may return as if exported
        tnp.export_saved_model(model, os.path.join(directory, "a_file", "export"))
        results["failed_export"] = "no error"
    except Exception as error:  # pylint: disable=broad-except
        results["failed_export"] = "%s: %s" % (type(error).__name__, error)
    shutil.rmtree(directory)
    return results


class CallMetrics(tf_keras.Model):
    """A model that updates metrics inside call(): `self.add_metric` and a metric object's
    `update_state` (as tf_keras' own distribution tests do)."""

    def __init__(self):
        super().__init__()
        init = tf_keras.initializers.RandomUniform(-0.2, 0.2, seed=70)
        self.table = tnp.ShardedEmbedding(VOCAB_A, DIM, embeddings_initializer=init, name="t")
        self.out = tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(71))
        self.largest = tf_keras.metrics.Mean(name="largest_logit")

    def call(self, features):
        logits = self.out(tf.concat([self.table(features["a"]), features["dense"]], axis=1))
        self.add_metric(tf.reduce_mean(logits), name="mean_logit")
        self.largest.update_state(tf.reduce_max(logits))
        return logits


def call_metrics_run(strategy, x, y):
    """Fits CallMetrics (pipeline "none": under micro-batches its max metric would be the
    parts' statistic; tests/test_frozen_window.py checks their mean metrics); returns its
    history."""
    pipeline, strategy.pipeline = strategy.pipeline, "none"
    try:
        tf_keras.utils.set_random_seed(12)
        with strategy.scope():
            model = CallMetrics()
            model.compile(optimizer=tf_keras.optimizers.SGD(0.5),
                          loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
        history = model.fit(per_worker_dataset(strategy, x, y, True), epochs=2,
                            steps_per_epoch=STEPS, verbose=0)
        return {"call_metrics/" + key: np.array(values) for key, values in history.history.items()}
    finally:
        strategy.pipeline = pipeline


def loop_inside_function_run(strategy):
    """A custom loop that takes its batches from a distributed iterator inside a tf.function
    (TensorFlow's ctl_correctness pattern: a nested tf.function step, a synchronized batch norm,
    2 steps an epoch, a new iterator each epoch); it hangs with one inter-op thread per task.
    Returns the weights after 2 epochs, the last epoch's loss and the inter-op threads."""
    rng = np.random.RandomState(21)
    features = rng.rand(48, 1).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((features, 3 * features)).batch(24)
    tf_keras.utils.set_random_seed(21)
    with strategy.scope():
        model = tf_keras.Sequential([
            # No bias: with inputs in [0, 1) each unit is active for all samples or none, and
            # the norm then cancels a bias's gradient exactly: its value would be rounding
            # noise (scaled up by Adagrad), which differs with the sums' order.
            tf_keras.layers.Dense(8, activation="relu", input_shape=(1,), use_bias=False),
            tf_keras.layers.BatchNormalization(synchronized=True),
            tf_keras.layers.Dense(1)])
        optimizer = tf_keras.optimizers.Adagrad(0.1)
    distributed = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def train_epoch(batches):
        @tf.function
        def step(inputs):
            samples, labels = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    tf_keras.losses.mean_squared_error(labels, model(samples, training=True)),
                    global_batch_size=24)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        iterator = iter(batches)
        total = 0.0
        for _ in range(2):
            total += strategy.reduce("SUM", strategy.run(step, args=(next(iterator),)), axis=None)
        return total / 2.0

    for _ in range(2):
        loss = train_epoch(distributed)
    out = {"loop_in_function/%d" % i: w for i, w in enumerate(model.get_weights())}
    out["loop_in_function/loss"] = loss.numpy()
    out["loop_in_function/inter_op_threads"] = np.array(
        int(os.environ.get("TF_NUM_INTEROP_THREADS", "0")))
    return out


def weight_copy(strategy, model, predict_ds):
    """Keras's weight-copy idiom: a fresh ranker given the trained one's get_weights() (whole
    tables on every worker count) predicts as it does; a table of another size is refused."""
    weights = model.get_weights()
    out = {"get_weights/shapes": np.array([w.shape[0] for w in weights[:2]])}
    with strategy.scope():
        copy = ranker(seed=80)
    copy.set_weights(weights)
    out["set_weights/predict"] = copy.predict(predict_ds, verbose=0)
    with strategy.scope():
        wrong = ranker(vocab_a=VOCAB_A + 2, seed=81)
    try:
        wrong.set_weights(weights)
        out["set_weights/wrong"] = "no error"
    except ValueError as error:
        out["set_weights/wrong"] = str(error)
    return out


def load_after_save(model, out):
    """Every worker loads the path it just saved to: on a disk every worker shares (the
    chief's file is complete when the save returns), and on a disk of its own (a non-chief
    finds no file there: an error saying why)."""
    results = {}
    shared = os.path.join(out, "later.h5")  # after the listing of out
    model.save_weights(shared)
    model.load_weights(shared)
    results["load_after_save/shared"] = "ok"
    own = tempfile.mkdtemp(prefix="own_disk")
    try:
        model.save_weights(os.path.join(own, "w.h5"))
        model.load_weights(os.path.join(own, "w.h5"))
        results["load_after_save/own"] = "ok"
    except Exception as error:  # pylint: disable=broad-except
        results["load_after_save/own"] = "%s: %s" % (type(error).__name__, error)
    shutil.rmtree(own)
    return results


def read_counts(strategy, before, prefix):
    """The strategy's packed metric reads since the `before` counts, as results."""
    after = strategy.extended.metric_read_counts
    return {prefix + field.name: getattr(after, field.name) - getattr(before, field.name)
            for field in dataclasses.fields(after)}


def overridden_metrics_fit(strategy, x, y):
    """The packed metric reads of a 2-step fit of a ranker whose compute_metrics is its own (it
    calls tf_keras'): its metrics are updated after the optimizer update, as tf_keras orders
    them, so their pack cannot ride on the gradients' all-reduce."""
    class OwnMetrics(tf_keras.Model):
        def compute_metrics(self, x, y, y_pred, sample_weight):
            return super().compute_metrics(x, y, y_pred, sample_weight)

    tf_keras.utils.set_random_seed(3)
    with strategy.scope():
        inner = ranker()
        model = OwnMetrics(inner.input, inner.output)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[tf_keras.metrics.AUC(from_logits=True, name="auc")])
    counts = dataclasses.replace(strategy.extended.metric_read_counts)
    model.fit(per_worker_dataset(strategy, x, y, True), epochs=1, steps_per_epoch=2, verbose=0)
    return read_counts(strategy, counts, "own_compute_metrics_reads/")


def metric_reads(strategy, model):
    """The model's metric results read in a replica step, within the packed reads of a step (as
    fit and evaluate trace theirs: keras_hooks.metric_reads_within_step) and without (tf_keras'
    own: one all-reduce per variable read), with each step's collectives; then, within the
    packed reads, the loss read before and after its tracker is updated in the same step (a
    write after the packed sums: it must be read fresh) and the same read outside."""
    results = {}
    for name, scope in (("packed", lambda: keras_hooks.metric_reads_within_step(model)),
                        ("original", contextlib.nullcontext)):
        step = tf.function(lambda: strategy.run(model.get_metrics_result))
        with scope():
            values = step()
        results["metric_reads/%s_collectives" % name] = count_collectives(
            step.get_concrete_function().graph).total
        for key, value in values.items():
            results["metric_reads/%s/%s" % (name, key)] = strategy.experimental_local_results(
                value)[0].numpy()
    tracker = next(m for m in model.metrics if m.name == "loss")
    auc = next(m for m in model.metrics if m.name == "auc")

    def read_write_read():
        before = tracker.result()  # the first read: packs every metric's state
        tracker.update_state(5.0)  # a write after the packed sums
        return before, tracker.result(), auc.result()

    counts = dataclasses.replace(strategy.extended.metric_read_counts)
    step = tf.function(lambda: strategy.run(read_write_read))
    with keras_hooks.metric_reads_within_step(model):
        before, after, auc_value = step()
    after_counts = strategy.extended.metric_read_counts
    local = lambda v: strategy.experimental_local_results(v)[0].numpy()  # noqa: E731
    results["write_after_read/before"] = local(before)
    results["write_after_read/after"] = local(after)
    results["write_after_read/auc"] = local(auc_value)
    results["write_after_read/collectives"] = count_collectives(
        step.get_concrete_function().graph).total
    results["write_after_read/fresh_reads"] = after_counts.fresh - counts.fresh
    plain = tf.function(lambda: strategy.run(lambda: (tracker.result(), auc.result())))
    results["write_after_read/loss_unpacked"], results["write_after_read/auc_unpacked"] = [
        local(v) for v in plain()]
    return results


def wait_for(path, seconds=300):
    """Waits until `path` exists (written by the reference run, started at the same time)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("%s did not appear within %d s: the reference run failed or is "
                               "not running" % (path, seconds))
        time.sleep(0.2)


def main():
    out = sys.argv[1]
    reference = sys.argv[2] if len(sys.argv) > 2 else None
    # row_wise: the row shards' save / load / export paths ("auto" would replicate these
    # small tables).
    strategy = tnp.NestPipeStrategy(placement="row_wise")
    rank = strategy.worker_index
    x, y = make_data(GLOBAL_BATCH * STEPS, 0)
    test_x, test_y = make_data(GLOBAL_BATCH * 2, 1)
    px, _ = make_data(100, 2)
    results = {}

    tf_keras.utils.set_random_seed(1)
    with strategy.scope():
        model = ranker()
    counts = dataclasses.replace(strategy.extended.metric_read_counts)
    history = model.fit(per_worker_dataset(strategy, x, y, True), epochs=EPOCHS,
                        steps_per_epoch=STEPS, verbose=0)
    results.update(read_counts(strategy, counts, "fit_metric_reads/"))
    results.update(state(model, "trained/"))
    for key in ("loss", "auc"):
        results["history/" + key] = np.array(history.history[key])
    results.update(metric_reads(strategy, model))
    results.update(mixed_precision_run(strategy, x, y))
    results.update(call_metrics_run(strategy, x, y))
    results.update(loop_inside_function_run(strategy))
    try:  # outside the scope: each worker would train its own model
        tf_keras.Sequential([tnp.ShardedEmbedding(VOCAB_A, DIM)]).build((None,))
        results["outside_scope"] = "built"
    except ValueError as error:
        results["outside_scope"] = str(error)
    results.update(overridden_metrics_fit(strategy, x, y))
    predict_ds = tf.data.Dataset.from_tensor_slices(px).batch(16)
    results["predict"] = model.predict(predict_ds, verbose=0)
    results.update(weight_copy(strategy, model, predict_ds))
    if rank == 0:
        np.savez(os.path.join(out, "x_predict.npz"), **px)

    # Every worker saves (the tables are gathered, a collective) to the same path, as a script
    # written for one process does: the chief's file is written there, the others' to scratch.
    model.save_weights(os.path.join(out, "w0.h5"))
    model.save_weights(os.path.join(out, "w0.weights.h5"))  # tf_keras' newer weights format
    model.save(os.path.join(out, "m0.keras"))
    model.save(os.path.join(out, "saved0"))  # SavedModel (tf format)
    # TensorFlow's own save (not redirected): per-worker paths, as with MultiWorkerMirrored.
    tf.saved_model.save(model, os.path.join(out, "tf_saved") if rank == 0 else
                        os.path.join(out, "scratch%d" % rank, "tf_saved"))
    if rank != 0:
        shutil.rmtree(os.path.join(out, "scratch%d" % rank))
    tnp.export_saved_model(model, os.path.join(out, "export"))
    results["files"] = np.array(sorted(os.listdir(out)))
    results.update(string_lookup_export(strategy, out))
    results.update(load_after_save(model, out))
    if rank == 0:  # the saves are complete: a run given this one as its reference may read them
        open(os.path.join(out, "w0.h5.done"), "w").close()

    tf_keras.utils.set_random_seed(2)
    with strategy.scope():
        fresh = ranker(seed=10)
    fresh.load_weights(os.path.join(out, "w0.h5"))
    results.update(state(fresh, "h5_own/"))
    results["h5_own/predict"] = fresh.predict(predict_ds, verbose=0)
    with strategy.scope():
        fresh = ranker(seed=40)
    fresh.load_weights(os.path.join(out, "w0.weights.h5"))
    results.update(state(fresh, "weights_h5_own/"))
    results["weights_h5_own/predict"] = fresh.predict(predict_ds, verbose=0)
    if reference is not None:
        with strategy.scope():
            other = ranker(seed=20)
        wait_for(os.path.join(reference, "w0.h5.done"))
        other.load_weights(os.path.join(reference, "w0.h5"))
        results.update(state(other, "h5_ref/"))
    with strategy.scope():
        loaded = tf_keras.models.load_model(os.path.join(out, "m0.keras"))  # no custom_objects
    results.update(state(loaded, "keras_own/"))
    results.update(table_slots(model, "trained/"))
    results.update(table_slots(loaded, "keras_own/"))
    results["keras_own/predict"] = loaded.predict(predict_ds, verbose=0)
    with strategy.scope():
        wrong = ranker(vocab_a=VOCAB_A + 4, seed=30)
    try:
        wrong.load_weights(os.path.join(out, "w0.h5"))
        results["wrong_size_error"] = "no error" if strategy.num_workers > 1 else "single"
    except (ValueError, tf.errors.InvalidArgumentError) as error:
        results["wrong_size_error"] = str(error)
    with strategy.scope():
        by_name = ranker(seed=50)
    try:  # matching by name: tf_keras' own path on one process, refused on 2 workers
        by_name.load_weights(os.path.join(out, "w0.h5"), by_name=True)
        results["by_name_error"] = "no error"
        results.update(state(by_name, "by_name/"))
    except ValueError as error:
        results["by_name_error"] = str(error)

    counts = dataclasses.replace(strategy.extended.metric_read_counts)
    history, lrs, evaluation = tfrs_run(strategy, x, y, test_x, test_y)
    results.update(read_counts(strategy, counts, "tfrs_metric_reads/"))
    for key, values in history.items():
        results["tfrs/" + key] = np.array(values)
    results["tfrs_lr"] = np.array(lrs)
    for key, value in evaluation.items():
        results["tfrs_eval/" + key] = np.array(value)
    if strategy.num_workers > 1:
        history, _, _ = tfrs_run(strategy, x, y, test_x, test_y, reduction="first")
        for key, values in history.items():
            results["tfrs_first/" + key] = np.array(values)
    for negatives in ("global", "local"):
        values, messages = retrieval_run(strategy, x, y, negatives == "global")
        for key, value in values.items():
            results["retrieval_%s/%s" % (negatives, key)] = value
        results["retrieval_%s_warnings" % negatives] = np.array(messages + [""])
    for name, nosync in (("exactness_dbp", False), ("exactness_dbp_nosync", True)):
        strategy.pipeline, strategy.unsafe_skip_buffer_sync = "dbp", nosync
        report = tnp.check_exactness(ranker, per_worker_dataset(strategy, x, y, False),
                                     steps=STEPS, strategy=strategy)
        print(name, report, flush=True)
        results[name] = report.max_difference
        results[name + "_pipeline_after"] = strategy.pipeline
    strategy.pipeline, strategy.unsafe_skip_buffer_sync = "none", False
    np.savez(os.path.join(out, "rank%d.npz" % rank), **results)
    print("rank", rank, "of", strategy.num_workers, "done", flush=True)


if __name__ == "__main__":
    main()
