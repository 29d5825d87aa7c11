"""tf_keras ModelCheckpoint / BackupAndRestore and plain tf.train.Checkpoint under NestPipeStrategy.

usage: keras_checkpoint.py OUT_DIR fit | load | killed
  fit  (any number of workers): OUT_DIR/uninterrupted.npz: a 4-epoch fit with ModelCheckpoint
       (weights of every epoch in OUT_DIR/weights); OUT_DIR/resumed.npz: the same fit with
       BackupAndRestore, interrupted after epoch 2 and fitted again by a fresh model (which
       resumes at epoch 3); OUT_DIR/resumed_lazy.npz: the same with a resumed model that fit
       builds (the backup restored before its variables exist); OUT_DIR/tf_checkpoint: tf.train.Checkpoint(model, optimizer) of the
       uninterrupted model, written by the chief (the others write to a scratch directory).
  load (any number of workers): OUT_DIR/loaded_W.npz: the epoch-4 weights read by load_weights,
       and the tf.train.Checkpoint read into a fresh model and optimizer.
  killed (under the launcher's --restarts 1): OUT_DIR/killed_reference.npz, an uninterrupted
       fit of a model fit builds; OUT_DIR/killed_resumed.npz, the same fit with
       BackupAndRestore after worker 1 was SIGKILLed at the end of epoch 2 and the cluster
       restarted (OUT_DIR/killed_reference_step11.npz: the reference one step before its end);
       then (under --restarts 2) OUT_DIR/preempted_resumed.npz: the same fit with tf_keras'
       BackupAndRestore(save_before_preemption=True, save_freq="epoch") after worker 1 got
       SIGTERM mid-epoch (after epoch 2's first batch), every worker backed up the next batch
       and exited, and the cluster restarted.
Every .npz holds the whole tables, dense weights by position and the tables' Adagrad slots.
"""
import os
import shutil
import signal
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import exactness as ex  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.strategy.nestpipe_strategy import row_shard_layout  # noqa: E402
from tf_nestpipe.strategy.row_shard_saving import gather_full_rows  # noqa: E402

EPOCHS, STEPS_PER_EPOCH = 4, 3


class Interrupt(tf_keras.callbacks.Callback):
    """Raises after epoch `epoch` (0-based) on every worker: a run stopped between epochs."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted after epoch %d" % (epoch + 1))


def dataset(strategy):
    """Every epoch: the same STEPS_PER_EPOCH global batches (repeated), each worker its slice."""
    batches = ex.make_batches(STEPS_PER_EPOCH)
    one_pass = ex.per_worker_dataset_fn(batches)

    def dataset_fn(context):
        return one_pass(context).repeat()

    return strategy.distribute_datasets_from_function(dataset_fn), batches


def new_model(strategy, batches):
    """A compiled TinyRanker with Adagrad, built (slots included) inside the scope."""
    with strategy.scope():
        model = ex.TinyRanker()
        model.compile(optimizer=ex.make_optimizer("adagrad"),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
        model(ex.local_slice(batches[0], strategy.worker_index, strategy.num_workers)[0])
        model.optimizer.build(model.trainable_variables)
    return model


def state(strategy, model):
    """Whole tables, dense weights and the tables' optimizer slots (a collective)."""
    out = {"table_a": model.table_a.full_table(), "table_b": model.table_b.full_table()}
    dense = [v for v in model.trainable_variables if "table_" not in v.name]
    out.update({"dense/%d" % i: v.numpy() for i, v in enumerate(dense)})
    slots = [v for v in model.optimizer.variables if row_shard_layout(v) is not None]
    assert len(slots) == 2, [v.name for v in model.optimizer.variables]
    for i, slot in enumerate(slots):
        out["slot/%d" % i] = gather_full_rows(slot, row_shard_layout(slot),
                                              strategy.extended.collectives,
                                              "test/slot%d" % i).numpy()
    return out


def save(strategy, path, values):
    if strategy.worker_index == 0:
        np.savez(path, **values)


class KillWorker1(tf_keras.callbacks.Callback):
    """SIGKILLs worker 1 after epoch `epoch` (0-based), once: `marker` remembers it."""

    def __init__(self, strategy, epoch, marker):
        super().__init__()
        self.strategy, self.epoch, self.marker = strategy, epoch, marker

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch and self.strategy.worker_index == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            print("worker 1 dies after epoch %d" % (epoch + 1), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def lazy_model(strategy):
    """A compiled TinyRanker that fit builds (tables and slots created in the first step)."""
    with strategy.scope():
        model = ex.TinyRanker()
        model.compile(optimizer=ex.make_optimizer("adagrad"),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    assert not model.built
    return model


class SigtermWorker1(tf_keras.callbacks.Callback):
    """Sends SIGTERM to worker 1 itself (a preempted pod) at the end of batch `batch` of epoch
    `epoch` (0-based), once: `marker` remembers it. Records the (epoch, batch) steps run."""

    def __init__(self, strategy, epoch, batch, marker):
        super().__init__()
        self.strategy, self.epoch, self.batch, self.marker = strategy, epoch, batch, marker
        self.current_epoch, self.steps = None, []

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append((self.current_epoch, batch))
        if ((self.current_epoch, batch) == (self.epoch, self.batch)
                and self.strategy.worker_index == 1 and not os.path.exists(self.marker)):
            open(self.marker, "w").close()
            print("worker 1 gets SIGTERM after epoch %d batch %d"
                  % (self.epoch + 1, self.batch + 1), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


class StateAt(tf_keras.callbacks.Callback):
    """Saves `state` at the end of batch `batch` of epoch `epoch` (0-based) to `path`."""

    def __init__(self, strategy, epoch, batch, path):
        super().__init__()
        self.strategy, self.epoch, self.batch, self.path = strategy, epoch, batch, path
        self.current_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.current_epoch, batch) == (self.epoch, self.batch):
            save(self.strategy, self.path, state(self.strategy, self.model))


def preempted(strategy, out, data):
    """tf_keras' own BackupAndRestore with save_before_preemption: worker 1 gets SIGTERM after
    epoch 2's first batch; every worker backs up epoch 2's second batch and exits (42); the
    restarted attempt resumes at its third batch."""
    tf_keras.utils.set_random_seed(5)
    model = lazy_model(strategy)
    steps = SigtermWorker1(strategy, 1, 0, os.path.join(out, "preempted.marker"))
    model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0, callbacks=[
        tf_keras.callbacks.BackupAndRestore(os.path.join(out, "backup_preempted"),
                                            save_before_preemption=True),
        steps])
    print("preempted run trained steps", steps.steps, flush=True)
    save(strategy, os.path.join(out, "preempted_resumed.npz"), state(strategy, model))


def killed(strategy, out, data):
    """Under `--restarts 1`: an uninterrupted fit of a model fit builds (first attempt only),
    then the same fit with BackupAndRestore, worker 1 SIGKILLed after epoch 2; the restarted
    attempt resumes it from the backup."""
    reference = os.path.join(out, "killed_reference.npz")
    if not os.path.exists(os.path.join(out, "killed.marker")):
        tf_keras.utils.set_random_seed(5)
        model = lazy_model(strategy)
        before_last = StateAt(strategy, EPOCHS - 1, STEPS_PER_EPOCH - 2,
                              os.path.join(out, "killed_reference_step11.npz"))
        model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                  callbacks=[before_last])
        save(strategy, reference, state(strategy, model))
    tf_keras.utils.set_random_seed(5)
    model = lazy_model(strategy)
    epochs_run = []
    model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0, callbacks=[
        tnp.BackupAndRestore(os.path.join(out, "backup_killed")),
        KillWorker1(strategy, 1, os.path.join(out, "killed.marker")),
        tf_keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs_run.append(e))])
    print("killed run trained epochs", epochs_run, flush=True)
    save(strategy, os.path.join(out, "killed_resumed.npz"), state(strategy, model))


def main():
    out, phase = sys.argv[1], sys.argv[2]
    # row_wise: the row shards' checkpoints ("auto" would replicate these small tables).
    strategy = tnp.NestPipeStrategy(placement="row_wise")
    chief = strategy.worker_index == 0
    data, batches = dataset(strategy)
    if phase == "killed":
        if not os.path.exists(os.path.join(out, "killed_resumed.npz")):
            killed(strategy, out, data)
        preempted(strategy, out, data)
    elif phase == "fit":
        tf_keras.utils.set_random_seed(1)
        model = new_model(strategy, batches)
        weights = tf_keras.callbacks.ModelCheckpoint(os.path.join(out, "weights", "w-{epoch}"),
                                                     save_weights_only=True)
        model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, callbacks=[weights], verbose=0)
        save(strategy, os.path.join(out, "uninterrupted.npz"), state(strategy, model))
        target = (os.path.join(out, "tf_checkpoint", "ckpt") if chief else
                  os.path.join(out, "scratch-%d" % strategy.worker_index, "ckpt"))
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(target)
        if not chief:
            shutil.rmtree(os.path.dirname(target))

        backup = tnp.BackupAndRestore(os.path.join(out, "backup"))
        tf_keras.utils.set_random_seed(1)
        first = new_model(strategy, batches)
        try:
            first.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, callbacks=[backup, Interrupt(1)], verbose=0)
            raise AssertionError("the run was not interrupted")
        except RuntimeError as error:
            if "interrupted after epoch" not in str(error):
                raise
            print("first run:", error, flush=True)
        tf_keras.utils.set_random_seed(2)  # other initial values: all must come from the backup
        second = new_model(strategy, batches)
        epochs_run = []
        second.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0, callbacks=[
            backup, tf_keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch))])
        print("resumed run trained epochs", epochs_run, flush=True)
        assert epochs_run == [2, 3], epochs_run
        save(strategy, os.path.join(out, "resumed.npz"), state(strategy, second))

        # The usual Keras way: the resumed model is built lazily by fit, so the backup is
        # restored before its tables and slots exist (restored when they are created).
        # tf_keras' own callback, as a script written for one process has it.
        lazy_backup = tf_keras.callbacks.BackupAndRestore(os.path.join(out, "backup_lazy"))
        tf_keras.utils.set_random_seed(1)
        try:
            new_model(strategy, batches).fit(
                data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                callbacks=[lazy_backup, Interrupt(1)])
            raise AssertionError("the run was not interrupted")
        except RuntimeError as error:
            if "interrupted after epoch" not in str(error):
                raise
        tf_keras.utils.set_random_seed(2)
        with strategy.scope():
            lazy = ex.TinyRanker()
            lazy.compile(optimizer=ex.make_optimizer("adagrad"),
                         loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
        assert not lazy.built
        lazy.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                 callbacks=[lazy_backup])
        save(strategy, os.path.join(out, "resumed_lazy.npz"), state(strategy, lazy))
    else:
        tf_keras.utils.set_random_seed(3)
        model = new_model(strategy, batches)
        model.load_weights(os.path.join(out, "weights", "w-%d" % EPOCHS))
        loaded = {"weights/" + k: v for k, v in state(strategy, model).items()
                  if not k.startswith("slot/")}
        tf_keras.utils.set_random_seed(4)
        model = new_model(strategy, batches)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
            os.path.join(out, "tf_checkpoint", "ckpt")).assert_existing_objects_matched()
        loaded.update({"checkpoint/" + k: v for k, v in state(strategy, model).items()})
        save(strategy, os.path.join(out, "loaded_%d.npz" % strategy.num_workers), loaded)
    print("done", phase, flush=True)


if __name__ == "__main__":
    main()
