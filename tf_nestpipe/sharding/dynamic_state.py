"""A dynamic table's hash-table state in checkpoints, its re-hashing onto another worker count,
and the ragged all-gather it and `DynamicEmbedding.full_table` use.

The row variable of a `DynamicEmbedding` is a row shard (slot s of worker i is row s * W + i of
a `[capacity * W, dim]` table), saved like every row shard (whole table, or this worker's rows
inside `ShardedCheckpoint`). `DynamicTableSaveable` saves the hash table beside it the same
way: the state of every worker (its ids with their whole-table row, their step and frequency,
the pending ids, every worker's counters, the worker count and capacity) gathered in one value;
per-worker files (`local_serialization()` true) hold this worker's state only. The row variable
and each of its optimizer slots save, beside their whole value, the ids and their whole-table
rows too (`row_keys`), so that each piece restores by itself, in any order.

Restore on the saving worker count and capacity: each worker takes its own ids and rows. On
another worker count W' (or capacity): the ids are *re-hashed* (`rehash_positions`): worker i
of W' takes the ids `ops.dynamic_owner(id, W')` gives it, in ascending id order, at slots
0, 1, ...; their rows, optimizer-slot rows, step, frequency and pending (admission) counts move
with them; the cumulative counters (admitted, evicted, ...) summed over the old workers go to
worker 0 (so the global counters carry on). An owner given more ids than its
`capacity_per_worker` is refused with the fix. Build the model and the optimizer before such a
restore (what the tests do; a value carrying these keys is never restored as a plain initial
value, so a deferred restore takes the same path, untested).
`ShardedCheckpoint.restore` on another worker count merges the old workers' files into the
whole-table form (`whole_state`, `whole_rows`) and re-hashes the same way.
"""
import numpy as np
import tensorflow as tf
from tf_nestpipe.tf_private import trackable_base as trackable

from tf_nestpipe.ops.dynamic_table import STAT_NAMES, DynamicTableState, dynamic_owner

_local_checks = []
ROW_KEYS = ("dynamic_ids", "dynamic_rows", "dynamic_workers")  # beside a row variable's value
_CUMULATIVE = [STAT_NAMES.index(k) for k in ("admitted", "evicted", "expired", "refused",
                                             "pending_dropped")]


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


def whole_table_keys(layer, tag):
    """`(ids, rows)`: every worker's admitted ids and their rows in the whole table (slot * W +
    worker), gathered over the workers (eager; a collective)."""
    state = layer.table.export()
    workers, me = layer.num_workers, layer.worker_index
    rows = state.entries[:, 0] * workers + me
    if workers == 1:
        return state.ids.numpy(), rows.numpy()
    (ids, rows), _ = all_gather_ragged([state.ids, rows], layer.collectives(), workers, tag)
    return ids, rows


def row_keys(layer, tag):
    """The tensors a dynamic table's row variable (or optimizer slot) saves beside its whole
    value (`ROW_KEYS`): the ids, their whole-table rows, the worker count."""
    ids, rows = whole_table_keys(layer, tag)
    return dict(zip(ROW_KEYS, (tf.constant(ids, tf.int64), tf.constant(rows, tf.int64),
                               tf.constant(layer.num_workers, tf.int64))))


def rehash_positions(ids, workers, me):
    """Positions in a checkpoint's `ids` (every old worker's, distinct) of those worker `me` of
    `workers` owns, in ascending id order: the id at position j restores at slot j."""
    order = tf.argsort(ids, stable=True)
    mine = tf.equal(dynamic_owner(tf.gather(ids, order), workers), me)
    return tf.boolean_mask(order, mine)


def _check_fits(count, layer):
    return tf.debugging.assert_less_equal(
        tf.cast(count, tf.int64), tf.constant(layer.capacity_per_worker, tf.int64), message=(
            "DynamicEmbedding '%s': re-hashed onto this run's %d workers, worker %d owns more of "
            "the checkpoint's ids (the first value below) than capacity_per_worker=%d. Build "
            "the layer with a capacity_per_worker of at least that many (or restore on more "
            "workers)." % (layer.name, layer.num_workers, layer.worker_index,
                           layer.capacity_per_worker)))


def restored_rows(layer, variable, restored, value):
    """This worker's rows of `variable` (the row variable of `layer` or one of its optimizer
    slots) from a whole-table checkpoint `value` with its `ROW_KEYS` in `restored`: its own rows
    of the saved layout on the saving worker count and capacity, else the re-hashed rows (slots
    no id takes keep their current value)."""
    ids, rows, saved_workers = [tf.cast(restored[k], tf.int64) for k in ROW_KEYS]
    ids, rows = tf.reshape(ids, [-1]), tf.reshape(rows, [-1])
    workers = layer.num_workers
    whole_rows = layer.capacity_per_worker * workers
    same = tf.logical_and(tf.equal(tf.reshape(saved_workers, []), workers),
                          tf.equal(tf.shape(value, out_type=tf.int64)[0], whole_rows))

    def own():
        return tf.gather(value, tf.range(layer.worker_index, whole_rows, workers))

    def rehashed():
        positions = rehash_positions(ids, workers, layer.worker_index)
        count = tf.size(positions)
        with tf.control_dependencies([_check_fits(count, layer)]):
            moved = tf.gather(value, tf.gather(rows, positions))
        return tf.tensor_scatter_nd_update(variable.read_value(), tf.range(count)[:, None],
                                           tf.cast(moved, variable.dtype))

    return tf.cond(same, own, rehashed)


def _own_state(ids, entries, pending_ids, pending, stats, workers, me):
    """This worker's part of a whole saved state on the saving worker count and capacity."""
    mine = tf.equal(entries[:, 0] % workers, me)
    entries = tf.boolean_mask(entries, mine)
    entries = tf.concat([entries[:, :1] // workers, entries[:, 1:]], axis=1)
    owned = tf.equal(dynamic_owner(pending_ids, workers), me)
    return (tf.boolean_mask(ids, mine), entries, tf.boolean_mask(pending_ids, owned),
            tf.boolean_mask(pending, owned), stats[me])


def _rehashed_state(layer, ids, entries, pending_ids, pending, stats):
    """This worker's part of a whole saved state re-hashed onto this run (see module)."""
    workers, me = layer.num_workers, layer.worker_index
    positions = rehash_positions(ids, workers, me)
    count = tf.size(positions, out_type=tf.int64)
    with tf.control_dependencies([_check_fits(count, layer)]):
        mine = tf.gather(entries, positions)
    entries = tf.concat([tf.range(count)[:, None], mine[:, 1:]], axis=1)
    owned = tf.equal(dynamic_owner(pending_ids, workers), me)
    pending_ids, pending = tf.boolean_mask(pending_ids, owned), tf.boolean_mask(pending, owned)
    totals = tf.reduce_sum(stats, axis=0)
    cumulative = tf.scatter_nd([[k] for k in _CUMULATIVE], tf.gather(totals, _CUMULATIVE),
                               [len(STAT_NAMES)]) * (1 if me == 0 else 0)
    step = stats[0, STAT_NAMES.index("step")]
    counts = tf.scatter_nd([[STAT_NAMES.index("size")], [STAT_NAMES.index("step")],
                            [STAT_NAMES.index("pending")]],
                           tf.stack([count, step, tf.size(pending_ids, out_type=tf.int64)]),
                           [len(STAT_NAMES)])
    return tf.gather(ids, positions), entries, pending_ids, pending, cumulative + counts


STATE_KEYS = ("ids", "entries", "pending_ids", "pending", "stats", "num_workers", "capacity")


def whole_state(per_worker):
    """The whole-table state (`STATE_KEYS`, as a tf.train.Checkpoint holds it) of a dynamic table
    from its per-worker states (ShardedCheckpoint files: dicts of NumPy arrays, in worker
    order)."""
    workers = len(per_worker)
    entries = []
    for index, state in enumerate(per_worker):
        e = np.array(state["entries"], np.int64).reshape(-1, 3)
        e[:, 0] = e[:, 0] * workers + index
        entries.append(e)
    return {"ids": np.concatenate([np.reshape(s["ids"], [-1]) for s in per_worker]),
            "entries": np.concatenate(entries),
            "pending_ids": np.concatenate([np.reshape(s["pending_ids"], [-1])
                                           for s in per_worker]),
            "pending": np.concatenate([np.reshape(s["pending"], [-1, 2]) for s in per_worker]),
            "stats": np.concatenate([np.reshape(s["stats"], [-1, len(STAT_NAMES)])
                                     for s in per_worker]),
            "num_workers": np.int64(workers), "capacity": np.int64(per_worker[0]["capacity"])}


def whole_rows(per_worker_rows):
    """The whole `[capacity * W, ...]` value (slot s of worker i at row s * W + i) of a dynamic
    table variable from its per-worker values."""
    stacked = np.stack(per_worker_rows, axis=1)
    return stacked.reshape((-1,) + stacked.shape[2:])


def state_row_keys(state):
    """The `ROW_KEYS` of a whole-table state (see `whole_state`)."""
    return dict(zip(ROW_KEYS, (state["ids"], state["entries"][:, 0], state["num_workers"])))


class DynamicTableSaveable(trackable.Trackable):
    """The checkpointed hash-table state of one `DynamicEmbedding` (see module)."""

    def __init__(self, layer):
        self._layer = layer

    def _serialize_to_tensors(self):
        layer = self._layer
        state = layer.table.export()
        workers, me = layer.num_workers, layer.worker_index
        capacity = tf.constant(layer.capacity_per_worker, tf.int64)
        if _local():
            return {"ids": state.ids, "entries": state.entries, "pending_ids": state.pending_ids,
                    "pending": state.pending, "stats": state.stats[None, :],
                    "num_workers": tf.constant(1, tf.int64), "capacity": capacity}
        entries = state.entries.numpy().copy()
        entries[:, 0] = entries[:, 0] * workers + me  # the slot's row in the whole table
        tag = "nestpipe/dynamic_checkpoint/" + layer.name
        if workers == 1:
            ids, pending_ids, pending = state.ids, state.pending_ids, state.pending
            stats = state.stats[None, :]
        else:
            (ids, entries), _ = all_gather_ragged([state.ids, entries], layer.collectives(),
                                                  workers, tag + "/map")
            (pending_ids, pending), _ = all_gather_ragged([state.pending_ids, state.pending],
                                                          layer.collectives(), workers,
                                                          tag + "/pending")
            stats = layer.collectives().all_gather(state.stats[None, :], tag + "/stats")
        return {"ids": ids, "entries": entries, "pending_ids": pending_ids, "pending": pending,
                "stats": stats, "num_workers": tf.constant(workers, tf.int64),
                "capacity": capacity}

    def _restore_from_tensors(self, restored_tensors):
        # Graph ops only: TensorFlow may run a restore inside a tf.function.
        layer = self._layer
        workers, me = layer.num_workers, layer.worker_index
        saved_workers = tf.reshape(tf.cast(restored_tensors["num_workers"], tf.int64), [])
        saved_capacity = tf.reshape(tf.cast(restored_tensors.get(
            "capacity", layer.capacity_per_worker), tf.int64), [])
        ids = tf.reshape(tf.cast(restored_tensors["ids"], tf.int64), [-1])
        entries = tf.reshape(tf.cast(restored_tensors["entries"], tf.int64), [-1, 3])
        pending_ids = tf.reshape(tf.cast(restored_tensors["pending_ids"], tf.int64), [-1])
        pending = tf.reshape(tf.cast(restored_tensors["pending"], tf.int64), [-1, 2])
        stats = tf.reshape(tf.cast(restored_tensors["stats"], tf.int64), [-1, len(STAT_NAMES)])
        if _local():
            # ShardedCheckpoint's own files: re-hashing across worker counts happens in
            # ShardedCheckpoint.restore, which reads every old worker's file.
            check = tf.debugging.assert_equal(
                saved_capacity, tf.constant(layer.capacity_per_worker, tf.int64), message=(
                    "DynamicEmbedding '%s': this worker's ShardedCheckpoint file was written "
                    "with another capacity_per_worker than this layer's %d (the first value "
                    "below): build the layer with the saving capacity_per_worker."
                    % (layer.name, layer.capacity_per_worker)))
            with tf.control_dependencies([check]):
                stats = tf.identity(stats)
            return layer.table.restore(DynamicTableState(ids, entries, pending_ids, pending,
                                                         stats[0]))
        same = tf.logical_and(tf.equal(saved_workers, workers),
                              tf.equal(saved_capacity, layer.capacity_per_worker))
        state = tf.cond(
            same, lambda: _own_state(ids, entries, pending_ids, pending, stats, workers, me),
            lambda: _rehashed_state(layer, ids, entries, pending_ids, pending, stats))
        return layer.table.restore(DynamicTableState(*state))
