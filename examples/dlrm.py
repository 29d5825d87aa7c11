"""DLRM-style recommendation model trained with NestPipeStrategy (the main job).

Bottom MLP over dense features, one row-sharded embedding table per categorical feature,
pairwise dot interaction, top MLP. Data: a deterministic synthetic click log with Zipf ids and
Criteo-Kaggle-shaped tables (scaled). Each worker feeds its own slice of every global batch via
`distribute_datasets_from_function`; held-out AUC and throughput are printed by worker 0.

Run on 2 local workers:
    python -m tf_nestpipe.launch --workers 2 -- python examples/dlrm.py
"""
import argparse
import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.data import SyntheticClickLog, criteo_kaggle_table_sizes  # noqa: E402


class DotInteraction(tf_keras.layers.Layer):
    """Pairwise dot products of the feature vectors (strict lower triangle), as in DLRM."""

    def call(self, features):
        stacked = tf.stack(features, axis=1)  # [B, F, D]
        products = tf.matmul(stacked, stacked, transpose_b=True)  # [B, F, F]
        num = len(features)
        rows, cols = np.tril_indices(num, k=-1)
        flat_index = tf.constant(rows * num + cols, tf.int32)
        return tf.gather(tf.reshape(products, [-1, num * num]), flat_index, axis=1)


class PerTableEmbeddings(tf_keras.layers.Layer):
    """One embedding layer per field, built by `factory(size, dim, name, seed)`: [B, F] -> [B, F, D]."""

    def __init__(self, table_sizes, dim, factory, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.tables = [factory(size, dim, "table_%d" % i, seed + i) for i, size in enumerate(table_sizes)]

    def call(self, ids):
        return tf.stack([table(ids[:, i]) for i, table in enumerate(self.tables)], axis=1)


def sharded_table(size, dim, name, seed):
    """A row-sharded table with a seeded uniform initializer (same at any worker count)."""
    return tnp.ShardedEmbedding(size, dim, name=name, embeddings_initializer=
                                tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=seed))


def make_embeddings(kind, table_sizes, dim, seed=0):
    """`fused`: one ShardedEmbeddingCollection (4 collectives per step for all tables);
    `per_table`: one ShardedEmbedding per field; `keras`: tf_keras Embedding per field."""
    if kind == "fused":
        return tnp.ShardedEmbeddingCollection(
            table_sizes, dim, name="tables",
            embeddings_initializer=tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=seed))
    if kind == "per_table":
        return PerTableEmbeddings(table_sizes, dim, sharded_table, seed, name="tables")
    if kind == "keras":
        return PerTableEmbeddings(table_sizes, dim, lambda size, dim, name, s: tf_keras.layers.Embedding(
            size, dim, name=name, embeddings_initializer=tf_keras.initializers.RandomUniform(
                -0.05, 0.05, seed=s)), seed, name="tables")
    raise ValueError("unknown embedding kind %r" % kind)


class DLRM(tf_keras.Model):
    """Bottom MLP + embeddings ([B, F] ids -> [B, F, D]) + dot interaction + top MLP."""

    def __init__(self, embeddings, dim=16, bottom=(64, 32), top=(64, 32), seed=0):
        super().__init__()
        self.embeddings = embeddings
        glorot = lambda s: tf_keras.initializers.GlorotUniform(seed=seed + 1000 + s)  # noqa: E731
        self.bottom = tf_keras.Sequential(
            [tf_keras.layers.Dense(u, activation="relu", kernel_initializer=glorot(i))
             for i, u in enumerate(bottom)] + [tf_keras.layers.Dense(dim, activation="relu",
                                                                     kernel_initializer=glorot(10))])
        self.interaction = DotInteraction()
        self.top = tf_keras.Sequential(
            [tf_keras.layers.Dense(u, activation="relu", kernel_initializer=glorot(20 + i))
             for i, u in enumerate(top)] + [tf_keras.layers.Dense(1, kernel_initializer=glorot(30))])

    def call(self, inputs):
        dense_out = self.bottom(inputs["dense"])
        embedded = tf.unstack(self.embeddings(inputs["sparse"]), axis=1)
        interactions = self.interaction([dense_out] + embedded)
        return self.top(tf.concat([dense_out, interactions], axis=1))


def build_compiled_dlrm(strategy, kind, table_sizes, dim=16, learning_rate=0.05,
                        make_metrics=list):
    """Builds and compiles the DLRM (embeddings of `kind`, see `make_embeddings`) under `strategy`:
    Adagrad, binary cross-entropy on logits, and the metrics `make_metrics()` creates (in the
    scope, as Keras requires)."""
    with strategy.scope():
        model = DLRM(make_embeddings(kind, table_sizes, dim), dim=dim)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(learning_rate),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=make_metrics())
    return model


def make_dataset_fn(log, first_batch, num_batches, global_batch, repeat):
    """dataset_fn(InputContext) yielding this worker's slice of global batches [first, first+n).

    The worker's slices are generated once, up front, so the training loop never waits on the
    (Python) generator: the input pipeline is plain in-memory tensors.
    """

    def dataset_fn(context):
        per = context.get_per_replica_batch_size(global_batch)
        lo = context.input_pipeline_id * per
        dense, sparse, labels = [], [], []
        for i in range(first_batch, first_batch + num_batches):
            features, label = log.batch(i, global_batch)
            dense.append(features["dense"][lo:lo + per])
            sparse.append(features["sparse"][lo:lo + per])
            labels.append(label[lo:lo + per])
        dataset = tf.data.Dataset.from_tensor_slices(
            ({"dense": np.stack(dense), "sparse": np.stack(sparse)}, np.stack(labels)))
        return (dataset.repeat() if repeat else dataset).prefetch(2)

    return dataset_fn


class StepTimer(tf_keras.callbacks.Callback):
    """Records the wall time of every training step."""

    def on_train_begin(self, logs=None):
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--eval-steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--table-scale", type=float, default=0.002,
                        help="fraction of the Criteo Kaggle table sizes")
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--embeddings", choices=["fused", "per_table"], default="fused",
                        help="one fused lookup for all tables, or one lookup per table")
    parser.add_argument("--pipeline", choices=["none", "dbp"], default="none",
                        help="NestPipeStrategy pipeline (dbp: Dual-Buffer Pipeline)")
    args = parser.parse_args()

    strategy = tnp.NestPipeStrategy(pipeline=args.pipeline)
    table_sizes = criteo_kaggle_table_sizes(args.table_scale)
    log = SyntheticClickLog(table_sizes, seed=1)
    chief = strategy.worker_index == 0
    if args.global_batch % strategy.num_workers:
        raise SystemExit("--global-batch %d must be divisible by the %d workers"
                         % (args.global_batch, strategy.num_workers))
    model = build_compiled_dlrm(strategy, args.embeddings, table_sizes, args.dim,
                                args.learning_rate,
                                make_metrics=lambda: [tf_keras.metrics.AUC(from_logits=True,
                                                                           name="auc")])
    train = strategy.distribute_datasets_from_function(
        make_dataset_fn(log, 0, args.steps, args.global_batch, repeat=True))
    held_out = strategy.distribute_datasets_from_function(
        make_dataset_fn(log, 10_000_000, args.eval_steps, args.global_batch, repeat=False))
    timer = StepTimer()
    if chief:
        print("DLRM: %d workers, %d tables (%d rows, %.1f MiB of embeddings), global batch %d"
              % (strategy.num_workers, len(table_sizes), sum(table_sizes),
                 sum(table_sizes) * args.dim * 4 / 2 ** 20, args.global_batch), flush=True)
    history = model.fit(train, epochs=1, steps_per_epoch=args.steps, callbacks=[timer],
                        verbose=0)
    evaluation = model.evaluate(held_out, steps=args.eval_steps, return_dict=True, verbose=0)
    steady = np.array(timer.times[min(5, len(timer.times) - 1):])
    samples_per_second = args.global_batch / float(np.median(steady))
    if chief:
        print("train: loss %.4f auc %.4f | held-out: loss %.4f auc %.4f | %.1f ms/step (median), "
              "%.0f samples/s" % (history.history["loss"][-1], history.history["auc"][-1],
                                  evaluation["loss"], evaluation["auc"], 1e3 * np.median(steady),
                                  samples_per_second), flush=True)


if __name__ == "__main__":
    main()
