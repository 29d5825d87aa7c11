"""The planner's command line (imports no TensorFlow itself).

    python -m tf_nestpipe.plan placement (--table NAME:ROWS:DIM ... | --model MODULE:FUNCTION)
        [--workers 2] [--placement auto] [--memory-budget-bytes N] [--transport sockets]

prints the table placement a NestPipeStrategy would choose, without training, and which costs it
used;

    python -m tf_nestpipe.plan calibrate [--workers 2] [--transport sockets] [--rounds 3]

measures this machine's (or, run as every task of a cluster, that cluster's) collective costs
into the user cache (`tf_nestpipe.plan.collective_costs.calibration_path()`), which the planner
prefers to the defaults shipped with the package.
"""
import argparse
import os
import subprocess
import sys

from tf_nestpipe.plan import placement as placement_lib
from tf_nestpipe.plan.collective_costs import CostsFileError, calibration_path

# The module every task of a calibration cluster runs (the measuring needs the strategy, which
# the planner's package never imports: it is started as a program instead).
CALIBRATION_PROGRAM = "tf_nestpipe.strategy.calibration"


def build_placement_parser():
    """The command line of `python -m tf_nestpipe.plan placement`."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_nestpipe.plan placement",
        description="Show the table placement NestPipeStrategy(placement=...) would choose "
                    "(tf_nestpipe.plan.placement), without training.")
    parser.add_argument("--table", action="append", default=[], metavar="NAME:ROWS:DIM",
                        help="a table (repeat for several, in build order)")
    parser.add_argument("--model", metavar="MODULE:FUNCTION",
                        help="a function returning a tf_keras model (built outside any "
                             "strategy) whose ShardedEmbedding tables are planned")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--placement", default="auto",
                        help="auto (NestPipeStrategy's default), data_parallel, row_wise, "
                             "table_wise (only when asked: auto never chooses it, its owner "
                             "answers every worker's lookups), or NAME=PLACEMENT,... (others "
                             "auto); column_wise is refused (not implemented)")
    parser.add_argument("--memory-budget-bytes", type=int, default=None)
    parser.add_argument("--optimizer-slots", type=int, default=placement_lib.DEFAULT_OPTIMIZER_SLOTS)
    parser.add_argument("--ids-per-step", type=int, default=placement_lib.DEFAULT_IDS_PER_STEP,
                        help="distinct ids a worker looks up per table and step (row_wise cost)")
    parser.add_argument("--transport", default="sockets",
                        choices=sorted(placement_lib.TRANSPORT_SECTIONS),
                        help="whose collective costs: sockets (the socket mesh, "
                             "NestPipeStrategy's default on CPU), tf or horovod (this "
                             "cluster's calibration where there is one, else the defaults)")
    return parser


def _parse_placement_arg(text):
    if "=" not in text:
        return text
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    return {name.strip(): value.strip() for name, value in pairs}


def _model_tables(spec):
    import importlib

    module, _, function = spec.partition(":")
    if not function:
        raise placement_lib.PlacementError("--model takes MODULE:FUNCTION, got %r" % spec)
    model = getattr(importlib.import_module(module), function)()
    return list(placement_lib.model_tables(model).values())


def placement_main(argv):
    """`python -m tf_nestpipe.plan placement ...`: prints the plan; 2 with a one-line error."""
    args = build_placement_parser().parse_args(argv)
    try:
        tables = [placement_lib.parse_table_arg(t) for t in args.table]
        if args.model:
            tables += _model_tables(args.model)
        if not tables:
            raise placement_lib.PlacementError("give the tables: --table NAME:ROWS:DIM or "
                                               "--model MODULE:FUNCTION")
        plans = placement_lib.plan_tables(tables, args.workers,
                                          _parse_placement_arg(args.placement),
                                          args.memory_budget_bytes, args.optimizer_slots,
                                          args.ids_per_step, transport=args.transport)
    except (placement_lib.PlacementError, CostsFileError) as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    print(placement_lib.render_plan(plans, args.workers, args.transport,
                                    placement_lib.costs_source(args.transport)))
    return 0


def build_calibrate_parser():
    """The command line of `python -m tf_nestpipe.plan calibrate`."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_nestpipe.plan calibrate",
        description="Measure the collective costs of this machine (a local cluster of --workers "
                    "workers) or, run as every task of a TF_CONFIG cluster, of that cluster, "
                    "into the user cache the placement planner reads first.")
    parser.add_argument("--workers", type=int, default=2,
                        help="local workers to start (ignored under TF_CONFIG: the cluster's)")
    parser.add_argument("--transport", default="sockets", choices=("sockets", "tf"),
                        help="whose collectives to measure (sockets: the socket mesh, "
                             "NestPipeStrategy's default on CPU; tf: TensorFlow's)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved timing rounds (the least disturbed one is kept)")
    parser.add_argument("--output", default=None,
                        help="the costs file (default: %s)" % calibration_path())
    return parser


def calibrate_main(argv):
    """`python -m tf_nestpipe.plan calibrate ...`: measures and records; returns the exit code.

    Outside a cluster it launches `--workers` local workers (`python -m tf_nestpipe.launch`),
    each running the calibration program; under `TF_CONFIG` this process becomes that program.
    """
    args = build_calibrate_parser().parse_args(argv)
    output = os.path.abspath(args.output or calibration_path())
    program = [sys.executable, "-m", CALIBRATION_PROGRAM, "--transport", args.transport,
               "--rounds", str(args.rounds), "--output", output]
    if os.environ.get("TF_CONFIG"):
        os.execv(sys.executable, program)
    if args.workers < 2:
        print("error: calibration needs 2 or more workers, got --workers %d" % args.workers,
              file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(args.workers),
               "--"] + program
    return subprocess.call(command)


def main(argv=None):
    """Runs the command line; returns the exit code (2 with a one-line error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"placement": placement_main, "calibrate": calibrate_main}
    if not argv or argv[0] not in commands:
        print("usage: python -m tf_nestpipe.plan {placement,calibrate} ... (--help after "
              "either); the scaling model is `python -m bench.scaling_model` in the source "
              "checkout", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
