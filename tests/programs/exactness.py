"""Trains a small recommendation model for a fixed number of steps and saves every parameter.

Run in one process (no TF_CONFIG: the reference) or on a cluster through the launcher; both see
the same global batches (each worker takes its contiguous slice). Worker 0 writes an .npz with
the full tables and the dense weights.

usage: exactness.py OUT_PREFIX STEPS RUN [RUN ...] [--invalid-id]
  RUN is MODE:OPTIMIZER[:OPTION ...] with OPTION in {cluster (key-centric clustering of the
  micro-batches), dbp, fwp, nested, auto (the run's pipeline; none without; auto under fit
  only), nosync (skip the buffer
  sync on purpose), mixed (the model gets a ShardedEmbeddingCollection of another dim: two
  exchange groups), dp (every table data_parallel: replicated, no exchange), mixdp (table_a
  data_parallel, the other tables row_wise), tw (table_a table_wise in the exchange of the
  row-wise table_b, the collection data_parallel), alltw (every table table_wise, balanced over
  the workers), autoplace (placement="auto"), split (table_a looked up once per id column: two
  lookups of one table per step, the same function as without), lazy (loop: the
  TrainPipeline is not given the trainable variables, so the model's variables and the
  optimizer's slots are created in its first traces, each traced twice)}, OPTIMIZER in
  {sgd, adagrad, adam} and MODE one of: loop (custom loop through tnp.TrainPipeline, given
  the trainable variables unless lazy: the fused exchange, with look-ahead under dbp /
  nested; 3 micro-batches under fwp / nested), direct (custom loop calling strategy.run:
  each table its own exchange; a frozen window under fwp), fit (steps_per_epoch=STEPS),
  epochs (3 epochs of STEPS // 3 steps over the repeated data: the pipeline carries across
  epoch boundaries), twice
  (two fit calls of STEPS // 2 steps, each with a new iterator over the same data), one (fit on a
  dataset of one batch), resize (two fit calls on repeated datasets of static shapes: STEPS // 2
  batches, then the next STEPS // 2 batches each cut in two halves, a batch size the first fit's
  step functions were not traced for);
  each run trains a fresh model and writes OUT_PREFIX.MODE.OPTIMIZER[.OPTION ...].npz.
"""
import contextlib
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402

VOCAB_A, VOCAB_B, DIM, NUM_DENSE = 61, 47, 4, 3
FIELD_SIZES, FIELD_DIM = [13, 7], 3
GLOBAL_BATCH = 24


def make_batches(steps, seed=0):
    """Deterministic global batches with Zipf-hot ids so consecutive batches share keys."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        ids = np.minimum(rng.zipf(1.3, size=(GLOBAL_BATCH, 2)) - 1, VOCAB_A - 1).astype(np.int64)
        lengths = rng.integers(1, 4, size=GLOBAL_BATCH)
        bag = np.minimum(rng.zipf(1.2, size=lengths.sum()) - 1, VOCAB_B - 1).astype(np.int64)
        dense = rng.normal(size=(GLOBAL_BATCH, NUM_DENSE)).astype(np.float32)
        label = ((ids[:, 0] % 3 == 0) ^ (dense[:, 0] > 0)).astype(np.float32)[:, None]
        batches.append((ids, lengths, bag, dense, label))
    return batches


def local_slice(batch, rank, workers):
    """This worker's contiguous share of a global batch (ragged bag included)."""
    ids, lengths, bag, dense, label = batch
    per = len(ids) // workers
    lo, hi = rank * per, (rank + 1) * per
    starts = np.concatenate([[0], np.cumsum(lengths)])
    bag_local = bag[starts[lo]:starts[hi]]
    ragged = tf.RaggedTensor.from_row_lengths(bag_local, lengths[lo:hi])
    return ({"ids": ids[lo:hi], "bag": ragged, "dense": dense[lo:hi]}, label[lo:hi])


class TinyRanker(tf_keras.Model):
    """Single-hot table (2 fields, no combiner) + multi-hot table (mean) + dense MLP."""

    def __init__(self):
        super().__init__()
        self.table_a = tnp.ShardedEmbedding(
            VOCAB_A, DIM, embeddings_initializer=tf_keras.initializers.RandomUniform(-0.3, 0.3, seed=7),
            name="table_a")
        self.table_b = tnp.ShardedEmbedding(
            VOCAB_B, DIM, combiner="mean",
            embeddings_initializer=tf_keras.initializers.TruncatedNormal(stddev=0.2, seed=8),
            name="table_b")
        self.hidden = tf_keras.layers.Dense(8, activation="relu",
                                            kernel_initializer=tf_keras.initializers.GlorotUniform(seed=9))
        self.out = tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=10))

    def embed_ids(self, ids):
        """table_a's rows of both id columns, `[B, 2 * DIM]`."""
        return tf.reshape(self.table_a(ids), [-1, 2 * DIM])

    def call(self, features):
        a = self.embed_ids(features["ids"])
        b = self.table_b(features["bag"])
        return self.out(self.hidden(tf.concat([a, b, features["dense"]], axis=1)))


class SplitRanker(TinyRanker):
    """TinyRanker whose table_a is looked up once per id column: the same function, two lookups
    of one table per step (outside a frozen window, two rounds: under DBP two prefetch buffers
    of one group, both re-synced)."""

    def embed_ids(self, ids):
        return tf.concat([self.table_a(ids[:, k]) for k in range(2)], axis=1)


class MixedRanker(TinyRanker):
    """TinyRanker plus a collection of two single-hot tables of another dim (a second exchange
    group: its rows travel in their own fused exchange)."""

    def __init__(self):
        super().__init__()
        self.fields = tnp.ShardedEmbeddingCollection(
            FIELD_SIZES, FIELD_DIM,
            embeddings_initializer=tf_keras.initializers.RandomUniform(-0.2, 0.2, seed=11),
            name="fields")

    def call(self, features):
        a = self.embed_ids(features["ids"])
        b = self.table_b(features["bag"])
        # Field f reads column f of the id pair, folded into its table.
        fields = features["ids"] % tf.constant(FIELD_SIZES, tf.int64)[None, :]
        c = tf.reshape(self.fields(fields), [-1, len(FIELD_SIZES) * FIELD_DIM])
        return self.out(self.hidden(tf.concat([a, b, c, features["dense"]], axis=1)))


def model_tables(model):
    """The model's full tables by name (a collective: every worker calls it)."""
    tables = {"table_a": model.table_a.full_table(), "table_b": model.table_b.full_table()}
    if isinstance(model, MixedRanker):
        tables["table_fields"] = model.fields.fused.full_table()
    return tables


def static_batch_spec(local_batch):
    """A batch's spec with the batch dimension `local_batch` (an int: a dataset of static shapes,
    as `drop_remainder=True` gives; None: any size)."""
    return ({"ids": tf.TensorSpec([local_batch, 2], tf.int64),
             "bag": tf.RaggedTensorSpec([local_batch, None], tf.int64, ragged_rank=1,
                                        row_splits_dtype=tf.int64),
             "dense": tf.TensorSpec([local_batch, NUM_DENSE], tf.float32)},
            tf.TensorSpec([local_batch, 1], tf.float32))


BATCH_SPEC = static_batch_spec(None)


def halves(batch):
    """A global batch cut into its first and second half (ragged bag included)."""
    ids, lengths, bag, dense, label = batch
    half = len(ids) // 2
    cut = int(np.sum(lengths[:half]))
    return [(ids[:half], lengths[:half], bag[:cut], dense[:half], label[:half]),
            (ids[half:], lengths[half:], bag[cut:], dense[half:], label[half:])]


def per_worker_dataset_fn(batches, static=False):
    """A dataset_fn whose pipeline on each worker yields its own slice of every global batch
    (`static`: with the slices' batch dimension in the dataset's spec)."""
    def dataset_fn(context):
        local = [local_slice(b, context.input_pipeline_id, context.num_input_pipelines)
                 for b in batches]
        spec = static_batch_spec(len(local[0][1])) if static else BATCH_SPEC
        # Nothing to tune; an autotuned iterator's deletion can stall in a cluster.
        return tnp.data.without_autotuning(
            tf.data.Dataset.from_generator(lambda: iter(local), output_signature=spec))

    return dataset_fn


def new_loss_fn():
    """Per-sample binary cross-entropy on logits (reduced by compute_average_loss)."""
    return tf_keras.losses.BinaryCrossentropy(from_logits=True,
                                              reduction=tf_keras.losses.Reduction.NONE)


def synchronous_train_step(strategy, model, optimizer):
    """A tf.function running one synchronous step of `model` on this worker's slice."""
    loss_fn = new_loss_fn()

    @tf.function
    def train_step(features, labels):
        def step_fn(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)),
                                                  global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(step_fn, args=(features, labels))

    return train_step


def make_optimizer(name):
    return {"sgd": lambda: tf_keras.optimizers.SGD(0.5),
            "adagrad": lambda: tf_keras.optimizers.Adagrad(0.3),
            "adam": lambda: tf_keras.optimizers.Adam(0.05)}[name]()


def train(strategy, batches, mode, opt_name, out_path, mixed=False, split=False, lazy=False):
    """Trains a fresh TinyRanker (MixedRanker if `mixed`, SplitRanker if `split`) with `mode`
    (custom loop or fit) and saves all parameters. `lazy`: see the module docstring."""
    if mixed and split:
        raise ValueError("the 'mixed' and 'split' options name two different models; a run "
                         "takes one of them")
    rank, workers = strategy.worker_index, strategy.num_workers
    steps = len(batches)
    with strategy.scope():
        model = MixedRanker() if mixed else SplitRanker() if split else TinyRanker()
        optimizer = make_optimizer(opt_name)
    loss_fn = new_loss_fn()
    spec = BATCH_SPEC
    local_dataset_fn = per_worker_dataset_fn(batches)

    micro = strategy.pipeline in ("fwp", "nested")

    def micro_batches(batch):
        """The step's micro-batches (clustered by both id features with --cluster)."""
        keys = tnp.pipeline.integer_leaves(batch[0]) if strategy.cluster_samples else None
        return tnp.pipeline.split_batch(batch, strategy.micro_batches, cluster_keys=keys)

    def window():
        return tnp.pipeline.frozen_window() if micro else contextlib.nullcontext()

    def step_fn(batch):
        with tf.GradientTape() as tape, window():
            parts = micro_batches(batch) if micro else [(batch, 1.0)]
            loss = tf.add_n([tf.nn.compute_average_loss(loss_fn(l, model(f, training=True)),
                                                        global_batch_size=GLOBAL_BATCH)
                             for (f, l), _ in parts])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def route_fn(batch):
        with window():
            for (f, _), _ in (micro_batches(batch) if micro else [(batch, 1.0)]):
                model(f)

    stats, auto_choice = None, None
    if mode == "loop":
        lookahead = 1 if strategy.pipeline in ("dbp", "nested") else 0
        pipeline = tnp.TrainPipeline(
            strategy, step_fn, route_fn, optimizer=optimizer,
            skip_buffer_sync=strategy.unsafe_skip_buffer_sync, lookahead=lookahead,
            trainable_variables=None if lazy else lambda: model.trainable_variables)
        iterator = iter(strategy.distribute_datasets_from_function(local_dataset_fn))
        for _ in range(steps):
            pipeline.progress(iterator)
        stats = pipeline.stats
    elif mode == "direct":
        @tf.function(input_signature=spec)
        def train_step(features, labels):
            per_replica = strategy.run(step_fn, args=((features, labels),))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        for step, batch in enumerate(batches):
            loss = train_step(*local_slice(batch, rank, workers))
            if step % 5 == 0:
                print("step %d loss %.5f" % (step, float(loss)), flush=True)
    else:
        if mode == "one":
            batches = batches[:1]
            local_dataset_fn = per_worker_dataset_fn(batches)
        with strategy.scope():
            model.compile(optimizer=optimizer,
                          loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                          metrics=[tf_keras.metrics.AUC(from_logits=True, name="auc")])
        dataset = strategy.distribute_datasets_from_function(local_dataset_fn)
        if mode == "epochs":
            dataset = strategy.distribute_datasets_from_function(
                lambda context: local_dataset_fn(context).repeat())
            history = model.fit(dataset, epochs=3, steps_per_epoch=steps // 3, verbose=0)
        elif mode == "twice":
            model.fit(dataset, epochs=1, steps_per_epoch=steps // 2, verbose=0)
            history = model.fit(dataset, epochs=1, steps_per_epoch=steps // 2, verbose=0)
        elif mode == "resize":
            first = batches[:steps // 2]
            second = [half for b in batches[steps // 2:steps // 2 * 2] for half in halves(b)]
            # Repeated: an infinite iterator gives the pipeline its static shapes.
            for part in (first, second):
                part_fn = per_worker_dataset_fn(part, static=True)
                history = model.fit(strategy.distribute_datasets_from_function(
                    lambda context, fn=part_fn: fn(context).repeat()),
                    epochs=1, steps_per_epoch=len(part), verbose=0)
        else:
            history = model.fit(dataset, epochs=1, steps_per_epoch=len(batches), verbose=0)
        print("fit history", {k: [round(x, 5) for x in v] for k, v in history.history.items()},
              flush=True)
        pipeline = getattr(model, "_nestpipe_pipeline", None)
        stats = pipeline.stats if pipeline is not None else None
        if getattr(pipeline, "choice", None) is not None:
            auto_choice = tnp.pipeline.AUTO_CANDIDATES.index(pipeline.choice.mode)
    tables = model_tables(model)
    # Dense weights by position: Keras name suffixes depend on how many models a process built.
    dense = [v.numpy() for v in model.trainable_variables
             if "table_" not in v.name and "fields" not in v.name]
    if stats is not None:
        print("pipeline stats", stats, flush=True)
    if rank == 0:
        extra = {} if stats is None else {
            "stats/rows_synced": stats.rows_synced, "stats/steps": stats.steps,
            "stats/drains": stats.drains, "stats/rows_requested": stats.rows_requested,
            "stats/first_lookup_rows": stats.first_lookup_rows,
            "stats/exchanges": stats.exchanges,
            "stats/collectives": -1 if stats.collectives is None else stats.collectives.total}
        for layer in model._flatten_layers():  # pylint: disable=protected-access
            if isinstance(layer, tnp.ShardedEmbedding) and layer.placement is not None:
                extra["stats/placement/" + layer.name] = layer.placement
                if layer.layout.table_wise:
                    extra["stats/owner/" + layer.name] = layer.layout.owner_shard
        if auto_choice is not None:
            extra["stats/auto_choice"] = auto_choice
        # Keys exchanges that needed the overflow round, in this launch so far (all runs).
        extra["stats/overflow_rounds"] = strategy.extended.embedding_exchange.overflow_rounds()
        np.savez(out_path, **tables, **{"dense/%d" % i: v for i, v in enumerate(dense)}, **extra)
    print("saved", mode, opt_name, flush=True)


def placement_of_run(options):
    """The strategy's table placement for a run's options (see the module docstring)."""
    if "dp" in options:
        return "data_parallel"
    if "alltw" in options:
        return "table_wise"
    if "tw" in options:  # table_a table_wise, fused with the row-wise table_b; fields replicated
        mixed = {"table_a": "table_wise", "table_b": "row_wise"}
        if "mixed" in options:
            mixed["fields_fused"] = "data_parallel"
        return mixed
    if "autoplace" in options:
        return "auto"
    if "mixdp" in options:
        mixed = {"table_a": "data_parallel", "table_b": "row_wise"}
        if "mixed" in options:
            mixed["fields_fused"] = "row_wise"
        return mixed
    return "row_wise"


def main():
    prefix, steps = sys.argv[1], int(sys.argv[2])
    runs = [a for a in sys.argv[3:] if not a.startswith("--")]
    # auto: none, fwp, dbp, nested (M=3), in 2 interleaved rounds of 1 timed step each (the
    # second after a settling step), so that its probe and choice fit in the runs' 20 steps.
    strategy = tnp.NestPipeStrategy(micro_batches=3, auto_warmup_steps=0, auto_timed_steps=1,
                                    auto_probe_rounds=2, auto_micro_batches=(3,))
    strategy.auto_probe_budget = None  # every candidate probed, however short the run
    batches = make_batches(steps)
    if "--invalid-id" in sys.argv:  # one id outside the vocabulary, seen by the last worker
        batches[0][0][-1, 0] = VOCAB_A + 5
    for run in runs:
        mode, opt_name, *options = run.split(":")
        # Read when a run's train function is made: pipeline and clustering can differ between
        # runs, so one launch serves many runs.
        strategy.cluster_samples = "cluster" in options
        strategy.pipeline = next((o for o in options if o in ("dbp", "fwp", "nested", "auto")),
                                 "none")
        strategy.unsafe_skip_buffer_sync = "nosync" in options
        strategy.placement = placement_of_run(options)
        train(strategy, batches, mode, opt_name,
              "%s.%s.npz" % (prefix, ".".join([mode, opt_name] + options)),
              mixed="mixed" in options, split="split" in options, lazy="lazy" in options)


if __name__ == "__main__":
    main()
