"""tf_keras `BackupAndRestore(save_before_preemption=True)` under `NestPipeStrategy`: a SIGTERM
to any worker during `fit` makes every worker back up the same step and exit, and the relaunched
`fit` resumes at the next step, on the data the interrupted epoch had not trained on yet.

tf_keras enables `save_before_preemption` only for `MultiWorkerMirroredStrategy` on Google
Cloud (its preemption notices come from the platform); elsewhere it accepts the argument and
does nothing. Here the notice is the SIGTERM Kubernetes (and `tf_nestpipe.launch`) sends before
killing a task:
- the signal only sets a flag (`preemption.SigtermFlag`): the step in flight finishes;
- at scheduled train batch ends the workers agree whether any of them was signalled (one tiny
  all-gather), so all of them back up the same step: the callback's usual backup (whole tables,
  optimizer slots, epoch, batch) with the batch that ended, then exit with
  `preemption.PREEMPTED_EXIT_CODE`. The agreement costs a collective and a wait for the step
  to finish, so it runs about every `TF_NESTPIPE_PREEMPTION_CHECK_SECONDS` (default 1) of
  training, not every step (0: every step): each
  agreement also gathers the slowest worker's seconds per step, from which every worker
  computes the same number of steps to the next one (a save comes that much later, well within
  a grace period of tens of seconds);
- an epoch-end backup records its epoch as complete, so a relaunch never repeats its last batch;
- the relaunched `fit` resumes at (epoch, batch + 1) and first skips the batches the interrupted
  epoch already trained on (Keras restarts each epoch's data from its beginning; without the
  skip those steps would train on the epoch's first batches again). The same resume point and
  skip apply to a backup of an integer `save_freq`.

The skip assumes each epoch's data starts where the interrupted attempt's epoch started (a
finite dataset iterated once per epoch, or a repeated one whose period divides the steps per
epoch); an endless stream with `steps_per_epoch` restarts from its beginning, as it does after
tf_keras' epoch-level restore.
"""
import functools
import math
import time

from tf_nestpipe import settings
from tf_nestpipe.strategy import preemption
from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy

# Model attribute: batches the next train function call skips before its first step.
_RESUME_SKIP = "_nestpipe_resume_skip"
_TRAIN_MODE = "train"  # tf_keras' ModeKeys.TRAIN
# The most steps between two agreements (however fast the steps).
MAX_STEPS_BETWEEN_CHECKS = 1000


class AgreementSchedule:
    """When the workers next agree on a preemption: the first train batch, then every
    `steps_between(slowest seconds per step)` batches, from values every worker shares, so all
    of them agree at the same batches.

    Args:
        flag: The `preemption.SigtermFlag` to agree on.
        interval_seconds: About how often to agree (default: `TF_NESTPIPE_PREEMPTION_CHECK_SECONDS`;
            0: every step).
    """

    def __init__(self, flag, interval_seconds=None):
        self.flag = flag
        self.interval_seconds = (settings.PREEMPTION_CHECK_SECONDS.value()
                                 if interval_seconds is None else float(interval_seconds))
        self._countdown = 1
        self._since = time.perf_counter()
        self._steps = 0

    def steps_between(self, seconds_per_step):
        """Steps to the next agreement after steps of `seconds_per_step` (at least 1)."""
        if seconds_per_step <= 0 or self.interval_seconds <= 0:
            return 1
        return max(1, min(MAX_STEPS_BETWEEN_CHECKS,
                          int(math.ceil(self.interval_seconds / seconds_per_step))))

    def preempted(self):
        """Call at every train batch end (every worker): whether any worker was signalled,
        agreed on at the scheduled batches (False at the others)."""
        self._steps += 1
        self._countdown -= 1
        if self._countdown > 0:
            return False
        now = time.perf_counter()
        signalled, slowest = self.flag.agree((now - self._since) / self._steps)
        self._since, self._steps = now, 0
        self._countdown = self.steps_between(slowest)
        return signalled


def _on_nestpipe(callback):
    model = getattr(callback, "model", None)
    return model is not None and isinstance(model.distribute_strategy, NestPipeStrategy)


def _resumes_mid_epoch(callback):
    """Whether the callback's backups may stop inside an epoch (preemption or batch backups)."""
    return bool(callback.save_before_preemption) or (
        callback.save_freq != "epoch" and isinstance(callback.save_freq, int)
        and not isinstance(callback.save_freq, bool))


def resume_point(state, model, steps_per_epoch, initial_epoch, mode):
    """Where a fit restored from `state`'s backup resumes (replaces tf_keras'
    `WorkerTrainingState.maybe_load_initial_counters_from_ckpt`): after the backed-up batch,
    or at the next epoch when the backup was the end of an epoch; records the batches the
    resumed epoch skips (`skip_trained_batches`).

    Args:
        state: tf_keras' `WorkerTrainingState` (its saved epoch and batch variables).
        model: The model being fitted.
        steps_per_epoch: Steps per epoch (None while unknown).
        initial_epoch: `fit`'s `initial_epoch`.
        mode: tf_keras' mode key.

    Returns:
        `(initial_epoch, initial_step)`.
    """
    setattr(model, _RESUME_SKIP, 0)
    if mode != _TRAIN_MODE:
        return initial_epoch, 0
    epoch = int(state._ckpt_saved_epoch.numpy())  # pylint: disable=protected-access
    batch = int(state._ckpt_saved_batch.numpy())  # pylint: disable=protected-access
    if epoch < 0:  # nothing backed up
        return initial_epoch, 0
    if batch < 0 or (steps_per_epoch is not None and batch >= steps_per_epoch - 1):
        return epoch + 1, 0
    setattr(model, _RESUME_SKIP, batch + 1)
    return epoch, batch + 1


def skip_trained_batches(model, iterator):
    """Before the first step of a resumed fit: takes the batches the interrupted epoch already
    trained on from `iterator` (every worker the same count, so their data stays aligned).

    Args:
        model: The model being fitted.
        iterator: The iterator its train function is about to read.
    """
    count = getattr(model, _RESUME_SKIP, 0)
    if not count:
        return
    setattr(model, _RESUME_SKIP, 0)
    for _ in range(count):
        next(iterator)


def on_train_begin(original):
    """Wraps `BackupAndRestore.on_train_begin`: under NestPipeStrategy with
    `save_before_preemption`, SIGTERM is caught from here to the end of fit; the resume point is
    `resume_point` when backups may stop inside an epoch."""
    @functools.wraps(original)
    def wrapped(self, logs=None):
        flag = None
        if _on_nestpipe(self) and self.save_before_preemption:
            flag = preemption.SigtermFlag(self.model.distribute_strategy)
        self._nestpipe_sigterm = flag  # pylint: disable=protected-access
        try:
            original(self, logs)
        except BaseException:
            if flag is not None:
                flag.close()
            raise
        # The schedule starts after the restore, at this fit's first batch on every worker.
        self._nestpipe_agreement = (  # pylint: disable=protected-access
            AgreementSchedule(flag) if flag is not None else None)
        if _on_nestpipe(self) and _resumes_mid_epoch(self):
            state = self._training_state  # pylint: disable=protected-access
            state.maybe_load_initial_counters_from_ckpt = functools.partial(
                resume_point, state, self.model)

    return wrapped


def on_train_batch_end(original):
    """Wraps `BackupAndRestore.on_train_batch_end`: records the batch that ended (with
    `steps_per_execution` > 1 it is not the one that began); under `save_before_preemption`,
    backs up on every worker and exits once any worker got SIGTERM."""
    @functools.wraps(original)
    def wrapped(self, batch, logs=None):
        if not (_on_nestpipe(self) and _resumes_mid_epoch(self)):
            return original(self, batch, logs)
        self._training_state._ckpt_saved_batch.assign(batch)  # pylint: disable=protected-access
        original(self, batch, logs)
        agreement = getattr(self, "_nestpipe_agreement", None)
        if agreement is not None and agreement.preempted():
            self._backup(epoch=self._current_epoch, batch=batch)  # pylint: disable=protected-access
            agreement.flag.close()
            print("tf_nestpipe: preempted; every worker backed up epoch %d batch %d to %s"
                  % (self._current_epoch + 1, batch + 1, self.backup_dir), flush=True)
            preemption.exit_preempted()
        return None

    return wrapped


def on_epoch_end(original):
    """Wraps `BackupAndRestore.on_epoch_end`: an epoch-end backup records its epoch as complete
    (batch -1), so `resume_point` starts the next epoch."""
    @functools.wraps(original)
    def wrapped(self, epoch, logs=None):
        if _on_nestpipe(self) and _resumes_mid_epoch(self):
            self._training_state._ckpt_saved_batch.assign(-1)  # pylint: disable=protected-access
        return original(self, epoch, logs)

    return wrapped


def on_train_end(original):
    """Wraps `BackupAndRestore.on_train_end`: gives SIGTERM back to its previous handler."""
    @functools.wraps(original)
    def wrapped(self, logs=None):
        flag = getattr(self, "_nestpipe_sigterm", None)
        if flag is not None:
            flag.close()
            self._nestpipe_sigterm = self._nestpipe_agreement = None  # pylint: disable=protected-access
        return original(self, logs)

    return wrapped


def implements_train_batch_hooks(original):
    """Wraps `BackupAndRestore._implements_train_batch_hooks`: fit calls the batch hooks when
    the callback checks for a preemption there (tf_keras calls them only for `save_freq`
    backups)."""
    @functools.wraps(original)
    def wrapped(self):
        return original(self) or bool(_on_nestpipe(self) and self.save_before_preemption)

    return wrapped


# BackupAndRestore method name -> wrapper.
WRAPPERS = {
    "on_train_begin": on_train_begin,
    "on_train_batch_end": on_train_batch_end,
    "on_epoch_end": on_epoch_end,
    "on_train_end": on_train_end,
    "_implements_train_batch_hooks": implements_train_batch_hooks,
}
