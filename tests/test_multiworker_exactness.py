"""Multi-worker training through the launcher equals single-process training (DESIGN.md §2)."""
import os

import numpy as np
import pytest

from conftest import EXACTNESS_RUNS, EXACTNESS_STEPS, PIPELINE_RUNS, PROGRAMS, launch, load_run

CASES = [(w, run) for w, runs in sorted(EXACTNESS_RUNS.items()) for run in runs]


@pytest.mark.parametrize("workers,run", CASES, ids=["%dw-%s" % c for c in CASES])
def test_cluster_matches_single_process(exactness_results, workers, run):
    ref = load_run(exactness_results[1], run)
    got = load_run(exactness_results[workers], run)
    params = [n for n in ref.files if not n.startswith("stats/")]
    assert sorted(params) == sorted(n for n in got.files if not n.startswith("stats/"))
    assert {"table_a", "table_b"} <= set(params)
    assert len(params) == (7 if run.endswith(":mixed") else 6)
    for name in params:
        assert ref[name].shape == got[name].shape, name
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)
    mode = run.split(":")[0]
    if mode in ("loop", "fit"):
        # The fused exchange: both tables of dim 4 (two layers) travel in one exchange per
        # step; the mixed model's dim-3 collection in a second.
        assert int(got["stats/exchanges"]) == (2 if run.endswith(":mixed") else 1)
    else:
        assert "stats/exchanges" not in got.files  # "direct": each table's own exchange


@pytest.mark.parametrize("workers", [2, 3])
def test_overflowing_key_exchanges_were_exercised(exactness_results, workers):
    """The keys all-to-all is padded to the last step's largest count (one bucket up); the
    Zipf batches' counts jump past it now and then, and those steps' second all-to-all carried
    the rest: the runs above are exact with it (this guards against it never running)."""
    counts = [int(load_run(exactness_results[workers], run)["stats/overflow_rounds"])
              for run in EXACTNESS_RUNS[workers] + PIPELINE_RUNS[workers]]
    assert max(counts) > 0


def test_training_moved_every_parameter(exactness_results):
    """Guards the exactness test against comparing two untrained models."""
    import tf_keras

    ref = np.load("%s.loop.adam.npz" % exactness_results[1])
    init_a = tf_keras.initializers.RandomUniform(-0.3, 0.3, seed=7)((61, 4)).numpy()
    init_b = tf_keras.initializers.TruncatedNormal(stddev=0.2, seed=8)((47, 4)).numpy()
    assert np.abs(ref["table_a"] - init_a).max() > 1e-2
    assert np.abs(ref["table_b"] - init_b).max() > 1e-2


@pytest.mark.cluster
def test_chief_plus_worker_cluster_matches_single_process(exactness_results, tmp_path):
    """A chief counts as a synchronous worker (the first), as in MultiWorkerMirroredStrategy."""
    result = launch(1, [os.path.join(PROGRAMS, "exactness.py"), str(tmp_path / "chief"),
                        str(EXACTNESS_STEPS), "loop:sgd"], chief=True)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "[chief:0] saved loop sgd" in result.stdout and "[worker:0] saved loop sgd" in result.stdout
    ref = np.load("%s.loop.sgd.npz" % exactness_results[1])
    got = np.load("%s.loop.sgd.npz" % (tmp_path / "chief"))
    for name in [n for n in ref.files if not n.startswith("stats/")]:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)
