"""tf_keras callbacks that need to know about `NestPipeStrategy`."""
import functools

import tf_keras

from tf_nestpipe.sharding.dynamic_embedding import DynamicEmbedding
from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy
from tf_nestpipe import tf_private


class BackupAndRestore(tf_keras.callbacks.BackupAndRestore):
    """tf_keras `BackupAndRestore` (same arguments), accepting `NestPipeStrategy`, whose table
    shards it backs up whole (see `row_shard_saving`): an interrupted `fit` resumes at the last
    backed-up epoch (or step, with an integer `save_freq`) on any number of workers. tf_keras'
    own `BackupAndRestore` accepts NestPipeStrategy too (`accept_nestpipe_strategy`, installed
    at import): this class is the same callback under tf_nestpipe's name.

    Args:
        *args: tf_keras `BackupAndRestore`'s arguments (`backup_dir`, ...).
        **kwargs: tf_keras `BackupAndRestore`'s keyword arguments (`save_freq`,
            `delete_checkpoint`, ...)."""


def accept_nestpipe_strategy(init):
    """Wraps tf_keras `BackupAndRestore.__init__`: the callback accepts `NestPipeStrategy` (it
    refuses strategies it does not know with a `NotImplementedError`)."""
    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        tf_private.accept_strategy_in_backup(self, NestPipeStrategy)

    return wrapped


class DynamicTableStats(tf_keras.callbacks.Callback):
    """Reports the counters of every `DynamicEmbedding` of the model at the end of each epoch
    (every `every_n_steps` train batches too, if given): summed over the workers (a collective:
    fit runs callbacks on every worker), logged as one line per table and added to the epoch's
    `logs` as `<table>/<counter>` (so a `TensorBoard` callback placed after this one records
    them). Counters: size, admitted, evicted, expired, refused, pending, pending_dropped.

    Args:
        every_n_steps: Also report every this many train batches (None: at epoch ends only).
        log: Where the lines go (default `print`; worker 0 only)."""

    def __init__(self, every_n_steps=None, log=print):
        super().__init__()
        self.every_n_steps = every_n_steps
        self.log = log
        self.history = []

    def _tables(self):
        return [layer for layer in tf_private.flatten_layers(self.model)
                if isinstance(layer, DynamicEmbedding)]

    def _report(self, when, logs):
        for layer in self._tables():
            stats = layer.global_table_stats()
            self.history.append((when, layer.name, stats))
            self.log("DynamicEmbedding '%s' %s: %s" % (layer.name, when, ", ".join(
                "%s=%d" % kv for kv in stats.items())))
            if logs is not None:
                logs.update({"%s/%s" % (layer.name, k): float(v) for k, v in stats.items()})

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps and (batch + 1) % self.every_n_steps == 0:
            self._report("step %d" % (batch + 1), None)

    def on_epoch_end(self, epoch, logs=None):
        self._report("epoch %d" % (epoch + 1), logs)
