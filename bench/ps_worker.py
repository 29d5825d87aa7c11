"""One run of the parameter-server benchmark (bench/ps.py): trains a small recommendation model
on MovieLens-1M's train split and prints `RESULT {json}` with the throughput, the traffic per
sample and the held-out AUC.

Modes:
- `tf_pss` (chief of a `--workers 2 --ps 2 --chief` cluster): TensorFlow's own
  `tf.distribute.ParameterServerStrategy` (MinSizePartitioner) with one `tf_keras.layers.Embedding`
  per feature; a custom step scheduled with `ClusterCoordinator.schedule`: forward, backward and
  a tf_keras Adagrad update of the ps variables, i.e. every step pushes its gradient.
- `downpour` (same cluster): `tnp.ParameterServerStrategy(update_window=T, local_optimizer=
  tnp.LocalSGD(lr))` with one `tnp.ShardedEmbedding` per feature and `tnp.DownpourTrainer`
  (global tf_keras Adagrad on the ps); one scheduled window = T local steps of one batch each.
- `sync` (launched on `--workers 2`, no ps, no chief): `tnp.NestPipeStrategy` and tf_keras `fit`
  with the same model and optimizer: the synchronous reference for the AUC.

The model is the same in every mode: an embedding (dim `--dim`) per single-hot MovieLens feature
(user, item, age, gender, occupation, zip, year) and a mean-pooled one for the multi-hot genres,
concatenated, then a 64-32-1 ReLU MLP giving a logit; binary cross-entropy, labels rating >= 4.
A *step* is one batch of `--batch` samples: a scheduled step (tf_pss), one local step of a
window (downpour; `--steps / T` windows) or one global batch split over the 2 workers (sync).

Measured:
- samples/s: wall time from the end of `--warmup` steps (scheduled, then `join`) to the `join`
  after the remaining steps (sync: from the end of warm-up step to the end of the last step of
  `fit`), divided into the samples of those steps.
- pushed values: what the workers send to the ps as gradients, in float32 values (indices not
  counted). downpour: the trainer's own count (second output of every window: the deduplicated
  summed gradient's values). tf_pss: counted in the step from the gradients handed to
  `apply_gradients`: dense gradients' sizes plus the `IndexedSlices` values of the embedding
  gradients (one row per looked-up id, duplicates included: TF sends them undeduplicated); the
  number of distinct rows touched (what a deduplicating push would send) is counted too.
- pulled values: what the workers read from the ps. downpour: the trainer's own count (third
  output of every window: the dense parameters whole plus each table row the window's batches
  read, once per window). tf_pss: the dense parameters plus one row per looked-up id
  (`embedding_lookup` gathers on the ps, per id).
- held-out AUC: after training, the chief (sync: worker 0, after an all-worker `full_table()`)
  copies the global parameters into a plain local model and scores the whole test split
  (MovieLens-1M's latest 10% of ratings); exact ROC AUC (rank statistic, ties averaged).
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.data import load_or_prepare_movielens, make_dataset, split_files  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from dlrm import model_inputs  # noqa: E402  (the example's MovieLens input mapping)

DATASET = "movielens-1m"
HIDDEN = (64, 32)


class MeanBag(tf_keras.layers.Layer):
    """Mean-pools a ragged `[B, None]` id tensor through `embedding` (applied to the flat ids):
    what `ShardedEmbedding(combiner="mean")` computes, for a `tf_keras.layers.Embedding`."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, ids):
        rows = self.embedding(tf.cast(ids.flat_values, tf.int64))
        pooled = tf.math.unsorted_segment_sum(rows, ids.value_rowids(), ids.nrows())
        counts = tf.cast(tf.maximum(ids.row_lengths(), 1), pooled.dtype)
        return pooled / counts[:, None]


class RecModel(tf_keras.Model):
    """Embeddings of `inputs["sparse"]` ([B, F] ids, one table per column) and mean-pooled
    embeddings of the ragged multi-hot features -> concat -> ReLU MLP -> [B, 1] logit.

    `kind`: "sharded" (tnp.ShardedEmbedding) or "keras" (tf_keras.layers.Embedding)."""

    def __init__(self, kind, table_sizes, bag_sizes, dim, seed=0):
        super().__init__()
        self.kind = kind
        self.bag_names = sorted(bag_sizes)
        init = lambda s: tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=seed + s)  # noqa: E731
        if kind == "sharded":
            self.tables = [tnp.ShardedEmbedding(size, dim, name="table_%d" % i,
                                                embeddings_initializer=init(i))
                           for i, size in enumerate(table_sizes)]
            self.bags = [tnp.ShardedEmbedding(bag_sizes[name], dim, combiner="mean",
                                              name="bag_" + name, embeddings_initializer=init(100 + i))
                         for i, name in enumerate(self.bag_names)]
        elif kind == "keras":
            self.tables = [tf_keras.layers.Embedding(size, dim, name="table_%d" % i,
                                                     embeddings_initializer=init(i))
                           for i, size in enumerate(table_sizes)]
            self.bags = [MeanBag(tf_keras.layers.Embedding(bag_sizes[name], dim,
                                                           name="bag_table_" + name,
                                                           embeddings_initializer=init(100 + i)),
                                 name="bag_" + name)
                         for i, name in enumerate(self.bag_names)]
        else:
            raise ValueError("unknown embedding kind %r" % kind)
        glorot = lambda s: tf_keras.initializers.GlorotUniform(seed=seed + 1000 + s)  # noqa: E731
        self.mlp = tf_keras.Sequential(
            [tf_keras.layers.Dense(units, activation="relu", kernel_initializer=glorot(i))
             for i, units in enumerate(HIDDEN)]
            + [tf_keras.layers.Dense(1, kernel_initializer=glorot(len(HIDDEN)))], name="mlp")

    def call(self, inputs):
        sparse = inputs["sparse"]
        vectors = [table(sparse[:, i]) for i, table in enumerate(self.tables)]
        vectors += [bag(inputs[name]) for bag, name in zip(self.bags, self.bag_names)]
        return self.mlp(tf.concat(vectors, axis=1))

    def embedding_layers(self):
        """The tables in a fixed order (single-hot, then multi-hot), as embedding layers."""
        return self.tables + [b.embedding if isinstance(b, MeanBag) else b for b in self.bags]


def loss_fn(labels, logits):
    """Mean binary cross-entropy of [B, 1] logits against [B, 1] 0/1 labels."""
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        tf.reshape(tf.cast(labels, tf.float32), [-1]), tf.reshape(logits, [-1])))


def exact_auc(labels, scores):
    """ROC AUC as the Mann-Whitney rank statistic (tied scores get their average rank)."""
    labels = np.asarray(labels, bool).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts + 1) / 2.0  # 1-based average rank of each tie group
    ranks[order] = np.repeat(average, counts)
    positives = labels.sum()
    negatives = len(labels) - positives
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0)
                 / (positives * negatives))


def _array(variable):
    """A (possibly sharded) variable's value as one NumPy array, rows in natural order."""
    if hasattr(variable, "full_table"):
        return variable.full_table()
    shards = getattr(variable, "variables", None)
    if shards is not None:
        return np.concatenate([s.numpy() for s in shards], axis=0)
    return variable.numpy()


def export_parameters(model):
    """(table arrays, MLP weights) of a trained model, read from wherever they live (ps tasks,
    or under NestPipeStrategy an all-worker `full_table()`)."""
    tables = []
    for layer in model.embedding_layers():
        if isinstance(layer, tnp.ShardedEmbedding):
            tables.append(layer.full_table())
        else:
            tables.append(_array(layer.embeddings))
    return tables, model.mlp.get_weights()


def held_out_auc(parameters, metadata, table_sizes, bag_sizes, dim, batch=8192):
    """Exact ROC AUC and mean loss of `parameters` (see export_parameters) on the test split,
    computed in this process with a plain (strategy-free) copy of the model."""
    tables, mlp_weights = parameters
    local = RecModel("keras", table_sizes, bag_sizes, dim)
    schema, to_model_inputs, _, _ = model_inputs(metadata)
    data_dir = metadata["_dir"]
    test = make_dataset(split_files(data_dir, "test", metadata), schema, batch).map(to_model_inputs)
    features, _ = next(iter(test))
    local(features)
    for layer, table in zip(local.embedding_layers(), tables):
        layer.embeddings.assign(table)
    local.mlp.set_weights(mlp_weights)
    predict = tf.function(lambda features: tf.reshape(local(features), [-1]))
    labels, logits = [], []
    for features, label in test:
        logits.append(predict(features).numpy())
        labels.append(label.numpy().ravel())
    labels, logits = np.concatenate(labels), np.concatenate(logits)
    loss = float(np.mean(np.maximum(logits, 0) - logits * labels + np.log1p(np.exp(-np.abs(logits)))))
    return {"auc": exact_auc(labels, logits), "test_loss": loss, "test_rows": int(len(labels))}


def count_values(variables):
    """Number of float values in `variables` (shards counted once each)."""
    return int(sum(np.prod(v.shape.as_list()) for v in variables))


def train_dataset_fn(metadata, batch, seed):
    """dataset_fn: the whole train split, repeated, shuffled (files and records) with `seed`
    (None: a different random order on every worker), in batches of `batch`."""
    schema, to_model_inputs, _, _ = model_inputs(metadata)
    files = split_files(metadata["_dir"], "train", metadata)

    def dataset_fn(_context=None):
        return make_dataset(files, schema, batch, shuffle=True, seed=seed,
                            num_epochs=None).map(to_model_inputs)

    return dataset_fn


def time_scheduled(schedule, steps_per_call, warmup_steps, steps, coordinator):
    """Calls `schedule()` (each call covers `steps_per_call` steps) for `warmup_steps`, joins, then
    for the remaining steps and joins again. Returns (remote values, timed steps, seconds)."""
    warmup_calls = warmup_steps // steps_per_call
    total_calls = steps // steps_per_call
    results = [schedule() for _ in range(warmup_calls)]
    coordinator.join()
    start = time.perf_counter()
    results += [schedule() for _ in range(total_calls - warmup_calls)]
    coordinator.join()
    seconds = time.perf_counter() - start
    return results, (total_calls - warmup_calls) * steps_per_call, seconds


def run_tf_pss(args, metadata, table_sizes, bag_sizes):
    """TF's ParameterServerStrategy, tf_keras Embedding, a scheduled step pushing every step."""
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=args.min_shard_bytes, max_shards=2)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = RecModel("keras", table_sizes, bag_sizes, args.dim)
        example = next(iter(train_dataset_fn(metadata, 4, 0)()))[0]
        model(example)
        optimizer = tf_keras.optimizers.Adagrad(args.learning_rate)
    dense_values = count_values([v for v in model.mlp.trainable_variables])
    per_worker = coordinator.create_per_worker_dataset(train_dataset_fn(metadata, args.batch, None))
    iterator = iter(per_worker)

    @tf.function
    def step(iterator):
        def replica_fn(features, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(features, training=True))
            variables = model.trainable_variables
            gradients = tape.gradient(loss, variables)
            pushed, distinct = [], []
            for gradient in gradients:
                if isinstance(gradient, tf.IndexedSlices):
                    pushed.append(tf.size(gradient.values))
                    unique = tf.size(tf.unique(gradient.indices)[0])
                    distinct.append(unique * tf.shape(gradient.values)[1])
                else:
                    pushed.append(tf.size(gradient))
                    distinct.append(tf.size(gradient))
            optimizer.apply_gradients(zip(gradients, variables))
            ids = tf.size(features["sparse"]) + tf.add_n(
                [tf.size(features[name].flat_values) for name in sorted(bag_sizes)])
            pulled = ids * args.dim + dense_values
            return loss, tf.add_n(pushed), tf.add_n(distinct), pulled
        return strategy.run(replica_fn, args=next(iterator))

    results, timed_steps, seconds = time_scheduled(
        lambda: coordinator.schedule(step, args=(iterator,)), 1, args.warmup, args.steps,
        coordinator)
    values = [r.fetch() for r in results]
    out = {"pushed_values": sum(int(v[1]) for v in values),
           "pushed_distinct_values": sum(int(v[2]) for v in values),
           "pulled_values": sum(int(v[3]) for v in values),
           "losses": [float(v[0]) for v in values],
           "shards": {layer.name: len(getattr(layer.embeddings, "variables", [layer.embeddings]))
                      for layer in model.embedding_layers()}}
    return model, timed_steps, seconds, out


def run_downpour(args, metadata, table_sizes, bag_sizes):
    """tnp.ParameterServerStrategy + DownpourTrainer with update window T (= args.window)."""
    strategy = tnp.ParameterServerStrategy(
        variable_partitioner=tnp.MinSizePartitioner(min_shard_bytes=args.min_shard_bytes),
        update_window=args.window, local_optimizer=tnp.LocalSGD(args.local_lr))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    example = next(iter(train_dataset_fn(metadata, 4, 0)()))[0]

    def model_fn():
        model = RecModel("sharded", table_sizes, bag_sizes, args.dim)
        model(example)
        return model

    with strategy.scope():
        optimizer = tf_keras.optimizers.Adagrad(args.learning_rate)
    trainer = tnp.DownpourTrainer(strategy, coordinator, model_fn, loss_fn, optimizer)
    model_values = count_values(trainer.local_model.trainable_variables)
    iterator = iter(coordinator.create_per_worker_dataset(
        train_dataset_fn(metadata, args.batch, None)))
    results, timed_steps, seconds = time_scheduled(
        lambda: trainer.schedule(iterator), args.window, args.warmup, args.steps, coordinator)
    values = [r.fetch() for r in results]
    model = trainer.model
    out = {"pushed_values": sum(int(v[1]) for v in values),
           "pulled_values": sum(int(v[2]) for v in values),
           "whole_model_values": model_values,
           "losses": [float(v[0]) for v in values],
           "windows": len(values),
           "shards": {layer.name: len(layer._table_shards())  # pylint: disable=protected-access
                      for layer in model.embedding_layers()}}
    return model, timed_steps, seconds, out


class _StepClock(tf_keras.callbacks.Callback):
    """Records the time at the end of every training step and fit's running mean loss."""

    def on_train_begin(self, logs=None):
        self.ends, self.running_loss = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())
        self.running_loss.append(float((logs or {}).get("loss", np.nan)))

    def step_losses(self, last):
        """Mean loss of the last `last` steps, from fit's running means (equal batches):
        (n * mean_n - k * mean_k) / (n - k) with k = n - last."""
        n = len(self.running_loss)
        k = n - last
        first = self.running_loss[k - 1] * k if k > 0 else 0.0
        return (self.running_loss[-1] * n - first) / float(last)


def run_sync(args, metadata, table_sizes, bag_sizes):
    """tnp.NestPipeStrategy (2 workers, no ps) with tf_keras fit: the synchronous reference."""
    strategy = tnp.NestPipeStrategy(placement="row_wise")  # row-sharded, as the ps tasks' tables
    with strategy.scope():
        model = RecModel("sharded", table_sizes, bag_sizes, args.dim)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(args.learning_rate),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    # One global batch of args.batch per step; the strategy auto-shards it (FILE: each worker
    # reads its own train shards) and gives each worker its part of the batch.
    dataset = train_dataset_fn(metadata, args.batch, 1)()
    clock = _StepClock()
    model.fit(dataset, epochs=1, steps_per_epoch=args.steps, callbacks=[clock], verbose=0)
    timed_steps = len(clock.ends) - args.warmup
    seconds = clock.ends[-1] - clock.ends[args.warmup - 1]
    # The mean loss of the last 5% of steps, as a one-element list (see main()).
    out = {"losses": [clock.step_losses(max(1, args.steps // 20))],
           "worker_index": strategy.worker_index}
    return model, timed_steps, seconds, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True, choices=["tf_pss", "downpour", "sync"])
    parser.add_argument("--window", type=int, default=1, help="DOWNPOUR update window T")
    parser.add_argument("--steps", type=int, default=1740,
                        help="training steps (batches of --batch), warm-up included")
    parser.add_argument("--warmup", type=int, default=30, help="untimed first steps")
    parser.add_argument("--batch", type=int, default=512, help="samples per step")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=0.3, help="(global) Adagrad")
    parser.add_argument("--local-lr", type=float, default=0.1, help="DOWNPOUR local SGD")
    parser.add_argument("--min-shard-bytes", type=int, default=64 << 10,
                        help="MinSizePartitioner's min_shard_bytes (max_shards = 2 ps)")
    args = parser.parse_args()
    for name in ("steps", "warmup"):
        if getattr(args, name) % args.window:
            raise SystemExit("--%s must be a multiple of --window" % name)

    data_dir, metadata = load_or_prepare_movielens(DATASET)
    metadata = dict(metadata, _dir=data_dir)
    _, _, table_sizes, bag_sizes = model_inputs(metadata)
    run = {"tf_pss": run_tf_pss, "downpour": run_downpour, "sync": run_sync}[args.mode]
    wall = time.perf_counter()
    model, timed_steps, seconds, out = run(args, metadata, table_sizes, bag_sizes)
    train_seconds = time.perf_counter() - wall
    parameters = export_parameters(model)
    if out.pop("worker_index", 0) != 0:
        return
    evaluation = held_out_auc(parameters, metadata, table_sizes, bag_sizes, args.dim)
    samples = args.steps * args.batch
    losses = out.pop("losses")
    result = {"mode": args.mode, "window": args.window if args.mode == "downpour" else None,
              "steps": args.steps, "batch": args.batch, "samples": samples,
              "timed_samples": timed_steps * args.batch, "timed_seconds": seconds,
              "samples_per_s": timed_steps * args.batch / seconds,
              "train_seconds": train_seconds,
              "final_train_loss": float(np.mean(losses[-max(1, len(losses) // 20):])),
              "parameters": int(sum(t.size for t in parameters[0])
                                + sum(w.size for w in parameters[1]))}
    for key in ("pushed_values", "pushed_distinct_values", "pulled_values"):
        if key in out:
            result[key.replace("_values", "_bytes_per_sample")] = 4.0 * out.pop(key) / samples
    result.update(out)
    result.update(evaluation)
    result["train_rows"] = int(metadata["splits"]["train"]["rows"])
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
