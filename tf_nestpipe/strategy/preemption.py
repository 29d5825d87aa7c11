"""Checkpoint on preemption, in the spirit of
`tf.distribute.experimental.PreemptionCheckpointHandler`: SIGTERM to any worker makes every
worker save a checkpoint at the same step and exit.

A SIGTERM only sets a flag in the receiving worker. At each `step_end(step)` the workers
all-gather their flags (one tiny collective every `check_every` steps); if any worker was
signalled, all of them write a `ShardedCheckpoint` of that step and exit with
`PREEMPTED_EXIT_CODE`, so that a restart (e.g. `python -m tf_nestpipe.launch --restarts N`)
resumes from it. `SigtermFlag` is that flag and agreement alone: tf_keras' `BackupAndRestore(...,
save_before_preemption=True)` uses it under `fit` (`strategy.keras_preemption`).
"""
import signal
import sys
import threading

import tensorflow as tf

from tf_nestpipe.launch.local_cluster import PREEMPTED_EXIT_CODE


class SigtermFlag:
    """Remembers a SIGTERM to this process (the signal only sets a flag: the training step in
    flight finishes) and tells whether any worker got one, the same answer on every worker.

    Args:
        strategy: The `NestPipeStrategy` whose workers agree.

    Raises:
        RuntimeError: Not on the main thread (Python installs signal handlers there only)."""

    def __init__(self, strategy):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "saving before a preemption needs the SIGTERM handler, which Python installs "
                "from the main thread only: run the training loop (fit) on the main thread")
        self.strategy = strategy
        self.signalled = False
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        del signum, frame
        self.signalled = True  # acted on at the next step boundary, on every worker

    def any_worker_signalled(self):
        """Whether any worker got SIGTERM: one tiny all-gather on more than one worker, so every
        worker must call it at the same step.

        Returns:
            True when at least one worker was signalled (the same on every worker)."""
        if self.strategy.num_workers == 1:
            return bool(self.signalled)
        flag = tf.constant([int(self.signalled)], tf.int32)
        flags = self.strategy.extended.collectives.all_gather(flag, "nestpipe/preemption")
        return bool(tf.reduce_max(flags).numpy())

    def agree(self, seconds_per_step):
        """Whether any worker got SIGTERM, and the slowest worker's `seconds_per_step`: one tiny
        all-gather on more than one worker, so every worker must call it at the same step.

        Args:
            seconds_per_step: This worker's recent seconds per training step.

        Returns:
            `(signalled, slowest_seconds_per_step)`, the same on every worker."""
        mine = tf.constant([[float(self.signalled), float(seconds_per_step)]], tf.float32)
        if self.strategy.num_workers == 1:
            return bool(self.signalled), float(seconds_per_step)
        gathered = self.strategy.extended.collectives.all_gather(mine, "nestpipe/preemption_agree")
        slowest = tf.reduce_max(gathered, axis=0).numpy()
        return bool(slowest[0] > 0), float(slowest[1])

    def close(self):
        """Restores the SIGTERM handler that was there before."""
        signal.signal(signal.SIGTERM, self._previous)


class PreemptionCheckpointHandler:
    """Saves `checkpoint` (a `tnp.ShardedCheckpoint`) to `directory` and exits on every worker
    once any worker got SIGTERM. Call `step_end(step)` after each training step (same steps on
    every worker).

    Args:
        strategy: The `NestPipeStrategy`.
        checkpoint: The `tnp.ShardedCheckpoint` to save.
        directory: Where it is saved.
        check_every: Check the workers' flags every this many steps (one tiny all-gather).
        exit_fn: Called to exit after the save (default: exit with code 42).

    Raises:
        ValueError: `check_every` is below 1.
        RuntimeError: Created outside the main thread."""

    def __init__(self, strategy, checkpoint, directory, check_every=1, exit_fn=None):
        if int(check_every) < 1:
            raise ValueError("check_every must be >= 1, got %r" % (check_every,))
        self.strategy = strategy
        self.checkpoint = checkpoint
        self.directory = directory
        self.check_every = int(check_every)
        self.exit_fn = exit_fn or exit_preempted
        self._flag = SigtermFlag(strategy)

    @property
    def signalled(self):
        """Whether this worker got SIGTERM."""
        return self._flag.signalled

    def any_worker_signalled(self):
        """Whether any worker got SIGTERM (a collective on more than one worker)."""
        return self._flag.any_worker_signalled()

    def step_end(self, step):
        """If a worker was preempted, saves step `step` on every worker and exits.

        Args:
            step: The count of finished training steps (1-based), the same on every worker."""
        if step % self.check_every:
            return
        if self.any_worker_signalled():
            self.checkpoint.save(self.directory, step)
            print("tf_nestpipe: preempted; saved step %d to %s" % (step, self.directory),
                  flush=True)
            self.exit_fn()

    def close(self):
        """Restores the previous SIGTERM handler."""
        self._flag.close()


def exit_preempted():
    """Exits this worker with `PREEMPTED_EXIT_CODE` (after its preemption save).

    Raises:
        SystemExit: Always."""
    sys.exit(PREEMPTED_EXIT_CODE)
