"""`EmbeddingExchange`: the strategy's registry of row-wise tables and the state their exchanges
keep between steps.

Every row-wise `ShardedEmbedding` built under a `NestPipeStrategy` registers here. Tables of
one dim and dtype form one *group* (`FusedTables`): the pipelines route, fetch and send back
all lookups of a group in one exchange per step. Groups only grow (tables registered later get
higher offsets), so a fused id never changes meaning. Each exchange tag also keeps a capacity
hint: the padded size its keys all-to-all uses, agreed by every worker without a collective
(see `lookup.route`). The exchange's `wire` (a `collectives.wire.Wire`) is what its rows and
gradient exchanges put on the wire (`NestPipeStrategy(wire_dtype=...)`) and counts their bytes.
"""
import tensorflow as tf
from tf_nestpipe.tf_private import resource_variable_ops

from tf_nestpipe.collectives.communication import (MAX_BUCKET, capacity_bucket,
                                                   static_capacity_bucket)
from tf_nestpipe.collectives.wire import Wire, WireStats
from tf_nestpipe.sharding.tables import FusedTables

# The keys all-to-all starts at this padded size per pair of workers; it then follows the
# largest count seen, one capacity step above it.
INITIAL_KEY_CAPACITY = 64


class CapacityHint:
    """The keys all-to-all's padded size of one exchange tag (a capacity bucket), equal on every
    worker: it starts at `INITIAL_KEY_CAPACITY` and is set from the counts every worker learns
    in that exchange."""

    def __init__(self, device, tag):
        initial = static_capacity_bucket(INITIAL_KEY_CAPACITY)
        with tf.init_scope(), tf.device(device):
            # Constructed directly (not tf.Variable) so no strategy creator intercepts it.
            self._bucket = resource_variable_ops.ResourceVariable(
                initial, dtype=tf.int32, trainable=False,
                name="nestpipe_capacity_hint_" + tag.replace("/", "_"))
            self._overflows = resource_variable_ops.ResourceVariable(
                0, dtype=tf.int64, trainable=False,
                name="nestpipe_overflow_rounds_" + tag.replace("/", "_"))

    def read_bucket(self):
        """The bucket of this step's keys all-to-all (an index into the exchange capacities)."""
        return self._bucket.read_value()

    def count_overflow(self):
        """Counts one overflow round (a second keys all-to-all); returns the op."""
        return self._overflows.assign_add(1, read_value=False)

    @property
    def overflow_rounds(self):
        """How many steps of this tag needed the overflow round so far (on this worker)."""
        return int(self._overflows.numpy())

    def follow(self, largest_count):
        """Sets the next step's capacity one bucket above `largest_count`; returns the op."""
        bucket, _ = capacity_bucket(tf.maximum(largest_count, 1))
        return self._bucket.assign(tf.minimum(bucket + 1, MAX_BUCKET),
                                   read_value=False)


class EmbeddingExchange:
    """Row-wise tables grouped by dim and dtype, their collectives and capacity hints."""

    def __init__(self, collectives, num_workers):
        self.collectives = collectives
        self.num_workers = num_workers
        self._groups = {}  # group key -> [layer, ...] in registration order
        self._hints = {}
        self.wire = Wire("fp32", WireStats(collectives.device))

    def set_wire_dtype(self, wire_dtype):
        """Sets the encoding of the rows and gradient exchanges (see `parse_wire_dtype`); call
        before the first step is traced. The byte counters carry on."""
        self.wire = Wire(wire_dtype, self.wire.stats)

    def wire_stats(self):
        """The wire counters so far (on this worker): bytes sent per kind and values clamped."""
        return self.wire.stats.read()

    @property
    def worker_index(self):
        """This worker's shard of every table (its rank in the collective group)."""
        return self.collectives.worker_index

    @staticmethod
    def group_key(layer):
        """The name of the exchange group `layer`'s table belongs to (its dim and the dtype its
        rows are stored in: a mixed precision policy's variable dtype, whatever dtype the table
        reads as where it is looked up)."""
        return "d%d_%s" % (layer.dim, tf.as_dtype(layer.dtype).name)

    def register(self, layer):
        """Adds a built row-wise table to its group (idempotent)."""
        members = self._groups.setdefault(self.group_key(layer), [])
        if all(member is not layer for member in members):
            members.append(layer)

    def tables(self, group_key):
        """The `FusedTables` of a group, as registered now."""
        return FusedTables(self._groups[group_key], self.num_workers, self.worker_index)

    def overflow_rounds(self):
        """Overflow rounds of every exchange so far (on this worker; the same on every worker)."""
        return sum(hint.overflow_rounds for hint in self._hints.values())

    def capacity_hint(self, tag):
        """The `CapacityHint` of exchange tag `tag` (created on first use)."""
        if tag not in self._hints:
            self._hints[tag] = CapacityHint(self.collectives.device, tag)
        return self._hints[tag]
