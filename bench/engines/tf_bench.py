"""Our socket mesh and TensorFlow's own CPU collectives, timed in the same worker processes.

    python -m tf_nestpipe.launch --workers W -- python bench/engines/tf_bench.py OUT.jsonl \
        OP:BYTES:ITERS:WARMUP ...

Every worker builds a `NestPipeStrategy()` (its socket mesh opens at start-up) and, for each case
(OP `alltoall`: `BYTES` per worker in total, float32[W, BYTES/4/W]; OP `allreduce`: a float32
vector of `BYTES`), times one call after another, alternating:

- `mesh`: a tf.function with one `NestpipeSocketAllToAll` (`SocketCollectives.all_to_all`), or
  the mesh's `all_reduce_sum`, output fetched;
- `tf`: the same through TensorFlow's CollectiveAllToAllV2 / CollectiveReduceV2 (RING);
- `tf_dispatch`: a tf.function returning `tf.identity` of a scalar, output fetched: what calling
  any op from Python through a tf.function costs, collective or not (fetching a CPU tensor to
  NumPy shares its buffer, so the output's size adds nothing);
- `mesh_x8`: a tf.function with 8 chained mesh calls, its time / 8: the per-call cost when the
  calls sit inside one graph (as in a training step), where the dispatch is paid once; run
  on about every `iters / 4`-th iteration (at most every 8th), so it costs about as much as the
  single calls.

Worker 0 appends one JSON line per engine and case, {"engine", "op", "bytes", "seconds"}, to
OUT.jsonl.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.collectives.communication import _NESTPIPE_GROUP_KEY, Collectives  # noqa: E402
from tf_nestpipe.tf_private import collective_ops  # noqa: E402

CHAIN = 8
# Above this size the dispatch is noise next to the transfer; 8 chained calls only cost time.
X8_MAX_BYTES = 1 << 20


def fetched(fn):
    """Seconds one call of `fn` takes with its outputs fetched to NumPy."""
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), fn())
    return time.perf_counter() - start


def build_case(strategy, coll, op, nbytes, index):
    """{engine: (tf.function, calls it makes per Python call)} for one case."""
    workers, rank = coll.num_workers, coll.worker_index
    scalar = tf.constant(1.0)
    tag = "engines/%s/%d/%d" % (op, nbytes, index)
    if op == "alltoall":
        per_peer = nbytes // 4 // workers
        x = tf.fill([workers, per_peer], float(rank + 1))
        expected = np.repeat(np.arange(1, workers + 1, dtype=np.float32)[:, None], per_peer, 1)

        def mesh_call(suffix):
            return coll.all_to_all(x, tag + suffix)

        def tf_call():
            # The base class's all_to_all: CollectiveAllToAllV2 on the same group.
            return Collectives.all_to_all(coll, x, tag + "/tf")
    elif op == "allreduce":
        x = tf.fill([nbytes // 4], float(rank + 1))
        expected = np.full([nbytes // 4], workers * (workers + 1) / 2, np.float32)

        def mesh_call(suffix):
            return coll.all_reduce_sum([x], tag + suffix)[0]

        def tf_call():
            return coll._chained(tag + "/tf", lambda key, token: collective_ops.all_reduce_v2(
                x, workers, _NESTPIPE_GROUP_KEY, key, merge_op="Add", final_op="Id",
                communication_hint=coll._hint, ordering_token=token))
    else:
        raise ValueError("unknown op %r" % op)
    fns = {
        "mesh": (tf.function(lambda: mesh_call("/mesh")), 1),
        "tf": (tf.function(tf_call), 1),
        "tf_dispatch": (tf.function(lambda: tf.identity(scalar)), 1),
    }
    if nbytes <= X8_MAX_BYTES:
        fns["mesh_x8"] = (tf.function(lambda: [mesh_call("/x8") for _ in range(CHAIN)]), CHAIN)
    for engine in ("mesh", "tf"):  # a broken exchange must not pass as a fast one
        got = fns[engine][0]().numpy()
        if not np.array_equal(got, expected):
            raise SystemExit("worker %d: %s %s result differs from the expected one"
                             % (rank, engine, op))
    return fns


def main(argv):
    out_path, cases = argv[1], argv[2:]
    strategy = tnp.NestPipeStrategy()
    coll = strategy.extended.collectives
    if coll.backend != "sockets":
        raise SystemExit("the socket mesh did not open (backend %r)" % coll.backend)
    barrier = tf.function(lambda: coll.all_to_all(tf.zeros([coll.num_workers, 1]),
                                                  "engines/barrier"))
    lines = []
    for index, case in enumerate(cases):
        op, nbytes, iters, warmup = case.split(":")
        nbytes, iters, warmup = int(nbytes), int(iters), int(warmup)
        fns = build_case(strategy, coll, op, nbytes, index)
        seconds = {engine: [] for engine in fns}
        stride = max(1, min(CHAIN, iters // 4))
        barrier().numpy()
        for k in range(warmup + iters):
            for engine, (fn, calls) in fns.items():
                if calls > 1 and k >= warmup and (k - warmup) % stride:
                    continue  # the chained variant: ~4 samples of `calls` calls each
                elapsed = fetched(fn)
                if k >= warmup:
                    seconds[engine].append(elapsed / calls)
        lines += [json.dumps({"engine": engine, "op": op, "bytes": nbytes, "seconds": s})
                  for engine, s in seconds.items()]
    if coll.worker_index == 0:
        with open(out_path, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv)
