"""The scaling model: `python -m bench.scaling_model [--measure] [--measure-runs] [--validate
compare.json] ...` (from the repository root) predicts NestPipe's step time and scaling
efficiency from measured per-stage costs and writes bench/results/plan.md (+ plan.png)."""
import argparse
import os
import sys

from bench.scaling_model import report
from bench.scaling_model.costs import CostsError, build_scenarios, load_costs
from bench.scaling_model.model import ModelError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "bench", "results")
DEFAULT_COSTS = os.path.join(RESULTS, "plan_costs.json")


def parse_workers(text):
    """'1,2,4' -> (1, 2, 4); each >= 1."""
    try:
        workers = tuple(sorted({int(w) for w in text.split(",") if w.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError("--workers takes integers separated by commas, got %r"
                                         % text) from None
    if not workers or workers[0] < 1:
        raise argparse.ArgumentTypeError("--workers must be >= 1, got %r" % text)
    return workers


def build_parser():
    """The command line of `python -m bench.scaling_model`."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.scaling_model",
        description="Predict NestPipe step time and scaling efficiency for W = 2 ... 1,536 "
                    "workers from measured per-stage costs, validate against measured runs, "
                    "write plan.md and plan.png.")
    parser.add_argument("--costs", default=DEFAULT_COSTS,
                        help="costs file (default bench/results/plan_costs.json)")
    parser.add_argument("--measure", action="store_true",
                        help="measure the stage costs on this machine first (about 5 "
                             "minutes on 2 shared cores)")
    parser.add_argument("--measure-runs", action="store_true",
                        help="measure NestPipe steps of the DLRM example at 2 and 4 workers for "
                             "validation (about 10 minutes on 2 shared cores) into the costs "
                             "file (with --measure: after it; alone: added to the existing file)")
    parser.add_argument("--validate", default=os.path.join(RESULTS, "compare.json"),
                        help="compare.json of bench/compare.py to validate against (default "
                             "bench/results/compare.json), together with the costs file's runs; "
                             "pipeline.md / step_time.md when neither has any")
    parser.add_argument("--out-dir", default=RESULTS, help="where plan.md and plan.png go")
    parser.add_argument("--per-worker-batch", type=float, default=256.0,
                        help="samples per worker, held fixed as W grows (default 256)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="M for fwp / nested (default: the costs file's)")
    parser.add_argument("--workers", type=parse_workers, default=report.DEFAULT_WORKERS,
                        help="worker counts to predict, comma-separated")
    parser.add_argument("--global-batch", type=int, default=512,
                        help="--measure: global batch of the contention and validation runs")
    parser.add_argument("--no-plot", action="store_true", help="skip plan.png")
    network = parser.add_argument_group("datacenter network assumption")
    network.add_argument("--bandwidth-gbps", type=float, default=200.0)
    network.add_argument("--peer-latency-us", type=float, default=1.0,
                         help="all-to-all cost per peer")
    network.add_argument("--launch-latency-us", type=float, default=30.0,
                         help="fixed cost per collective")
    network.add_argument("--hop-latency-us", type=float, default=5.0,
                         help="tree all-reduce / all-gather cost per step")
    return parser


def main(argv=None):
    """Runs the CLI; returns the exit code (2 with a one-line error for bad costs or inputs)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.measure:
            from bench.scaling_model.measure import run_measurements

            run_measurements(args.costs, args.global_batch, args.micro_batches or 4,
                             with_runs=args.measure_runs)
        elif args.measure_runs:
            from bench.scaling_model.measure import add_runs

            add_runs(args.costs, args.global_batch)
        costs = load_costs(args.costs)
        text, summary = run_report(costs, args)
    except (CostsError, ModelError) as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    print(text)
    print(summary)
    return 0


def run_report(costs, args):
    """Fits eta, validates, predicts and writes plan.md (+ plan.png); returns (markdown, a
    one-line note of the files written)."""
    micro_batches = args.micro_batches or int(costs["workload"]["micro_batches"])
    batch = args.per_worker_batch
    network = {"bandwidth_gbps": args.bandwidth_gbps, "peer_latency_us": args.peer_latency_us,
               "launch_latency_us": args.launch_latency_us, "hop_latency_us": args.hop_latency_us}
    runs = report.gather_runs(costs, args.validate, RESULTS)
    eta_info = report.fit_eta(costs, runs, micro_batches)
    scenarios = build_scenarios(costs, eta_info[0], network)
    validation = report.validate(costs, runs, eta_info[0], micro_batches)
    tables = {name: report.prediction_table(costs, scenarios[name], args.workers, batch,
                                            micro_batches) for name in report.EXTRAPOLATED}
    keys_rows = report.key_assumptions(costs, args.workers, batch)
    needed = report.compute_needed(costs, scenarios["datacenter"], max(args.workers), batch,
                                   micro_batches)
    # The commands that made this report (with the costs file, where not the default one).
    costs_flag = ("" if os.path.abspath(args.costs) == os.path.abspath(DEFAULT_COSTS)
                  else " --costs %s" % os.path.relpath(args.costs, REPO))
    commands = ["python -m bench.scaling_model --measure" + costs_flag]
    if costs.get("runs"):
        commands.append("python -m bench.scaling_model --measure-runs" + costs_flag)
    commands.append("python -m bench.scaling_model" + costs_flag + (
        " --validate %s" % os.path.relpath(args.validate, REPO)
        if args.validate and os.path.exists(args.validate) else " --validate ''"))
    sensitivity = report.sensitivity(costs, network, max(args.workers), batch, micro_batches)
    text = report.render(costs, scenarios, tables, validation, eta_info, keys_rows, needed, batch,
                         micro_batches, args.workers, commands, sensitivity,
                         costs_file=os.path.relpath(args.costs, REPO))
    os.makedirs(args.out_dir, exist_ok=True)
    md = os.path.join(args.out_dir, "plan.md")
    with open(md, "w") as f:
        f.write(text)
    written = [md]
    if not args.no_plot:
        assumptions = report.plot_assumptions(costs, scenarios, keys_rows)
        png = os.path.join(args.out_dir, "plan.png")
        if report.write_plot(png, tables, validation, scenarios, batch, micro_batches, assumptions):
            written.append(png)
        else:
            written.append("(no plot: matplotlib is not installed; pip install -r "
                           "bench/requirements.txt)")
    return text, "wrote " + ", ".join(written)


if __name__ == "__main__":
    sys.exit(main())
