"""The costs file (bench/results/plan_costs.json): its layout, loading with clear errors, the fits
that turn raw measurements into stage costs, and the scenarios built from it.

Layout (times in ms, `*_us` per unit in microseconds; every section also says how it was measured):

    workload     fields, dim, dense_params, table_scale, micro_batches, ...
    routing      base_ms, per_id_us, per_slot_us          (ids routed, padded slots owner-deduped)
    retrieval    base_ms, per_row_us                       (rows gathered, fwd + bwd)
    compute      base_ms, per_sample_us                    (dense fwd/bwd + update + step overhead)
    pipeline_overhead  {dbp, fwp, nested}: base_ms, per_sample_us   (extra ops, one worker)
    contention   {"2": k2, "4": k4}                        (CPU slowdown of W processes here)
    collectives  {all_to_all, all_gather, all_reduce}: alpha0_ms, alpha_step_ms, beta_ms_per_mb
    keys         the sampled key statistics grid (bench.scaling_model.keys)
    runs         optional measured steps [{pipeline, workers, global_batch, ms_median, source}]
"""
import json
import os

from tf_nestpipe.plan.collective_costs import nonnegative_lstsq  # noqa: F401  (re-exported)
from bench.scaling_model.keys import STATS
from bench.scaling_model.model import (COLLECTIVES, PIPELINES, CollectiveParams, Scenario,
                                    collective_steps)

SCHEMA = "tf_nestpipe.plan/1"
REQUIRED = {
    "workload": ("fields", "dim", "dense_params", "micro_batches"),
    "routing": ("base_ms", "per_id_us", "per_slot_us"),
    "retrieval": ("base_ms", "per_row_us"),
    "compute": ("base_ms", "per_sample_us"),
}


class CostsError(ValueError):
    """A costs file that is missing, unreadable or lacks a value the model needs; the message
    names the file and the key."""


def _number(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostsError("%s must be a number, got %r" % (where, value))
    return float(value)


def validate_costs(costs, source="costs"):
    """Checks that `costs` has every value the model reads; returns it. Raises CostsError naming
    `source` and the first missing or malformed key."""
    if not isinstance(costs, dict):
        raise CostsError("%s: expected a JSON object, got %s" % (source, type(costs).__name__))
    for section, keys in REQUIRED.items():
        if not isinstance(costs.get(section), dict):
            raise CostsError("%s: missing section %r (rerun `python -m bench.scaling_model --measure`)"
                             % (source, section))
        for key in keys:
            if key not in costs[section]:
                raise CostsError("%s: missing %s.%s" % (source, section, key))
            _number(costs[section][key], "%s: %s.%s" % (source, section, key))
    overhead = costs.get("pipeline_overhead")
    if not isinstance(overhead, dict):
        raise CostsError("%s: missing section 'pipeline_overhead'" % source)
    for pipeline in PIPELINES[1:]:
        for key in ("base_ms", "per_sample_us"):
            if key not in overhead.get(pipeline, {}):
                raise CostsError("%s: missing pipeline_overhead.%s.%s" % (source, pipeline, key))
            _number(overhead[pipeline][key], "%s: pipeline_overhead.%s.%s" % (source, pipeline, key))
    collectives = costs.get("collectives")
    if not isinstance(collectives, dict):
        raise CostsError("%s: missing section 'collectives'" % source)
    for kind in COLLECTIVES:
        for key in ("alpha0_ms", "alpha_step_ms", "beta_ms_per_mb"):
            if key not in collectives.get(kind, {}):
                raise CostsError("%s: missing collectives.%s.%s" % (source, kind, key))
            _number(collectives[kind][key], "%s: collectives.%s.%s" % (source, kind, key))
    contention = costs.get("contention", {})
    for workers, factor in contention.items():
        if workers.isdigit():
            _number(factor, "%s: contention.%s" % (source, workers))
    keys = costs.get("keys")
    if not isinstance(keys, dict):
        raise CostsError("%s: missing section 'keys' (the sampled key statistics)" % source)
    for name in ("samples", "workers") + STATS:
        if name not in keys:
            raise CostsError("%s: missing keys.%s" % (source, name))
    shape = (len(keys["samples"]), len(keys["workers"]))
    for name in STATS:
        table = keys[name]
        if len(table) != shape[0] or any(len(row) != shape[1] for row in table):
            raise CostsError("%s: keys.%s must be a %d x %d grid (samples x workers)"
                             % (source, name, shape[0], shape[1]))
    if any(sorted(keys[axis]) != list(keys[axis]) for axis in ("samples", "workers")):
        raise CostsError("%s: keys.samples and keys.workers must be increasing" % source)
    for run in costs.get("runs", []):
        for key in ("pipeline", "workers", "global_batch", "ms_median"):
            if key not in run:
                raise CostsError("%s: a runs entry lacks %r: %r" % (source, key, run))
    return costs


def load_costs(path):
    """Reads and validates a costs file; CostsError (naming the path) if it is missing, not
    JSON, or incomplete."""
    if not os.path.exists(path):
        raise CostsError("costs file %s not found: run `python -m bench.scaling_model --measure` "
                         "first (about 3-5 minutes) or pass --costs PATH" % path)
    try:
        with open(path) as f:
            costs = json.load(f)
    except json.JSONDecodeError as e:
        raise CostsError("costs file %s is not valid JSON: %s" % (path, e)) from None
    return validate_costs(costs, path)


# --- fits -----------------------------------------------------------------------------------
def fit_collective(kind, points_by_workers, algorithm="ring"):
    """Fits `alpha0 + alpha_step * steps(W) + beta * MB * factor(W)` to sweeps measured at two
    or more worker counts ({W: [[bytes, ms], ...]}); returns the params dict with the per-W
    intercepts and slopes it came from."""
    rows, ys, per = [], [], {}
    for workers, points in sorted(points_by_workers.items(), key=lambda kv: int(kv[0])):
        w = int(workers)
        steps, factor = collective_steps(kind, algorithm, w)
        for nbytes, ms in points:
            rows.append([1.0, steps, nbytes / 1e6 * factor])
            ys.append(ms)
        base, slope = nonnegative_lstsq([[1.0, nbytes / 1e6] for nbytes, _ in points],
                                        [ms for _, ms in points])
        per[str(w)] = {"intercept_ms": base, "slope_ms_per_mb": slope, "points": points}
    if len(per) < 2:
        raise CostsError("collective %s: need sweeps at two worker counts to separate the fixed "
                         "and the per-peer latency, got %s" % (kind, sorted(per)))
    alpha0, alpha_step, beta = nonnegative_lstsq(rows, ys)
    return {"alpha0_ms": alpha0, "alpha_step_ms": alpha_step, "beta_ms_per_mb": beta,
            "algorithm": algorithm, "per_workers": per}


# --- scenarios ------------------------------------------------------------------------------
def measured_collectives(costs, per_workers=False):
    """CollectiveParams per kind as fitted from this testbed's measurements; with `per_workers`
    the sweeps' own intercept and slope at each measured worker count take precedence."""
    params = {}
    for kind in COLLECTIVES:
        c = costs["collectives"][kind]
        measured = None
        if per_workers:
            measured = {int(w): (float(v["intercept_ms"]), float(v["slope_ms_per_mb"]))
                        for w, v in c.get("per_workers", {}).items()}
        params[kind] = CollectiveParams(float(c["alpha0_ms"]), float(c["alpha_step_ms"]),
                                        float(c["beta_ms_per_mb"]), c.get("algorithm", "ring"),
                                        measured)
    return params


def datacenter_collectives(bandwidth_gbps=200.0, peer_latency_us=1.0, launch_latency_us=30.0,
                           hop_latency_us=5.0):
    """Assumed (not measured) collectives of an accelerator cluster on a datacenter fabric, the
    paper's kind of setting: per-worker link of `bandwidth_gbps`, an all-to-all that posts all
    W-1 sends at once (`peer_latency_us` each, message-rate bound), tree all-reduce / all-gather
    with `hop_latency_us` per step (NCCL-like), `launch_latency_us` per collective."""
    beta = 8.0 / bandwidth_gbps  # ms per MB = 8e6 bit / (Gbit/s * 1e9) * 1e3
    return {"all_to_all": CollectiveParams(launch_latency_us / 1e3, peer_latency_us / 1e3, beta),
            "all_gather": CollectiveParams(launch_latency_us / 1e3, hop_latency_us / 1e3, beta, "tree"),
            "all_reduce": CollectiveParams(launch_latency_us / 1e3, hop_latency_us / 1e3, beta, "tree")}


def contention_factors(costs):
    """{workers: CPU slowdown} measured on this testbed (1.0 for one worker)."""
    factors = {1: 1.0}
    for workers, factor in costs.get("contention", {}).items():
        if str(workers).isdigit():
            factors[int(workers)] = float(factor)
    return factors


def build_scenarios(costs, eta, network=None):
    """The scenarios of the report: `testbed` (this machine, W <= 4, for validation),
    `measured` (our measured per-worker costs extrapolated, fitted overlap `eta`),
    `measured_ideal` (same, perfect overlap) and `datacenter` (our CPU costs, assumed datacenter
    network `network` kwargs for `datacenter_collectives`, perfect overlap)."""
    mine = measured_collectives(costs)
    network = dict(network or {})
    dc = datacenter_collectives(**network)
    dc_text = ("%g Gb/s per worker, all-to-all %g us launch + %g us per peer, tree all-reduce / "
               "all-gather %g us per hop" % (network.get("bandwidth_gbps", 200.0),
                                             network.get("launch_latency_us", 30.0),
                                             network.get("peer_latency_us", 1.0),
                                             network.get("hop_latency_us", 5.0)))
    return {
        "testbed": Scenario("testbed", "this testbed (W processes on 2 shared cores)",
                            measured_collectives(costs, per_workers=True), eta,
                            contention_factors(costs),
                            ("collectives as swept at 2 and 4 workers (intercept + slope each)",
                             "CPU stages slowed by the measured contention of W processes",
                             "overlap eta = %.2f (fitted to the 2-worker pipelined runs)" % eta)),
        "measured": Scenario("measured", "OUR MEASURED COSTS, extrapolated", mine, eta, None,
                             ("per-worker CPU costs as measured on one process here, no "
                              "contention (one worker per host)",
                              "TF gRPC collectives: alpha + per-peer alpha * (W-1) + beta * bytes "
                              "as fitted from the 2- and 4-worker sweeps (ring all-reduce / "
                              "all-gather)", "overlap eta = %.2f as fitted here" % eta)),
        "measured_ideal": Scenario("measured_ideal", "our measured costs, perfect overlap", mine,
                                   1.0, None, ("as 'measured', but eta = 1: communication "
                                               "never competes with compute for the CPU",)),
        "datacenter": Scenario("datacenter", "DATACENTER NETWORK ASSUMPTION (not measured)", dc,
                               1.0, None, ("our measured per-worker CPU costs (routing, "
                                           "retrieval, dense compute, pipeline op overheads)",
                                           "network assumed: " + dc_text, "eta = 1")),
    }
