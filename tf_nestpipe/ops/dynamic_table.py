"""Python side of the dynamic-table ops (ops/dynamic_table_ops.cc): the hash-table resource from
raw int64 ids to slots of a fixed-capacity row variable, the owner hash and the per-id initial
rows. The semantics of a training step are documented in the .cc file and in `DynamicTable.admit`.
"""
import collections
import itertools

import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library

POLICIES = ("lru", "lfu")
STAT_NAMES = ("size", "step", "admitted", "evicted", "expired", "refused", "pending",
              "pending_dropped")
_uids = itertools.count()

DynamicTableState = collections.namedtuple(
    "DynamicTableState", ["ids", "entries", "pending_ids", "pending", "stats"])
DynamicTableState.__doc__ = """A table's whole state: `ids` ascending `[n]`, `entries` `[n, 3]`
(slot, last step, frequency), `pending_ids` `[m]` with `pending` `[m, 2]` (steps seen, last step)
and `stats` `[8]` (see `STAT_NAMES`)."""


class DynamicTable(tf.saved_model.experimental.TrackableResource):
    """One worker's hash table from int64 ids to slots `[0, capacity)` of its row variable.

    `admit_after`: an id gets a slot in the `admit_after`-th training step it appears in (1:
    at first sight); until then it is *pending*, counted in a map of at most `counter_capacity`
    ids (beyond it the least recently seen pending id is dropped, counted). When no slot is free,
    `policy` ("lru" or "lfu") picks a victim among ids not seen in the current step; if there is
    none the id is refused (counted). `ttl` > 0: an id not seen for `ttl` steps is removed.
    Thread-safe (one mutex per table).
    """

    def __init__(self, capacity, admit_after=1, policy="lru", ttl=0, counter_capacity=None,
                 name="dynamic_table"):
        if int(capacity) < 1:
            raise ValueError("capacity must be >= 1, got %r" % (capacity,))
        if int(admit_after) < 1:
            raise ValueError("admit_after must be >= 1, got %r" % (admit_after,))
        if policy not in POLICIES:
            raise ValueError("eviction policy must be one of %s, got %r" % (POLICIES, policy))
        if int(ttl) < 0:
            raise ValueError("ttl must be >= 0 steps (0: no time-to-live), got %r" % (ttl,))
        self.capacity = int(capacity)
        self.admit_after = int(admit_after)
        self.policy = policy
        self.ttl = int(ttl)
        self.counter_capacity = int(counter_capacity or max(4 * self.capacity, 1024))
        if self.counter_capacity < 1:
            raise ValueError("counter_capacity must be >= 1, got %r" % (counter_capacity,))
        self._shared_name = "nestpipe_dynamic_%s_%d" % (name, next(_uids))
        super().__init__()
        self._create_op()

    def _create_resource(self):
        return load_op_library().nestpipe_dynamic_table_handle(shared_name=self._shared_name)

    def _initialize(self):
        return self._create_op()

    def _create_op(self):
        return load_op_library().nestpipe_dynamic_table_create(
            self.resource_handle, capacity=self.capacity, admit_after=self.admit_after,
            policy=self.policy, ttl=self.ttl, counter_capacity=self.counter_capacity)

    def find(self, ids):
        """Slots of int64 `ids` (-1 where absent); changes nothing (inference)."""
        return load_op_library().nestpipe_dynamic_table_find(
            self.resource_handle, tf.reshape(tf.cast(ids, tf.int64), [-1]))

    def admit(self, ids):
        """One training step over `ids`: `(slots, fresh)`; slots -1 where not admitted, `fresh`
        where the slot was assigned in this step (its row must be initialized)."""
        return load_op_library().nestpipe_dynamic_table_admit(
            self.resource_handle, tf.reshape(tf.cast(ids, tf.int64), [-1]))

    def stats(self):
        """int64 `[8]` counters, named by `STAT_NAMES`."""
        return load_op_library().nestpipe_dynamic_table_stats(self.resource_handle)

    def stats_dict(self):
        """The counters as a dict (eager)."""
        return dict(zip(STAT_NAMES, (int(v) for v in self.stats().numpy())))

    def export(self):
        """The whole state, a `DynamicTableState`."""
        return DynamicTableState(*load_op_library().nestpipe_dynamic_table_export(
            self.resource_handle))

    def restore(self, state):
        """Replaces the state with `state` (a `DynamicTableState`); refused if inconsistent."""
        state = DynamicTableState(*[tf.cast(t, tf.int64) for t in state])
        return load_op_library().nestpipe_dynamic_table_import(
            self.resource_handle, tf.reshape(state.ids, [-1]), tf.reshape(state.entries, [-1, 3]),
            tf.reshape(state.pending_ids, [-1]), tf.reshape(state.pending, [-1, 2]),
            tf.reshape(state.stats, [-1]))


def dynamic_owner(ids, num_shards):
    """Owner worker of each int64 id: `splitmix64_finalizer(uint64(id)) mod num_shards` (int32)."""
    return load_op_library().nestpipe_dynamic_owner(tf.cast(ids, tf.int64),
                                                    num_shards=int(num_shards))


def dynamic_row_init(seed, ids, dim, distribution):
    """Raw initial rows `[n, dim]` (U[0,1), N(0,1) or truncated N(0,1)) of int64 `ids`: a
    function of (seed, id) only (Philox with the seed's key/counter, counter word 1 xor id)."""
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.cast(seed, tf.int64))
    return load_op_library().nestpipe_stateless_row_init(
        key, counter, tf.reshape(tf.cast(ids, tf.int64), [-1]), dim=int(dim),
        distribution=distribution, keyed_by="id")
