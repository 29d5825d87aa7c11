"""`--measure`: runs bench/stage_costs.py (one process, then 2- and 4-worker clusters), samples
the key statistics, fits the stage costs and writes the costs file; `--measure-runs` adds
measured NestPipe steps of the DLRM example at 2 and 4 workers for validation."""
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

from bench.scaling_model import keys as key_stats
from bench.scaling_model.costs import SCHEMA, fit_collective, nonnegative_lstsq, validate_costs
from bench.scaling_model.model import (PIPELINES, COLLECTIVES, CollectiveParams, Scenario,
                                    StepModel)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_path(name):
    """Path of bench/NAME in this checkout; CostsError-free RuntimeError if bench/ is absent
    (the measurement programs live in the source tree, not in an installed wheel)."""
    path = os.path.join(REPO, "bench", name)
    if not os.path.exists(path):
        raise RuntimeError("%s not found: --measure needs the source checkout (bench/)" % path)
    return path


def run_result(argv, workers=1, timeout=900):
    """Runs `python argv...` (through the launcher for `workers` > 1) from the repository root
    and returns the JSON worker 0 printed after `RESULT `."""
    command = [sys.executable] + list(argv)
    if workers > 1:
        command = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers), "--"] + command
    # This checkout's package first: the programs run from bench/, where another editable
    # install of tf_nestpipe could otherwise be imported.
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=path)
    out = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=REPO, env=env, timeout=timeout)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    with tempfile.NamedTemporaryFile("w", prefix="nestpipe_plan_", suffix=".log",
                                     delete=False) as log:
        log.write(out.stdout)
    raise RuntimeError("%s failed (rc=%d), full output in %s:\n%s"
                       % (" ".join(command), out.returncode, log.name, out.stdout[-2000:]))


def _plain_model(costs):
    """A StepModel on one worker without contention, overlap or pipeline overheads."""
    zero = CollectiveParams(0.0, 0.0, 0.0)
    scenario = Scenario("fit", "fit", {k: zero for k in COLLECTIVES}, 0.0)
    return StepModel(costs, scenario, overheads=False)


def _check_transport(results, transport, what):
    """Raises RuntimeError unless every cluster result in `results` ({workers: result}) timed
    `transport`'s collectives (stage_costs.py reports the one it used)."""
    for workers, result in sorted(results.items()):
        used = result.get("transport", "tf")
        if used != transport:
            raise RuntimeError(
                "%s on %d workers timed the %r transport's collectives, not %r: the costs file's "
                "sections are per transport ('collectives', 'collectives_sockets');  "
                "run bench/stage_costs.py cluster with --collectives %s"
                % (what, workers, used, transport, "tf" if transport == "tf" else "auto"))


def assemble(single, clusters, keys, global_batch, micro_batches, commands, mesh=None):
    """The costs dict from the raw results of stage_costs.py `single`, `cluster` on TensorFlow's
    collectives (by worker count), the key statistics grid and (optional) `cluster
    --collectives-only` on the socket mesh (by worker count: `collectives_sockets`)."""
    _check_transport(clusters, "tf", "the 'collectives' sweep")
    if mesh:
        _check_transport(mesh, "sockets", "the 'collectives_sockets' sweep")
    fields = single["fields"]
    costs = {
        "schema": SCHEMA,
        "measured": {
            "date": datetime.date.today().isoformat(),
            "host": "%s, %d CPU cores shared with other users (%s)"
                    % (platform.machine(), os.cpu_count(), platform.platform()),
            "commands": commands,
            "statistic": "best round: the lowest of the per-round medians of interleaved rounds "
                         "(the round least disturbed by other processes on the shared cores)",
            "loadavg": {"single": single["loadavg"],
                        **{str(w): c["loadavg"] for w, c in clusters.items()}},
        },
        "workload": {
            "model": "DLRM example (examples/dlrm.py): bottom MLP 13-64-32-16, 26 fields in one "
                     "fused ShardedEmbeddingCollection, dot interaction, top MLP 64-32-1",
            "data": "SyntheticClickLog, Zipf 1.2, Criteo-Kaggle table profile x %g"
                    % single["table_scale"],
            "optimizer": "Adagrad (only touched rows change: DBP re-syncs updated ∩ prefetched)",
            "fields": fields, "dim": single["dim"], "dense_params": single["dense_params"],
            "table_scale": single["table_scale"], "vocab": single["vocab"],
            "micro_batches": micro_batches, "global_batch": global_batch,
            # Per fit step: 2 + 1 all-to-alls (the key counts ride in the keys exchange) and
            # the dense gradients' all-reduce, the loss mean's states riding on it
            # (`strategy.summed_reads`): no scalar all-reduce of its own (PipelineStats.
            # collectives: 4 under none).
            "metric_all_reduces": 0,
        },
        "keys": keys,
    }
    stages = single["stages"]
    route = nonnegative_lstsq([[1.0, s["ids"], s["slots"]] for s in stages],
                              [s["route_ms"] for s in stages])
    costs["routing"] = {
        "base_ms": route[0], "per_id_us": 1e3 * route[1], "per_slot_us": 1e3 * route[2],
        "how": "tf.function of ops.route_keys + capacity bucketing + padded key layout + "
               "ops.owner_rounds over every padded slot (collectives replaced by local copies), "
               "minus an empty tf.function; fit base + per id + per padded slot",
        "points": [{k: s[k] for k in ("samples", "shards", "ids", "unique", "slots", "route_ms",
                                      "route_median_ms")} for s in stages]}
    rows = [s["owner_rows"] + s["slots"] + s["ids"] for s in stages]
    retrieve = nonnegative_lstsq([[1.0, r] for r in rows], [s["retrieve_ms"] for s in stages])
    costs["retrieval"] = {
        "base_ms": retrieve[0], "per_row_us": 1e3 * retrieve[1],
        "how": "tf.function of the owner's tf.gather of its distinct rows, ops.gather_rows into "
               "the slot layout, the inverse-index rebuild, and their adjoints (segment sums) "
               "under a GradientTape; fit base + per row touched (owner rows + slots + ids)",
        "points": [{"samples": s["samples"], "shards": s["shards"], "rows": r,
                    "retrieve_ms": s["retrieve_ms"], "retrieve_median_ms": s["retrieve_median_ms"]}
                   for s, r in zip(stages, rows)]}
    steps = {(s["pipeline"], s["batch"]): s for s in single["steps"]}
    costs["compute"] = {"base_ms": 0.0, "per_sample_us": 0.0}
    costs["pipeline_overhead"] = {p: {"base_ms": 0.0, "per_sample_us": 0.0} for p in PIPELINES[1:]}
    costs["collectives"] = {}
    plain = _plain_model(costs)
    points = []
    for (pipeline, batch), s in sorted(steps.items()):
        if pipeline != "none":
            continue
        cpu = plain.lookup(batch, 1)[0]
        points.append({"batch": batch, "step_ms": s["best_ms"], "step_median_ms": s["median_ms"],
                       "routing_and_retrieval_ms": cpu, "compute_ms": s["best_ms"] - cpu})
    fit = nonnegative_lstsq([[1.0, p["batch"]] for p in points], [p["compute_ms"] for p in points])
    costs["compute"] = {
        "base_ms": fit[0], "per_sample_us": 1e3 * fit[1],
        "how": "tf_keras fit step of the DLRM example by one process (NestPipeStrategy, one "
               "worker, pipeline none) minus the modelled routing + retrieval of its ids; fit "
               "base + per sample (base = Keras step overhead + per-step ops)",
        "points": points}
    overheads = {}
    for pipeline in PIPELINES[1:]:
        residuals = []
        for batch in sorted(b for p, b in steps if p == pipeline):
            predicted = plain.step_ms(pipeline, 1, batch, micro_batches)
            residuals.append({"batch": batch, "step_ms": steps[(pipeline, batch)]["best_ms"],
                              "step_median_ms": steps[(pipeline, batch)]["median_ms"],
                              "model_without_overhead_ms": predicted,
                              "overhead_ms": steps[(pipeline, batch)]["best_ms"] - predicted})
        fit = nonnegative_lstsq([[1.0, r["batch"]] for r in residuals],
                                [r["overhead_ms"] for r in residuals])
        overheads[pipeline] = {"base_ms": fit[0], "per_sample_us": 1e3 * fit[1], "points": residuals}
    costs["pipeline_overhead"] = dict(overheads, how=(
        "the same fit step with pipeline dbp / fwp / nested (M=%d) on one worker, minus the "
        "model's one-worker step without overheads and without overlap (eta = 0); fit base + per "
        "sample, clamped at 0" % micro_batches))
    contention = {"how": "compute-only: every worker of a W-worker cluster on this machine trains "
                         "the DLRM example alone (no strategy) on its share global_batch/W, all at "
                         "once; factor = that step / the same step by one process alone"}
    for workers, c in sorted(clusters.items()):
        alone = steps.get(("plain", c["compute_only"]["batch"]))
        if alone is not None:
            contention[str(workers)] = c["compute_only"]["best_ms"] / alone["best_ms"]
        contention["points_%d" % workers] = {"compute_only": c["compute_only"],
                                             "alone": alone}
    costs["contention"] = contention
    for kind in COLLECTIVES:
        costs["collectives"][kind] = fit_collective(
            kind, {w: c["collectives"][kind] for w, c in clusters.items()})
    costs["collectives"]["how"] = (
        "TF collectives (RING, gRPC on loopback) on W = %s local workers: a tf.function with one "
        "collective per call, minus an empty tf.function, per size; all_to_all: "
        "CollectiveAllToAllV2 of a [W, n] float32 tensor (bytes = whole send tensor); all_gather: "
        "bytes = one worker's contribution; all_reduce: the MultiWorkerMirrored replica-context "
        "path (bytes = the tensor). Fit alpha0 + alpha_step * steps(W) + beta * MB * factor(W) "
        "(all_to_all: W-1, (W-1)/W; ring all_gather: W-1, W-1; ring all_reduce: 2(W-1), "
        "2(W-1)/W), coefficients >= 0" % ", ".join(str(w) for w in sorted(clusters)))
    if mesh:
        costs["collectives_sockets"] = {
            kind: fit_collective(kind, {w: c["collectives"][kind] for w, c in mesh.items()})
            for kind in COLLECTIVES}
        costs["collectives_sockets"]["how"] = (
            "the socket mesh (NestPipeStrategy's default transport on CPU, collectives='auto'), "
            "measured like 'collectives' on W = %s local workers (stage_costs.py cluster "
            "--collectives-only); all_reduce is the strategy's replica-context all-reduce on "
            "the mesh; same fit as 'collectives'" % ", ".join(str(w) for w in sorted(mesh)))
    return validate_costs(costs, "measured costs")


def measure_runs(global_batch, micro_batches, steps=40, workers=(2, 4), log=print):
    """Measured ms/step of the DLRM example with NestPipeStrategy for every pipeline on
    `workers` local workers (bench/dlrm_worker.py --mode nestpipe), for validation."""
    runs = []
    for w in workers:
        for pipeline in PIPELINES:
            argv = [bench_path("dlrm_worker.py"), "--mode", "nestpipe", "--pipeline", pipeline,
                    "--steps", str(steps), "--global-batch", str(global_batch),
                    "--micro-batches", str(micro_batches)]
            try:
                result = run_result(argv, workers=w)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # keep the others
                log("run %s on %d workers failed, left out: %s" % (pipeline, w, str(e)[-300:]))
                continue
            runs.append({"pipeline": pipeline, "workers": w, "global_batch": global_batch,
                         "ms_median": result["median_ms"], "ms_p90": result["p90_ms"],
                         "loadavg": os.getloadavg()[0],
                         "source": "plan --measure-runs (bench/dlrm_worker.py --mode nestpipe, "
                                   "%d steps, M=%d)" % (steps, micro_batches)})
            log("run %s" % runs[-1])
    return runs


def run_measurements(path, global_batch=512, micro_batches=4, with_runs=False, log=print):
    """Measures everything (about 5 minutes on 2 shared cores; `with_runs` adds about 10 more),
    writes the costs file to `path` and returns the costs dict."""
    stage = bench_path("stage_costs.py")
    rel = os.path.relpath(stage, REPO)
    commands = ["python %s single --micro-batches %d" % (rel, micro_batches)]
    log("measuring routing, retrieval and one-worker steps: %s" % commands[-1])
    single = run_result([stage, "single", "--micro-batches", str(micro_batches)])
    clusters, mesh = {}, {}
    for workers in (2, 4):
        # TensorFlow's collectives ('collectives', the model's) with the contention run; then the
        # socket mesh's sweeps ('collectives_sockets').
        commands.append("python -m tf_nestpipe.launch --workers %d -- python %s cluster "
                        "--collectives tf --global-batch %d" % (workers, rel, global_batch))
        log("measuring collectives and contention: %s" % commands[-1])
        clusters[workers] = run_result([stage, "cluster", "--collectives", "tf",
                                        "--global-batch", str(global_batch)], workers=workers)
        commands.append("python -m tf_nestpipe.launch --workers %d -- python %s cluster "
                        "--collectives-only" % (workers, rel))
        log("measuring the socket mesh's collectives: %s" % commands[-1])
        mesh[workers] = run_result([stage, "cluster", "--collectives-only"], workers=workers)
    log("sampling key statistics (bench.scaling_model.keys)")
    keys = key_stats.sample_key_stats(single["table_scale"])
    commands.append("bench.scaling_model.keys.sample_key_stats(%g)" % single["table_scale"])
    costs = assemble(single, clusters, keys, global_batch, micro_batches, commands, mesh)
    if with_runs:
        costs["runs"] = measure_runs(global_batch, micro_batches, log=log)
    elif os.path.exists(path):  # keep validation runs measured earlier
        try:
            with open(path) as f:
                costs["runs"] = json.load(f).get("runs", [])
        except (OSError, ValueError):
            pass
    with open(path, "w") as f:
        json.dump(costs, f, indent=1)
    log("wrote %s" % path)
    return costs


def add_runs(path, global_batch=512, log=print):
    """Measures the validation runs (`measure_runs`, M from the costs file) and stores them in
    the existing costs file at `path`."""
    from bench.scaling_model.costs import load_costs

    costs = load_costs(path)
    costs["runs"] = measure_runs(global_batch, int(costs["workload"]["micro_batches"]), log=log)
    with open(path, "w") as f:
        json.dump(costs, f, indent=1)
    log("wrote %s" % path)
    return costs
