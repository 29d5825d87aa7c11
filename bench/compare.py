"""Side-by-side benchmark (issue 7): NestPipeStrategy vs one process, MultiWorkerMirroredStrategy,
TF ParameterServerStrategy and Horovod (replicated and all-to-all tables) on the same model, data,
global batch and cluster size, in one run, with the ratios and the issue's targets.

    python bench/compare.py                         # the default matrix (see DEFAULT_PLAN)
    python bench/compare.py --steps 12 --warmup 4 --workers 2 --systems single mwms nestpipe \\
        --pipelines none dbp --collectives tf       # any product of the matrix flags
    python bench/compare.py --full                  # every model x data x workers x network x system

Every row is one launch of bench/compare_worker.py (which describes the systems and models);
`single` (one process) is run once per model and data and is the reference of the distribution
efficiency E = single ms/step / cluster ms/step (same global batch, same cores). A network
`DELAYms:RATE` puts every task in its own network namespace (bench/netem.py: veth + `tc tbf` +
a delaying TCP relay, since this kernel has no `tc netem`), created before the row and removed
after it (needs root); Gloo's direct rank-to-rank connections are sent through the same relay
(bench/native/relay_connect.c), so Horovod rows see the same delay. Horovod rows (hvd_*, and
ours with collectives "horovod") need `horovod.tensorflow` (scripts/install_horovod.sh) and run
through `python -m tf_nestpipe.launch --horovod` when the launcher has that flag, else (loopback
only) `horovodrun --gloo`; without Horovod they are listed as not run. A row that
fails is listed with its error. Writes bench/results/compare.md, compare.json (one dict per
row) and compare.png (samples/s per system vs workers); `--plot-only` redraws the PNG.

Ours runs with `--placement` (default "auto", the strategy's default; one row of ours per
placement given). `--memory-budget-bytes N` is a per-worker budget for tables + optimizer slots
(issue 15: a cell whose tables do not fit replicated): ours gets `NestPipeStrategy(
memory_budget_bytes=N)` (its planner places row-wise what does not fit replicated, or refuses
the model naming the table: the row then fails with that error); for every baseline the bytes
its fullest process holds are computed first (bench/compare_memory.py: its layout, its tables +
Adagrad's slot) and a baseline over the budget is not run, its row saying "does not fit: X >
budget Y". That is arithmetic, not a memory limit imposed on the processes.
"""
import argparse
import datetime
import functools
import importlib.util
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from netem import EmulatedNetwork, launched_on, round_trip_ms
from pipeline import parse_network
from runner import HERE, REPO, write_result

WORKER = os.path.join(HERE, "compare_worker.py")
RESULTS = os.path.join(HERE, "results")
MODELS = ["dlrm", "dcn"]
DATA = ["synthetic", "movielens-1m"]
BASELINES = ["mwms", "psv2", "hvd_replicated"]
PLAIN_SYSTEMS = ["single", "mwms", "psv2", "hvd_replicated", "hvd_alltoall", "compute_only",
                 "torchrec", "torchrec_pipelined"]
TORCHREC_WORKER = os.path.join(HERE, "torchrec_worker.py")
PIPELINES = ["none", "dbp", "fwp", "nested", "auto"]
COLLECTIVES = ["sockets", "tf", "horovod"]
ALL_OURS = ["nestpipe:%s:%s" % (p, c) for c in COLLECTIVES for p in PIPELINES]
# Targets on 2 workers (issue 7): efficiency, and ours' throughput over each baseline.
TARGET_WORKERS = 2
TARGETS = {"efficiency": 0.8, "mwms": 5.0, "psv2": 3.0, "hvd_replicated": 2.0}
LEARNING_RATE = 0.05  # compare_worker.LEARNING_RATE (not imported: that loads TensorFlow)

# The default matrix: about 20-25 minutes on 2 shared cores. (models, data, workers, networks,
# systems); `single` is added for every model and data.
DEFAULT_PLAN = [
    (["dlrm"], ["synthetic"], [2], ["loopback"], PLAIN_SYSTEMS[1:] + ALL_OURS),
    (["dlrm"], ["synthetic"], [1, 4], ["loopback"],
     ["mwms", "psv2", "hvd_replicated", "nestpipe:none:tf", "nestpipe:none:horovod"]),
    (["dcn"], ["synthetic"], [2], ["loopback"],
     ["mwms", "psv2", "hvd_replicated", "nestpipe:none:tf", "nestpipe:dbp:tf"]),
    (["dlrm"], ["movielens-1m"], [2], ["loopback"], ["mwms", "psv2", "nestpipe:none:tf"]),
    (["dlrm"], ["synthetic"], [2], ["1ms:200mbit"],
     ["mwms", "psv2", "nestpipe:none:tf", "nestpipe:dbp:tf"]),
]

SYSTEM_NOTES = {
    "single": "one process, tf_keras Embedding, fit",
    "mwms": "MultiWorkerMirroredStrategy RING, replicated tf_keras Embedding, fit",
    "psv2": "chief + W workers + W ps; per step W scheduled functions of B/W then join",
    "hvd_replicated": "Horovod DistributedGradientTape, replicated Embedding (IndexedSlices allgathered)",
    "hvd_alltoall": "Horovod, table t on rank t mod W, hvd.alltoall of ids and rows",
    "nestpipe": "NestPipeStrategy, fused ShardedEmbeddingCollection, fit",
    "torchrec": ("TorchRec 1.9 on CPU (bench/torchrec_worker.py): EmbeddingBagCollection "
                 "sharded by DistributedModelParallel with its planner's plan, gloo, FBGEMM's "
                 "fused Adagrad, the same DLRM shape and batches; the plain training loop"),
    "torchrec_pipelined": "the same TorchRec model trained by its TrainPipelineSparseDist",
    "compute_only": ("the compute-only bound: W processes at once on these cores, each one "
                     "process (as single) on its own share B/W of the global batch, no "
                     "communication; vs compute-only = row ms/step / its ms/step"),
}
HOROVOD_MISSING = "not run: horovod not installed (scripts/install_horovod.sh)"
# horovodrun cannot start ranks inside network namespaces; our launcher can.
HOROVOD_NETEM = ("not run: Horovod on the emulated network needs tf_nestpipe.launch --horovod "
                 "(this checkout's launcher lacks it)")

# tf_nestpipe.pipeline's profiler counts TF Collective* / Nccl* ops as communication. TF's profiler
# records no event at all for Horovod's ops (HorovodAllreduce / HorovodAlltoall are absent from
# the trace even at host_tracer_level 3), so Horovod rows have no exposure.
NO_COMMUNICATION_SEEN = ("exposure n/a: the profile saw no collective (TF's profiler records no "
                         "event for Horovod's ops)")
# A socket-mesh exchange (collectives "sockets") is an asynchronous op: its profiler event covers
# its sends, not the wait for the peers' messages, so its exposure is not measured either.
SOCKETS_NOT_TIMED = ("exposure n/a: a socket-mesh exchange is an asynchronous op, the profile "
                     "times its sends only")


# TF 2.21's profiler, stopping, can free an invalid pointer (core dump of a 4-worker dbp row:
# abort in tsl::profiler::SplitEventTracker::FindStartAndMerge <- TraceMeRecorder::Consume <-
# ProfilerSession::CollectData); intermittent, more likely with many threads and collectives.
PROFILE_ABORTED = ("profile n/a: the profiling pass aborted twice (%s); TensorFlow's profiler can "
                   "abort when it stops (tsl TraceMeRecorder::Consume); the timing stands")


class NotRun(Exception):
    """A row that cannot run here (e.g. Horovod not installed); its message becomes the note."""


# --- the matrix ------------------------------------------------------------------------------
def expand_systems(tokens, pipelines, collectives):
    """System tokens -> (system, pipeline, collectives) triples: `nestpipe` expands to every
    `pipelines` x `collectives`; `nestpipe:PIPELINE:COLLECTIVES` names one of ours."""
    out = []
    for token in tokens:
        if token == "nestpipe":
            out += [("nestpipe", p, c) for c in collectives for p in pipelines]
        elif token.startswith("nestpipe:"):
            _, pipeline, coll = token.split(":")
            if pipeline not in PIPELINES or coll not in COLLECTIVES:
                raise ValueError("unknown system %r (nestpipe:{%s}:{%s})"
                                 % (token, ",".join(PIPELINES), ",".join(COLLECTIVES)))
            out.append(("nestpipe", pipeline, coll))
        elif token in PLAIN_SYSTEMS:
            out.append((token, "-", {"single": "-", "mwms": "tf", "psv2": "tf",
                                     "compute_only": "-", "torchrec": "gloo",
                                     "torchrec_pipelined": "gloo"}.get(token, "horovod")))
        else:
            raise ValueError("unknown system %r; choose from %s, nestpipe, nestpipe:P:C"
                             % (token, ", ".join(PLAIN_SYSTEMS)))
    return out


def make_row(system, pipeline, collectives, model, data, network, workers):
    """A row spec: which system, model, data, network and cluster size to run."""
    return {"system": system, "pipeline": pipeline, "collectives": collectives, "model": model,
            "data": data, "network": network, "workers": workers}


def plan_rows(blocks, pipelines, collectives):
    """Row specs of `blocks` ((models, data, workers, networks, system tokens) each): one
    `single` per model and data first, then every cluster row once, in block order. Rows that
    make no sense (1 worker on an emulated network) are left out."""
    rows, seen = [], set()

    def add(row):
        key = tuple(sorted(row.items()))
        if key not in seen:
            seen.add(key)
            rows.append(row)

    for models, datas, _, _, _ in blocks:
        for model, data in itertools.product(models, datas):
            add(make_row("single", "-", "-", model, data, "-", 1))
    for models, datas, workers, networks, tokens in blocks:
        for model, data, w, network in itertools.product(models, datas, workers, networks):
            for system, pipeline, coll in expand_systems(tokens, pipelines, collectives):
                if system == "single" or (network != "loopback" and w < 2):
                    continue
                # No communication: one row per cluster size, whatever the network.
                add(make_row(system, pipeline, coll, model, data,
                             "-" if system == "compute_only" else network, w))
    return rows


def memory_check(row, args):
    """The `MEMORY` verdict of bench/compare_worker.py for a baseline row under
    `--memory-budget-bytes` (see bench/compare_memory.py): computed in one process, nothing
    trained; raises RuntimeError when the check itself fails."""
    command = [sys.executable, "-u", WORKER, "--system", row["system"], "--data", row["data"],
               "--dim", str(args.dim), "--table-scale", str(args.table_scale),
               "--synthetic-tables", args.synthetic_tables,
               "--memory-budget-bytes", str(args.memory_budget_bytes),
               "--memory-check-workers", str(row["workers"])]
    process = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=args.row_timeout,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                                      TF_USE_LEGACY_KERAS="1", PYTHONPATH=_python_path()))
    for line in process.stdout.splitlines():
        if line.startswith("MEMORY "):
            return json.loads(line[len("MEMORY "):])
    raise RuntimeError("memory check: " + error_summary(process.stdout, process.returncode))


def checked_rows(rows, args, exclude=(), check=memory_check):
    """{row index: its result without running} for the baseline rows whose tables do not fit
    `--memory-budget-bytes` ("does not fit: ..."), and {row index: the verdict} of every baseline
    row checked (not those in `exclude`); ours and rows of a system not computed are run as
    usual."""
    skipped, verdicts = {}, {}
    if not args.memory_budget_bytes:
        return skipped, verdicts
    cache = {}
    for i, row in enumerate(rows):
        if row["system"] == "nestpipe" or i in exclude:
            continue
        key = (row["system"], row["data"], row["workers"])
        if key not in cache:
            try:
                cache[key] = check(row, args)
            except (RuntimeError, subprocess.SubprocessError) as e:
                cache[key] = {"computed": False, "note": str(e).splitlines()[0][:300]}
        verdicts[i] = cache[key]
        if cache[key].get("computed") and not cache[key]["fits"]:
            skipped[i] = dict(empty_result(row, args, cache[key]["note"], "does not fit"),
                              table_bytes_per_process=cache[key]["bytes"])
    return skipped, verdicts


def add_memory_notes(done, verdicts, args):
    """Under `--memory-budget-bytes`: every row records the budget, a checked baseline that ran
    its computed bytes and verdict ("fits: ..." or why it was not computed)."""
    if not args.memory_budget_bytes:
        return
    for i, row in enumerate(done):
        row["memory_budget_bytes"] = args.memory_budget_bytes
        verdict = verdicts.get(i)
        if verdict is None or row["status"] == "does not fit":
            continue
        if verdict.get("computed"):
            row["table_bytes_per_process"] = verdict["bytes"]
        row["note"] = "; ".join(n for n in (row["note"], verdict["note"]) if n)
        row["details"] = "; ".join(n for n in (row["details"], verdict["note"]) if n)


def row_label(row):
    """Short name of a row's system, e.g. `nestpipe dbp/tf` or `mwms`."""
    if row["system"] == "nestpipe":
        placement = row.get("placement", "row_wise")
        return "nestpipe %s/%s%s" % (row["pipeline"], row["collectives"],
                                     "" if placement == "row_wise" else " " + placement)
    return row["system"]


# --- running one row ------------------------------------------------------------------------------
def horovod_available():
    """True when `import horovod.tensorflow` works in this Python (checked in a subprocess)."""
    probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    return probe.returncode == 0


def launcher_has_horovod():
    """True when `python -m tf_nestpipe.launch` has the `--horovod` flag (read from its source)."""
    with open(os.path.join(REPO, "tf_nestpipe", "launch", "__main__.py")) as f:
        return '"--horovod"' in f.read()


def worker_argv(row, args):
    """The bench/compare_worker.py (TorchRec rows: bench/torchrec_worker.py) command line of a
    row; raises NotRun for a TorchRec row of a cell it cannot model."""
    if row["system"].startswith("torchrec"):
        return torchrec_argv(row, args)
    return [sys.executable, "-u", WORKER, "--system", row["system"],
            "--pipeline", row["pipeline"] if row["system"] == "nestpipe" else "none",
            "--collectives", row["collectives"] if row["system"] == "nestpipe" else "tf",
            "--model", row["model"], "--data", row["data"], "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--global-batch", str(args.global_batch),
            "--dim", str(args.dim), "--table-scale", str(args.table_scale), "--zipf", str(args.zipf),
            "--micro-batches", str(args.micro_batches), "--tables", args.tables,
            "--synthetic-tables", args.synthetic_tables,
            "--auto-timed-steps", str(args.auto_timed_steps),
            "--auto-probe-rounds", str(args.auto_probe_rounds),
            "--auto-job-steps", str(args.auto_job_steps),
            "--profile-steps", str(profile_steps(row, args)),
            "--placement", row.get("placement") or "auto",
            "--memory-budget-bytes", str(args.memory_budget_bytes or 0)] + (
                ["--skip-buffer-sync"] if skips_buffer_sync(row, args) else [])


def torchrec_argv(row, args):
    """The bench/torchrec_worker.py command line of a TorchRec row; raises NotRun where the
    cell is not `--synthetic-tables` DLRM (the only model it has)."""
    if row["model"] != "dlrm" or row["data"] != "synthetic" or not args.synthetic_tables:
        raise NotRun("not run: the TorchRec row models DLRM on --synthetic-tables COUNT:ROWS only")
    if importlib.util.find_spec("torchrec") is None:
        raise NotRun("not run: torchrec not installed (pip install -r bench/requirements.txt)")
    return [sys.executable, "-u", TORCHREC_WORKER,
            "--pipeline", "sparse_dist" if row["system"] == "torchrec_pipelined" else "none",
            "--synthetic-tables", args.synthetic_tables, "--zipf", str(args.zipf),
            "--global-batch", str(args.global_batch), "--dim", str(args.dim),
            "--steps", str(args.steps), "--warmup", str(args.warmup)]


def skips_buffer_sync(row, args):
    """True for the rows a --skip-buffer-sync run trains without the buffer sync: ours."""
    return args.skip_buffer_sync and row["system"] == "nestpipe"


def profile_steps(row, args):
    """How many steps a row profiles after its timed steps (ours only)."""
    return args.profile_steps if row["system"] == "nestpipe" else 0


def uses_horovod(row):
    """True for the rows that need Horovod (its baselines, and ours with Horovod collectives)."""
    return row["collectives"] == "horovod"


def cluster_tasks(row):
    """Task counts of a row's cluster (role -> count), as the launcher and netem see them."""
    if row["system"] == "psv2":
        return {"chief": 1, "worker": row["workers"], "ps": row["workers"]}
    return {"worker": row["workers"]}


def row_command(row, args, net, env):
    """The command that runs a row (through the launcher, or horovodrun); raises NotRun."""
    argv = worker_argv(row, args)
    if row["system"] == "single":
        return argv
    w = str(row["workers"])
    launch = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", w,
              "--timeout", str(args.row_timeout)]
    if args.pin_cpus is not None:
        launch.append("--pin-cpus" if args.pin_cpus else "--no-pin-cpus")
    if uses_horovod(row):
        if not env["horovod"]:
            raise NotRun(HOROVOD_MISSING)
        if net is not None:
            if not env["launcher_horovod"]:
                raise NotRun(HOROVOD_NETEM)
            return launched_on(net, launch, argv, horovod=True)
        if env["launcher_horovod"]:
            return launch + ["--horovod", "--"] + argv
        horovodrun = ("import sys; from horovod.runner.launch import run_commandline; "
                      "sys.exit(run_commandline())")
        return [sys.executable, "-c", horovodrun, "--gloo", "-np", w, "-H", "localhost:" + w] + argv
    if row["system"] == "psv2":
        launch += ["--ps", w, "--chief"]
    return launched_on(net, launch, argv) if net is not None else launch + ["--"] + argv


def pinning_text(args):
    """How the rows' tasks were placed on the cores (the launcher's `--pin-cpus`)."""
    if args.pin_cpus is False:
        return "No task is pinned to a core (`--no-pin-cpus`)."
    scope = "every row's tasks" if args.pin_cpus else "the tasks of every row but PSv2's"
    return ("The launcher pins %s to their own cores where every task gets the same share "
            "(tf_nestpipe/launch/cpu_pinning.py: W tasks on C cores, one block of C/W cores "
            "each, or task k on core k mod C); single runs unpinned on all cores." % scope)


def error_summary(output, returncode):
    """One line naming why a run failed: its last error line (or the tail) and the exit code."""
    lines = [l.strip() for l in output.splitlines() if l.strip()]
    errors = [l for l in lines if "Error" in l or "error:" in l or "Traceback" in l
              or "not run" in l]
    errors = [l for l in errors if not l.endswith("Traceback (most recent call last):")]
    text = errors[-1] if errors else (lines[-1] if lines else "no output")
    return "failed (rc=%s): %s" % (returncode, text[-300:])


def _python_path():
    """PYTHONPATH for the rows: this checkout first, so its tf_nestpipe is the one measured."""
    return os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


# A row's CPU steal above this share flags its timing: the hypervisor ran other machines' work
# on this machine's cores while the row ran (a shared VM; seen at 37% on 2026-12-03).
STEAL_FLAG = 0.05


def cpu_times():
    """The machine's cumulative CPU times (`/proc/stat`'s first line: user, nice, system, idle,
    iowait, irq, softirq, steal, ...), in ticks; None where /proc/stat is unreadable."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before, after):
    """The share of the machine's CPU time between two `cpu_times()` that the hypervisor stole
    (gave to other machines), or None when unknown."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    # guest time (fields 9-10) is already counted in user / nice
    total = sum(after[:8]) - sum(before[:8])
    return (after[7] - before[7]) / total if total > 0 else None


def steal_text(share):
    """`share` of stolen CPU as a note, or "" below STEAL_FLAG."""
    if share is None or share < STEAL_FLAG:
        return ""
    return ("CPU steal %.0f%% (the hypervisor gave this machine's cores to other machines during "
            "the row: its timing is unreliable)" % (100 * share))


@functools.lru_cache(maxsize=None)
def _allocator():
    """tf_nestpipe/launch/allocator.py, loaded once by path (no TensorFlow import in the
    driver)."""
    spec = importlib.util.spec_from_file_location(
        "_nestpipe_allocator", os.path.join(REPO, "tf_nestpipe", "launch", "allocator.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def allocator_variables():
    """The allocator setting the launcher gives its tasks, for every row's processes (also those
    it does not start: single, horovodrun), so all rows run with the same malloc."""
    return _allocator().allocator_env(os.environ)


def allocator_text():
    """The rows' allocator setting, for the report."""
    variables = dict(os.environ, **allocator_variables())
    name = _allocator().TOP_PAD_ENV
    return "%s=%s" % (name, variables[name]) if name in variables else "glibc's default malloc"


def run_command(command, timeout, profiled=False):
    """Runs `command` in its own process group (killed on timeout); returns the dict printed
    after `RESULT ` updated with the one after `PROFILE ` (and `steal`: the machine's CPU steal
    share while it ran, where /proc/stat tells), or raises RuntimeError with an error
    summary (full output kept in /tmp). A `profiled` run that printed its timing but no profile
    returns the timing with `profile_aborted` (why the run ended)."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env=dict(os.environ, **allocator_variables(),
                                        TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1",
                                        PYTHONPATH=_python_path()))
    started = cpu_times()
    try:
        output, _ = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        code = "timeout after %d s" % timeout
    steal = steal_share(started, cpu_times())
    result, profile = parse_output(output)
    if result is not None and steal is not None:
        result["steal"] = steal
    if result is not None and (profile is not None or not profiled):
        result.update(profile or {})
        return result
    with tempfile.NamedTemporaryFile("w", prefix="nestpipe_compare_", suffix=".log",
                                     delete=False) as log:
        log.write(" ".join(command) + "\n" + output)
    print("    full output: %s" % log.name, flush=True)
    if result is None:
        raise RuntimeError(error_summary(output, code))
    result["profile_aborted"] = error_summary(output, code)
    return result


def parse_output(output):
    """The dicts a row printed after `RESULT ` and after `PROFILE ` (None where missing)."""
    found = {"RESULT ": None, "PROFILE ": None}
    for line in output.splitlines():
        for marker in found:
            if marker in line and found[marker] is None:
                found[marker] = json.loads(line.split(marker, 1)[1])
    return found["RESULT "], found["PROFILE "]


def run_profiled_round(run_once):
    """`run_once()`, run again once if its profiling pass aborted the process (that abort is
    TensorFlow's and intermittent, see PROFILE_ABORTED); if both aborted, the first run's timing
    with `profile_error` saying so."""
    result = run_once()
    if "profile_aborted" not in result:
        return result
    print("    the profiling pass aborted (%s); running the row again" % result["profile_aborted"],
          flush=True)
    again = run_once()
    if "profile_aborted" not in again:
        return again
    result["profile_error"] = PROFILE_ABORTED % result.pop("profile_aborted")
    return result


def row_runner(row, args, env):
    """(the row's result dict so far, a function that runs one round of the row: in a fresh
    emulated network when its network is not loopback)."""
    out = empty_result(row, args, SYSTEM_NOTES[row["system"]], "ok")
    spec = parse_network(row["network"]) if row["network"] not in ("-", "loopback") else None
    profiled = profile_steps(row, args) > 0

    def run_once():
        if spec is None:
            return run_command(row_command(row, args, None, env), args.row_timeout, profiled)
        with EmulatedNetwork(cluster_tasks(row), delay_ms=spec[0], rate=spec[1]) as net:
            out["rtt_ms"] = round_trip_ms(net)
            return run_command(row_command(row, args, net, env), args.row_timeout, profiled)

    return out, lambda: run_profiled_round(run_once)


def run_rounds(row, args, out, rounds):
    """The row dict with its measurements over `rounds()` (the list of its rounds' results),
    or with the reason in `note` when it did not run."""
    try:
        results = rounds()
    except NotRun as e:
        return dict(empty_result(row, args, str(e), "not run"), **{
            k: v for k, v in out.items() if k == "rtt_ms"})
    except Exception as e:  # pylint: disable=broad-except  (a failed row must not stop the run)
        return dict(empty_result(row, args, str(e).splitlines()[0][:400], "failed"), **{
            k: v for k, v in out.items() if k == "rtt_ms"})
    return summarize_rounds(row, args, out, results)


def run_row(row, args, env):
    """Runs the rounds of one row one after another and returns the row dict with its
    measurements, or with the reason in `note` when it did not run."""
    out, run_once = row_runner(row, args, env)
    return run_rounds(row, args, out, lambda: [run_once() for _ in range(args.rounds)])


def run_interleaved(rows, args, env):
    """`--interleave`: round r of every row runs before round r+1 of any, so that a change of
    the machine's load during the run is spread over all rows instead of the rows run then;
    returns the row dicts. A row that fails a round runs no more rounds."""
    runners = [row_runner(row, args, env) for row in rows]
    results, errors = [[] for _ in rows], [None] * len(rows)
    for r in range(args.rounds):
        for i, (row, (_, run_once)) in enumerate(zip(rows, runners)):
            if errors[i] is not None:
                continue
            print("[round %d/%d, %d/%d] %s %s/%s/%s W=%d ..." % (
                r + 1, args.rounds, i + 1, len(rows), row_label(row), row["model"], row["data"],
                row["network"], row["workers"]), flush=True)
            try:
                results[i].append(run_once())
                steal = results[i][-1].get("steal")
                print("    -> %.1f ms/step%s" % (results[i][-1]["ms_median"], "" if steal is None
                                                 else " (CPU steal %.0f%%)" % (100 * steal)),
                      flush=True)
            except Exception as e:  # pylint: disable=broad-except  (reported by run_rounds)
                errors[i] = e
                print("    -> failed: %s" % str(e).splitlines()[0][:300], flush=True)

    def rounds_of(i):
        if errors[i] is not None:
            raise errors[i]
        return results[i]

    return [run_rounds(row, args, out, lambda i=i: rounds_of(i))
            for i, (row, (out, _)) in enumerate(zip(rows, runners))]


def summarize_rounds(row, args, out, results):
    """The row dict `out` with the medians over its rounds' `results`."""
    median = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
    out.update(ms_median=median("ms_median"), ms_p90=median("ms_p90"), steps=results[0]["steps"])
    out["ms_rounds"] = [r["ms_median"] for r in results]  # for ratios paired by round
    out["samples_per_s"] = args.global_batch / out["ms_median"] * 1e3
    first = results[0]
    for key in ("communication_ms", "exposed_ms", "profiled_step_ms", "async_samples_per_s",
                "ops_per_step", "cpu_ms_per_step", "cpu_busy", "cpu_sys_ms_per_step",
                "auto_probe_extra_s"):
        if key in first:
            out[key] = median(key)
    steals = [r["steal"] for r in results if r.get("steal") is not None]
    if steals:
        out["steal"] = max(steals)
    for key in ("collectives_per_step", "collectives_detail", "exchanges", "auto_choice",
                "auto_timings_ms", "auto_probe_steps", "auto_job_steps", "placements",
                "table_bytes_per_worker", "torchrec_plan", "wire_bytes_per_step",
                "dense_bytes"):
        if key in first:
            out[key] = first[key]
    if len(results) > 1 and "auto_choice" in first:  # each round probes and chooses anew
        out["auto_choice"] = " / ".join(r.get("auto_choice", "?") for r in results)
    probes = [r["auto_timings_ms"] for r in results if r.get("auto_timings_ms")]
    if probes:  # every round's probe: the modes timed in the same processes
        out["auto_timings_ms_rounds"] = probes
        cpu = [r.get("auto_cpu") for r in results if r.get("auto_timings_ms")]
        if all(cpu):  # rank 0's process CPU per mode, same launches
            out["auto_cpu_rounds"] = cpu
    extras = []
    if "exposure_ratio" in first:
        out["stage_ms"] = first.get("stage_ms")
        if first.get("stages"):
            out["stages"] = first["stages"]
        if row["workers"] > 1 and row.get("collectives") == "sockets":
            extras.append(SOCKETS_NOT_TIMED)
        elif row["workers"] > 1 and not out.get("communication_ms"):
            extras.append(NO_COMMUNICATION_SEEN)
        else:
            out["exposure"] = median("exposure_ratio")
    if "profile_error" in first:
        extras.append("profile failed: " + first["profile_error"])
    if steal_text(out.get("steal")):
        extras.append(steal_text(out["steal"]))
    if "async_samples_per_s" in out:
        extras.append("one join for all steps: %.0f samples/s" % out["async_samples_per_s"])
    if out.get("placements"):
        extras.append(plan_text(out))
    if out.get("torchrec_plan"):
        extras.append("TorchRec's plan: %s" % ", ".join(out["torchrec_plan"]))
    if out.get("cpu_ms_per_step") is not None:
        kernel = ("; %.1f in the kernel" % out["cpu_sys_ms_per_step"]
                  if out.get("cpu_sys_ms_per_step") is not None else "")
        extras.append("rank 0's process CPU %.1f ms/step (%.2f cores busy%s)"
                      % (out["cpu_ms_per_step"], out["cpu_busy"], kernel))
    out["details"] = "; ".join(extras)
    out["note"] = "; ".join([out["note"]] + extras)
    return out


def plan_text(row):
    """Ours: the planner's placements and the fullest worker's tables + slots, e.g. `plan: 20
    data_parallel, 6 row_wise; tables 12.0 MiB/worker`."""
    counts = ", ".join("%d %s" % (n, p) for p, n in sorted(row["placements"].items()))
    return "plan: %s; tables %.1f MiB/worker" % (counts, row["table_bytes_per_worker"] / 2 ** 20)


def empty_result(row, args, note, status):
    """A row dict with no measurements yet (`note` and `status` say why, or what the system is)."""
    return dict(row, global_batch=args.global_batch, steps=args.steps, ms_median=None,
                ms_p90=None, samples_per_s=None, efficiency=None, exposure=None, note=note,
                status=status, details=note if status != "ok" else "")


# --- derived numbers ---------------------------------------------------------------------------
def add_ratios(rows):
    """Fills `efficiency` (single ms / row ms, same model and data) and `vs_<baseline>` (row
    samples/s / baseline samples/s, same model, data, network and workers) in place."""
    measured = [r for r in rows if r["samples_per_s"]]
    for row in measured:
        single = [r for r in measured if r["system"] == "single"
                  and (r["model"], r["data"]) == (row["model"], row["data"])]
        if single:
            row["efficiency"] = single[0]["ms_median"] / row["ms_median"]
        for base in BASELINES:
            ref = [r for r in measured if r["system"] == base and all(
                r[k] == row[k] for k in ("model", "data", "network", "workers"))]
            row["vs_" + base] = row["samples_per_s"] / ref[0]["samples_per_s"] if ref else None
            if not ref and any(r["system"] == base and r["status"] == "does not fit" and all(
                    r[k] == row[k] for k in ("model", "data", "network", "workers"))
                               for r in rows):
                row.setdefault("baselines_not_fitting", []).append(base)
        bound = [r for r in measured if r["system"] == "compute_only" and all(
            r[k] == row[k] for k in ("model", "data", "workers"))]
        if bound and row["system"] != "compute_only":
            row["vs_compute_only"] = row["ms_median"] / bound[0]["ms_median"]
        if row["system"] == "nestpipe":
            # ms/step over ours without pipeline (same collectives, placement, cell): <= 1.0
            # is faster.
            none = [r for r in measured if r["system"] == "nestpipe" and r["pipeline"] == "none"
                    and all(r.get(k) == row.get(k) for k in ("model", "data", "network",
                                                             "workers", "collectives",
                                                             "placement"))]
            row["vs_none"] = row["ms_median"] / none[0]["ms_median"] if none else None
            if none and row is not none[0]:
                paired = paired_ratio(row.get("ms_rounds"), none[0].get("ms_rounds"))
                if paired is not None:
                    row["vs_none_paired"] = paired
        elif row["system"].startswith("torchrec"):
            # ms/step over ours without pipeline on the socket mesh (same cell): the peer's
            # time in units of ours.
            none = [r for r in measured if r["system"] == "nestpipe" and r["pipeline"] == "none"
                    and r["collectives"] == "sockets" and all(
                        r.get(k) == row.get(k) for k in ("model", "data", "network", "workers"))]
            if none:
                row["vs_none"] = row["ms_median"] / none[0]["ms_median"]
                paired = paired_ratio(row.get("ms_rounds"), none[0].get("ms_rounds"))
                if paired is not None:
                    row["vs_none_paired"] = paired


def paired_ratio(rounds, base_rounds):
    """The median over rounds of a row's ms/step over its baseline's in the same round (with
    --interleave, round r of every row runs before round r + 1 of any: the pair ran close in
    time, so a drift of the machine between rounds cancels); None without 2 rounds of each."""
    if not rounds or not base_rounds or len(rounds) != len(base_rounds) or len(rounds) < 2:
        return None
    return statistics.median(a / b for a, b in zip(rounds, base_rounds))


def vs_none_cell(row):
    """The "vs ours none" cell: the ratio of the rows' medians, and with rounds the median of
    the per-round ratios (`paired_ratio`)."""
    text = _num(row.get("vs_none"), "%.2fx")
    if row.get("vs_none_paired") is not None:
        text += " (per round %.2fx)" % row["vs_none_paired"]
    return text


def ratio_cell(row, key, base, target):
    """A ratio cell of the report: the target's verdict on target rows, else the ratio; where
    the baseline's tables do not fit the memory budget, says so."""
    value = row.get(key)
    if value is None and base in row.get("baselines_not_fitting", ()):
        return "%s does not fit" % base
    if target:
        return verdict(value, TARGETS[base])
    return _num(value, "%.2fx")


def verdict(value, target):
    """`0.36 (missed, target >= 0.8)`-style text, or `n/a` when the number is missing."""
    if value is None:
        return "n/a"
    return "%.2f (%s, target >= %g)" % (value, "met" if value >= target else "missed", target)


def targets_apply(row):
    """True for the rows the issue's targets are about: ours on 2 workers, measured."""
    return (row["system"] == "nestpipe" and row["workers"] == TARGET_WORKERS
            and row["samples_per_s"] is not None)


def needed_ms(row, single_ms):
    """For each missed target of `row`, the ms/step that would meet it (same baselines)."""
    needs = {}
    if single_ms and (row.get("efficiency") or 0) < TARGETS["efficiency"]:
        needs["E"] = single_ms / TARGETS["efficiency"]
    for base, label in (("mwms", "MWMS"), ("psv2", "PSv2"), ("hvd_replicated", "Horovod repl.")):
        ratio = row.get("vs_" + base)
        if ratio is not None and ratio < TARGETS[base]:
            needs[label] = row["ms_median"] * ratio / TARGETS[base]
    return needs


def bound_text(row, single_ms):
    """What bounds a row, from its profile: what each missed target needs, the stages' medians,
    and whether the profiled compute alone already exceeds a need (unreachable on these cores)."""
    needs = needed_ms(row, single_ms)
    parts = []
    if needs:
        parts.append("missed targets need <= " + ", ".join(
            "%.1f ms/step (%s)" % (ms, label) for label, ms in needs.items()))
    if row.get("stage_ms"):
        stages = ", ".join("%s %.1f" % (k, v) for k, v in sorted(row["stage_ms"].items(),
                                                                  key=lambda kv: -kv[1]))
        parts.append("profiled step %.1f ms: %s; exposed communication %.1f ms" % (
            row.get("profiled_step_ms", float("nan")), stages, row.get("exposed_ms", float("nan"))))
        compute = row["stage_ms"].get("compute", 0.0)
        beyond = [label for label, ms in needs.items() if compute > ms]
        if beyond:
            parts.append("compute alone (%.1f ms, each worker's share of the same cores) exceeds "
                         "the need of %s" % (compute, ", ".join(beyond)))
        if row.get("collectives") == "sockets":
            parts.append("the socket mesh's waits are not in the profile (asynchronous ops): "
                         "the step minus compute bounds communication")
        elif row.get("exposure") is None:
            parts.append("Horovod's communication is not in the profile (TF's profiler records "
                         "no event for Horovod's ops): the step minus compute bounds it")
    return "; ".join(parts)


# --- outputs ------------------------------------------------------------------------------------
def collectives_text(row):
    """Ours: the collectives a step issues (every step; the overflow round's are conditional)
    and the fused exchanges per step; under auto, the mode it chose."""
    if row.get("collectives_per_step") is None:
        return "-"
    text = "%d (%d)" % (row["collectives_per_step"], row.get("exchanges", 0))
    if row.get("ops_per_step") is not None:
        text += ", %d ops executed (profiled)" % row["ops_per_step"]
    if row.get("auto_choice"):
        text += ", auto chose %s" % row["auto_choice"]
        if row.get("auto_probe_steps"):
            text += " after a %d-step probe (not timed)" % row["auto_probe_steps"]
        if row.get("auto_probe_extra_s") is not None and row.get("auto_job_steps"):
            text += ("; the probe cost %.1f s beyond the chosen mode (traces included) in a "
                     "%d-step job" % (row["auto_probe_extra_s"], row["auto_job_steps"]))
    return text


def _num(value, fmt):
    return "-" if value is None else fmt % value


def memory_lines(args):
    """The report's paragraph on `--memory-budget-bytes` (none without it)."""
    if not args.memory_budget_bytes:
        return []
    return ["Memory budget: %d bytes (%.2f GiB) of tables + optimizer slots per worker. Ours: "
            "`NestPipeStrategy(memory_budget_bytes=...)`, whose planner places row-wise the "
            "tables whose replica does not fit (2 optimizer slots assumed) or refuses the model; "
            "its plan and the bytes its fullest worker holds are in the notes. Baselines: the "
            "bytes of tables + 1 Adagrad slot their fullest process holds are computed "
            "(bench/compare_memory.py, not measured) and a baseline over the budget is not run "
            "(\"does not fit\"); no memory limit is imposed on any process, and runtime memory "
            "is not counted." % (args.memory_budget_bytes, args.memory_budget_bytes / 2 ** 30),
            ""]


def run_steal_text(env):
    """", L at the end, CPU steal N% over the run": the load average now (the other jobs that
    shared the cores show in it) and the steal since `env["cpu_start"]` (left out when
    unknown)."""
    share = steal_share(env.get("cpu_start"), cpu_times())
    text = ", %.2f at the end" % os.getloadavg()[0]
    return text if share is None else text + ", CPU steal %.0f%% over the run" % (100 * share)


# Loopback: a pipelined mode may cost at most this much more than none (issue 14).
LOOPBACK_PIPELINE_TARGET = 1.05


def same_process_ratios(timings_rounds):
    """{candidate: median over rounds of its ms/step / none's ms/step in the same round} from
    auto's probe timings of each round ({candidate: ms}); {} without none's timing."""
    ratios = {}
    for timings in timings_rounds:
        if not timings.get("none") or not math.isfinite(timings["none"]):
            continue
        for name, ms in timings.items():
            if ms is not None and math.isfinite(ms):  # inf: the probe's budget skipped it
                ratios.setdefault(name, []).append(ms / timings["none"])
    return {name: statistics.median(values) for name, values in ratios.items()}


# The report of a run with --skip-buffer-sync says first that it measures a diagnostic.
SKIPPED_SYNC_TEXT = (
    "**Diagnostic run (`--skip-buffer-sync`): ours ran dbp and nested without their buffer "
    "sync, so they trained on rows a step stale (not exact, not the product); their times say "
    "what the sync costs, not what the modes cost. No target is judged on them.**")


def same_process_lines(rows, judged=True):
    """The report's table of every auto row's probe: each mode's ms/step and its ratio to none,
    timed interleaved in the same processes (no process-to-process spread); loopback ratios are
    judged against the target unless not `judged` (a diagnostic run)."""
    probed = [r for r in rows if r.get("auto_timings_ms_rounds")]
    if not probed:
        return []
    lines = ["", "## Same-process comparison (auto's probe)", "",
             "Each auto row's probe runs every mode in the same worker processes, interleaved "
             "over its probe rounds, on the same batches (the slowest worker's median ms/step of "
             "each mode per launch). Separate rows also differ by the spread between processes "
             "doing the same work; these ratios do not." + (
                 " Loopback target: every pipelined mode <= %.2fx none." % LOOPBACK_PIPELINE_TARGET
                 if judged else ""), "",
             "| row | network | mode | ms/step per launch | vs none (median over launches) "
             "| rank 0's process CPU ms/step per launch (cores busy) |",
             "|---|---|---|---|---|---|"]
    for r in probed:
        ratios = same_process_ratios(r["auto_timings_ms_rounds"])
        names = list(r["auto_timings_ms_rounds"][0])
        for name in names:
            ms = " / ".join(_probe_ms(t.get(name)) for t in r["auto_timings_ms_rounds"])
            ratio = ratios.get(name)
            if ratio is None:
                cell = "-"
            elif name == "none":
                cell = "1.00x"
            elif r["network"] == "loopback" and judged:
                cell = "%.2fx (%s, target <= %.2fx)" % (
                    ratio, "met" if ratio <= LOOPBACK_PIPELINE_TARGET else "missed",
                    LOOPBACK_PIPELINE_TARGET)
            else:
                cell = "%.2fx" % ratio
            lines.append("| %s | %s | %s | %s | %s | %s |" % (
                row_label(r), r["network"], name, ms, cell, cpu_cell(r, name)))
    return lines


def _probe_ms(ms):
    """A probe timing: ms/step, or why there is none (the probe stops once it would cost more
    than its budget of the first epoch, and a mode it never reached has no timing)."""
    if ms is not None and not math.isfinite(ms):
        return "not timed (probe budget)"
    return _num(ms, "%.1f")


def cpu_cell(row, name):
    """An auto row's process CPU per step of mode `name` on rank 0 in each launch's probe, with
    the cores it kept busy ("-" for reports without it)."""
    rounds = row.get("auto_cpu_rounds")
    if not rounds or any(name not in r for r in rounds):
        return "-"
    return " / ".join("%.1f (%.2f)" % (r[name][0], r[name][1]) for r in rounds)


def markdown(rows, args, env, seconds):
    """The Markdown report: setup, the table of every row, the targets and the failures."""
    singles = {(r["model"], r["data"]): r["ms_median"] for r in rows if r["system"] == "single"}
    judged = not args.skip_buffer_sync  # a diagnostic run judges no target
    lines = [
        "# Side-by-side: NestPipeStrategy vs MWMS vs ParameterServerStrategy vs Horovod", "",
        "Command: `%s` (%s, %.0f s in all)." % (
            " ".join(["python bench/compare.py"] + sys.argv[1:]),
            datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), seconds), "",
    ] + ([] if judged else [SKIPPED_SYNC_TEXT, ""]) + [
        "Cluster: every task of every row on this one machine (%d CPU cores shared by all tasks "
        "and with other jobs; load average %.2f at the start%s), Python %s, TensorFlow 2.21 CPU, "
        "tf_keras, %s. Loopback: tasks on 127.0.0.1. `DELAYms:RATE`: every task in its own "
        "network namespace, veth pairs to a bridge with `tc tbf` at RATE on both ends and a TCP "
        "relay delaying each direction by DELAY (no `tc netem` on this kernel; Horovod's direct "
        "Gloo connections are redirected through it by a preloaded connect()); RTT is the "
        "measured 1-byte round trip. PSv2 rows add a chief and W ps tasks on the same cores. "
        "Every process of every row runs with %s (tf_nestpipe/launch/allocator.py: freed "
        "memory stays in the process). %s" % (
            os.cpu_count(), env["load"], run_steal_text(env), platform.python_version(),
            env["horovod_text"], allocator_text(), pinning_text(args)),
        "",
        "Setup: global batch %d, %d timed steps after %d warm-up steps per row (median and p90 "
        "of the per-step wall times; %d round(s)%s, median of the rounds); samples/s = global "
        "batch / median step. Synthetic: Zipf (exponent %g) click log, %s, 13 dense features; MovieLens-1M: 7 single-hot features + mean-pooled "
        "genres. Embedding dim %d, Adagrad %g. DLRM = examples/dlrm.py's model; DCN = TFRS "
        "`tfrs.layers.dcn.Cross` + deep tower + `tfrs.tasks.Ranking` (SUM / batch). E = single "
        "ms/step / row ms/step (same model, data, global batch, same cores). Exposure (ours, "
        "profiled over %d steps) = time a collective runs while no other op runs / time "
        "collectives run. vs X = row samples/s / X's samples/s (same model, data, network, "
        "workers); vs ours none = row ms/step / ours none's, and with 2 or more rounds also "
        "\"per round\": the median over the rounds of the same ratio within each round. "
        "Targets (ours, %d workers): E >= %g, >= %gx MWMS, >= %gx PSv2, >= %gx Horovod "
        "replicated. bench/compare_worker.py describes each system." % (
            args.global_batch, args.steps, args.warmup, args.rounds,
            " interleaved (round r of every row before round r+1)" if args.interleave else "",
            args.zipf, ("%s tables of %s rows (one %s layer each)" % (
                tuple(args.synthetic_tables.split(":")) + (
                    "ShardedEmbedding" if args.tables == "per_table" else "collection",))
                if args.synthetic_tables else
                "26 tables (Criteo Kaggle sizes x %g)" % args.table_scale), args.dim,
            LEARNING_RATE, args.profile_steps, TARGET_WORKERS, TARGETS["efficiency"], TARGETS["mwms"],
            TARGETS["psv2"], TARGETS["hvd_replicated"]), "",
        *memory_lines(args),
        "| system | model | data | network | W | ms/step median | p90 | samples/s | E | exposure "
        "| vs MWMS | vs PSv2 | vs Horovod repl. | vs ours none | vs compute-only "
        "| collectives/step (exchanges) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        target = judged and targets_apply(r)
        cells = []
        cells.append(verdict(r.get("efficiency"), TARGETS["efficiency"]) if target
                     else _num(r.get("efficiency"), "%.2f"))
        for base in ("mwms", "psv2", "hvd_replicated"):
            cells.append(ratio_cell(r, "vs_" + base, base, target))
        network = r["network"] + (" (RTT %.2f ms)" % r["rtt_ms"] if r.get("rtt_ms") else "")
        lines.append("| %s | %s | %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            row_label(r), r["model"], r["data"], network, r["workers"],
            _num(r["ms_median"], "%.1f"), _num(r["ms_p90"], "%.1f"),
            _num(r["samples_per_s"], "%.0f"), cells[0], _num(r["exposure"], "%.2f"),
            cells[1], cells[2], cells[3], vs_none_cell(r),
            _num(r.get("vs_compute_only"), "%.2fx"), collectives_text(r),
            r["details"].replace("|", "/")))
    lines += ["", "Systems: " + "; ".join("**%s**: %s" % item for item in SYSTEM_NOTES.items())
              + ". nestpipe P/C: pipeline P, collectives C."]
    lines += same_process_lines(rows, judged)
    target_rows = [r for r in rows if judged and targets_apply(r)]
    if target_rows:
        lines += ["", "## Targets (ours on %d workers)" % TARGET_WORKERS, "",
                  "| row | model / data / network | E >= %g | >= %gx MWMS | >= %gx PSv2 | "
                  ">= %gx Horovod repl. | what bounds it (profile) |" % (
                      TARGETS["efficiency"], TARGETS["mwms"], TARGETS["psv2"],
                      TARGETS["hvd_replicated"]),
                  "|---|---|---|---|---|---|---|"]
        for r in target_rows:
            lines.append("| %s | %s / %s / %s | %s | %s | %s | %s | %s |" % (
                row_label(r), r["model"], r["data"], r["network"],
                verdict(r.get("efficiency"), TARGETS["efficiency"]),
                verdict(r.get("vs_mwms"), TARGETS["mwms"]),
                verdict(r.get("vs_psv2"), TARGETS["psv2"]),
                verdict(r.get("vs_hvd_replicated"), TARGETS["hvd_replicated"]),
                bound_text(r, singles.get((r["model"], r["data"])))))
        lines += ["", "`n/a`: the baseline row was not run or failed (see the table)."]
    problems = [r for r in rows if r["status"] != "ok"]
    if problems:
        lines += ["", "## Rows without numbers", ""]
        lines += ["- %s, %s / %s / %s, %d workers: %s" % (
            row_label(r), r["model"], r["data"], r["network"], r["workers"], r["note"])
            for r in problems]
    return "\n".join(lines) + "\n"


JSON_KEYS = ["system", "pipeline", "collectives", "model", "data", "network", "workers",
             "global_batch", "steps", "ms_median", "ms_p90", "samples_per_s", "efficiency",
             "exposure", "note"]
EXTRA_KEYS = ["status", "vs_mwms", "vs_psv2", "vs_hvd_replicated", "communication_ms",
              "exposed_ms", "profiled_step_ms", "stage_ms", "async_samples_per_s", "rtt_ms",
              "ops_per_step", "cpu_ms_per_step", "cpu_busy", "cpu_sys_ms_per_step",
              "ms_rounds", "vs_none", "vs_none_paired", "vs_compute_only",
              "collectives_per_step", "collectives_detail", "exchanges",
              "auto_choice", "auto_timings_ms", "auto_timings_ms_rounds", "auto_cpu_rounds",
              "auto_probe_steps", "auto_probe_extra_s", "auto_job_steps", "stages",
              "wire_bytes_per_step", "dense_bytes", "placement",
              "memory_budget_bytes", "placements", "table_bytes_per_worker", "torchrec_plan",
              "table_bytes_per_process", "baselines_not_fitting"]


def json_rows(rows, args=None):
    """The rows as compare.json stores them: JSON_KEYS first, then the extra measurements; with
    the run's `args`, the rows it trained without the buffer sync (`skips_buffer_sync`) also
    say `"skip_buffer_sync": true` (inexact training), so that the JSON alone marks them."""
    def stored(r):
        out = {k: r.get(k) for k in JSON_KEYS + EXTRA_KEYS if k in JSON_KEYS or k in r}
        if args is not None and skips_buffer_sync(r, args):
            out["skip_buffer_sync"] = True
        return out
    return [stored(r) for r in rows]


def plot(rows, path):
    """compare.png: samples/s per system vs workers, one panel per model / data / network
    (the single process as a dashed line)."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    measured = [r for r in rows if r["samples_per_s"]]
    panels = sorted({(r["model"], r["data"], r["network"]) for r in measured
                     if r["system"] != "single"})
    if not panels:
        return False
    columns = min(2, len(panels))
    grid_rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(grid_rows, columns, figsize=(7 * columns, 4.8 * grid_rows),
                             squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    labels = sorted({row_label(r) for r in rows})  # one color per system in every panel
    for ax, (model, data, network) in zip(axes.flat, panels):
        mine = [r for r in measured if (r["model"], r["data"], r["network"]) == (model, data, network)]
        for label in sorted({row_label(r) for r in mine}):
            points = sorted((r["workers"], r["samples_per_s"]) for r in mine if row_label(r) == label)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                    color=plt.get_cmap("tab20")(labels.index(label) % 20),
                    linestyle="-" if label.startswith("nestpipe") else ":")
        for r in measured:
            if r["system"] == "single" and (r["model"], r["data"]) == (model, data):
                ax.axhline(r["samples_per_s"], color="gray", linestyle="--", label="single process")
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["workers"] for r in mine}))
        ax.set_xlabel("workers")
        ax.set_ylabel("samples/s")
        ax.set_title("%s / %s / %s" % (model, data, network))
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def prepare_movielens(timeout):
    """Fetches and converts MovieLens-1M once before the rows (the workers then just read it)."""
    code = "from tf_nestpipe.data import load_or_prepare_movielens; load_or_prepare_movielens('movielens-1m')"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=timeout, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def parse_args(argv=None):
    """The command-line flags (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS)
    parser.add_argument("--data", nargs="+", choices=DATA)
    parser.add_argument("--workers", nargs="+", type=int)
    parser.add_argument("--networks", nargs="+", help="loopback and/or DELAYms:RATE, e.g. 1ms:200mbit")
    parser.add_argument("--systems", nargs="+",
                        help="single mwms psv2 hvd_replicated hvd_alltoall nestpipe "
                             "(= every --pipelines x --collectives) or nestpipe:PIPELINE:COLLECTIVES")
    parser.add_argument("--pipelines", nargs="+", choices=PIPELINES, default=PIPELINES)
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=COLLECTIVES)
    parser.add_argument("--full", action="store_true",
                        help="every model x data x workers 1 2 4 x loopback, 1ms:200mbit x system")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=1, help="runs per row (median taken)")
    parser.add_argument("--interleave", action="store_true",
                        help="run round r of every row before round r+1 of any (load changes "
                             "spread over all rows)")
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--zipf", type=float, default=1.2,
                        help="synthetic: the ids' Zipf exponent (> 1; nearer 1 = milder skew)")
    parser.add_argument("--micro-batches", type=int, default=4, help="ours, fwp / nested")
    parser.add_argument("--tables", choices=["fused", "per_table"], default="fused",
                        help="ours: one ShardedEmbeddingCollection, or a ShardedEmbedding layer "
                             "per field (the model written the natural Keras way)")
    parser.add_argument("--synthetic-tables", default="",
                        help="synthetic: N:ROWS (N tables of ROWS rows) instead of the Criteo profile")
    parser.add_argument("--auto-timed-steps", type=int, default=4,
                        help="ours, pipeline auto: timed probe steps per mode")
    parser.add_argument("--auto-job-steps", type=int, default=0,
                        help="ours, pipeline auto: the job length (steps) fit is told, whose 5%% "
                             "the probe may spend (0: just room for the probe and the timed "
                             "steps, a short job)")
    parser.add_argument("--auto-probe-rounds", type=int, default=0,
                        help="ours, pipeline auto: probe rounds (0: the strategy's default)")
    parser.add_argument("--profile-steps", type=int, default=5, help="ours: profiled steps")
    parser.add_argument("--placement", nargs="+", default=["auto"],
                        choices=["auto", "row_wise", "table_wise", "data_parallel"],
                        help="ours: NestPipeStrategy(placement=...), one row each: auto "
                             "(default, the strategy's), row_wise, table_wise and/or "
                             "data_parallel (issue 15)")
    parser.add_argument("--memory-budget-bytes", type=int, default=None,
                        help="per-worker bytes of tables + optimizer slots: ours plans within "
                             "it; a baseline whose tables (computed) do not fit is not run "
                             "(see the module docstring)")
    parser.add_argument("--row-timeout", type=int, default=600, help="seconds per row")
    parser.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=None,
                        help="passed to the launcher of every row it starts: each task pinned "
                             "to its own cores (--pin-cpus) or free (--no-pin-cpus); default "
                             "the launcher's (pinned, but not PSv2 rows: ps mode)")
    parser.add_argument("--skip-buffer-sync", action="store_true",
                        help="a diagnostic: ours run dbp and nested WITHOUT their buffer sync "
                             "(inexact training; the report says so): with an auto row, the "
                             "same-process comparison prices the sync")
    parser.add_argument("--output", default="compare", help="bench/results/OUTPUT.{md,json,png}")
    parser.add_argument("--plot-only", action="store_true",
                        help="only redraw OUTPUT.png from an existing OUTPUT.json")
    return parser.parse_args(argv)


def plan_from_args(args):
    """The blocks to run: DEFAULT_PLAN, `--full`, or the product of the given matrix flags
    (flags not given: dlrm, synthetic, 2 workers, loopback, every system)."""
    given = [args.models, args.data, args.workers, args.networks, args.systems]
    if args.full:
        return [(args.models or MODELS, args.data or DATA, args.workers or [1, 2, 4],
                 args.networks or ["loopback", "1ms:200mbit"],
                 args.systems or PLAIN_SYSTEMS + ["nestpipe"])]
    if all(g is None for g in given):
        return DEFAULT_PLAN
    return [(args.models or ["dlrm"], args.data or ["synthetic"], args.workers or [2],
             args.networks or ["loopback"], args.systems or PLAIN_SYSTEMS + ["nestpipe"])]


def main(argv=None):
    """Runs the matrix and writes bench/results/compare.{md,json,png}."""
    args = parse_args(argv)
    if args.plot_only:
        with open(os.path.join(RESULTS, args.output + ".json")) as f:
            plot(json.load(f), os.path.join(RESULTS, args.output + ".png"))
        return
    for network in args.networks or []:
        if network != "loopback":
            parse_network(network)  # fail early on a malformed DELAYms:RATE
    rows = plan_rows(plan_from_args(args), args.pipelines, args.collectives)
    rows = [dict(row, placement=placement) if row["system"] == "nestpipe" else row
            for row in rows for placement in (args.placement if row["system"] == "nestpipe"
                                              else [None])]
    env = {"load": os.getloadavg()[0], "cpu_start": cpu_times(), "horovod": False, "horovod_version": None,
           "launcher_horovod": launcher_has_horovod()}
    needs_horovod = any(uses_horovod(r) for r in rows)
    if needs_horovod and horovod_available():
        env["horovod"] = True
        env["horovod_version"] = subprocess.run(
            [sys.executable, "-c", "import horovod; print(horovod.__version__)"],
            stdout=subprocess.PIPE, text=True).stdout.strip()
    movielens_error = None
    if any(r["data"] == "movielens-1m" for r in rows):
        try:
            prepare_movielens(args.row_timeout)
        except (subprocess.SubprocessError, OSError) as e:
            movielens_error = "failed: MovieLens-1M could not be prepared: %s" % (
                (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()[-1:]
                or [str(e)])[0][:300]
    env["horovod_text"] = (("Horovod " + env["horovod_version"]) if env["horovod"] else
                           "Horovod not installed") if needs_horovod else "no Horovod rows"
    print("compare: %d rows (%s, launcher --horovod %s)" % (
        len(rows), env["horovod_text"], env["launcher_horovod"]), flush=True)
    started = time.perf_counter()
    done = []
    # Rows with a result before they run: MovieLens not prepared, or tables over the budget.
    ready = {i: empty_result(row, args, movielens_error, "failed") for i, row in enumerate(rows)
             if movielens_error and row["data"] == "movielens-1m"}
    skipped, verdicts = checked_rows(rows, args, exclude=set(ready))
    ready.update(skipped)
    if args.interleave:
        measured = iter(run_interleaved([r for i, r in enumerate(rows) if i not in ready],
                                        args, env))
        done = [ready[i] if i in ready else next(measured)
                for i in range(len(rows))]  # in the plan's order
    else:
        for i, row in enumerate(rows):
            print("[%d/%d] %s %s/%s/%s W=%d ..." % (i + 1, len(rows), row_label(row), row["model"],
                                                   row["data"], row["network"], row["workers"]),
                  flush=True)
            result = ready[i] if i in ready else run_row(row, args, env)
            done.append(result)
            print("    -> %s" % (("%.1f ms/step, %.0f samples/s" % (result["ms_median"],
                                                                  result["samples_per_s"]))
                                 if result["samples_per_s"] else result["note"]), flush=True)
    add_memory_notes(done, verdicts, args)
    add_ratios(done)
    seconds = time.perf_counter() - started
    with open(os.path.join(RESULTS, args.output + ".json"), "w") as f:
        json.dump(json_rows(done, args), f, indent=1)
    try:
        plot(done, os.path.join(RESULTS, args.output + ".png"))
    except ImportError:
        print("matplotlib missing: pip install -r bench/requirements.txt (no PNG written)")
    write_result(args.output + ".md", markdown(done, args, env, seconds))


if __name__ == "__main__":
    main()
