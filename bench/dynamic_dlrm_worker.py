"""One run of bench/dynamic_dlrm.py: the DLRM example (examples/dlrm.py) on Criteo-format TSV
files, trained with fit on this cluster, then evaluated on the held-out file; worker 0 prints
`RESULT {json}` (held-out AUC and loss, peak RSS growth of worker 0 from before the model was
built, the bytes of its embedding state, step time).

Modes:
- fixed: `read_criteo_tsv(path, table_sizes)` folds each hash into its column's table size
  (`--table-sizes-scale` times the Criteo Kaggle sizes); one fused `ShardedEmbeddingCollection`.
- dynamic: `read_criteo_tsv(path, raw_ids=True)` keeps the raw hashes; one `DynamicEmbedding`
  holds every column (id = (column + 1) << 32 | hash, empty -> -(column + 1): distinct across
  columns), `--capacity` rows per worker, admission at first sight, LRU eviction.
"""
import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import dlrm  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.data import criteo_kaggle_table_sizes, read_criteo_tsv  # noqa: E402


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class DynamicCriteoEmbeddings(tf_keras.layers.Layer):
    """The 26 Criteo columns' raw hashes `[B, 26]` -> `[B, 26, dim]` from one DynamicEmbedding
    (column-salted ids, see module): one lookup, one exchange per step."""

    def __init__(self, dim, capacity, **kwargs):
        super().__init__(**kwargs)
        self.table = tnp.DynamicEmbedding(
            dim, embeddings_initializer=tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=0),
            capacity_per_worker=capacity, admission=1, eviction="lru", name="criteo_ids")

    def call(self, ids, training=None):
        column = tf.range(1, 27, dtype=tf.int64)[None, :]
        salted = tf.where(ids < 0, -column, tf.bitwise.left_shift(column, 32) | ids)
        return self.table(salted, training=training)


def read_all(path, table_sizes):
    """The whole TSV file: dense [N, 13], sparse [N, 26], labels [N, 1]."""
    batches = list(read_criteo_tsv(path, table_sizes, raw_ids=table_sizes is None))
    return (np.concatenate([b[0]["dense"] for b in batches]),
            np.concatenate([b[0]["sparse"] for b in batches]),
            np.concatenate([b[1] for b in batches])[:, None])


def dataset_fn(data, global_batch):
    """This worker's slice of every global batch of `data` (in memory)."""
    dense, sparse, labels = data
    steps = len(labels) // global_batch

    def fn(context):
        per = context.get_per_replica_batch_size(global_batch)
        lo = context.input_pipeline_id * per
        pick = (np.arange(steps)[:, None] * global_batch + lo + np.arange(per)[None, :]).ravel()
        dataset = tf.data.Dataset.from_tensor_slices(
            ({"dense": dense[pick], "sparse": sparse[pick]}, labels[pick]))
        return dataset.batch(per, drop_remainder=True).prefetch(2)

    return fn, steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["fixed", "dynamic"], required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--test", required=True)
    parser.add_argument("--table-sizes-scale", type=float, default=0.05)
    parser.add_argument("--capacity", type=int, default=1 << 17)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    args = parser.parse_args()
    sizes = (criteo_kaggle_table_sizes(args.table_sizes_scale) if args.mode == "fixed"
             else None)
    train, test = read_all(args.train, sizes), read_all(args.test, sizes)
    # row_wise: the fixed tables sharded as the dynamic ones are ("auto" may replicate them).
    strategy = tnp.NestPipeStrategy(pipeline="none", placement="row_wise")
    baseline = current_rss_bytes()
    with strategy.scope():
        if args.mode == "fixed":
            embeddings = dlrm.make_embeddings("fused", sizes, args.dim)
        else:
            embeddings = DynamicCriteoEmbeddings(args.dim, args.capacity, name="tables")
        model = dlrm.DLRM(embeddings, dim=args.dim)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(args.learning_rate),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[tf_keras.metrics.AUC(from_logits=True, name="auc")])
    train_fn, train_steps = dataset_fn(train, args.global_batch)
    test_fn, test_steps = dataset_fn(test, args.global_batch)
    callbacks = [tnp.DynamicTableStats()] if args.mode == "dynamic" else []
    start = time.perf_counter()
    history = model.fit(strategy.distribute_datasets_from_function(train_fn), epochs=1,
                        steps_per_epoch=train_steps, verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - start
    evaluation = model.evaluate(strategy.distribute_datasets_from_function(test_fn),
                                steps=test_steps, return_dict=True, verbose=0)
    if args.mode == "fixed":
        rows = embeddings.fused.layout.local_rows
        stats = {}
    else:
        rows = args.capacity
        stats = embeddings.table.global_table_stats()
    # The rows and the Adagrad accumulator beside them (float32).
    state_bytes = 2 * rows * args.dim * 4
    result = {"mode": args.mode, "workers": strategy.num_workers,
              "train_rows": int(len(train[2])), "test_rows": int(len(test[2])),
              "train_steps": train_steps, "auc": float(evaluation["auc"]),
              "loss": float(evaluation["loss"]), "train_auc": float(history.history["auc"][-1]),
              "rows_per_worker": rows, "state_bytes_per_worker": state_bytes,
              "peak_growth_bytes": peak_rss_bytes() - baseline,
              "seconds_per_step": seconds / train_steps, "table_stats": stats}
    if strategy.worker_index == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
