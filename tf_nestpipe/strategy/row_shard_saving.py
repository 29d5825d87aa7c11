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
from tf_nestpipe.tf_private import tensor_callable
from tf_nestpipe.tf_private import trackable_base as trackable

from tf_nestpipe.sharding.dynamic_slots import dynamic_table_of, is_dynamic_table_variable
from tf_nestpipe.sharding.dynamic_state import (ROW_KEYS, restored_rows, row_keys,
                                                set_local_serialization_check)
from tf_nestpipe.sharding.full_table import gather_full_rows
from tf_nestpipe.sharding.row_shard import mark_row_shard, row_shard_layout
from tf_nestpipe.strategy.row_shard_updates import RowShardUpdates

_state = threading.local()
_classes = {}


@contextlib.contextmanager
def _thread_setting(name, value):
    """Within this context, this thread's setting `name` (an attribute of `_state`) is
    `value`; the previous value is back after it."""
    previous = getattr(_state, name, None)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def local_shard_serialization():
    """Within this context, row shards save and restore only this worker's own rows."""
    return _thread_setting("local", True)


def _saving_local_rows():
    return getattr(_state, "local", False)


set_local_serialization_check(_saving_local_rows)  # dynamic tables' hash-table state too


def whole_table_values():
    """Within this context (eager), a row shard's `numpy()` returns the whole table (every
    worker must read it at the same point) and `assign()` of a whole table takes this worker's
    rows: what tf_keras' `.h5` / `.keras` saving and loading use (see module)."""
    return _thread_setting("whole", True)


@contextlib.contextmanager
def whole_tables_gathered(variables):
    """Gathers, here and in the order given, the whole table of each row shard among
    `variables` (a collective: every worker passes the same variables in the same order);
    within the context a checkpoint of one of them reads that value instead of gathering.

    For savers whose order of variables differs between workers, or that save a variable twice
    (Keras 3's export saves each Keras variable and the `tf.Variable` in it, its functions'
    variables in no fixed order): their whole-table reads would otherwise be collectives in a
    different order on each worker."""
    gathered = {}
    for variable in variables:
        layout = row_shard_layout(variable)
        if (layout is None or layout.num_shards == 1 or _saving_local_rows()
                or id(variable) in gathered):
            continue
        with tf.device(variable.device):
            gathered[id(variable)] = gather_full_rows(
                variable.read_value_no_copy(), layout,
                variable._nestpipe_collectives,  # pylint: disable=protected-access
                "nestpipe/export/" + variable._shared_name)  # pylint: disable=protected-access
    with _thread_setting("gathered", gathered):
        yield


def _whole_values(variable):
    return (getattr(_state, "whole", False) and not _saving_local_rows()
            and row_shard_layout(variable).num_shards > 1 and tf.executing_eagerly())


class _RowShardSaving:
    """Mixed into a row-shard variable's class: checkpoints hold the whole table (see module)."""

    def _serialize_to_tensors(self):
        tensors = self._serialize_whole_table()
        table = dynamic_table_of(self)
        if table is not None and not _saving_local_rows():
            # The ids of a dynamic table's rows: it restores on any worker count by itself.
            tensors.update(row_keys(table, "nestpipe/checkpoint_ids/" + self._shared_name))  # pylint: disable=no-member
        return tensors

    def _serialize_whole_table(self):
        layout = row_shard_layout(self)
        if layout.num_shards == 1 or _saving_local_rows():
            return dict(super()._serialize_to_tensors())
        variable, collectives = self, self._nestpipe_collectives  # pylint: disable=no-member
        tag = "nestpipe/checkpoint/" + self._shared_name  # pylint: disable=no-member

        def read_whole_table():
            gathered = (getattr(_state, "gathered", None) or {}).get(id(variable))
            if gathered is not None:
                return gathered
            with tf.device(variable.device):
                return gather_full_rows(variable.read_value_no_copy(), layout, collectives, tag)

        return {trackable.VARIABLE_VALUE_KEY: tensor_callable.Callable(
            read_whole_table, dtype=self.dtype, device=self.device)}

    def _restore_from_tensors(self, restored_tensors):
        layout = row_shard_layout(self)
        value = restored_tensors[trackable.VARIABLE_VALUE_KEY]
        table = dynamic_table_of(self)
        if table is not None and not _saving_local_rows() and ROW_KEYS[0] in restored_tensors:
            with tf.device(self.device):  # on any worker count (re-hashed: see dynamic_state)
                value = restored_rows(table, self, restored_tensors, value)
            return super()._restore_from_tensors({trackable.VARIABLE_VALUE_KEY: value})
        rows = value.shape[0] if value.shape.rank else None
        if is_dynamic_table_variable(self) and rows is not None and rows != (
                layout.local_rows if _saving_local_rows() else layout.vocab_size):
            raise ValueError(
                "cannot restore %s, a DynamicEmbedding's rows (or their optimizer slot): the "
                "checkpoint holds %d rows, %d per worker on this run's %d workers, and not the "
                "ids of its rows (a per-worker file, or one written before dynamic tables "
                "re-hashed). Restore it on the saving worker count with the same "
                "capacity_per_worker (tf.train.Checkpoints written now restore on any worker "
                "count; ShardedCheckpoint.restore re-hashes its own files)."
                % (self.name, rows, layout.local_rows, layout.num_shards))
        check_restored_rows(self.name, rows, layout, local=_saving_local_rows())
        if not _saving_local_rows() and layout.num_shards > 1:
            with tf.device(self.device):
                value = tf.gather(value, tf.constant(layout.global_ids()))
        return super()._restore_from_tensors({trackable.VARIABLE_VALUE_KEY: value})

    def numpy(self):
        if not _whole_values(self):
            return super().numpy()
        return gather_full_rows(self.read_value(), row_shard_layout(self),
                                self._nestpipe_collectives,  # pylint: disable=no-member
                                "nestpipe/keras_file/" + self._shared_name).numpy()  # pylint: disable=no-member

    def assign(self, value, use_locking=None, name=None, read_value=True):
        if _whole_values(self):
            value = self._own_rows(value)
        return super().assign(value, use_locking=use_locking, name=name, read_value=read_value)

    def _own_rows(self, value):
        """This worker's rows of `value`, a whole table (other row counts are refused)."""
        layout = row_shard_layout(self)
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
        layout = row_shard_layout(self)
        if layout.num_shards > 1 and not _saving_local_rows():
            # The checkpoint holds the whole table: so does the variable a SavedModel restores.
            whole = tf.TensorShape([layout.vocab_size]).concatenate(self.shape[1:])
            proto.variable.shape.CopyFrom(whole.as_proto())


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
    of it hold (and restore from) the whole table; its sparse updates take
    `row_shard_updates.RowShardUpdates`'."""
    base = type(variable)
    if base not in _classes:
        # Its rows' sparse updates also take our op (`row_shard_updates`).
        _classes[base] = type("RowShard" + base.__name__,
                              (_RowShardSaving, RowShardUpdates, base), {})
    variable.__class__ = _classes[base]
    mark_row_shard(variable, layout)
    variable._nestpipe_collectives = collectives  # pylint: disable=protected-access
    return variable
