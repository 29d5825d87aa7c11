"""Typed records passed between the stages of a row-wise exchange (route -> fetch -> output ->
backward) and kept between steps by the pipelines. NamedTuples, so `tf.nest`, `tf.function`
outputs and `strategy.run` carry them as they carry tuples."""
from typing import NamedTuple

import tensorflow as tf


class RoutingRecord(NamedTuple):
    """What the route stage of one exchange learned, on the requester's and the owner's side.

    Requester side: `splits` `[W]` int32 (unique ids asked of each owner), `inverse` `[n]`
    (input position -> bucketed unique index), `slot_of_bucket_pos` `[u]` (bucketed unique index
    -> slot of the row exchange). Exchange shape: `bucket` (instance-key offset of the padded
    size) and `capacity` (padded ids per requester/owner pair), int32 scalars. Owner side:
    `local_rows` `[r]` int64 (distinct owned rows requested, in the exchange's row space),
    `slot_to_unique` `[W * capacity]` (slot -> index into `local_rows`, -1 for padding) and
    `received` `[W]` (ids received from each requester: the rows sent back to each). `shares`
    `[W]` int32: the size of every worker's share of the batch routed, as each sender put it in
    its keys header (-1 where it gave none), so the workers can check equal shares without a
    collective of their own. `table_sizes` `[T]` int32: the rows of `local_rows` in each of the
    T tables sharing the row space, which `local_rows` holds grouped by table, table 0's first
    (`ops.owner_rounds`).
    """

    splits: tf.Tensor
    inverse: tf.Tensor
    slot_of_bucket_pos: tf.Tensor
    bucket: tf.Tensor
    capacity: tf.Tensor
    local_rows: tf.Tensor
    slot_to_unique: tf.Tensor
    received: tf.Tensor
    shares: tf.Tensor
    table_sizes: tf.Tensor

    def id_slots(self):
        """Each routed id's slot in the rows exchange (its bucketed unique id's), int32 `[n]`."""
        return tf.gather(self.slot_of_bucket_pos, self.inverse)


class PrefetchedRows(NamedTuple):
    """A prefetch buffer: an exchange's routing and the rows it retrieved, one per bucketed
    unique id (`[u, dim]`), read before the step that uses them."""

    routing: RoutingRecord
    rows: tf.Tensor
