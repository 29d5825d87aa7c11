"""Row shards in ordinary TensorFlow checkpoints (`tf.train.Checkpoint`, `CheckpointManager`,
tf_keras `save_weights`, `ModelCheckpoint`, `BackupAndRestore`).

Under `NestPipeStrategy` a table (or its optimizer slot) is a row shard: worker i holds the rows
of ids i, i+W, i+2W, ... A plain checkpoint of it would hold only the saving worker's rows, and
tf_keras keeps only the chief's file, so every other worker's rows would be lost. Row shards
therefore save the *whole* table: the value written is the all-gather of every worker's rows in
id order (a collective: every worker saves at the same point, as tf_keras and MultiWorkerMirrored
already require). Restoring takes this worker's rows out of the whole table, so a checkpoint
written on W workers (or by one process) restores on any number of workers.

`ShardedCheckpoint` keeps per-worker files instead (no worker ever holds a whole table); it saves
inside `local_shard_serialization()`, where row shards write and read only their own rows.
"""
import contextlib
import threading

import tensorflow as tf
from tensorflow.python.trackable import base as trackable
from tensorflow.python.checkpoint import tensor_callable

from tf_nestpipe.sharding.full_table import gather_full_rows
from tf_nestpipe.sharding.row_shard import mark_row_shard, row_shard_layout

_state = threading.local()
_classes = {}


@contextlib.contextmanager
def local_shard_serialization():
    """Within this context, row shards save and restore only this worker's own rows."""
    previous = getattr(_state, "local", False)
    _state.local = True
    try:
        yield
    finally:
        _state.local = previous


def _saving_local_rows():
    return getattr(_state, "local", False)


class _RowShardSaving:
    """Mixed into a row-shard variable's class: checkpoints hold the whole table (see module)."""

    def _serialize_to_tensors(self):
        layout = row_shard_layout(self)
        if layout.num_shards == 1 or _saving_local_rows():
            return super()._serialize_to_tensors()
        variable, collectives = self, self._nestpipe_collectives  # pylint: disable=no-member
        tag = "nestpipe/checkpoint/" + self._shared_name  # pylint: disable=no-member

        def read_whole_table():
            with tf.device(variable.device):
                return gather_full_rows(variable.read_value_no_copy(), layout, collectives, tag)

        return {trackable.VARIABLE_VALUE_KEY: tensor_callable.Callable(
            read_whole_table, dtype=self.dtype, device=self.device)}

    def _restore_from_tensors(self, restored_tensors):
        layout = row_shard_layout(self)
        value = restored_tensors[trackable.VARIABLE_VALUE_KEY]
        rows = value.shape[0] if value.shape.rank else None
        if not _saving_local_rows() and layout.num_shards > 1 and rows in (layout.vocab_size, None):
            with tf.device(self.device):
                value = tf.gather(value, tf.constant(layout.global_ids()))
        elif rows is not None and rows != layout.local_rows:
            raise ValueError(
                "checkpoint value of %s has %d rows; this worker's shard has %d and the whole "
                "table %d. Was it written for another table size? (ShardedCheckpoint files "
                "restore through ShardedCheckpoint.restore.)"
                % (self.name, rows, layout.local_rows, layout.vocab_size))
        return super()._restore_from_tensors({trackable.VARIABLE_VALUE_KEY: value})


def make_checkpointable(variable, layout, collectives):
    """Marks `variable` as the row shard `layout` of a table and makes TensorFlow checkpoints
    of it hold (and restore from) the whole table."""
    base = type(variable)
    if base not in _classes:
        _classes[base] = type("RowShard" + base.__name__, (_RowShardSaving, base), {})
    variable.__class__ = _classes[base]
    mark_row_shard(variable, layout)
    variable._nestpipe_collectives = collectives  # pylint: disable=protected-access
    return variable
