"""Keras 3 (`import keras`) models under NestPipeStrategy, for comparison with one process.

    python keras3_fit.py PREFIX RUN [RUN ...]

Each RUN is `PIPELINE:PLACEMENT` with PIPELINE one of none, dbp, auto and PLACEMENT one of
rw (every table row_wise), mix (table_a row_wise, table_b table_wise, table_c
data_parallel) and front (every table row_wise, configured with keras-rs's `TableConfig` /
`FeatureConfig` in a subclassed model: table_a (shared by two features, "sum") and table_b
("sqrtn", placed on "sparsecore" as keras-rs's TPU examples place tables) in keras-rs's own
`keras_rs.layers.DistributedEmbedding`, unchanged, table_c in a `tnpk.DistributedEmbedding`). A run builds a functional model of three `tnpk.ShardedEmbedding` tables and a
dense tower (or the front's model) in `strategy.scope()`, fits it for STEPS steps (2 epochs) on per-worker slices of the
same global batches, evaluates and predicts, and saves to `PREFIX.RUN.npz`: the whole tables,
the dense weights, the history, the evaluation, the predictions and the fused exchange's count.
The first run also checks the Keras files on every worker: `model.save(".keras")` loaded by
`keras.models.load_model` with no custom_objects, and `save_weights` / `load_weights` into a
fresh model, give the same whole tables and predictions (`saving_ok` in its npz); and it writes
`tnp.export_saved_model` to `PREFIX.RUN.export` with the inputs and predictions to serve it
with in `PREFIX.RUN.export_check.npz`, and Keras 3's own `model.export` to
`PREFIX.RUN.keras_export`.
"""
import os
import sys

import numpy as np
import keras
import keras_rs
import tensorflow as tf

import tf_nestpipe as tnp
from tf_nestpipe import keras3 as tnpk

GLOBAL_BATCH = 24  # divisible by 1, 2 and 3 workers
STEPS = 50
VOCAB = {"table_a": 97, "table_b": 31, "table_c": 13}
NUM_DENSE = 3


def make_batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        x = {"a": rng.integers(0, VOCAB["table_a"], (GLOBAL_BATCH, 3)),
             "b": rng.integers(0, VOCAB["table_b"], (GLOBAL_BATCH, 2)),
             "c": rng.integers(0, VOCAB["table_c"], (GLOBAL_BATCH, 1)),
             "dense": rng.normal(size=(GLOBAL_BATCH, NUM_DENSE)).astype(np.float32)}
        y = (rng.random((GLOBAL_BATCH, 1)) < 0.4).astype(np.float32)
        batches.append((x, y))
    return batches


def dataset_fn_of(batches):
    def dataset_fn(context):
        n, k = context.num_input_pipelines, context.input_pipeline_id
        share = GLOBAL_BATCH // n
        local = [({key: v[k * share:(k + 1) * share] for key, v in x.items()},
                  y[k * share:(k + 1) * share]) for x, y in batches]
        spec = ({"a": tf.TensorSpec([share, 3], tf.int64), "b": tf.TensorSpec([share, 2], tf.int64),
                 "c": tf.TensorSpec([share, 1], tf.int64),
                 "dense": tf.TensorSpec([share, NUM_DENSE], tf.float32)},
                tf.TensorSpec([share, 1], tf.float32))
        # Repeated: Keras 3's fit reads one batch to build the model before its first epoch.
        return tnp.data.without_autotuning(
            tf.data.Dataset.from_generator(lambda: iter(local), output_signature=spec).repeat())

    return dataset_fn


def build_model():
    keras.utils.set_random_seed(7)
    inputs = {"a": keras.Input((3,), dtype="int64", name="a"),
              "b": keras.Input((2,), dtype="int64", name="b"),
              "c": keras.Input((1,), dtype="int64", name="c"),
              "dense": keras.Input((NUM_DENSE,), name="dense")}
    a = tnpk.ShardedEmbedding(VOCAB["table_a"], 8, combiner="sum", name="table_a")(inputs["a"])
    b = tnpk.ShardedEmbedding(VOCAB["table_b"], 8, combiner="mean", name="table_b",
                              embeddings_initializer="glorot_uniform")(inputs["b"])
    c = keras.layers.Flatten()(tnpk.ShardedEmbedding(VOCAB["table_c"], 4, name="table_c")(
        inputs["c"]))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(
        keras.layers.Concatenate()([a, b, c, inputs["dense"]]))
    model = keras.Model(inputs, keras.layers.Dense(1, name="logit")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
    return model


class FrontModel(keras.Model):
    """keras-rs's DistributedEmbedding usage (feature dict in, embedding dict out), written for
    keras-rs: only the strategy's scope makes its tables sharded. table_c goes through
    tf_nestpipe's own `tnpk.DistributedEmbedding` (the same configs)."""

    def __init__(self):
        super().__init__()
        # table_b as keras-rs's TPU examples configure tables: on SparseCore, its own optimizer
        # (under the strategy: sharded by it, trained with compile's optimizer, a warning).
        tables = {name: keras_rs.layers.TableConfig(
            name=name, vocabulary_size=VOCAB[name], embedding_dim=dim, combiner=combiner,
            initializer="uniform", **extra) for name, dim, combiner, extra in (
                ("table_a", 8, "sum", {}),
                ("table_b", 8, "sqrtn", {"placement": "sparsecore", "optimizer": "adagrad"}),
                ("table_c", 4, "sum", {}))}
        shapes = {"a": (GLOBAL_BATCH, 3), "a_first": (GLOBAL_BATCH,), "b": (GLOBAL_BATCH, 2),
                  "c": (GLOBAL_BATCH, 1)}
        dims = {"a": 8, "a_first": 8, "b": 8, "c": 4}
        table_of = {"a": "table_a", "a_first": "table_a", "b": "table_b", "c": "table_c"}
        features = {key: keras_rs.layers.FeatureConfig(
            name=key, table=tables[table_of[key]], input_shape=shapes[key],
            output_shape=(GLOBAL_BATCH, dims[key])) for key in shapes}
        self.embedding = keras_rs.layers.DistributedEmbedding(
            {key: features[key] for key in ("a", "a_first", "b")})
        self.embedding_c = tnpk.DistributedEmbedding({"c": features["c"]})
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.logit = keras.layers.Dense(1, name="logit")

    def call(self, x):
        out = self.embedding({"a": x["a"], "a_first": x["a"][:, 0], "b": x["b"]})
        out.update(self.embedding_c({"c": x["c"]}))
        return self.logit(self.hidden(keras.ops.concatenate(
            [out["a"], out["a_first"], out["b"], out["c"], x["dense"]], axis=1)))


def build_front_model():
    keras.utils.set_random_seed(7)
    model = FrontModel()
    model.compile(optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
    return model


PLACEMENTS = {"rw": "row_wise", "front": "row_wise",
              "mix": {"table_a": "row_wise", "table_b": "table_wise",
                      "table_c": "data_parallel"}}


def sharded_layers(model):
    return [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
            if isinstance(layer, tnpk.ShardedEmbedding)]


def tables_of(model):
    return {layer.name: layer.full_table() for layer in sharded_layers(model)}


def check_saving(strategy, model, prefix, batches):
    """Every worker saves; loads give the same whole tables and predictions."""
    x = batches[0][0]
    before_tables, before = tables_of(model), model.predict(x, verbose=0)
    path = prefix + ".model.keras"
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert type(loaded.get_layer("table_a")) is tnpk.ShardedEmbedding
    np.testing.assert_allclose(loaded.predict(x, verbose=0), before, atol=1e-6)
    for name, table in tables_of(loaded).items():
        np.testing.assert_allclose(table, before_tables[name], atol=0, err_msg=name)
    weights = prefix + ".model.weights.h5"
    model.save_weights(weights)
    with strategy.scope():
        fresh = build_model()
    fresh.load_weights(weights)
    for name, table in tables_of(fresh).items():
        np.testing.assert_allclose(table, before_tables[name], atol=0, err_msg=name)
    np.testing.assert_allclose(fresh.predict(x, verbose=0), before, atol=1e-6)
    whole = model.get_layer("table_a").get_weights()[0]
    assert whole.shape == (VOCAB["table_a"], 8), whole.shape
    # Served by plain TensorFlow (the test loads them in a process without tf_nestpipe).
    tnp.export_saved_model(model, prefix + ".export")
    model.export(prefix + ".keras_export", verbose=False)  # Keras 3's own export
    if strategy.worker_index == 0:
        np.savez(prefix + ".export_check.npz", predictions=before, **x)
    return 1


def run(strategy, batches, name, prefix, check_files):
    pipeline, placement = name.split(":")
    strategy.pipeline = pipeline
    strategy.placement = PLACEMENTS[placement]
    with strategy.scope():
        model = build_front_model() if placement == "front" else build_model()
    dataset = strategy.distribute_datasets_from_function(dataset_fn_of(batches))
    history = model.fit(dataset, epochs=2, steps_per_epoch=len(batches) // 2, verbose=0)
    evaluation = model.evaluate(strategy.distribute_datasets_from_function(
        dataset_fn_of(batches[:4])), steps=4, verbose=0, return_dict=True)
    predictions = model.predict(strategy.distribute_datasets_from_function(
        dataset_fn_of(batches[:2])), steps=2, verbose=0)
    pipe = getattr(model, "_nestpipe_pipeline", None)
    extra = {"exchanges": pipe.stats.exchanges} if pipe is not None else {}
    extra.update({"placement/" + layer.name: layer.placement for layer in sharded_layers(model)})
    if check_files:
        extra["saving_ok"] = check_saving(strategy, model, "%s.%s" % (prefix, name), batches)
    if placement == "front":  # keras-rs's reader gives the whole tables (on every worker)
        whole = tables_of(model)
        read = model.embedding.get_embedding_tables()
        assert sorted(read) == ["table_a", "table_b"], sorted(read)
        for table, value in read.items():
            np.testing.assert_array_equal(np.asarray(value), whole[table], err_msg=table)
    dense = {"dense/" + v.path: v.numpy() for v in model.trainable_variables
             if "table_" not in v.path}
    out = {"table/" + k: v for k, v in tables_of(model).items()}
    out.update(dense)
    out.update({"history/" + k: np.asarray(v) for k, v in history.history.items()})
    out.update({"eval/" + k: np.asarray(v) for k, v in evaluation.items()})
    out["predictions"] = predictions
    out.update(extra)
    if strategy.worker_index == 0:
        np.savez("%s.%s.npz" % (prefix, name.replace(":", ".")), **out)
    print("keras3 run", name, "done on worker", strategy.worker_index, flush=True)


def main():
    prefix, runs = sys.argv[1], sys.argv[2:]
    strategy = tnp.NestPipeStrategy()
    batches = make_batches(STEPS)
    for i, name in enumerate(runs):
        run(strategy, batches, name, prefix, check_files=(i == 0 and "front" not in name))


if __name__ == "__main__":
    main()
