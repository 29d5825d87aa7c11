"""Compressed exchanges (issue 19): ms/step, bytes on the wire per step and held-out AUC per
wire dtype, side by side with fp32, in the bandwidth-bound setting.

    python bench/wire_dtypes.py      # as root (netem); the default cells, about 4 minutes
    python bench/wire_dtypes.py --networks loopback --workers 2 --wire-dtypes fp32 int8-bf16

Every row is one launch of bench/compare_worker.py (`--system nestpipe --wire-dtype W
--eval-batches N`: DLRM, Adagrad, tf_keras fit), on the emulated network of bench/compare.py
(bench/netem.py: each task in its own network namespace, `tc tbf` rate + delaying relay; needs
root). A cell is one (data, workers, network, pipeline); its rows are the wire dtypes, each
trained from the same initialization on the same batches for the same number of steps, then
evaluated on the same held-out batches. Bytes per step are what rank 0's exchanges sent to the
other workers (the strategy's wire counters: keys, rows, gradients, DBP sync), averaged over all
steps. Writes bench/results/OUTPUT.md and OUTPUT.json.
"""
import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import (EmulatedNetwork, cluster_tasks, parse_network, round_trip_ms,  # noqa: E402
                     run_command)
from netem import launched_on  # noqa: E402
from runner import REPO, write_result  # noqa: E402

WORKER = os.path.join(HERE, "compare_worker.py")
KINDS = ("keys", "forward", "backward", "sync")


def worker_argv(args, cell, wire):
    """The compare_worker.py command line of one row."""
    data, _, _, pipeline = cell
    return [sys.executable, "-u", WORKER, "--system", "nestpipe", "--pipeline", pipeline,
            "--model", "dlrm", "--data", data, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--global-batch", str(args.global_batch),
            "--dim", str(args.dim), "--table-scale", str(args.table_scale),
            "--wire-dtype", wire, "--eval-batches", str(args.eval_batches),
            "--placement", "row_wise"]  # the exchanges are what is compressed


def run_row(args, cell, wire):
    """Runs one row; returns compare_worker's RESULT dict (with `rtt_ms` on an emulated
    network), or `{"error": ...}`."""
    _, workers, network, _ = cell
    argv = worker_argv(args, cell, wire)
    launch = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers),
              "--timeout", str(args.row_timeout)]
    spec = parse_network(network) if network != "loopback" else None
    try:
        if spec is None:
            return run_command(launch + ["--"] + argv, args.row_timeout)
        row = {"system": "nestpipe", "workers": workers}
        with EmulatedNetwork(cluster_tasks(row), delay_ms=spec[0], rate=spec[1]) as net:
            result = run_command(launched_on(net, launch, argv), args.row_timeout)
            result["rtt_ms"] = round_trip_ms(net)
            return result
    except Exception as e:  # pylint: disable=broad-except  (one failed row must not stop the run)
        return {"error": str(e).splitlines()[0][:300]}


def total_bytes(result):
    """All bytes rank 0 sent per step (every exchange kind)."""
    return sum(result["wire_bytes_per_step"].get(k, 0) for k in KINDS)


def link_ms(network, sent_bytes):
    """Milliseconds `sent_bytes` take at the emulated link's rate (None on loopback): the
    step's lower bound from this worker's sending alone."""
    if network == "loopback":
        return None
    rate = network.split(":")[1].lower()
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return sent_bytes * 8 / (float(rate[:-len(unit)]) * scale) * 1e3
    raise ValueError("unknown rate %r" % rate)


def markdown(args, rows, command):
    """The results table: per cell, each wire dtype next to the cell's fp32 row."""
    lines = ["# Compressed exchanges: wire dtypes side by side (issue 19)", "",
             "`%s`" % command, "",
             "%s; DLRM (Adagrad %s), global batch %d, dim %d, table scale %g, %d warm-up + %d "
             "timed steps (ms/step: median of the timed steps), AUC on %d held-out global "
             "batches after those steps. Bytes: what rank 0 sent to the other workers per step "
             "(keys / rows / gradients / DBP sync), from the strategy's wire counters."
             % (datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"), "0.05",
                args.global_batch, args.dim, args.table_scale, args.warmup, args.steps,
                args.eval_batches), "",
             "| data | workers | network | pipeline | wire (fwd/bwd) | ms/step | speed-up | "
             "KB/step (keys/rows/grads/sync) | bytes vs fp32 | link ms/step | AUC | AUC - fp32 "
             "| clamped |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell, results in rows:
        base = results.get("fp32")
        for wire, result in results.items():
            data, workers, network, pipeline = cell
            if "error" in result:
                lines.append("| %s | %d | %s | %s | %s | failed: %s ||||||||" % (
                    data, workers, network, pipeline, wire, result["error"]))
                continue
            per_kind = "/".join("%.0f" % (result["wire_bytes_per_step"].get(k, 0) / 1e3)
                                for k in KINDS)
            ok = base is not None and "error" not in base
            speed = base["ms_median"] / result["ms_median"] if ok else None
            ratio = total_bytes(base) / total_bytes(result) if ok else None
            delta = result["auc"] - base["auc"] if ok else None
            link = link_ms(network, total_bytes(result))
            lines.append("| %s | %d | %s | %s | %s | %.1f | %s | %.0f (%s) | %s | %s | %.4f | %s "
                         "| %d |"
                         % (data, workers, network, pipeline, result["wire_dtype"],
                            result["ms_median"], "%.2fx" % speed if speed else "-",
                            total_bytes(result) / 1e3, per_kind,
                            "%.2fx fewer" % ratio if ratio else "-",
                            "%.1f" % link if link is not None else "-", result["auc"],
                            "%+.4f" % delta if delta is not None else "-", result["clamped"]))
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", default=["synthetic", "movielens-1m"],
                        choices=["synthetic", "movielens-1m"])
    parser.add_argument("--workers", nargs="+", type=int, default=[2])
    parser.add_argument("--networks", nargs="+", default=["0.2ms:1gbit"],
                        help="loopback and/or DELAYms:RATE")
    parser.add_argument("--pipelines", nargs="+", default=["none"])
    parser.add_argument("--wire-dtypes", nargs="+", default=["fp32", "int8-bf16", "bf16-bf16"],
                        help="FORWARD-BACKWARD pairs; fp32 is every cell's reference")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--row-timeout", type=int, default=300)
    parser.add_argument("--output", default="wire_dtypes")
    args = parser.parse_args(argv)
    if "fp32" not in args.wire_dtypes:
        args.wire_dtypes = ["fp32"] + args.wire_dtypes
    return args


def main(argv=None):
    """Runs every cell's rows and writes the table."""
    args = parse_args(argv)
    command = "python bench/wire_dtypes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for data in args.data:
        for workers in args.workers:
            for network in args.networks:
                for pipeline in args.pipelines:
                    cell = (data, workers, network, pipeline)
                    results = {}
                    for wire in ["fp32"] + [w for w in args.wire_dtypes if w != "fp32"]:
                        print("row %s %s" % (cell, wire), flush=True)
                        results[wire] = run_row(args, cell, wire)
                        print("   ", json.dumps(results[wire]), flush=True)
                    rows.append((cell, results))
    write_result(args.output + ".md", markdown(args, rows, command))
    with open(os.path.join(REPO, "bench", "results", args.output + ".json"), "w") as f:
        json.dump([{"cell": list(cell), "rows": results} for cell, results in rows], f, indent=1)


if __name__ == "__main__":
    main()
