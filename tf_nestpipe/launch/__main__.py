"""`python -m tf_nestpipe.launch --workers N [--ps K] [--chief] [--horovod] -- COMMAND ...`

This process never imports TensorFlow (see `tf_nestpipe._started_as_launcher`).
"""
import argparse
import json
import sys

from tf_nestpipe.launch.local_cluster import (DEFAULT_GRACE_PERIOD, OUTPUT_ENV, OUTPUT_MODES,
                                              LocalCluster)


def main(argv=None):
    """Parses the launcher's flags and runs COMMAND on a localhost cluster."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        flags, command = argv[:split], argv[split + 1:]
    else:
        flags, command = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m tf_nestpipe.launch",
        description="Start a local TF_CONFIG cluster and run COMMAND on each training task.")
    parser.add_argument("--workers", type=int, default=2, help="number of worker tasks")
    parser.add_argument("--ps", type=int, default=0, help="number of parameter-server tasks")
    parser.add_argument("--chief", action="store_true", help="add a chief task")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before teardown")
    parser.add_argument("--env", action="append", default=[], metavar="K=V",
                        help="extra environment variable for every task")
    parser.add_argument("--restarts", type=int, default=0,
                        help="after a failure, start the whole cluster again up to N times "
                             "(scripts resume from their latest checkpoint)")
    parser.add_argument("--cluster-spec", default=None, metavar="JSON",
                        help="use these task addresses instead of free localhost ports, e.g. "
                             "'{\"worker\": [\"10.0.0.1:2222\", \"10.0.0.2:2222\"]}'")
    parser.add_argument("--horovod", action="store_true",
                        help="also start Horovod's Gloo rendezvous and set each worker's "
                             "HOROVOD_* variables (for NestPipeStrategy(collectives='horovod'))")
    parser.add_argument("--horovod-address", default=None, metavar="IP",
                        help="with --horovod: the address of this machine the tasks reach the "
                             "rendezvous at (default 127.0.0.1; needed with --cluster-spec or "
                             "--task-prefix)")
    parser.add_argument("--horovod-interface", default=None, metavar="IFACE",
                        help="with --horovod: the network interface Gloo uses in every task "
                             "(default lo)")
    parser.add_argument("--task-prefix", default="", metavar="TEMPLATE",
                        help="run each task under this command, {role} and {index} filled in "
                             "(e.g. 'ip netns exec ns_{role}{index}')")
    parser.add_argument("--output", choices=OUTPUT_MODES, default=None,
                        help="whose output the console shows: 'first' (default: the chief's, "
                             "else worker 0's) or 'all' (every task's, prefixed); every task's "
                             "output also goes to its log file in --log-dir (default $%s, else "
                             "first)" % OUTPUT_ENV)
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="where each task's log file is written (default: a new "
                             "temporary directory, named in the summary lines)")
    parser.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD,
                        metavar="SECONDS",
                        help="on SIGTERM / SIGINT the launcher forwards SIGTERM to the tasks "
                             "(a PreemptionCheckpointHandler then saves) and kills what still "
                             "runs after this many seconds (default %(default)s)")
    parser.add_argument("--threads-per-task", type=int, default=None, metavar="N",
                        help="size of each task's TensorFlow thread pools (intra-op, inter-op; "
                             "TF_NUM_INTRAOP_THREADS etc.). Default: this machine's cores split "
                             "among the tasks (at least 1 each); 0: TensorFlow's default, every "
                             "task sized to all cores. Variables already set in the environment "
                             "or with --env win")
    parser.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=None,
                        help="pin each task to its own physical cores (CPU affinity), its "
                             "thread pools sized to them. Default: pinned where the launcher "
                             "splits the cores itself (no --threads-per-task) and there are no "
                             "ps tasks; --no-pin-cpus leaves every task free to run anywhere")
    args = parser.parse_args(flags)
    if not command:
        parser.error("no command: add `-- python script.py ARGS`")
    env = {}
    for item in args.env:
        if "=" not in item:
            parser.error("--env expects K=V, got %r" % item)
        key, value = item.split("=", 1)
        env[key] = value
    spec = None
    if args.cluster_spec is not None:
        try:
            spec = json.loads(args.cluster_spec)
        except ValueError as e:
            parser.error("--cluster-spec is not valid JSON (%s)" % e)
        if not isinstance(spec, dict) or not all(
                isinstance(v, list) and all(isinstance(a, str) for a in v) for v in spec.values()):
            parser.error("--cluster-spec must map roles to lists of 'host:port' strings")
    if args.horovod:
        try:
            import horovod.runner.gloo_run  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        except ImportError as e:
            from tf_nestpipe.collectives.horovod_collectives import INSTALL_HINT  # pylint: disable=import-outside-toplevel

            parser.error("--horovod: %s (%s)" % (INSTALL_HINT, e))
    try:
        cluster = LocalCluster(command, args.workers, args.ps, args.chief, env=env, cluster=spec,
                               task_prefix=args.task_prefix, horovod=args.horovod,
                               horovod_address=args.horovod_address,
                               horovod_interface=args.horovod_interface,
                               output_mode=args.output, log_dir=args.log_dir,
                               grace_period=args.grace_period,
                               threads_per_task=args.threads_per_task,
                               pin_cpus=args.pin_cpus)
    except ValueError as e:
        parser.error(str(e))
    if args.restarts < 0:
        parser.error("--restarts must be >= 0")
    return cluster.run(timeout=args.timeout, restarts=args.restarts)


if __name__ == "__main__":
    sys.exit(main())
