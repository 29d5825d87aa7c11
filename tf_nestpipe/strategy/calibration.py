"""Measures a cluster's collective costs for the placement planner (run by every task; started
by `python -m tf_nestpipe.plan calibrate`).

    python -m tf_nestpipe.strategy.calibration [--transport sockets] [--rounds 3] [--output FILE]

Every worker builds a `NestPipeStrategy` on the transport asked and times its all-to-all and
its dense all-reduce over a sweep of sizes, each as a `tf.function` of one collective minus an
empty `tf.function`'s call, in interleaved rounds (every size once per round, the same order on
every worker); the lowest per-round median of each size is kept (the round least disturbed by
other processes). Worker 0 records the sweeps (`collective_costs.record_calibration`) and
prints where.
"""
import argparse
import os
import statistics
import sys
import time

from tf_nestpipe.plan import collective_costs

# Bytes of the whole all-to-all send tensor, and of the all-reduced tensor.
ALL_TO_ALL_SIZES = (1 << 10, 32 << 10, 256 << 10, 1 << 20)
ALL_REDUCE_SIZES = (4 << 10, 128 << 10, 1 << 20)


def _timed_rounds(functions, rounds, calls=10, warmup=3):
    """Per function, the per-round medians (ms) of `calls` calls, rounds interleaved."""
    for fn in functions:
        for _ in range(warmup):
            fn()
    medians = [[] for _ in functions]
    for _ in range(rounds):
        for fn, out in zip(functions, medians):
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out.append(1e3 * statistics.median(times))
    return medians


def collective_probes(strategy, tag):
    """One-collective `tf.function`s of `strategy`'s transport, for timing sweeps.

    Args:
        strategy: A `NestPipeStrategy`.
        tag: The collectives' tag prefix (sweeps with different prefixes never match).

    Returns:
        `(noop, probes)`: an empty `tf.function` (the call overhead to subtract) and
        `{"all_to_all" | "all_gather" | "all_reduce": make}`, where `make(nbytes)` returns
        `(bytes actually sent, a tf.function of one such collective)`: the whole all-to-all send
        tensor, one worker's all-gather contribution, the dense all-reduced tensor.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    collectives = strategy.extended.collectives
    workers = strategy.num_workers

    @tf.function
    def noop():
        return tf.ones([1])

    def all_to_all(total_bytes):
        tensor = tf.zeros([workers, max(1, total_bytes // (4 * workers))], tf.float32)
        fn = tf.function(lambda: collectives.all_to_all(tensor, "%s/a2a/%d" % (tag, total_bytes)))
        return int(tensor.shape[1]) * workers * 4, fn

    def all_gather(contribution_bytes):
        tensor = tf.zeros([max(1, contribution_bytes // 4)], tf.float32)
        fn = tf.function(lambda: collectives.all_gather(
            tensor, "%s/ag/%d" % (tag, contribution_bytes)))
        return int(tensor.shape[0]) * 4, fn

    def all_reduce(total_bytes):
        tensor = tf.zeros([max(1, total_bytes // 4)], tf.float32)
        fn = tf.function(lambda: strategy.run(
            lambda: tf.distribute.get_replica_context().all_reduce("sum", tensor)))
        return int(tensor.shape[0]) * 4, fn

    return noop, {"all_to_all": all_to_all, "all_gather": all_gather, "all_reduce": all_reduce}


def measure(strategy, rounds=3, all_to_all_sizes=ALL_TO_ALL_SIZES,
            all_reduce_sizes=ALL_REDUCE_SIZES):
    """Times `strategy`'s all-to-all and dense all-reduce (call it on every worker).

    Args:
        strategy: A multi-worker `NestPipeStrategy`.
        rounds: Interleaved timing rounds (>= 1).
        all_to_all_sizes: Bytes of the whole all-to-all send tensor, one sweep point each.
        all_reduce_sizes: Bytes of the all-reduced tensor, one sweep point each.

    Returns:
        `{"all_to_all": [[bytes, ms], ...], "all_reduce": [[bytes, ms], ...]}`, each ms the
        lowest per-round median above an empty call's (never below 0).

    Raises:
        ValueError: `rounds` < 1 or fewer than two sizes of a kind.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if int(rounds) < 1:
        raise ValueError("rounds must be >= 1, got %r" % (rounds,))
    if len(all_to_all_sizes) < 2 or len(all_reduce_sizes) < 2:
        raise ValueError("each collective needs two or more sizes to fit a line")
    noop, probes = collective_probes(strategy, "calibrate")
    labels, functions = [], [noop]
    for kind, sizes in (("all_to_all", all_to_all_sizes), ("all_reduce", all_reduce_sizes)):
        for size in sizes:
            nbytes, fn = probes[kind](int(size))
            labels.append((kind, nbytes))
            functions.append(fn)
    fetched = [lambda fn=fn: tf.nest.map_structure(lambda t: t.numpy(), fn()) for fn in functions]
    medians = _timed_rounds(fetched, int(rounds))
    sweeps = {"all_to_all": [], "all_reduce": []}
    for (kind, nbytes), times in zip(labels, medians[1:]):
        above_empty = [t - empty for t, empty in zip(times, medians[0])]
        sweeps[kind].append([nbytes, max(min(above_empty), 0.0)])
    return sweeps


def main(argv=None):
    """Measures on this worker and, on worker 0, records the result; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m tf_nestpipe.strategy.calibration",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="sockets", choices=("sockets", "tf"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    import tf_nestpipe as tnp  # pylint: disable=import-outside-toplevel

    strategy = tnp.NestPipeStrategy(transport=args.transport)
    if strategy.num_workers < 2:
        print("error: calibration needs a cluster of 2 or more workers (run `python -m "
              "tf_nestpipe.plan calibrate --workers N`, or this module as every task of a "
              "TF_CONFIG cluster)", file=sys.stderr)
        return 2
    used = strategy.extended.collectives_backend
    sweeps = measure(strategy, args.rounds)
    if strategy.worker_index == 0:
        path = collective_costs.record_calibration(
            used, strategy.num_workers, sweeps,
            "python -m tf_nestpipe.plan calibrate --transport %s --rounds %d on %d workers "
            "(host %s): lowest per-round median above an empty call"
            % (args.transport, args.rounds, strategy.num_workers, os.uname().nodename),
            args.output)
        print("tf_nestpipe: %s collective costs of %d workers written to %s"
              % (used, strategy.num_workers, path), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
