"""tf_keras fit/evaluate of a TFRS model on 2 workers, and error paths on a real cluster."""
import os
import sys
import time

import numpy as np
import pytest

from conftest import PROGRAMS, launch, run_command, run_together


@pytest.fixture(scope="session")
def tfrs_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tfrs")
    program = os.path.join(PROGRAMS, "tfrs_fit.py")
    single, cluster = run_together(  # independent: at once
        (run_command, [sys.executable, program, str(out / "single.npz")]),
        (launch, 2, [program, str(out / "two.npz")]))
    assert single.returncode == 0, single.stdout[-4000:]
    assert cluster.returncode == 0, cluster.stdout[-6000:]
    return np.load(out / "single.npz"), np.load(out / "two.npz"), cluster.stdout


def test_tfrs_fit_on_two_workers_equals_one_process(tfrs_results):
    """The tutorial's code (the task's default AUTO loss reduction, an unscaled regularizer):
    weights and history as one process's, the task loss and regularization reduced over the
    global batch as compile reduces them (summed over the workers unscaled, the regularization
    would be twice one process's)."""
    single, two, _ = tfrs_results
    names = [n for n in single.files if n.startswith("field_") or n.startswith("dense/")]
    assert len(names) == 11
    for name in names:
        np.testing.assert_allclose(two[name], single[name], rtol=0, atol=1e-5, err_msg=name)
    for key in ("train_loss", "train_regularization", "eval_loss", "eval_regularization"):
        np.testing.assert_allclose(two[key], single[key], rtol=1e-5, err_msg=key)
    assert float(np.min(single["train_regularization"])) > 1e-4  # it is there to be reduced


def test_tfrs_lookups_of_separate_layers_share_one_exchange(tfrs_results):
    """A TFRS model (tfrs.Model's train_step, no nestpipe_route): its 3 ShardedEmbedding
    layers' lookups travel in one fused exchange per step (pipeline auto, the default)."""
    single, two, _ = tfrs_results
    assert "exchanges" not in single.files  # one process: no exchange at all
    assert int(two["exchanges"]) == 1


def test_fit_and_evaluate_auc_is_global_not_summed(tfrs_results):
    single, two, _ = tfrs_results
    np.testing.assert_allclose(two["train_auc"], single["train_auc"], atol=1e-6)
    np.testing.assert_allclose(two["eval_auc"], single["eval_auc"], atol=1e-6)
    assert 0.0 < float(two["eval_auc"]) < 1.0
    assert single["train_auc"][1] != single["train_auc"][0]  # the model trained


@pytest.mark.cluster
@pytest.mark.parametrize("run", ["loop:sgd", "direct:sgd:tw"])  # tw: table_a table_wise
def test_out_of_range_id_on_one_worker_fails_the_cluster_with_a_clear_error(tmp_path, run):
    start = time.time()
    result = launch(2, [os.path.join(PROGRAMS, "exactness.py"), str(tmp_path / "bad"), "3",
                        run, "--invalid-id"], timeout=120)
    assert result.returncode != 0
    assert "ShardedEmbedding 'table_a': id 66 at position" in result.stdout
    assert "failed" in result.stdout
    assert time.time() - start < 90
