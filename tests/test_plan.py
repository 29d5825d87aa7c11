"""The scaling model (bench/scaling_model, `python -m bench.scaling_model`): arithmetic on
hand-computed costs, costs-file errors, validation plumbing and the CLI on a small fixed costs
dict. Fast: no clusters, no TensorFlow graphs."""
import copy
import json
import math
import os
import sys

import pytest

from conftest import REPO

sys.path.insert(0, REPO)  # bench/ is a namespace package of the checkout, not installed

# pylint: disable=wrong-import-position
from bench.scaling_model import (CollectiveParams, CostsError, ModelError, StepModel,  # noqa: E402
                                 build_scenarios, collective_ms, datacenter_collectives,
                                 load_costs, overlap, padded_capacity, validate_costs)
from bench.scaling_model import __main__ as cli  # noqa: E402
from bench.scaling_model import report  # noqa: E402
from bench.scaling_model.costs import fit_collective, nonnegative_lstsq  # noqa: E402
from bench.scaling_model.model import collective_bandwidth_ms  # noqa: E402

WORKERS = [1, 2, 4, 8]


def small_costs():
    """Hand-sized costs: 2 fields, dim 4 (16-byte rows), 250 dense params (1000 bytes), M = 2;
    key statistics for 50 and 100 samples on 1, 2, 4, 8 workers."""
    return {
        "workload": {"fields": 2, "dim": 4, "dense_params": 250, "micro_batches": 2,
                     "table_scale": 0.002},
        "routing": {"base_ms": 0.1, "per_id_us": 1.0, "per_slot_us": 0.0},
        "retrieval": {"base_ms": 0.1, "per_row_us": 0.0},
        "compute": {"base_ms": 1.0, "per_sample_us": 10.0},
        "pipeline_overhead": {p: {"base_ms": 0.0, "per_sample_us": 0.0}
                              for p in ("dbp", "fwp", "nested")},
        "contention": {"2": 1.5, "4": 2.0},
        "collectives": {
            "all_to_all": {"alpha0_ms": 0.5, "alpha_step_ms": 0.1, "beta_ms_per_mb": 1.0},
            "all_gather": {"alpha0_ms": 0.2, "alpha_step_ms": 0.05, "beta_ms_per_mb": 0.0},
            "all_reduce": {"alpha0_ms": 0.3, "alpha_step_ms": 0.1, "beta_ms_per_mb": 0.0},
        },
        "keys": {
            "samples": [50, 100], "workers": WORKERS,
            "unique": [[60, 60, 60, 60], [100, 100, 100, 100]],
            "capacity": [[60, 33, 17, 9], [100, 55, 28, 14]],
            "owner_rows": [[60, 50, 40, 30], [100, 80, 60, 40]],
            "sync_capacity": [[30, 20, 10, 5], [50, 20, 14, 9]],
            "sync_rows": [[30, 40, 50, 55], [50, 70, 90, 95]],
        },
        "runs": [
            {"pipeline": "dbp", "workers": 2, "global_batch": 200, "ms_median": 4.0, "source": "t"},
            {"pipeline": "none", "workers": 4, "global_batch": 400, "ms_median": 9.0, "source": "t"},
        ],
    }


def scenario(costs, eta=1.0, name="measured"):
    return build_scenarios(costs, eta)[name]


# --- arithmetic ---------------------------------------------------------------------------------
def test_padded_capacity_matches_the_strategy_buckets():
    from tf_nestpipe.collectives.communication import _CAPACITIES

    for count in [0, 1, 2, 7, 8, 9, 55, 56, 1000, 12345]:
        expected = min(c for c in _CAPACITIES if c >= max(count, 1))
        assert padded_capacity(count) == expected


def test_collectives_grow_as_assumed():
    a2a = CollectiveParams(0.5, 0.1, 1.0)
    for kind in ("all_to_all", "all_gather", "all_reduce"):
        assert collective_ms(kind, a2a, 1, 10 ** 6) == 0.0  # nothing issued on one worker
    # all-to-all: alpha0 + alpha_peer * (W-1) + beta * MB * (W-1)/W
    for w in (2, 8, 1536):
        assert collective_ms("all_to_all", a2a, w, 2 * 10 ** 6) == pytest.approx(
            0.5 + 0.1 * (w - 1) + 1.0 * 2.0 * (w - 1) / w)
    # ring all-reduce: 2(W-1) steps and 2(W-1)/W of the bytes; tree: 2 ceil(log2 W) steps.
    assert collective_ms("all_reduce", a2a, 4, 10 ** 6) == pytest.approx(0.5 + 0.1 * 6 + 1.5)
    tree = CollectiveParams(0.5, 0.1, 1.0, "tree")
    assert collective_ms("all_reduce", tree, 1536, 0) == pytest.approx(0.5 + 0.1 * 2 * 11)
    # ring all-gather: W-1 steps, every worker receives (W-1) contributions.
    assert collective_ms("all_gather", a2a, 4, 10 ** 6) == pytest.approx(0.5 + 0.3 + 3.0)
    # Measured per-W values take precedence where they exist.
    measured = CollectiveParams(0.5, 0.1, 1.0, measured={2: (0.9, 2.0)})
    assert collective_ms("all_to_all", measured, 2, 10 ** 6) == pytest.approx(2.9)
    assert collective_ms("all_to_all", measured, 4, 0) == pytest.approx(0.8)
    costs = [collective_ms("all_to_all", a2a, w, 10 ** 5) for w in range(2, 64)]
    assert costs == sorted(costs)


def test_overlap():
    assert overlap(3.0, 2.0, 1.0) == 3.0
    assert overlap(3.0, 2.0, 0.0) == 5.0
    assert overlap(3.0, 2.0, 0.5) == 4.0


def test_one_worker_step_by_hand():
    costs = small_costs()
    model = StepModel(costs, scenario(costs))
    # routing 0.1 + 200 ids * 1 us, retrieval 0.1, compute 1.0 + 100 * 10 us; no collectives.
    assert model.step_ms("none", 1, 100) == pytest.approx(0.3 + 0.1 + 2.0)
    # 50 samples: routing 0.1 + 100 ids * 1 us, retrieval 0.1, compute 1.0 + 50 * 10 us.
    assert model.step_ms("none", 1, 50) == pytest.approx(0.2 + 0.1 + 1.5)


def _two_worker_none_step_by_hand():
    """ms of the plain step on 2 workers at 100 samples per worker, from small_costs by hand: no
    counts all-gather, the counts ride in the keys all-to-all as a 2 x 3 int64 header."""
    slots = 2 * 55  # capacity 55 is a bucket
    keys = 0.5 + 0.1 + (slots * 8 + 2 * 3 * 8) / 1e6 * 0.5
    rows = 0.5 + 0.1 + slots * 16 / 1e6 * 0.5
    all_reduce = 0.3 + 0.1 * 2
    return 0.4 + keys + rows + 2.0 + rows + all_reduce


def test_two_worker_step_by_hand():
    costs = small_costs()
    model = StepModel(costs, scenario(costs))
    slots = 2 * 55
    keys = 0.5 + 0.1 + (slots * 8 + 2 * 3 * 8) / 1e6 * 0.5
    rows = 0.5 + 0.1 + slots * 16 / 1e6 * 0.5
    all_reduce = 0.3 + 0.1 * 2
    none = _two_worker_none_step_by_hand()
    assert model.step_ms("none", 2, 100) == pytest.approx(none)
    assert model.efficiency("none", 2, 100) == pytest.approx(2.4 / none)
    # DBP with perfect overlap: max(prefetch + sync, compute + grads + all-reduce). The sync's
    # fresh rows (capacity 20, a bucket) ride on the next keys all-to-all: bandwidth only.
    sync_send = 2 * 20 * (16 + 4) / 1e6 * 0.5
    prefetch = 0.4 + keys + rows + sync_send
    critical = 2.0 + rows + all_reduce
    assert model.step_ms("dbp", 2, 100) == pytest.approx(max(prefetch, critical))
    # The testbed scenario slows CPU stages by the contention factor (1.5 at 2 workers).
    testbed = StepModel(costs, scenario(costs, 1.0, "testbed"))
    assert testbed.step_ms("none", 2, 100) == pytest.approx(none + 0.5 * (0.4 + 2.0))


def test_metric_all_reduces_are_counted():
    costs = small_costs()
    before = StepModel(costs, scenario(costs)).step_ms("none", 2, 100)
    costs["workload"]["metric_all_reduces"] = 2
    after = StepModel(costs, scenario(costs)).step_ms("none", 2, 100)
    assert after == pytest.approx(before + 2 * (0.3 + 0.1 * 2))  # two scalar ring all-reduces


def test_dbp_never_slower_than_none_when_its_resync_is_free(monkeypatch):
    costs = small_costs()
    monkeypatch.setattr(StepModel, "sync", lambda self, *a, **k: (0.0, 0.0))
    for eta in (0.0, 0.3, 1.0):
        model = StepModel(costs, scenario(costs, eta))
        for w in WORKERS:
            none, dbp = model.step_ms("none", w, 100), model.step_ms("dbp", w, 100)
            assert dbp <= none + 1e-12
            if eta == 0.0:
                assert dbp == pytest.approx(none)  # nothing overlaps: the same serial work


def test_dbp_pays_exactly_its_resync_without_overlap():
    costs = small_costs()
    model = StepModel(costs, scenario(costs, 0.0))
    plan, send = model.sync(100, 4)
    # sync capacity 14 (a bucket) x 4 owners x (16-byte row + 4), bandwidth (W-1)/W at 1 ms/MB.
    assert (plan, send) == (0.0, pytest.approx(4 * 14 * 20 / 1e6 * 1.0 * 3 / 4))
    assert model.step_ms("dbp", 4, 100) == pytest.approx(model.step_ms("none", 4, 100) + plan + send)


def test_sync_adds_no_collective_latency():
    """The re-sync rides on existing exchanges (plan counts on the rows all-to-all, fresh rows on
    the next keys all-to-all): with a latency-only all-to-all (beta = 0) and nothing overlapping,
    DBP costs exactly the plain step (+ its op overhead, 0 here); the fetch pays two all-to-all
    latencies and no all-gather."""
    costs = small_costs()
    costs["collectives"]["all_to_all"]["beta_ms_per_mb"] = 0.0
    model = StepModel(costs, scenario(costs, 0.0))
    for w in WORKERS[1:]:
        assert model.sync(100, w) == (0.0, 0.0)
        assert model.lookup(100, w)[1] == pytest.approx(2 * (0.5 + 0.1 * (w - 1)))
        assert model.step_ms("dbp", w, 100) == pytest.approx(model.step_ms("none", w, 100))


def test_sync_adds_exactly_the_bandwidth_of_its_bytes():
    """Positive control: with beta > 0 the re-sync adds exactly its padded block's bandwidth on an
    all-to-all (formula: beta x MB x (W-1)/W; measured params: slope x MB), no intercept."""
    costs = small_costs()
    costs["collectives"]["all_to_all"]["per_workers"] = {
        "2": {"intercept_ms": 0.9, "slope_ms_per_mb": 2.0}}
    sync_bytes = {2: 2 * 20 * 20, 4: 4 * 14 * 20}  # W x sync capacity x (16-byte row + 4)
    formula = StepModel(costs, scenario(costs, 0.0))
    for w, nbytes in sync_bytes.items():
        send = nbytes / 1e6 * 1.0 * (w - 1) / w
        assert formula.sync(100, w) == (0.0, pytest.approx(send))
        assert formula.step_ms("dbp", w, 100) == pytest.approx(
            formula.step_ms("none", w, 100) + send)
    testbed = StepModel(costs, scenario(costs, 0.0, "testbed"))
    assert testbed.sync(100, 2) == (0.0, pytest.approx(2.0 * 2 * 20 * 20 / 1e6))
    assert testbed.step_ms("dbp", 2, 100) == pytest.approx(
        testbed.step_ms("none", 2, 100) + 2.0 * 2 * 20 * 20 / 1e6)
    # The helper itself: the collective minus its zero-byte (latency) cost, 0 on one worker.
    params = CollectiveParams(0.5, 0.1, 1.0, measured={2: (0.9, 2.0)})
    assert collective_bandwidth_ms("all_to_all", params, 2, 10 ** 6) == pytest.approx(2.0)
    assert collective_bandwidth_ms("all_to_all", params, 4, 10 ** 6) == pytest.approx(0.75)
    assert collective_bandwidth_ms("all_to_all", params, 1, 10 ** 6) == 0.0


def test_nested_is_dbp_with_its_own_overhead():
    """A look-ahead window is fetched in one exchange of the batch's distinct ids, as DBP
    fetches its batch: nested differs from dbp only by its measured op overhead, whatever M."""
    costs = small_costs()
    costs["pipeline_overhead"]["nested"] = {"base_ms": 0.25, "per_sample_us": 5.0}
    for eta in (0.0, 1.0):
        model = StepModel(costs, scenario(costs, eta))
        for w in WORKERS:
            for m in (1, 2, 4):
                assert model.step_ms("nested", w, 100, m) == pytest.approx(
                    model.step_ms("dbp", w, 100) + 0.25 + 0.5)


def test_fwp_step_by_hand():
    """FWP as it runs: one route of the batch (one keys all-to-all), a rows all-to-all per
    micro-batch (round 2 overlapping micro-batch 1's compute), one gradient all-to-all for the
    window. Latency-only all-to-all, 2 workers, 100 samples, M = 2: without overlap it pays
    exactly one more round than none (a retrieval and a rows all-to-all); with perfect overlap
    that round hides behind compute / M and FWP costs none's step."""
    costs = small_costs()
    costs["collectives"]["all_to_all"]["beta_ms_per_mb"] = 0.0
    a2a = 0.5 + 0.1
    none = 0.3 + 0.1 + a2a + a2a + 2.0 + a2a + (0.3 + 0.1 * 2)  # route, retrieval, keys, rows,
    serial = StepModel(costs, scenario(costs, 0.0))              # compute, grads, all-reduce
    assert serial.step_ms("none", 2, 100) == pytest.approx(none)
    assert serial.step_ms("fwp", 2, 100, 2) == pytest.approx(none + 0.1 + a2a)
    overlapped = StepModel(costs, scenario(costs, 1.0))
    assert overlapped.step_ms("fwp", 2, 100, 2) == pytest.approx(none)
    window = serial.window(100, 2, 2)
    assert len(window.rounds) == 2 and window.keys == pytest.approx(a2a)
    # One gradient exchange carries both rounds' rows (bandwidth on: it grows with their slots).
    costs["collectives"]["all_to_all"]["beta_ms_per_mb"] = 1.0
    window = StepModel(costs, scenario(costs, 0.0)).window(100, 2, 2)
    slots = sum(s for _, _, s in window.rounds)
    assert window.grad == pytest.approx(a2a + slots * 16 / 1e6 * 0.5)


def test_fwp_with_one_micro_batch_is_the_plain_step():
    costs = small_costs()
    model = StepModel(costs, scenario(costs, 1.0))
    for w in WORKERS:
        assert model.step_ms("fwp", w, 100, micro_batches=1) == pytest.approx(
            model.step_ms("none", w, 100))


def test_fwp_overlap_and_per_micro_batch_latency():
    costs = small_costs()
    overlapped = StepModel(costs, scenario(costs, 1.0))
    serial = StepModel(costs, scenario(costs, 0.0))
    # Overlap only helps; without it FWP pays every micro-batch's collective latencies.
    assert overlapped.step_ms("fwp", 4, 100, 2) < serial.step_ms("fwp", 4, 100, 2)
    assert serial.step_ms("fwp", 4, 100, 2) > serial.step_ms("none", 4, 100)
    # Nested with perfect overlap is never slower than FWP's serial-in-prefetch schedule here.
    assert overlapped.step_ms("nested", 4, 100, 2) <= serial.step_ms("nested", 4, 100, 2)


def test_pipeline_overhead_is_added_and_efficiency_is_one_at_one_worker():
    costs = small_costs()
    costs["pipeline_overhead"]["dbp"] = {"base_ms": 0.5, "per_sample_us": 10.0}
    model = StepModel(costs, scenario(costs, 0.0))
    base = StepModel(costs, scenario(costs, 0.0), overheads=False)
    assert model.step_ms("dbp", 2, 100) == pytest.approx(base.step_ms("dbp", 2, 100) + 1.5)
    assert model.step_ms("none", 2, 100) == base.step_ms("none", 2, 100)
    # Each pipeline is measured against itself on one worker: DBP's overhead (0.5 ms + 100 *
    # 10 us) is in both its 1-worker and its 2-worker step.
    expected = (base.step_ms("dbp", 1, 100) + 1.5) / (base.step_ms("dbp", 2, 100) + 1.5)
    assert model.efficiency("dbp", 2, 100, 2) == pytest.approx(expected)
    assert model.efficiency("dbp", 2, 100, 2) != pytest.approx(
        base.step_ms("none", 1, 100) / model.step_ms("dbp", 2, 100))  # not against "none"
    for pipeline in ("none", "dbp", "fwp", "nested"):
        assert model.efficiency(pipeline, 8, 100, 2) < model.efficiency(pipeline, 2, 100, 2) < 1.0


def test_efficiency_falls_with_workers_and_key_stats_interpolate():
    costs = small_costs()
    model = StepModel(costs, scenario(costs, 0.0))
    eff = [model.efficiency("none", w, 100) for w in WORKERS[1:]]
    assert all(a > b for a, b in zip(eff, eff[1:])) and eff[0] < 1.0, eff
    # log-log interpolation between sampled cells: W = sqrt(2 * 4) lies half way in log W.
    assert model.keys.at("owner_rows", 100, math.sqrt(8)) == pytest.approx(70.0)
    assert model.keys.at("unique", math.sqrt(5000), 2) == pytest.approx(80.0)
    with pytest.raises(ModelError, match="worker counts 1..8, not 16"):
        model.step_ms("none", 16, 100)
    with pytest.raises(ModelError, match="unknown pipeline"):
        model.step_ms("pipedream", 2, 100)
    with pytest.raises(ModelError, match="contention factors"):
        StepModel(costs, scenario(costs, 0.0, "testbed")).step_ms("none", 8, 100)


def test_datacenter_assumption_units():
    dc = datacenter_collectives(bandwidth_gbps=200, peer_latency_us=1, launch_latency_us=30,
                                hop_latency_us=5)
    assert dc["all_to_all"].beta_ms_per_mb == pytest.approx(0.04)  # 1 MB at 200 Gb/s = 40 us
    assert collective_ms("all_to_all", dc["all_to_all"], 1536, 0) == pytest.approx(0.030 + 1.535)
    assert dc["all_reduce"].algorithm == "tree"


# --- fits -------------------------------------------------------------------------------------
def test_fits():
    assert nonnegative_lstsq([[1, 1], [1, 2], [1, 3]], [3, 5, 7]) == pytest.approx([1, 2])
    assert nonnegative_lstsq([[1, 1], [1, 2]], [3, 1])[1] == 0.0  # a negative slope is dropped
    sweeps = {w: [[b, 0.4 + 0.3 * (w - 1) + 2.0 * b / 1e6 * (w - 1) / w] for b in (0, 10 ** 6)]
              for w in (2, 4)}
    fit = fit_collective("all_to_all", sweeps)
    coefficients = (fit["alpha0_ms"], fit["alpha_step_ms"], fit["beta_ms_per_mb"])
    assert coefficients == pytest.approx((0.4, 0.3, 2.0))
    with pytest.raises(CostsError, match="two worker counts"):
        fit_collective("all_to_all", {2: sweeps[2]})


def test_validation_against_hand_made_measurements():
    """Predictions checked against measurements that the model did not make: a plain 2-worker
    run measured at 5.0 ms is predicted from the costs by hand (the testbed scenario adds the
    contention factor 1.5 to the CPU stages: 0.5 * (0.4 routing + 2.0 compute))."""
    costs = small_costs()
    runs = [{"pipeline": "none", "workers": 2, "global_batch": 200, "ms_median": 5.0,
             "source": "hand"},
            {"pipeline": "none", "workers": 2, "global_batch": 2000, "ms_median": 9.0,
             "source": "hand"}]
    rows = report.validate(costs, runs, 0.0, 2)
    predicted = _two_worker_none_step_by_hand() + 0.5 * (0.4 + 2.0)
    assert rows[0]["predicted"] == pytest.approx(predicted)
    assert rows[0]["error"] == pytest.approx(100.0 * (predicted - 5.0) / 5.0)
    assert rows[0]["role"] == "out of sample"
    assert rows[1]["predicted"] is None  # 1,000 samples per worker: outside the key statistics


def test_eta_fit_recovers_a_known_eta_from_synthetic_runs():
    """The fit's own test (not a validation of the model): runs synthesized with eta = 0.3 give
    back 0.3, and runs synthesized with another eta do not."""
    costs = small_costs()
    truth = build_scenarios(costs, 0.3)["testbed"]
    runs = [{"pipeline": p, "workers": 2, "global_batch": 200, "source": "t",
             "ms_median": StepModel(costs, truth).step_ms(p, 2, 100, 2)}
            for p in ("dbp", "fwp", "nested")]
    assert report.fit_eta(costs, runs, 2) == (pytest.approx(0.3), 3)
    other = build_scenarios(costs, 0.8)["testbed"]
    assert report.fit_eta(costs, [dict(r, ms_median=StepModel(costs, other).step_ms(
        r["pipeline"], 2, 100, 2)) for r in runs], 2)[0] == pytest.approx(0.8)
    rows = report.validate(costs, runs, 0.3, 2)
    assert all(abs(r["error"]) < 1e-9 and r["role"] == "eta fit" for r in rows)
    # Relative to the none run of the same source, a level error common to all runs of that
    # source (here every time doubled) does not move eta.
    none = {"pipeline": "none", "workers": 2, "global_batch": 200, "source": "t",
            "ms_median": StepModel(costs, truth).step_ms("none", 2, 100, 2)}
    doubled = [dict(r, ms_median=2 * r["ms_median"]) for r in runs + [none]]
    assert report.fit_eta(costs, doubled, 2) == (pytest.approx(0.3), 3)


# --- the costs file --------------------------------------------------------------------------
def test_costs_file_errors_are_named(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(CostsError, match="nope.json not found.*--measure"):
        load_costs(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CostsError, match="bad.json is not valid JSON"):
        load_costs(str(bad))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(small_costs()))
    assert load_costs(str(good))["routing"]["base_ms"] == 0.1
    cases = [
        (lambda c: c.pop("routing"), "missing section 'routing'"),
        (lambda c: c["collectives"]["all_to_all"].pop("beta_ms_per_mb"),
         "missing collectives.all_to_all.beta_ms_per_mb"),
        (lambda c: c["compute"].update(per_sample_us="fast"), "compute.per_sample_us must be a number"),
        (lambda c: c["pipeline_overhead"].pop("nested"), "pipeline_overhead.nested.base_ms"),
        (lambda c: c["keys"]["capacity"].pop(), "keys.capacity must be a 2 x 4 grid"),
        (lambda c: c.pop("keys"), "missing section 'keys'"),
        (lambda c: c["runs"][0].pop("ms_median"), "runs entry lacks 'ms_median'"),
        (lambda c: c["workload"].pop("dim"), "missing workload.dim"),
    ]
    for mutate, message in cases:
        costs = copy.deepcopy(small_costs())
        mutate(costs)
        with pytest.raises(CostsError, match=message):
            validate_costs(costs, "x.json")
    with pytest.raises(CostsError, match="expected a JSON object"):
        validate_costs([], "x.json")


def test_compare_json_rows_are_filtered(tmp_path):
    rows = [
        {"system": "nestpipe", "pipeline": "dbp", "collectives": "tf", "model": "dlrm",
         "data": "synthetic", "network": "loopback", "workers": 2, "global_batch": 512,
         "ms_median": 20.0},
        {"system": "nestpipe", "pipeline": "dbp", "collectives": "horovod", "model": "dlrm",
         "data": "synthetic", "network": "loopback", "workers": 2, "global_batch": 512,
         "ms_median": 18.0},
        {"system": "mwms", "pipeline": None, "collectives": "tf", "model": "dlrm",
         "data": "synthetic", "network": "loopback", "workers": 2, "global_batch": 512,
         "ms_median": 90.0},
        {"system": "nestpipe", "pipeline": "none", "collectives": "tf", "model": "dlrm",
         "data": "synthetic", "network": "1ms:200mbit", "workers": 2, "global_batch": 512,
         "ms_median": 50.0},
        {"system": "nestpipe", "pipeline": "none", "collectives": "tf", "model": "dlrm",
         "data": "synthetic", "network": "loopback", "workers": 4, "global_batch": 512,
         "ms_median": None},
    ]
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(rows))
    runs = report.runs_from_compare(str(path))
    assert [(r["pipeline"], r["workers"], r["ms_median"]) for r in runs] == [("dbp", 2, 20.0)]
    costs = small_costs()
    gathered = report.gather_runs(costs, str(path), str(tmp_path))
    assert [r["source"] for r in gathered] == ["compare.json", "t", "t"]  # no calibration here
    fallback = report.gather_runs(costs, str(tmp_path / "absent.json"), str(tmp_path))
    assert [r["ms_median"] for r in fallback] == [4.0, 9.0]


# --- the CLI -------------------------------------------------------------------------------------
def test_cli_on_small_costs(tmp_path, capsys):
    costs_path = tmp_path / "costs.json"
    costs_path.write_text(json.dumps(small_costs()))
    code = cli.main(["--costs", str(costs_path), "--out-dir", str(tmp_path), "--workers", "1,2,4",
                     "--per-worker-batch", "100", "--no-plot",
                     "--validate", str(tmp_path / "absent.json")])
    assert code == 0
    text = (tmp_path / "plan.md").read_text()
    for needle in ("OUR MEASURED COSTS", "DATACENTER NETWORK ASSUMPTION", "Validation",
                   "out of sample", "eta fit", "What the model leaves out", "94.07%",
                   "| 4 |"):
        assert needle in text, needle
    assert "wrote" in capsys.readouterr().out
    assert not (tmp_path / "plan.png").exists()
    # The report names the costs file it was made from (not the default one here).
    assert "`python -m bench.scaling_model --costs %s" % os.path.relpath(costs_path, cli.REPO) in text


def test_runs_outside_the_key_statistics_are_listed_not_fatal():
    costs = small_costs()
    runs = costs["runs"] + [{"pipeline": "fwp", "workers": 2, "global_batch": 1024,
                             "ms_median": 30.0, "source": "t"}]
    eta, used = report.fit_eta(costs, runs, 2)
    assert used == 1  # only the dbp run: b = 512 is outside the sampled 50..100 samples
    rows = report.validate(costs, runs, eta, 2)
    assert rows[-1]["predicted"] is None and "samples per worker 50..100" in rows[-1]["role"]


def test_cli_reports_bad_costs(tmp_path, capsys):
    assert cli.main(["--costs", str(tmp_path / "none.json"), "--out-dir", str(tmp_path)]) == 2
    assert "none.json not found" in capsys.readouterr().err
    costs = small_costs()
    costs["keys"]["workers"] = [1, 2, 4, 8]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(costs))
    # The default worker list goes to 1,536: beyond the sampled keys, named as such.
    assert cli.main(["--costs", str(path), "--out-dir", str(tmp_path), "--no-plot",
                     "--per-worker-batch", "100", "--validate", str(tmp_path / "absent")]) == 2
    assert "worker counts 1..8" in capsys.readouterr().err


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    costs = small_costs()
    scenarios = build_scenarios(costs, 0.0)
    tables = {name: report.prediction_table(costs, scenarios[name], [1, 2, 4], 100, 2)
              for name in report.EXTRAPOLATED}
    validation = report.validate(costs, costs["runs"], 0.0, 2)
    path = os.path.join(tmp_path, "plan.png")
    assert report.write_plot(path, tables, validation, scenarios, 100, 2, ["a test"])
    assert os.path.getsize(path) > 10000


# --- measure: the costs file's sections per transport ---------------------------------------
def _raw_measurements(tf_ms_per_mb, mesh_ms_per_mb, cluster_transport="tf"):
    """Hand-made raw results of bench/stage_costs.py (`single`, `cluster` per W on TF's
    collectives, `cluster --collectives-only` per W on the mesh): every collective costs 1 ms +
    its slope per MB (TF's or the mesh's)."""
    stages = [{"samples": n, "shards": 1, "ids": 26 * n, "unique": 10 * n, "slots": 10 * n,
               "owner_rows": 10 * n, "route_ms": 0.1 + n / 1e3, "route_median_ms": 0.2,
               "retrieve_ms": 0.1 + n / 2e3, "retrieve_median_ms": 0.2} for n in (64, 256, 1024)]
    steps = [{"pipeline": p, "batch": b, "best_ms": 2.0 + b / 100, "median_ms": 3.0}
             for p in ("none", "dbp", "fwp", "nested", "plain") for b in (60, 100)]
    single = {"fields": 26, "dim": 16, "dense_params": 1000, "table_scale": 0.002, "vocab": 500,
              "loadavg": [0.1, 0.1], "stages": stages, "steps": steps}

    def sweep(slope, transport):
        return {"transport": transport, "loadavg": [0.1, 0.1],
                "compute_only": {"batch": 100, "best_ms": 5.0},
                "collectives": {kind: [[n, 1.0 + slope * n / 1e6] for n in (1 << 10, 1 << 20)]
                                for kind in ("all_to_all", "all_gather", "all_reduce")}}

    clusters = {w: sweep(tf_ms_per_mb, cluster_transport) for w in (2, 4)}
    mesh = {w: sweep(mesh_ms_per_mb, "sockets") for w in (2, 4)}
    return single, clusters, mesh


def test_measured_collectives_go_to_their_transports_section():
    """`--measure` writes TF's sweeps to `collectives` (the model's, and the placement planner's
    for tf / horovod) and the socket mesh's to `collectives_sockets` (the planner's for the
    default transport), and refuses a 'collectives' sweep that timed the mesh (the mistake a
    default-transport `cluster` run made: mesh costs labelled as TF's, the mesh's section
    dropped)."""
    from bench.scaling_model.measure import assemble

    keys = dict(small_costs()["keys"], samples=[10, 1000])
    single, clusters, mesh = _raw_measurements(tf_ms_per_mb=3.0, mesh_ms_per_mb=0.5)
    costs = assemble(single, clusters, keys, 512, 4, ["cmd"], mesh)
    for section, slope in (("collectives", 3.0), ("collectives_sockets", 0.5)):
        per_w = costs[section]["all_to_all"]["per_workers"]["2"]
        assert per_w["slope_ms_per_mb"] == pytest.approx(slope, rel=1e-6)
        assert per_w["intercept_ms"] == pytest.approx(1.0, abs=1e-3)
    assert "socket mesh" in costs["collectives_sockets"]["how"]
    assert "collectives_sockets" not in assemble(single, clusters, keys, 512, 4, ["cmd"])
    single, wrong, mesh = _raw_measurements(3.0, 0.5, cluster_transport="sockets")
    with pytest.raises(RuntimeError, match="timed the 'sockets' transport's collectives, not "
                                           "'tf'.*--collectives tf"):
        assemble(single, wrong, keys, 512, 4, ["cmd"], mesh)
    with pytest.raises(RuntimeError, match="not 'sockets'"):
        assemble(single, clusters, keys, 512, 4, ["cmd"], clusters)
