"""All-to-all latency, Horovod (Gloo) vs TensorFlow's CollectiveAllToAllV2, on one 2-worker cluster.

    python -m tf_nestpipe.launch --workers 2 --horovod -- python bench/horovod_latency.py

Every worker builds both backends in one process (a collectives="tf" NestPipeStrategy over its
TF_CONFIG and Horovod over the launcher's Gloo rendezvous) and times the same exchanges, each a
tf.function with one collective whose output is fetched: median (and p90) of 200 calls after 20
warm-up calls, the TF and Horovod calls alternating. Worker 0 prints a Markdown table and writes
bench/results/horovod_latency.md (set HOROVOD_CYCLE_TIME, in ms, with the launcher's --env to see
Horovod's background-loop period at work; Horovod's default is 1 ms).
"""
import os
import statistics
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.collectives.horovod_collectives import (HorovodCollectives, init_horovod,  # noqa: E402
                                                       pack, unpack)

HERE = os.path.dirname(os.path.abspath(__file__))
REPEATS, WARMUP = 200, 20


def measure_pair(tf_fn, hvd_fn):
    """(median, p90) wall milliseconds of each function with its outputs fetched; the two are
    called alternately, so load from other jobs on the machine hits both alike."""
    def call(fn):
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn())
        return time.perf_counter() - start

    for _ in range(WARMUP):
        call(tf_fn), call(hvd_fn)
    times = {tf_fn: [], hvd_fn: []}
    for _ in range(REPEATS):
        for fn in (tf_fn, hvd_fn):
            times[fn].append(call(fn))
    return tuple((1e3 * statistics.median(times[fn]), 1e3 * float(np.percentile(times[fn], 90)))
                 for fn in (tf_fn, hvd_fn))


def main():
    """Times every exchange with both backends; worker 0 writes the table."""
    strategy = tnp.NestPipeStrategy()  # TF collectives over TF_CONFIG (RING)
    tf_coll = strategy.extended.collectives
    hvd, rank, size = init_horovod()
    hvd_coll = HorovodCollectives(hvd, size, rank, strategy.extended.worker_devices[0])
    workers = strategy.num_workers
    assert workers == size == 2, (workers, size)

    mib = 1 << 20
    per_peer = mib // 4 // workers  # float32 elements each worker sends to each peer
    big = tf.random.stateless_uniform([workers, per_peer], [rank, 1])
    big_flat = tf.reshape(big, [-1])
    big_splits = tf.fill([workers], per_peer)
    # The DLRM example's row exchange (global batch 512, 26 fields, dim 16): ~1.7k ids per peer
    # padded to a capacity bucket; real counts about 85% of it.
    capacity, dim = 1700, 16
    rows = tf.random.stateless_uniform([workers, capacity, dim], [rank, 2])
    real = tf.constant([int(capacity * 0.85)] * workers, tf.int32)
    dense = tf.random.stateless_uniform([20000], [rank, 3])

    cases = [
        ("1 MiB all-to-all, float32[%d, %d]" % (workers, per_peer),
         tf.function(lambda: tf_coll.all_to_all(big, "bench/a2a")),
         tf.function(lambda: hvd.alltoall(big_flat, splits=big_splits, name="bench.a2a",
                                          ignore_name_scope=True)[0])),
        ("1 MiB all-to-all through the Collectives interface (Horovod: pack + unpack)",
         tf.function(lambda: tf_coll.all_to_all(big, "bench/a2a_iface")),
         tf.function(lambda: hvd_coll.all_to_all(big, "bench/a2a_iface",
                                                 send_counts=big_splits))),
        ("rows all-to-all, float32[%d, %d, %d]: TF padded, Horovod real splits (85%%)"
         % (workers, capacity, dim),
         tf.function(lambda: tf_coll.all_to_all(rows, "bench/rows")),
         tf.function(lambda: hvd_coll.all_to_all(rows, "bench/rows", send_counts=real))),
        ("counts all-gather, int32[%d]" % workers,
         tf.function(lambda: tf_coll.all_gather(big_splits, "bench/counts")),
         tf.function(lambda: hvd_coll.all_gather(big_splits, "bench/counts"))),
        ("dense all-reduce (sum), float32[20000]",
         tf.function(lambda: strategy.run(
             lambda: tf.distribute.get_replica_context().all_reduce("sum", dense))),
         tf.function(lambda: hvd_coll.all_reduce_sum([dense], "bench/dense")[0])),
    ]
    table = [(name,) + measure_pair(tf_fn, hvd_fn) for name, tf_fn, hvd_fn in cases]
    local_copy = tf.function(lambda: tf.identity(big))
    pack_unpack = tf.function(lambda: unpack(pack(big, big_splits), big_splits, per_peer, 0))
    table.append(("local only, no collective: 1 MiB identity (TF) / pack + unpack (Horovod)",)
                 + measure_pair(local_copy, pack_unpack))
    if rank == 0:
        cycle = os.environ.get("HOROVOD_CYCLE_TIME")
        command = "python -m tf_nestpipe.launch --workers %d --horovod%s -- python " \
                  "bench/horovod_latency.py" % (workers, " --env HOROVOD_CYCLE_TIME=%s" % cycle
                                                if cycle else "")
        lines = [
            "# All-to-all latency: Horovod 0.28.1 (Gloo) vs TF CollectiveAllToAllV2 (RING), "
            "%d local CPU workers" % workers, "",
            "Command: `%s`; both backends in the same processes, each row a tf.function with one "
            "collective, output fetched; median and p90 of %d calls after %d warm-up calls, TF "
            "and Horovod calls alternating. Horovod cycle time: %s ms. Date: %s. Machine: 2 CPU "
            "cores shared with other jobs, so compare the columns of one run."
            % (command, REPEATS, WARMUP, cycle or "1 (default)", time.strftime("%Y-%m-%d")), "",
            "| exchange | TF ms (median / p90) | Horovod ms (median / p90) |", "|---|---|---|"]
        lines += ["| %s | %.3f / %.3f | %.3f / %.3f |" % (name, t[0], t[1], h[0], h[1])
                  for name, t, h in table]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        name = "horovod_latency%s.md" % ("_cycle%s" % cycle if cycle else "")
        with open(os.path.join(HERE, "results", name), "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
