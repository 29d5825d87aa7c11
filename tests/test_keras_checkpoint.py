"""Ordinary TensorFlow checkpoints under NestPipeStrategy: tf_keras ModelCheckpoint weights and a
tf.train.Checkpoint written on 2 workers hold every table whole (not just the chief's rows) and
restore on 3 workers and on 1 process; tnp.BackupAndRestore resumes an interrupted fit at the
next epoch and ends equal to the uninterrupted fit."""
import os
import sys

import numpy as np
import pytest

from conftest import UNPINNED, PROGRAMS, launch, run_command, run_together

PROGRAM = os.path.join(PROGRAMS, "keras_checkpoint.py")


@pytest.fixture(scope="session")
def keras_checkpoint_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_checkpoint")
    # "killed" (its own files) alongside "fit", then both loads of fit's files at once.
    fit, killed = run_together(
        (launch, 2, [PROGRAM, str(out), "fit"]),
        (run_command, [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", UNPINNED,
                       "--restarts", "1", "--output", "all", "--", sys.executable, PROGRAM,
                       str(out), "killed"], 300))
    assert fit.returncode == 0, fit.stdout[-5000:]
    assert "resumed run trained epochs [2, 3]" in fit.stdout
    assert killed.returncode == 0, killed.stdout[-5000:]
    three, one = run_together((launch, 3, [PROGRAM, str(out), "load"]),
                              (run_command, [sys.executable, PROGRAM, str(out), "load"]))
    assert three.returncode == 0, three.stdout[-5000:]
    assert one.returncode == 0, one.stdout[-5000:]
    (out / "killed.log").write_text(killed.stdout)
    return out


def _assert_equal(expected, actual, prefix=""):
    for name in expected.files:
        if prefix and name.startswith("slot/") and prefix == "weights/":
            continue  # save_weights holds no optimizer state
        np.testing.assert_allclose(actual[prefix + name], expected[name], rtol=0, atol=1e-6,
                                   err_msg=prefix + name)


def test_backup_and_restore_resumes_an_interrupted_fit_exactly(keras_checkpoint_runs):
    uninterrupted = np.load(keras_checkpoint_runs / "uninterrupted.npz")
    assert len(uninterrupted.files) == 8  # 2 tables, 4 dense, 2 table slots
    _assert_equal(uninterrupted, np.load(keras_checkpoint_runs / "resumed.npz"))


def test_a_killed_worker_restarted_resumes_a_lazily_built_fit_exactly(keras_checkpoint_runs):
    """kill -9 of worker 1 after epoch 2 of 4, --restarts 1, tnp.BackupAndRestore, the model
    built by fit: the restarted cluster resumes at epoch 3 and ends equal to the uninterrupted
    fit (it differed by ~0.6 when the backup was restored into the first rows of each table)."""
    log = (keras_checkpoint_runs / "killed.log").read_text()
    assert "worker 1 dies after epoch 2" in log and "[launch] task worker:1 failed (-9)" in log
    assert "restarting the cluster (restart 1 of 1)" in log
    assert "[worker:0] killed run trained epochs [2, 3]" in log, log[-3000:]
    _assert_equal(np.load(keras_checkpoint_runs / "killed_reference.npz"),
                  np.load(keras_checkpoint_runs / "killed_resumed.npz"))


def test_backup_and_restore_into_a_model_fit_builds_resumes_exactly(keras_checkpoint_runs):
    """The backup is restored before fit builds the tables and slots: each worker must get its
    own rows of the whole tables (it got the whole table's first rows: differences of ~0.6)."""
    _assert_equal(np.load(keras_checkpoint_runs / "uninterrupted.npz"),
                  np.load(keras_checkpoint_runs / "resumed_lazy.npz"))


@pytest.mark.parametrize("workers", [3, 1])
def test_model_checkpoint_weights_restore_on_other_worker_counts(keras_checkpoint_runs, workers):
    _assert_equal(np.load(keras_checkpoint_runs / "uninterrupted.npz"),
                  np.load(keras_checkpoint_runs / ("loaded_%d.npz" % workers)), "weights/")


@pytest.mark.parametrize("workers", [3, 1])
def test_tf_train_checkpoint_restores_tables_and_slots_on_other_worker_counts(
        keras_checkpoint_runs, workers):
    _assert_equal(np.load(keras_checkpoint_runs / "uninterrupted.npz"),
                  np.load(keras_checkpoint_runs / ("loaded_%d.npz" % workers)), "checkpoint/")


def test_a_table_checkpoint_of_another_size_is_refused_clearly(tmp_path):
    import tensorflow as tf
    import tf_nestpipe as tnp

    strategy = tnp.NestPipeStrategy()
    with strategy.scope():
        small = tnp.ShardedEmbedding(10, 4, name="resized_table")
        small(tf.constant([[1]], tf.int64))
        large = tnp.ShardedEmbedding(12, 4, name="resized_table")
        large(tf.constant([[1]], tf.int64))
    path = tf.train.Checkpoint(table=small).write(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="holds a table of 10 rows, this model's table has 12 rows"):
        tf.train.Checkpoint(table=large).read(path)
