"""How much of each embedding exchange a pipeline leaves on the step's critical path, measured
by taking bytes off it: per mode, the step with the fp32 wire, with only the forward exchanges
(rows and sync) in bf16, and with only the gradients in bf16, interleaved round by round.

    python bench/exposed_exchange.py   # as root; the base cell, two link bursts, ~20 minutes
    python bench/exposed_exchange.py --cells 8x200k_d64_zipf1.05_b4096_1gbit_w2 --modes nested

Halving one exchange's bytes removes their time on the link (`removed ms`, from the strategy's
wire counters at the link's rate). Where the step falls by that much, those bytes were on the
critical path; where it does not move, the pipeline already hid them. **Exposed share** =
(fp32 ms - bf16 ms) / removed ms, per exchange and mode: about 1 exposed, about 0 hidden. The
bf16 encode and decode cost some CPU of their own, so a share reads a little low. A share above
1 says fewer bytes saved more than their time at the rate: the emulated link lets its bucket
(`tc tbf`'s burst) through at once after an idle spell, so an exchange that shrinks towards it
costs less than its bytes' time. Each cell runs with every `--bursts` size (bench/netem.py's
default, and a smaller one) to show how much of the step that bucket gives. The numbers
are for timing only: a bf16 run trains a (slightly) different model.

Each row is one launch of bench/compare_worker.py (`--system nestpipe --wire-dtype W`: DLRM,
Adagrad, tf_keras fit) with the cell's shape (bench/families.py's `BANDWIDTH_CELLS`), on the
emulated network of bench/compare.py (bench/netem.py; needs root). Writes
bench/results/exposed_exchange.{md,json}.
"""
import argparse
import datetime
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import EmulatedNetwork, parse_network, run_command  # noqa: E402
from netem import TBF_BURST, launched_on  # noqa: E402
from families import BANDWIDTH_CELLS  # noqa: E402
from runner import REPO, write_result  # noqa: E402
from wire_dtypes import link_ms  # noqa: E402

WORKER = os.path.join(HERE, "compare_worker.py")
# The wire of each row: the reference, then one exchange direction halved at a time.
WIRES = (("fp32", "fp32"), ("forward bf16", "bf16-fp32"), ("gradients bf16", "fp32-bf16"))
# The wire counters' kinds each direction's encoding changes.
HALVED = {"bf16-fp32": ("forward", "sync"), "fp32-bf16": ("backward",)}


def worker_argv(cell, mode, wire, args):
    """compare_worker.py's command line of one row of `cell` (a `families.Cell`)."""
    return [sys.executable, "-u", WORKER, "--system", "nestpipe", "--collectives", "sockets",
            "--pipeline", mode, "--model", "dlrm", "--data", "synthetic",
            "--tables", cell.tables, "--synthetic-tables", cell.synthetic_tables,
            "--zipf", str(cell.zipf), "--dim", str(cell.dim),
            "--global-batch", str(cell.global_batch), "--micro-batches", str(cell.micro_batches),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--wire-dtype", wire]


def run_row(net, workers, argv, timeout):
    """One launch on the emulated network `net`; compare_worker's RESULT, or {"error": ...}."""
    launch = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers),
              "--timeout", str(timeout)]
    try:
        return run_command(launched_on(net, launch, argv), timeout)
    except Exception as e:  # pylint: disable=broad-except  (one failed row must not stop the run)
        return {"error": str(e).splitlines()[0][:300]}


def exposed_share(reference, halved, wire, network):
    """(ms the step fell by, ms of link time the halved bytes took, their ratio) of one mode's
    fp32 row `reference` and its row with `wire`; the ratio is None where nothing was removed."""
    removed = sum(reference["bytes"][k] - halved["bytes"][k] for k in HALVED[wire])
    removed_ms = link_ms(network, removed)
    saved = reference["ms"] - halved["ms"]
    if not removed_ms or removed_ms <= 0:
        return saved, removed_ms, None
    return saved, removed_ms, saved / removed_ms


def summarize(results):
    """Per (mode, wire): the median ms/step over the rounds and the mean bytes per kind."""
    out = {}
    for key, rows in results.items():
        ok = [r for r in rows if "error" not in r]
        if not ok:
            out[key] = {"error": rows[-1]["error"] if rows else "not run"}
            continue
        kinds = ok[0]["wire_bytes_per_step"]
        out[key] = {"ms": statistics.median(r["ms_median"] for r in ok),
                    "ms_rounds": [round(r["ms_median"], 2) for r in ok],
                    "cpu_ms": statistics.median(r.get("cpu_ms_per_step") or 0 for r in ok),
                    "bytes": {k: statistics.mean(r["wire_bytes_per_step"][k] for r in ok)
                              for k in kinds}}
    return out


def markdown(args, measured, command, started, minutes, load=None):
    """The results: per cell and link bucket (`measured`: [(name, cell, burst, summary)]),
    per mode, each wire's step and the exposed share of what it halved."""
    lines = ["# How much of each exchange stays on the critical path", "",
             "`%s` (%s, %.0f min%s)" % (command, started, minutes,
                                        "" if load is None else
                                        "; load average %.2f at the start, %.2f at the end"
                                        % load), ""]
    for name, cell, burst, summary in measured:
        lines += _cell_table(args, name, cell, burst, summary)
    return "\n".join(lines)


def _cell_table(args, name, cell, burst, summary):
    network = cell.networks[0]
    lines = ["## %s, link bucket %s" % (name, burst), "",
             "%s: %s tables, dim %d, Zipf %s, global batch %d, M=%d, %d workers on %s "
             "(`tc tbf` burst %s); "
             "%d warm-up + %d timed steps per row, %d interleaved rounds (median of the "
             "rounds). Removed ms = the halved bytes' time at the link's rate; **exposed share** "
             "= (fp32 ms - bf16 ms) / removed ms: about 1, those bytes are on the critical path; "
             "about 0, the mode hides them."
             % (name, cell.synthetic_tables, cell.dim, cell.zipf, cell.global_batch,
                cell.micro_batches, cell.workers[0], network, burst, args.warmup, args.steps,
                args.rounds), "",
             "| mode | wire | ms/step (rounds) | CPU ms/step | KB/step keys/rows/grads/sync "
             "| step fell by ms | removed ms | exposed share |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in args.modes:
        reference = summary.get((mode, "fp32"))
        for label, wire in WIRES:
            row = summary.get((mode, wire))
            if row is None or "error" in row:
                lines.append("| %s | %s | failed: %s ||||||" % (
                    mode, label, (row or {}).get("error", "not run")))
                continue
            kb = "/".join("%.0f" % (row["bytes"].get(k, 0) / 1e3)
                          for k in ("keys", "forward", "backward", "sync"))
            fell = removed = share = None
            if wire != "fp32" and reference is not None and "error" not in reference:
                fell, removed, share = exposed_share(reference, row, wire, network)
            lines.append("| %s | %s | %.1f (%s) | %.1f | %s | %s | %s | %s |" % (
                mode, label, row["ms"], " / ".join("%.1f" % m for m in row["ms_rounds"]),
                row["cpu_ms"], kb, "-" if fell is None else "%.1f" % fell,
                "-" if removed is None else "%.1f" % removed,
                "-" if share is None else "%.2f" % share))
    return lines + [""]


def parse_args(argv=None):
    """The benchmark's flags."""
    cells = dict(BANDWIDTH_CELLS)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", choices=sorted(cells),
                        default=[BANDWIDTH_CELLS[0][0]],
                        help="cells of the bandwidth family (bench/families.py)")
    parser.add_argument("--bursts", nargs="+", default=[TBF_BURST, "64kb"],
                        help="`tc tbf` bucket sizes of the emulated link (tc's units)")
    parser.add_argument("--modes", nargs="+", default=["none", "nested"],
                        choices=["none", "dbp", "fwp", "nested"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--row-timeout", type=int, default=600)
    parser.add_argument("--output", default="exposed_exchange")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    loopback = [name for name in args.cells if cells[name].networks[0] == "loopback"]
    if loopback:
        parser.error("cell(s) %s run on loopback: no link rate to take bytes off"
                     % ", ".join(loopback))
    return args, [(name, cells[name]) for name in args.cells]


def measure(args, cell, burst):
    """Every (mode, wire) row of one cell on a link with `tc tbf` bucket `burst`, round by
    round; their `summarize`."""
    delay, rate = parse_network(cell.networks[0])
    results = {(mode, wire): [] for mode in args.modes for _, wire in WIRES}
    with EmulatedNetwork({"worker": cell.workers[0]}, delay_ms=delay, rate=rate,
                         burst=burst) as net:
        for round_index in range(args.rounds):
            for mode in args.modes:
                for _, wire in WIRES:
                    result = run_row(net, cell.workers[0],
                                     worker_argv(cell, mode, wire, args), args.row_timeout)
                    results[(mode, wire)].append(result)
                    outcome = result.get("error") or "%.2f ms" % result["ms_median"]
                    print("burst %s round %d %s %s: %s" % (burst, round_index, mode, wire,
                                                           outcome), flush=True)
    return summarize(results)


def main(argv=None):
    """Runs every cell's rows and writes the tables."""
    args, cells = parse_args(argv)
    command = "python bench/exposed_exchange.py " + " ".join(sys.argv[1:] if argv is None
                                                             else argv)
    started, load_before = datetime.datetime.utcnow(), os.getloadavg()[0]
    measured = [(name, cell, burst, measure(args, cell, burst)) for name, cell in cells
                for burst in args.bursts]
    minutes = (datetime.datetime.utcnow() - started).total_seconds() / 60
    with open(os.path.join(REPO, "bench", "results", args.output + ".json"), "w") as f:
        json.dump({"command": command,
                   "cells": [{"cell": name, "burst": burst,
                              "rows": [{"mode": m, "wire": w, **v}
                                       for (m, w), v in summary.items()]}
                             for name, _, burst, summary in measured]}, f, indent=1)
    write_result(args.output + ".md", markdown(args, measured, command,
                                               started.strftime("%Y-%m-%d %H:%M UTC"), minutes,
                                               (load_before, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
