"""The Dual-Buffer, Frozen-Window and nested pipelines on 2 and 3 workers, with and without
key-centric clustering, equal non-pipelined single-process training after 30 steps (hot Zipf
keys: consecutive batches share keys, so the buffer sync must run), and skipping the sync on
purpose makes the parameters differ."""
import os
import sys

import numpy as np
import pytest

import tf_keras
import tf_nestpipe as tnp
from conftest import PROGRAMS, launch, run_command
from tf_nestpipe.pipeline import updates_only_touched_rows

STEPS = 30
# Every optimizer (SGD, Adagrad, Adam), loop and fit, on 2 and 3 workers, for each pipeline; kept
# few because each run is a multi-process launch on 2 cores.
DBP_RUNS = {
    2: ["loop:sgd", "loop:adagrad", "fit:adam", "epochs:adagrad", "twice:sgd", "one:sgd"],
    3: ["loop:adam", "fit:adagrad"],
}
NESTED_RUNS = {2: ["loop:adagrad", "fit:adam", "loop:adagrad:cluster", "fit:sgd:cluster"],
               3: ["loop:adagrad", "fit:adam"]}
FWP_RUNS = {2: ["loop:adagrad", "fit:adam"], 3: ["loop:sgd", "fit:adagrad", "loop:adam:cluster"]}


@pytest.fixture(scope="session")
def dbp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dbp")
    program = os.path.join(PROGRAMS, "exactness.py")
    # The reference trains without pipeline (clustering does not apply): one run per MODE:OPT.
    runs = sorted(set(":".join(r.split(":")[:2]) for r in sum(
        list(DBP_RUNS.values()) + list(FWP_RUNS.values()) + list(NESTED_RUNS.values()), [])))
    ref = run_command([sys.executable, program, str(out / "ref"), str(STEPS)] + runs)
    assert ref.returncode == 0, ref.stdout[-4000:]
    prefixes = {"ref": str(out / "ref")}
    for workers, worker_runs in DBP_RUNS.items():
        result = launch(workers, [program, str(out / ("dbp%d" % workers)), str(STEPS)] + worker_runs
                        + ["--pipeline=dbp"])
        assert result.returncode == 0, result.stdout[-6000:]
        prefixes[workers] = str(out / ("dbp%d" % workers))
    for workers, worker_runs in FWP_RUNS.items():
        result = launch(workers, [program, str(out / ("fwp%d" % workers)), str(STEPS)] + worker_runs
                        + ["--pipeline=fwp"])
        assert result.returncode == 0, result.stdout[-6000:]
        prefixes["fwp%d" % workers] = str(out / ("fwp%d" % workers))
    for workers, worker_runs in NESTED_RUNS.items():
        result = launch(workers, [program, str(out / ("nested%d" % workers)), str(STEPS)]
                        + worker_runs + ["--pipeline=nested"])
        assert result.returncode == 0, result.stdout[-6000:]
        prefixes["nested%d" % workers] = str(out / ("nested%d" % workers))
    broken = launch(2, [program, str(out / "nosync"), str(STEPS), "loop:adagrad",
                        "--pipeline=dbp", "--skip-sync"])
    assert broken.returncode == 0, broken.stdout[-6000:]
    prefixes["nosync"] = str(out / "nosync")
    return prefixes


def _load(prefix, run):
    return np.load("%s.%s.npz" % (prefix, run.replace(":", ".")))


def _ref(results, run):
    """The single-process reference of a run (the same MODE:OPT, no pipeline)."""
    return _load(results["ref"], ":".join(run.split(":")[:2]))


CASES = [(w, run) for w, runs in sorted(DBP_RUNS.items()) for run in runs]


@pytest.mark.parametrize("workers,run", CASES, ids=["%dw-%s" % c for c in CASES])
def test_dbp_matches_unpipelined_single_process(dbp_results, workers, run):
    ref, got = _load(dbp_results["ref"], run), _load(dbp_results[workers], run)
    params = [n for n in ref.files if not n.startswith("stats/")]
    assert len(params) == 6
    for name in params:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)
    steps = {"one": 1, "epochs": (STEPS // 3) * 3}.get(run.split(":")[0], STEPS)
    assert int(got["stats/steps"]) == steps  # "twice": one pipeline, re-primed by the 2nd fit
    if not run.startswith("one"):
        # Hot keys: batches share keys, so rows prefetched for i+1 were updated at i and re-synced.
        assert int(got["stats/rows_synced"]) > 0
    if run.startswith("loop") or run.startswith("fit") or run.startswith("one"):
        assert int(got["stats/drains"]) == 1  # the last batch was computed without a prefetch


FWP_CASES = [(w, run) for w, runs in sorted(FWP_RUNS.items()) for run in runs]


@pytest.mark.parametrize("workers,run", FWP_CASES, ids=["%dw-%s" % c for c in FWP_CASES])
def test_fwp_matches_unpipelined_single_process(dbp_results, workers, run):
    """3 micro-batches per step in a frozen window, window cache on (clustered: ':cluster')."""
    _assert_params_equal(_ref(dbp_results, run), _load(dbp_results["fwp%d" % workers], run))


NESTED_CASES = [(w, run) for w, runs in sorted(NESTED_RUNS.items()) for run in runs]


def _assert_params_equal(ref, got):
    params = [n for n in ref.files if not n.startswith("stats/")]
    assert len(params) == 6 and all(n in got.files for n in params)
    for name in params:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("workers,run", NESTED_CASES, ids=["%dw-%s" % c for c in NESTED_CASES])
def test_nested_matches_unpipelined_single_process(dbp_results, workers, run):
    """DBP + FWP: 3 micro-batches per step, each with its own prefetch buffer, all re-synced
    (clustered: ':cluster')."""
    got = _load(dbp_results["nested%d" % workers], run)
    _assert_params_equal(_ref(dbp_results, run), got)
    assert int(got["stats/steps"]) == STEPS and int(got["stats/drains"]) == 1
    assert int(got["stats/rows_synced"]) > 0
    # The window cache: later micro-batches fetch only ids the first did not.
    assert 0 < int(got["stats/first_lookup_rows"]) < int(got["stats/rows_requested"])


def test_clustering_puts_fewer_rows_in_the_first_micro_batch(dbp_results):
    plain = _load(dbp_results["nested2"], "loop:adagrad")
    clustered = _load(dbp_results["nested2"], "loop:adagrad:cluster")
    # Same batches, same total of distinct rows per step (the window cache dedups the batch) ...
    assert int(clustered["stats/rows_requested"]) == int(plain["stats/rows_requested"])
    # ... but the first (exposed) micro-batch fetches fewer of them.
    assert int(clustered["stats/first_lookup_rows"]) < int(plain["stats/first_lookup_rows"])


def test_skipping_the_buffer_sync_breaks_exactness(dbp_results):
    ref, broken = _load(dbp_results["ref"], "loop:adagrad"), _load(dbp_results["nosync"], "loop:adagrad")
    assert int(broken["stats/rows_synced"]) == 0
    worst = max(float(np.abs(broken[n] - ref[n]).max()) for n in ("table_a", "table_b"))
    assert worst > 1e-3


def test_sparse_optimizers_sync_only_touched_rows():
    assert updates_only_touched_rows(tf_keras.optimizers.Adagrad(0.1))
    assert updates_only_touched_rows(tf_keras.optimizers.SGD(0.1))
    assert not updates_only_touched_rows(tf_keras.optimizers.SGD(0.1, momentum=0.9))
    assert not updates_only_touched_rows(tf_keras.optimizers.Adam(0.1))
    assert not updates_only_touched_rows(tf_keras.optimizers.Adagrad(0.1, weight_decay=0.01))
    assert not updates_only_touched_rows(None)


def test_unknown_pipelines_are_refused():
    with pytest.raises(ValueError, match="pipeline must be one of"):
        tnp.NestPipeStrategy(pipeline="turbo")
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        tnp.NestPipeStrategy(pipeline="fwp", micro_batches=0)
