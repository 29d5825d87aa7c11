"""Multi-worker training through the launcher equals single-process training (DESIGN.md §2)."""
import os

import numpy as np
import pytest

from conftest import EXACTNESS_RUNS, EXACTNESS_STEPS, PROGRAMS, launch

CASES = [(w, run) for w, runs in sorted(EXACTNESS_RUNS.items()) for run in runs]


@pytest.mark.parametrize("workers,run", CASES, ids=["%dw-%s" % c for c in CASES])
def test_cluster_matches_single_process(exactness_results, workers, run):
    mode, optimizer = run.split(":")
    ref = np.load("%s.%s.%s.npz" % (exactness_results[1], mode, optimizer))
    got = np.load("%s.%s.%s.npz" % (exactness_results[workers], mode, optimizer))
    assert sorted(ref.files) == sorted(got.files)
    assert {"table_a", "table_b"} <= set(ref.files) and len(ref.files) == 6
    for name in ref.files:
        assert ref[name].shape == got[name].shape, name
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)


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
    for name in ref.files:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)
