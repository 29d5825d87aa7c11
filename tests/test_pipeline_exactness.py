"""The Dual-Buffer, Frozen-Window and nested pipelines on 2 and 3 workers, with and without
key-centric clustering, equal non-pipelined single-process training after 20 steps (hot Zipf
keys: consecutive batches share keys, so the buffer sync must run), and skipping the sync on
purpose makes the parameters differ."""
import numpy as np
import pytest

import tf_keras
import tf_nestpipe as tnp
from conftest import EXACTNESS_STEPS as STEPS
from conftest import PIPELINE_RUNS, load_run, reference_of
from tf_nestpipe.pipeline import updates_only_touched_rows


def _pipeline_of(run):
    return next(o for o in run.split(":")[2:] if o in ("dbp", "fwp", "nested", "auto"))


def _cases(pipeline):
    return [(w, run) for w, runs in sorted(PIPELINE_RUNS.items()) for run in runs
            if _pipeline_of(run) == pipeline and not run.endswith(":nosync")]


def _ref(results, run):
    """The single-process reference of a run (the same MODE:OPT and model, no pipeline)."""
    return load_run(results[1], reference_of(run))


def _groups(run):
    return 2 if ":mixed" in run else 1


def _rounds(run):
    """Lookups of one table per step outside a frozen window (":split": table_a twice)."""
    return 2 if ":split" in run else 1


def _assert_params_equal(ref, got):
    params = [n for n in ref.files if not n.startswith("stats/")]
    assert len(params) == (7 if "table_fields" in ref.files else 6)
    assert all(n in got.files for n in params)
    for name in params:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("workers,run", _cases("dbp"), ids=["%dw-%s" % c for c in _cases("dbp")])
def test_dbp_matches_unpipelined_single_process(exactness_results, workers, run):
    got = load_run(exactness_results[workers], run)
    _assert_params_equal(_ref(exactness_results, run), got)
    # "resize": STEPS // 2 batches, then STEPS // 2 more cut in halves.
    steps = {"one": 1, "epochs": (STEPS // 3) * 3, "resize": (STEPS // 2) * 3}.get(
        run.split(":")[0], STEPS)
    assert int(got["stats/steps"]) == steps  # "twice": one pipeline, re-primed by the 2nd fit
    # One fused prefetch per table group and round (a round per lookup of one table).
    assert int(got["stats/exchanges"]) == _groups(run) * _rounds(run)
    if not run.startswith("one"):
        # Hot keys: batches share keys, so rows prefetched for i+1 were updated at i and re-synced.
        assert int(got["stats/rows_synced"]) > 0
    if run.startswith("loop") or run.startswith("fit") or run.startswith("one"):
        assert int(got["stats/drains"]) == 1  # the last batch was computed by the drain


@pytest.mark.parametrize("workers,run", _cases("fwp"), ids=["%dw-%s" % c for c in _cases("fwp")])
def test_fwp_matches_unpipelined_single_process(exactness_results, workers, run):
    """3 micro-batches per step in a frozen window, window cache on (clustered: ':cluster')."""
    got = load_run(exactness_results[workers], run)
    _assert_params_equal(_ref(exactness_results, run), got)
    if run.startswith("direct"):
        return  # strategy.run with a frozen window: no pipeline statistics
    # Only micro-batching makes these: an exchange per micro-batch and group, and the window
    # cache leaving the later micro-batches only the ids the first did not fetch.
    assert int(got["stats/exchanges"]) == 3 * _groups(run)
    assert 0 < int(got["stats/first_lookup_rows"]) < int(got["stats/rows_requested"])


def test_fwp_adds_only_the_micro_batches_row_exchanges_to_a_step(exactness_results):
    """fit under fwp (3 micro-batches) issues the collectives of fit without a pipeline plus
    one rows all-to-all per further micro-batch: the window's keys exchange and its gradient
    exchange are one each (a gradient exchange per micro-batch would add 2 more)."""
    plain = load_run(exactness_results[2], "fit:adam")
    fwp = load_run(exactness_results[2], "fit:adam:fwp")
    assert int(plain["stats/collectives"]) >= 4  # keys, rows, gradients, dense all-reduce
    assert int(fwp["stats/collectives"]) - int(plain["stats/collectives"]) == 3 - 1


@pytest.mark.parametrize("workers,run", _cases("nested"),
                         ids=["%dw-%s" % c for c in _cases("nested")])
def test_nested_matches_unpipelined_single_process(exactness_results, workers, run):
    """DBP + FWP: 3 micro-batches per step in a frozen window whose rows are prefetched a step
    ahead in one exchange per group (one buffer of the window's distinct ids), re-synced
    (clustered: ':cluster')."""
    got = load_run(exactness_results[workers], run)
    _assert_params_equal(_ref(exactness_results, run), got)
    assert int(got["stats/exchanges"]) == _groups(run)  # one prefetch per window and group
    assert int(got["stats/steps"]) == STEPS and int(got["stats/drains"]) == 1
    assert int(got["stats/rows_synced"]) > 0
    assert int(got["stats/first_lookup_rows"]) == int(got["stats/rows_requested"]) > 0


def test_nested_fetches_each_distinct_row_of_a_window_once(exactness_results):
    """nested's one window exchange requests what dbp's one exchange of the whole batch does
    (each distinct id once per batch), on the same batches."""
    dbp = load_run(exactness_results[2], "loop:adagrad:dbp")
    nested = load_run(exactness_results[2], "loop:adagrad:nested")
    assert int(nested["stats/rows_requested"]) == int(dbp["stats/rows_requested"]) > 0


def test_dbp_issues_the_collectives_of_a_step_without_a_pipeline(exactness_results):
    """dbp's sync (the fresh rows of the buffers it computes from) rides on the next batch's
    keys all-to-all: a dbp step issues exactly the collectives of fit without a pipeline (a
    sync all-to-all of its own would add one), and so does nested (its window's rows in one
    exchange a step ahead). Positive control: fwp adds its further micro-batches' rows
    exchanges, so the count does see the exchanges of a step."""
    plain = load_run(exactness_results[2], "fit:adam")
    dbp = load_run(exactness_results[2], "fit:adam:dbp")
    nested = load_run(exactness_results[2], "fit:adam:nested")
    fwp = load_run(exactness_results[2], "fit:adam:fwp")
    assert int(plain["stats/collectives"]) >= 4  # keys, rows, gradients, dense all-reduce
    assert int(dbp["stats/collectives"]) == int(plain["stats/collectives"])
    assert int(dbp["stats/rows_synced"]) > 0  # and the sync did carry rows
    assert int(nested["stats/collectives"]) == int(plain["stats/collectives"])
    assert int(nested["stats/rows_synced"]) > 0
    assert int(fwp["stats/collectives"]) - int(plain["stats/collectives"]) == 3 - 1


@pytest.mark.parametrize("workers,run", _cases("auto"), ids=["%dw-%s" % c for c in _cases("auto")])
def test_auto_matches_unpipelined_single_process_and_chooses(exactness_results, workers, run):
    """fit's default: two interleaved probe rounds (each candidate 1 timed step, after a
    settling one in the second; dbp's and nested's held batches are trained before the next,
    and they prime again in round two), then the agreed fastest: 20 exact steps."""
    got = load_run(exactness_results[workers], run)
    _assert_params_equal(_ref(exactness_results, run), got)
    assert "stats/auto_choice" in got.files  # every candidate was timed and one was chosen
    assert 0 <= int(got["stats/auto_choice"]) < len(tnp.pipeline.AUTO_CANDIDATES)


def test_clustering_puts_fewer_rows_in_the_first_micro_batch(exactness_results):
    plain = load_run(exactness_results[2], "loop:adagrad:fwp")
    clustered = load_run(exactness_results[2], "loop:adagrad:cluster:fwp")
    # Same batches, same total of distinct rows per step (the window cache dedups the batch) ...
    assert int(clustered["stats/rows_requested"]) == int(plain["stats/rows_requested"])
    # ... but the first (exposed) micro-batch fetches fewer of them.
    assert int(clustered["stats/first_lookup_rows"]) < int(plain["stats/first_lookup_rows"])


def test_skipping_the_buffer_sync_breaks_exactness(exactness_results):
    ref = _ref(exactness_results, "loop:adagrad")
    broken = load_run(exactness_results[2], "loop:adagrad:dbp:nosync")
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
    with pytest.raises(ValueError, match="auto_probe_rounds >= 1"):
        tnp.NestPipeStrategy(auto_probe_rounds=0)
    with pytest.raises(ValueError, match="auto_micro_batches must be"):
        tnp.NestPipeStrategy(auto_micro_batches=(0, 2))
    with pytest.raises(ValueError, match="auto_micro_batches must be"):
        tnp.NestPipeStrategy(auto_micro_batches=())
    assert tnp.NestPipeStrategy(micro_batches=8).auto_micro_batches == (2, 8)
