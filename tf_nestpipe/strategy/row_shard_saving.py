"""Row shards in ordinary TensorFlow checkpoints (`tf.train.Checkpoint`, `CheckpointManager`,
tf_keras `save_weights`, `ModelCheckpoint`, `BackupAndRestore`).

Under `NestPipeStrategy` a table (or its optimizer slot) is a row shard: worker i holds the rows
of ids i, i+W, i+2W, ... A plain checkpoint of it would hold only the saving worker's rows, and
tf_keras keeps only the chief's file, so every other worker's rows would be lost. Row shards
therefore save the *whole* table: the value written is the all-gather of every worker's rows in
id order (a collective: every worker saves at the same point, as tf_keras and MultiWorkerMirrored
already require). Restoring takes this worker's rows out of the whole table, so a checkpoint
written on W workers (or by one process) restores on any number of workers.

tf_keras' own file formats (`.h5`, `.weights.h5`, `.keras`) read a variable with `numpy()` and
write it with `assign()`; inside `whole_table_values()` a row shard's `numpy()` is the whole table
(a collective) and `assign()` of a whole table keeps this worker's rows, so those files hold whole
tables too and load on any number of workers. A SavedModel records each row shard with the whole
table's shape, matching the whole value its checkpoint holds.

`ShardedCheckpoint` keeps per-worker files instead (no worker ever holds a whole table); it saves
inside `local_shard_serialization()`, where row shards write and read only their own rows.
"""
import contextlib
import threading

import tensorflow as tf
from tensorflow.python.trackable import base as trackable
from tensorflow.python.checkpoint import tensor_callable

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


@contextlib.contextmanager
def whole_table_values():
    """Within this context (eager), a row shard's `numpy()` returns the whole table (every
    worker must read it at the same point) and `assign()` of a whole table takes this worker's
    rows: what tf_keras' `.h5` / `.keras` saving and loading use (see module)."""
    previous = getattr(_state, "whole", False)
    _state.whole = True
    try:
        yield
    finally:
        _state.whole = previous


def _whole_values(variable):
    return (getattr(_state, "whole", False) and not _saving_local_rows()
            and variable._nestpipe_row_shard.num_shards > 1 and tf.executing_eagerly())


def gather_full_rows(local, layout, collectives, tag):
    """The whole `[vocab_size, ...]` value from every worker's row shard `local` (a collective)."""
    if layout.num_shards == 1:
        return tf.convert_to_tensor(local)
    local = tf.convert_to_tensor(local)
    pad = layout.max_local_rows - layout.local_rows
    padded = tf.pad(local, [[0, pad]] + [[0, 0]] * (local.shape.rank - 1))
    gathered = collectives.all_gather(padded, tag)  # [num_shards * max_local_rows, ...]
    ids = tf.range(layout.vocab_size, dtype=tf.int64)
    index = (ids % layout.num_shards) * layout.max_local_rows + ids // layout.num_shards
    return tf.gather(gathered, index)


class _RowShardSaving:
    """Mixed into a row-shard variable's class: checkpoints hold the whole table (see module)."""

    def _serialize_to_tensors(self):
        layout = self._nestpipe_row_shard  # pylint: disable=no-member
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
        layout = self._nestpipe_row_shard  # pylint: disable=no-member
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

    def numpy(self):
        if not _whole_values(self):
            return super().numpy()
        return gather_full_rows(self.read_value(), self._nestpipe_row_shard,  # pylint: disable=no-member
                                self._nestpipe_collectives,  # pylint: disable=no-member
                                "nestpipe/keras_file/" + self._shared_name).numpy()  # pylint: disable=no-member

    def assign(self, value, use_locking=None, name=None, read_value=True):
        if _whole_values(self):
            value = self._own_rows(value)
        return super().assign(value, use_locking=use_locking, name=name, read_value=read_value)

    def _own_rows(self, value):
        """This worker's rows of `value`, a whole table (other row counts are refused)."""
        layout = self._nestpipe_row_shard  # pylint: disable=no-member
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        rows = value.shape[0] if value.shape.rank else None
        if rows != layout.vocab_size:
            raise ValueError(
                "the saved value of %s has %s rows, but the whole table has %d (this worker's "
                "shard %d): a file written by tf_keras under NestPipeStrategy holds whole "
                "tables; was it written for another table size, or by a tf_nestpipe older than "
                "whole-table Keras files (which kept worker 0's rows only)?"
                % (self.name, rows, layout.vocab_size, layout.local_rows))
        with tf.device(self.device):
            return tf.gather(value, tf.constant(layout.global_ids()))

    def _write_object_proto(self, proto, options):
        super()._write_object_proto(proto, options)
        layout = self._nestpipe_row_shard  # pylint: disable=no-member
        if layout.num_shards > 1 and not _saving_local_rows():
            # The checkpoint holds the whole table: so does the variable a SavedModel restores.
            whole = tf.TensorShape([layout.vocab_size]).concatenate(self.shape[1:])
            proto.variable.shape.CopyFrom(whole.as_proto())


def make_checkpointable(variable, layout, collectives):
    """Marks `variable` as the row shard `layout` of a table and makes TensorFlow checkpoints
    of it hold (and restore from) the whole table."""
    base = type(variable)
    if base not in _classes:
        _classes[base] = type("RowShard" + base.__name__, (_RowShardSaving, base), {})
    variable.__class__ = _classes[base]
    variable._nestpipe_row_shard = layout  # pylint: disable=protected-access
    variable._nestpipe_collectives = collectives  # pylint: disable=protected-access
    return variable
