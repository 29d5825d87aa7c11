"""Step time and communication exposure of the DLRM example on 2 workers with pipeline="none",
"dbp", "fwp" and "nested", side by side, on loopback and on an emulated network.

    python bench/pipeline.py [--steps 60] [--networks loopback 1ms:200mbit]

A network `DELAYms:RATE` puts each worker in its own network namespace, joined by veth pairs with
`tc tbf` rate limits; the delay is a TCP relay (bench/delay_relay.py) because this kernel has no
`tc netem` (see bench/netem.py). Per setting it also runs the compute-only bound (each worker
trains alone on its share of the batch, no communication) and takes the communication-only time
as the union of the collectives' intervals in the profiled "none" step. It measures key-centric
clustering's effect on the rows fetched per micro-batch on the same data. Needs root for the
namespaces. Writes bench/results/pipeline.md.
"""
import argparse
import os
import statistics
import time

import numpy as np

from netem import EmulatedNetwork, round_trip_ms
from runner import HERE, run_program, write_result

PIPELINES = ["none", "dbp", "fwp", "nested"]


def parse_network(text):
    """'loopback' or 'DELAYms:RATE' (e.g. 1ms:200mbit) -> (delay_ms, rate) or None."""
    if text == "loopback":
        return None
    delay, rate = text.split(":")
    return float(delay.rstrip("ms")), rate


def run_setting(args, network, net):
    """Runs every pipeline and the compute-only bound in one network setting."""
    flags = net.launcher_flags() if net is not None else []
    common = ["--steps", str(args.steps), "--global-batch", str(args.global_batch),
              "--table-scale", str(args.table_scale), "--micro-batches", str(args.micro_batches)]
    results = {p: [] for p in PIPELINES + ["compute-only"]}
    for _ in range(args.rounds):
        for pipeline in PIPELINES:
            results[pipeline].append(run_program(
                [os.path.join(HERE, "dlrm_worker.py"), "--mode", "nestpipe", "--pipeline", pipeline,
                 "--profile-steps", str(args.profile_steps)] + common,
                workers=2, launcher_flags=flags))
            print(network, pipeline, results[pipeline][-1], flush=True)
        results["compute-only"].append(run_program(
            [os.path.join(HERE, "dlrm_worker.py"), "--mode", "local"] + common,
            workers=2, launcher_flags=flags))
    return {p: _median_result(rs) for p, rs in results.items()}


def _median_result(results):
    keys = ("median_ms", "p90_ms", "communication_ms", "exposed_ms", "exposure_ratio")
    return {k: statistics.median(r[k] for r in results) for k in keys if k in results[0]}


def clustering_rows(args):
    """Distinct rows per micro-batch of worker 0's share of the DLRM batches, plain vs clustered
    (what the window cache fetches: all rows in total, the first micro-batch's without overlap)."""
    import tensorflow as tf
    from tf_nestpipe.data import SyntheticClickLog, criteo_kaggle_table_sizes
    from tf_nestpipe.pipeline import cluster_permutation

    log = SyntheticClickLog(criteo_kaggle_table_sizes(args.table_scale), seed=1)
    local = args.global_batch // 2
    totals = {"plain": np.zeros(2), "clustered": np.zeros(2)}
    for index in range(10):
        sparse = log.batch(index, args.global_batch)[0]["sparse"][:local]
        orders = {"plain": np.arange(local),
                  "clustered": cluster_permutation([tf.constant(sparse)], local,
                                                   args.micro_batches).numpy()}
        for name, order in orders.items():
            chunks = np.array_split(order, args.micro_batches)
            per_chunk = [sum(len(np.unique(sparse[c, f])) for f in range(sparse.shape[1]))
                         for c in chunks]
            totals[name] += [per_chunk[0], sum(per_chunk)]
    return totals


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--networks", nargs="+", default=["loopback", "1ms:200mbit"])
    args = parser.parse_args()
    settings = []
    for network in args.networks:
        spec = parse_network(network)
        if spec is None:
            settings.append((network, "-", run_setting(args, network, None)))
            continue
        with EmulatedNetwork({"worker": 2}, delay_ms=spec[0], rate=spec[1]) as net:
            rtt = round_trip_ms(net)
            settings.append((network, "%.2f" % rtt, run_setting(args, network, net)))
    rows = clustering_rows(args)
    ideal = 1.0 / args.micro_batches + 0.1
    lines = [
        "# NestPipe pipelines: none vs dbp vs fwp vs nested (DLRM, 2 workers)", "",
        "Command: `python bench/pipeline.py --steps %d --rounds %d --profile-steps %d "
        "--global-batch %d --table-scale %g --micro-batches %d --networks %s`" % (
            args.steps, args.rounds, args.profile_steps, args.global_batch, args.table_scale,
            args.micro_batches, " ".join(args.networks)), "",
        "DLRM example, one fused ShardedEmbeddingCollection (26 Criteo-profile tables), tf_keras "
        "fit, Adagrad, synthetic Zipf data, both workers on the same 2 CPU cores. ms/step: median "
        "after 10 warm-up steps (median of %d rounds). Communication / exposed / exposure: medians "
        "over %d profiled steps (exposure = time a collective runs while no other op runs / time "
        "collectives run; the profiler slows steps). `DELAYms:RATE`: each worker in its own "
        "network namespace, veth pairs to a bridge, `tc tbf` at RATE on both ends, and a TCP "
        "relay delaying each direction by DELAY (no `tc netem` on this kernel); RTT = measured "
        "1-byte round trip through it. Compute-only: each worker trains alone on its share of "
        "the batch (no communication). Communication-only: union of the collectives' intervals "
        "in the profiled `none` step. Targets: exposure <= 1/M + 0.1 = %.2f; nested <= 1.15 x "
        "max(compute-only, communication-only). Date: %s." % (
            args.rounds, args.profile_steps, ideal, time.strftime("%Y-%m-%d")), "",
        "| network | RTT ms | pipeline | ms/step | p90 | speedup vs none | communication ms | "
        "exposed ms | exposure | exposure target met | step / max(compute, comm) |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for network, rtt, results in settings:
        compute = results["compute-only"]["median_ms"]
        comm = results["none"]["communication_ms"]
        bound = max(compute, comm)
        for pipeline in PIPELINES:
            r = results[pipeline]
            lines.append("| %s | %s | %s | %.1f | %.1f | %.2fx | %.1f | %.1f | %.2f | %s | %.2f |" % (
                network, rtt, pipeline, r["median_ms"], r["p90_ms"],
                results["none"]["median_ms"] / r["median_ms"], r["communication_ms"],
                r["exposed_ms"], r["exposure_ratio"],
                "yes" if r["exposure_ratio"] <= ideal else "no", r["median_ms"] / bound))
        lines.append("| %s | %s | compute-only | %.1f | %.1f | | | | | | |" % (
            network, rtt, compute, results["compute-only"]["p90_ms"]))
    plain, clustered = rows["plain"], rows["clustered"]
    lines += [
        "", "## Key-centric sample clustering", "",
        "Distinct rows of worker 0's share (%d samples, 26 fields) over 10 batches, %d "
        "micro-batches: the first micro-batch fetches with nothing to overlap; the window cache "
        "makes the batch total the batch's distinct rows whatever the order, and without it "
        "(the sum over micro-batches) clustering saves rows too." % (
            args.global_batch // 2, args.micro_batches), "",
        "| order | rows in the first micro-batch | sum of per-micro-batch distinct rows |",
        "|---|---|---|",
        "| plain | %d | %d |" % tuple(plain),
        "| clustered | %d (%.1f%% fewer) | %d (%.1f%% fewer) |" % (
            clustered[0], 100 * (1 - clustered[0] / plain[0]), clustered[1],
            100 * (1 - clustered[1] / plain[1]))]
    write_result("pipeline.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
