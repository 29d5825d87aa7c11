"""Ordinary TensorFlow checkpoints under NestPipeStrategy: tf_keras ModelCheckpoint weights and a
tf.train.Checkpoint written on 2 workers hold every table whole (not just the chief's rows) and
restore on 3 workers and on 1 process; tnp.BackupAndRestore resumes an interrupted fit at the
next epoch and ends equal to the uninterrupted fit."""
import os
import shutil
import sys

import numpy as np
import pytest

from conftest import UNPINNED, PROGRAMS, launch, run_command, run_together

PROGRAM = os.path.join(PROGRAMS, "keras_checkpoint.py")


@pytest.fixture(scope="session")
def keras_checkpoint_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_checkpoint")
    # "killed" (its own files; then "preempted" in the same cluster, restarted once more)
    # alongside "fit", then both loads of fit's files at once.
    fit, killed = run_together(
        (launch, 2, [PROGRAM, str(out), "fit"]),
        (run_command, [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", UNPINNED,
                       "--restarts", "2", "--output", "all",
                       # the workers agree on a preemption at every step (default: every ~1 s)
                       "--env", "TF_NESTPIPE_PREEMPTION_CHECK_SECONDS=0", "--", sys.executable, PROGRAM,
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
    assert "restarting the cluster (restart 1 of 2)" in log
    assert "[worker:0] killed run trained epochs [2, 3]" in log, log[-3000:]
    _assert_equal(np.load(keras_checkpoint_runs / "killed_reference.npz"),
                  np.load(keras_checkpoint_runs / "killed_resumed.npz"))


def test_sigterm_mid_epoch_backs_up_the_same_step_everywhere_and_the_restart_resumes_exactly(
        keras_checkpoint_runs):
    """tf_keras' own BackupAndRestore(save_before_preemption=True): worker 1 alone gets SIGTERM
    (a preempted pod) after epoch 2's first batch; both workers back up epoch 2's second batch
    and exit 42, the launcher waits for both, and the restarted cluster trains the 7 remaining
    steps and ends equal to the uninterrupted fit."""
    log = (keras_checkpoint_runs / "killed.log").read_text()
    assert "[worker:1] worker 1 gets SIGTERM after epoch 2 batch 1" in log
    preempted_attempt = log.split("(restart 1 of 2)")[1].split("(restart 2 of 2)")[0]
    for worker in (0, 1):
        assert ("[worker:%d] tf_nestpipe: preempted; every worker backed up epoch 2 batch 2"
                % worker) in log
        assert ("[worker:%d] preempted run trained steps [(1, 2), (2, 0), (2, 1), (2, 2), "
                "(3, 0), (3, 1), (3, 2)]" % worker) in log
        assert "worker:%d: exit 42 after" % worker in preempted_attempt
    assert "worker:1 saved on preemption (exit 42)" in preempted_attempt or (
        "worker:0 saved on preemption (exit 42)" in preempted_attempt)
    assert "killed by the launcher" not in preempted_attempt
    reference = np.load(keras_checkpoint_runs / "killed_reference.npz")
    _assert_equal(reference, np.load(keras_checkpoint_runs / "preempted_resumed.npz"))
    # Control: one step fewer (a step lost to the preemption) is far outside the tolerance.
    before_last = np.load(keras_checkpoint_runs / "killed_reference_step11.npz")
    assert max(np.abs(reference[k] - before_last[k]).max() for k in reference.files) > 1e-4


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


def test_preemption_backup_and_restore_in_one_process(tmp_path, monkeypatch):
    """tf_keras' BackupAndRestore(save_before_preemption=True) in one process: a SIGTERM after
    epoch 2's first batch backs up its second batch and exits (42); a new fit resumes at the
    third batch, on the epoch's third batch of data, and ends equal to the uninterrupted fit.
    Controls: the same resume without the skip of the trained batches differs, and
    save_before_preemption=False leaves SIGTERM alone (no handler: the process would die)."""
    import signal
    import tensorflow as tf
    import tf_keras
    import tf_nestpipe as tnp
    from tf_nestpipe.strategy import keras_preemption
    sys.path.insert(0, PROGRAMS)
    import keras_checkpoint as kc

    monkeypatch.setenv("TF_NESTPIPE_PREEMPTION_CHECK_SECONDS", "0")  # agree at every step
    strategy = tnp.NestPipeStrategy(placement="row_wise")
    data, _ = kc.dataset(strategy)

    def fit(callbacks, model=None):
        if model is None:
            tf_keras.utils.set_random_seed(5)
            model = kc.lazy_model(strategy)
        model.fit(data, epochs=kc.EPOCHS, steps_per_epoch=kc.STEPS_PER_EPOCH, verbose=0,
                  callbacks=callbacks)
        return model

    class Sigterm(tf_keras.callbacks.Callback):
        def __init__(self, at):
            super().__init__()
            self.at, self.epoch, self.handlers, self.steps = at, None, set(), []

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            self.steps.append((self.epoch, batch))
            self.handlers.add(signal.getsignal(signal.SIGTERM))
            if (self.epoch, batch) == self.at:
                assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
                signal.raise_signal(signal.SIGTERM)

    # The reference, under a BackupAndRestore without save_before_preemption: SIGTERM keeps
    # the handler it had (the default would end the process; nothing would be backed up).
    unhandled = Sigterm(at=None)
    reference = kc.state(strategy, fit(
        [tf_keras.callbacks.BackupAndRestore(str(tmp_path / "plain")), unhandled]))
    assert unhandled.handlers == {signal.getsignal(signal.SIGTERM)}

    backup_dir = str(tmp_path / "preempted")
    before = signal.getsignal(signal.SIGTERM)
    first = Sigterm(at=(1, 0))
    preempted = kc.lazy_model(strategy)
    with pytest.raises(SystemExit) as exit_info:
        fit([tf_keras.callbacks.BackupAndRestore(backup_dir, save_before_preemption=True), first],
            preempted)
    assert exit_info.value.code == 42
    # (1, 1) ran too: the backup callback, listed first, exited at its end.
    assert first.steps == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert signal.getsignal(signal.SIGTERM) is before
    shutil.copytree(backup_dir, backup_dir + "-copy")

    def resumed_from(directory):
        # The preempted model again (its train function traced once), every variable and slot
        # overwritten with other values: all must come from the backup.
        for variable in preempted.variables + preempted.optimizer.variables:
            variable.assign(tf.random.uniform(variable.shape, seed=6, dtype=variable.dtype)
                            if variable.dtype.is_floating else tf.zeros_like(variable))
        resumed = Sigterm(at=None)
        model = fit([tf_keras.callbacks.BackupAndRestore(directory, save_before_preemption=True),
                     resumed], preempted)
        assert resumed.steps == [(1, 2)] + [(e, b) for e in (2, 3) for b in range(3)]
        return kc.state(strategy, model)

    resumed = resumed_from(backup_dir)
    for name in reference:
        np.testing.assert_allclose(resumed[name], reference[name], rtol=0, atol=1e-6, err_msg=name)
    monkeypatch.setattr(keras_preemption, "skip_trained_batches", lambda model, iterator: None)
    unskipped = resumed_from(backup_dir + "-copy")
    assert max(np.abs(reference[k] - unskipped[k]).max() for k in reference) > 1e-4


def test_preemption_agreements_come_about_every_interval_and_at_the_same_steps_everywhere():
    """The workers agree on a preemption at the first batch, then after as many steps as the
    interval takes at the slowest worker's pace (from gathered values, so every worker counts
    the same); 0 agrees at every step."""
    from tf_nestpipe.strategy.keras_preemption import (AgreementSchedule,
                                                       MAX_STEPS_BETWEEN_CHECKS)

    class Flag:
        def __init__(self):
            self.calls, self.pace = [], 0.02

        def agree(self, seconds_per_step):
            self.calls.append(seconds_per_step)
            return len(self.calls) == 3, self.pace  # the slowest worker's pace, not this one's

    flag = Flag()
    schedule = AgreementSchedule(flag, interval_seconds=1.0)
    assert schedule.steps_between(0.02) == 50 and schedule.steps_between(5.0) == 1
    assert schedule.steps_between(1e-6) == MAX_STEPS_BETWEEN_CHECKS
    answers = [schedule.preempted() for _ in range(101)]
    assert [i for i, a in enumerate(answers) if a] == [100]  # agreements at batches 0, 50, 100
    assert len(flag.calls) == 3
    every = AgreementSchedule(Flag(), interval_seconds=0)
    assert [every.preempted() for _ in range(3)] == [False, False, True]
