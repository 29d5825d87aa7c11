"""Latency of each collective one NestPipe training step issues, on a real 2-worker cluster.

    python -m tf_nestpipe.launch --workers 2 -- python bench/collective_latency.py

Worker 0 prints a Markdown table (and writes bench/results/collective_latency.md): the counts
all-gather, the key and row all-to-alls at the DLRM example's sizes, and the dense all-reduce.
"""
import os
import statistics
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(fn, repeats=200, warmup=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    strategy = tnp.NestPipeStrategy()
    collectives = strategy.extended.collectives
    workers = strategy.num_workers
    # Sizes of the DLRM example (global batch 512, 26 fields, dim 16): ~3.3k unique ids per
    # worker per step, ~1.7k per destination.
    capacity, dim, dense_params = 1700, 16, 20000
    splits = tf.ones([workers], tf.int32)
    keys = tf.zeros([workers, capacity], tf.int64)
    rows = tf.zeros([workers, capacity, dim], tf.float32)
    grads = tf.zeros([dense_params], tf.float32)

    @tf.function
    def gather_counts():
        return collectives.all_gather(splits, "bench/counts")

    @tf.function
    def exchange_keys():
        return collectives.all_to_all(keys, "bench/keys")

    @tf.function
    def exchange_rows():
        return collectives.all_to_all(rows, "bench/rows")

    @tf.function
    def all_reduce_dense():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", grads))

    @tf.function
    def noop():
        return tf.identity(splits)

    results = [
        ("tf.function call overhead (no collective)", noop),
        ("counts all-gather, int32[%d]" % workers, gather_counts),
        ("keys all-to-all, int64[%d, %d]" % (workers, capacity), exchange_keys),
        ("rows all-to-all, float32[%d, %d, %d] (fwd; bwd is the same)" % (workers, capacity, dim),
         exchange_rows),
        ("dense all-reduce, float32[%d] (MWMS path)" % dense_params, all_reduce_dense),
    ]
    table = [(name, measure(lambda fn=fn: tf.nest.map_structure(lambda t: t.numpy(), fn())))
             for name, fn in results]
    if strategy.worker_index == 0:
        lines = ["# Collective latency on %d local CPU workers (RING)" % workers, "",
                 "Command: `python -m tf_nestpipe.launch --workers %d -- python "
                 "bench/collective_latency.py`; median of 200 calls, each a tf.function with one "
                 "collective, output fetched. Date: %s." % (workers, time.strftime("%Y-%m-%d")), "",
                 "| collective | ms (median) |", "|---|---|"]
        lines += ["| %s | %.3f |" % row for row in table]
        per_step = table[2][1] + 2 * table[3][1] + table[1][1] + table[4][1] - 4 * table[0][1]
        lines += ["", "One fused NestPipe step issues the counts all-gather, the key all-to-all, "
                  "two row all-to-alls and the dense all-reduce: about **%.1f ms** of collective "
                  "latency per step, serialized (no pipelining yet)." % per_step]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        with open(os.path.join(HERE, "results", "collective_latency.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
