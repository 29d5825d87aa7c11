"""Lookups/s of a dynamic table's hash-table op vs a fixed-vocabulary gather (issue 18).

    python bench/dynamic_table.py                  # about a minute on 2 cores
    python bench/dynamic_table.py --ids 262144 --dim 32 --repeats 20

One process, one CPU device, no exchange. Each cell looks up a batch of `--ids` Zipf ids drawn
from a vocabulary of `--vocab`:
- gather: `tf.gather(table, ids)` on a fixed `[vocab, dim]` table (ids already in range).
- find: `DynamicTable.find` (hash map id -> slot) + gather of the slots (the inference lookup).
- admit: `DynamicTable.admit` (one training step of the table: dedup, touch, admission) + gather,
  on a warm table (every id already admitted), and on a full table where every step evicts
  (capacity = the batch's distinct ids; each timed step looks up a shifted, new set of ids).
Ids are raw 64-bit hashes of the Zipf ranks.
All inside one tf.function per cell; the best of `--repeats` timed runs. Writes
bench/results/dynamic_table.md.
"""
import argparse
import datetime
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tf_nestpipe import ops  # noqa: E402


def best_seconds(fn, repeats):
    fn()  # trace + warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=65536, help="ids per lookup")
    parser.add_argument("--vocab", type=int, default=1 << 20)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "dynamic_table.md"))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ranks = np.minimum(rng.zipf(1.2, size=args.ids), args.vocab) - 1
    raw = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)  # 64-bit
    ids_fixed = tf.constant(ranks.astype(np.int64))
    ids_raw = tf.constant(raw)
    table = tf.Variable(tf.random.uniform([args.vocab, args.dim]))
    rows = tf.Variable(tf.random.uniform([args.vocab, args.dim]))
    warm = ops.DynamicTable(args.vocab)
    warm.admit(ids_raw)
    # As many slots as one batch has distinct ids: each step's new ids evict the last step's.
    full = ops.DynamicTable(len(np.unique(raw)))
    shifts = [tf.constant(raw + np.int64(k) * np.int64(7919)) for k in range(args.repeats + 1)]
    calls = {"n": 0}

    @tf.function
    def gather(ids):
        return tf.gather(table, ids)

    @tf.function
    def find(ids):
        slots = warm.find(ids)
        return tf.gather(rows, tf.maximum(slots, 0))

    @tf.function
    def admit(t, ids):
        slots, _ = t.admit(ids)
        return tf.gather(rows, tf.maximum(slots, 0))

    def evicting():
        calls["n"] += 1
        return admit(full, shifts[calls["n"] % len(shifts)]).numpy()

    cells = [("gather (fixed vocabulary)", lambda: gather(ids_fixed).numpy()),
             ("find + gather (dynamic, inference)", lambda: find(ids_raw).numpy()),
             ("admit + gather (dynamic, warm)", lambda: admit(warm, ids_raw).numpy()),
             ("admit + gather (dynamic, full: evicting)", evicting)]
    results = [(name, args.ids / best_seconds(fn, args.repeats)) for name, fn in cells]
    full_stats = full.stats_dict()
    base = results[0][1]
    lines = ["# Dynamic table lookups/s vs a fixed-vocabulary gather (issue 18)", "",
             "Generated %s by `python bench/dynamic_table.py --ids %d --vocab %d --dim %d "
             "--repeats %d` (one process, CPU, %d cores visible, no exchange)."
             % (datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"), args.ids, args.vocab,
                args.dim, args.repeats, os.cpu_count()), "",
             "| lookup | lookups/s | vs gather |", "|---|---:|---:|"]
    for name, rate in results:
        lines.append("| %s | %.3g | %.2fx |" % (name, rate, rate / base))
    lines += ["", "Distinct ids per batch: %d of %d. The evicting table (capacity %d) ended with "
              "%s." % (len(np.unique(raw)), args.ids, full.capacity, full_stats), ""]
    text = "\n".join(lines)
    print(text)
    with open(args.output, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
