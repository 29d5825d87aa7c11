"""MPI CPU collectives micro-benchmark (mpi4py): Alltoallv and Allreduce (sum, float32).

    mpirun -n W python bench/engines/mpi_bench.py OUT.jsonl OP:BYTES:ITERS:WARMUP ...

OP is `alltoall` (Alltoallv, equal splits, `BYTES` per rank in total) or `allreduce`. Every case
starts after a barrier; each rank times each call and rank 0 appends one JSON line per case,
{"op", "bytes", "seconds"}, to OUT.jsonl. The buffers are preallocated NumPy arrays, so mpi4py
adds only its call overhead (a few microseconds) to the library's time.
"""
import json
import sys
import time

import numpy as np
from mpi4py import MPI


def run_case(comm, op, nbytes, iters, warmup):
    """Per-call wall seconds of `iters` calls of `op` after `warmup` calls (result checked)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    per_peer = nbytes // 4 // size
    send = np.full(per_peer * size, rank + 1, np.float32)
    recv = np.zeros_like(send)
    counts = [per_peer] * size
    displs = [per_peer * i for i in range(size)]
    if op == "alltoall":
        def call():
            comm.Alltoallv([send, counts, displs, MPI.FLOAT], [recv, counts, displs, MPI.FLOAT])
        expected = np.repeat(np.arange(1, size + 1, dtype=np.float32), per_peer)
    elif op == "allreduce":
        def call():
            comm.Allreduce(send, recv, op=MPI.SUM)
        expected = np.full_like(send, size * (size + 1) / 2)
    else:
        raise ValueError("unknown op %r" % op)
    comm.Barrier()
    seconds = []
    for k in range(warmup + iters):
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        if k >= warmup:
            seconds.append(elapsed)
    if not np.array_equal(recv, expected):
        raise SystemExit("rank %d: %s result differs from the expected one" % (rank, op))
    return seconds


def main(argv):
    out_path, cases = argv[1], argv[2:]
    comm = MPI.COMM_WORLD
    lines = []
    for case in cases:
        op, nbytes, iters, warmup = case.split(":")
        seconds = run_case(comm, op, int(nbytes), int(iters), int(warmup))
        lines.append(json.dumps({"op": op, "bytes": int(nbytes), "seconds": seconds}))
    if comm.Get_rank() == 0:
        with open(out_path, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv)
