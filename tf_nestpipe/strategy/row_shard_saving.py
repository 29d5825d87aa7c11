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
        check_restored_rows(self.name, rows, layout, local=_saving_local_rows())
        if not _saving_local_rows() and layout.num_shards > 1:
            with tf.device(self.device):
                value = tf.gather(value, tf.constant(layout.global_ids()))
        return super()._restore_from_tensors({trackable.VARIABLE_VALUE_KEY: value})


def check_restored_rows(name, rows, layout, local):
    """Refuses a checkpoint value of `rows` rows for the row shard `layout` of table `name`:
    a whole-table checkpoint must hold exactly `vocab_size` rows (a value the size of this
    worker's shard is not a whole table: a table of another size), a per-worker one
    (`local`, `ShardedCheckpoint`) exactly this shard's rows."""
    expected = layout.local_rows if local else layout.vocab_size
    if rows is None or rows == expected:
        return
    if local:
        raise ValueError(
            "cannot restore %s: its per-worker checkpoint holds %d rows, this worker's shard "
            "has %d (a table of %d rows on %d workers). Restore with a model of the table size "
            "it was written with." % (name, rows, layout.local_rows, layout.vocab_size,
                                      layout.num_shards))
    raise ValueError(
        "cannot restore %s: the checkpoint holds a table of %d rows, this model's table has %d "
        "rows. Build the model with the vocabulary size the checkpoint was written with (%d), "
        "or copy the rows into the new table yourself. (ShardedCheckpoint files restore "
        "through ShardedCheckpoint.restore.)" % (name, rows, layout.vocab_size, rows))


def restore_on_create_rows(initial_value, layout, name):
    """`initial_value` for the row shard `layout` of table `name`, where a value restored on
    creation (TensorFlow's deferred restoration: a `tf.train.Checkpoint` / tf_keras
    `BackupAndRestore` restored before `fit` built the model) is a whole table: it is checked
    (exactly `vocab_size` rows) and cut to this worker's rows, instead of becoming a variable of
    the whole table's shape or the first rows of it."""
    def rows_of_this_worker():
        value = initial_value() if callable(initial_value) else initial_value
        if not isinstance(value, trackable.CheckpointInitialValue):
            return value
        whole = value.wrapped_value
        check_restored_rows(name, whole.shape[0] if whole.shape.rank else None, layout,
                            local=False)
        if layout.num_shards == 1:
            return whole
        return tf.gather(whole, tf.constant(layout.global_ids()))

    return rows_of_this_worker


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
