"""A dynamic table's hash-table state in checkpoints, and the ragged all-gather it and
`DynamicEmbedding.full_table` use.

The row variable of a `DynamicEmbedding` is a row shard (slot s of worker i is row s * W + i of
a `[capacity * W, dim]` table), saved like every row shard (whole table, or this worker's rows
inside `ShardedCheckpoint`). `DynamicTableSaveable` saves the hash table beside it the same
way: the state of every worker (its ids with their global row, their step and frequency, the
pending ids, every worker's counters) gathered in one value, from which each worker of a restore
on the same worker count takes its own ids; per-worker files (`local_serialization()` true)
hold this worker's state only. A restore on another worker count would have to move rows and
optimizer slots to their new owners: it is refused with the fix (see `restore`).
"""
import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable

from tf_nestpipe.ops.dynamic_table import DynamicTableState, dynamic_owner

_local_checks = []


def set_local_serialization_check(check):
    """Registers `check()`: true while per-worker files are written or read (the strategy's
    `local_shard_serialization`)."""
    _local_checks.append(check)


def _local():
    return any(check() for check in _local_checks)


def all_gather_ragged(tensors, collectives, num_workers, tag):
    """Concatenates, over the workers (in worker order), tensors of one leading length that
    differs per worker, and returns them with each worker's count (eager; NumPy)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if num_workers == 1:
        return [t.numpy() for t in tensors], np.array([int(tensors[0].shape[0])])
    count = tf.shape(tensors[0], out_type=tf.int64)[:1]
    counts = collectives.all_gather(count, tag + "/counts").numpy()
    largest = int(max(counts.max(), 1))
    out = []
    for k, t in enumerate(tensors):
        padded = tf.pad(t, [[0, largest - int(t.shape[0])]] + [[0, 0]] * (t.shape.rank - 1))
        gathered = collectives.all_gather(padded, "%s/%d" % (tag, k)).numpy()
        out.append(np.concatenate([gathered[i * largest:i * largest + counts[i]]
                                   for i in range(num_workers)], axis=0))
    return out, counts


class DynamicTableSaveable(trackable.Trackable):
    """The checkpointed hash-table state of one `DynamicEmbedding` (see module)."""

    def __init__(self, layer):
        self._layer = layer

    def _serialize_to_tensors(self):
        layer = self._layer
        state = layer.table.export()
        workers, me = layer.num_workers, layer.worker_index
        if _local() or workers == 1:
            return {"ids": state.ids, "entries": state.entries, "pending_ids": state.pending_ids,
                    "pending": state.pending, "stats": state.stats[None, :],
                    "num_workers": tf.constant(1 if _local() else workers, tf.int64)}
        entries = state.entries.numpy().copy()
        entries[:, 0] = entries[:, 0] * workers + me  # the slot's row in the whole table
        tag = "nestpipe/dynamic_checkpoint/" + layer.name
        (ids, entries), _ = all_gather_ragged([state.ids, entries], layer.collectives(),
                                              workers, tag + "/map")
        (pending_ids, pending), _ = all_gather_ragged([state.pending_ids, state.pending],
                                                      layer.collectives(), workers,
                                                      tag + "/pending")
        stats = layer.collectives().all_gather(state.stats[None, :], tag + "/stats")
        return {"ids": ids, "entries": entries, "pending_ids": pending_ids, "pending": pending,
                "stats": stats, "num_workers": tf.constant(workers, tf.int64)}

    def _restore_from_tensors(self, restored_tensors):
        # Graph ops only: TensorFlow may run a restore inside a tf.function.
        layer = self._layer
        workers, me = layer.num_workers, layer.worker_index
        local = _local() or workers == 1
        saved_workers = tf.cast(restored_tensors["num_workers"], tf.int64)
        check = tf.debugging.assert_equal(
            saved_workers, tf.constant(1 if _local() else workers, tf.int64), message=(
                "DynamicEmbedding '%s': the checkpoint's dynamic table was written on another "
                "number of workers than this run's %d (the first value below). Restoring a "
                "dynamic table on another worker count (moving rows and optimizer slots to their "
                "new owners) is not supported yet: restore on the saving worker count."
                % (layer.name, workers)))
        with tf.control_dependencies([check]):
            ids = tf.reshape(tf.cast(restored_tensors["ids"], tf.int64), [-1])
        entries = tf.reshape(tf.cast(restored_tensors["entries"], tf.int64), [-1, 3])
        pending_ids = tf.reshape(tf.cast(restored_tensors["pending_ids"], tf.int64), [-1])
        pending = tf.reshape(tf.cast(restored_tensors["pending"], tf.int64), [-1, 2])
        stats = tf.reshape(tf.cast(restored_tensors["stats"], tf.int64), [-1, 8])
        if not local:
            mine = tf.equal(entries[:, 0] % workers, me)
            ids = tf.boolean_mask(ids, mine)
            entries = tf.boolean_mask(entries, mine)
            entries = tf.concat([entries[:, :1] // workers, entries[:, 1:]], axis=1)
            owned = tf.equal(dynamic_owner(pending_ids, workers), me)
            pending_ids, pending = tf.boolean_mask(pending_ids, owned), tf.boolean_mask(pending,
                                                                                        owned)
            stats = stats[me:me + 1]
        return layer.table.restore(DynamicTableState(ids, entries, pending_ids, pending,
                                                     stats[0]))
