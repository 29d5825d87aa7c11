"""The row-wise sharder's stages for one exchange (DESIGN.md sections 2 and 10).

`source` is the row source of the exchange: a `FusedTables` (one table, or every table of one
dim and dtype in one fused id space) with its `layout` and `gather(local_rows)`.

- route: fused dedup + bucket-by-owner (custom op); the keys all-to-all, padded to the tag's
  capacity hint and headed by the sender's split sizes, so every worker learns the whole count
  matrix from it (no separate counts all-gather); if a count exceeded the hint, a second
  all-to-all carries the overflow (every worker sees the same counts, so all take it or none:
  no key is ever dropped); the owner's dedup (custom op).
- fetch: the owner gathers the owned rows (`source.gather`).
- output: the rows all-to-all back to the requesters and the inverse-index rebuild.
- backward (the adjoint): segment-sum per unique key (custom op), the reverse all-to-all and the
  owner's segment-sum into an `IndexedSlices` gradient of its own rows only.

`wire` (a `collectives.wire.Wire`) encodes the rows and gradient exchanges and counts the bytes
every exchange sends (the keys are never compressed); None is fp32, uncounted.
"""
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.collectives.communication import capacity_bucket
from tf_nestpipe.collectives.wire import PLAIN
from tf_nestpipe.sharding.records import RoutingRecord


def _padded(ragged_keys, width):
    """`[W, None]` ragged keys as a `[W, width]` tensor padded with -1."""
    return ragged_keys.to_tensor(default_value=-1, shape=tf.stack(
        [ragged_keys.nrows(), tf.cast(width, tf.int64)]))


def route(ids, layout, collectives, tag, hint, share_size=None, wire=None):
    """Route stage for a vector of int64 (fused) `ids` over more than one shard; returns a
    `RoutingRecord`. `hint` is the tag's `CapacityHint` (equal on every worker). `share_size`
    (optional int scalar: this worker's share of the batch) rides in the keys header, so every
    worker learns every worker's (`RoutingRecord.shares`); `wire` counts the keys' bytes."""
    wire = wire or PLAIN
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    num_shards = layout.num_shards
    keys, splits, inverse = ops.route_keys(ids, num_shards, layout.vocab_size, tag)
    splits64 = tf.cast(splits, tf.int64)
    by_owner = tf.RaggedTensor.from_row_lengths(keys, splits64)
    hint_bucket, hint_capacity = hint.read()
    # Block j: this worker's split sizes and share size (the header), then up to hint_capacity
    # keys for owner j.
    share = tf.constant(-1, tf.int64) if share_size is None else tf.cast(share_size, tf.int64)
    header = tf.tile(tf.concat([splits64, [share]], 0)[None, :], [num_shards, 1])
    first = tf.concat([header, _padded(by_owner[:, :hint_capacity], hint_capacity)], axis=1)
    first_counts = num_shards + 1 + tf.minimum(splits, hint_capacity)
    with tf.control_dependencies(wire.count("keys", first, collectives, first_counts)):
        received_first = collectives.all_to_all(first, tag + "/keys", hint_bucket,
                                                send_counts=first_counts, fill=-1)
    # sent[i, j] = unique ids worker i requests from worker j: the same matrix on every worker.
    sent = tf.cast(received_first[:, :num_shards], tf.int32)
    largest = tf.reduce_max(sent)

    def overflow():
        extra_bucket, extra_capacity = capacity_bucket(largest - hint_capacity)
        rest = _padded(by_owner[:, hint_capacity:], extra_capacity)
        rest_counts = tf.maximum(splits - hint_capacity, 0)
        with tf.control_dependencies([hint.count_overflow()]
                                     + wire.count("keys", rest, collectives, rest_counts)):
            return collectives.all_to_all(rest, tag + "/keys_overflow", extra_bucket,
                                          send_counts=rest_counts, fill=-1)

    extra = tf.cond(largest > hint_capacity, overflow,
                    lambda: tf.fill([num_shards, 0], tf.constant(-1, tf.int64)))
    with tf.control_dependencies([hint.follow(largest)]):
        bucket, capacity = capacity_bucket(tf.maximum(largest, 1))
    # The rows exchange's slot layout: from requester i, its sent[i, me] keys, then padding.
    received = sent[:, layout.shard_index]
    keys_in = tf.concat([received_first[:, num_shards + 1:], extra], axis=1)
    received_keys = _padded(tf.RaggedTensor.from_row_lengths(
        tf.boolean_mask(keys_in, keys_in >= 0), tf.cast(received, tf.int64)), capacity)
    local_rows, slot_to_unique = ops.owner_dedup(received_keys, num_shards, layout.shard_index)
    offsets = tf.cumsum(splits, exclusive=True)
    owner_of_bucket_pos = tf.repeat(tf.range(num_shards, dtype=tf.int32), splits)
    slot_of_bucket_pos = (owner_of_bucket_pos * capacity + tf.range(tf.size(keys, tf.int32))
                          - tf.gather(offsets, owner_of_bucket_pos))
    return RoutingRecord(splits=splits, inverse=inverse, slot_of_bucket_pos=slot_of_bucket_pos,
                         bucket=bucket, capacity=capacity, local_rows=local_rows,
                         slot_to_unique=slot_to_unique, received=received,
                         shares=tf.cast(received_first[:, num_shards], tf.int32))


def exchange_rows(owned, routing, layout, collectives, tag, differentiable=True, wire=None):
    """Output stage: the owner's `owned` rows (one per `routing.local_rows`) go back to the
    requesters, in `wire`'s forward encoding (its backward one for the gradient). Returns the
    received rows in slot layout, `[num_shards * capacity, dim]`."""
    wire = wire or PLAIN
    outgoing = tf.reshape(ops.gather_rows(owned, routing.slot_to_unique),
                          [layout.num_shards, routing.capacity, layout.dim])
    if differentiable:
        # The gradient goes back to each owner for the rows received from it: splits[j].
        incoming = wire.differentiable_exchange(outgoing, collectives, tag + "/rows",
                                                routing.bucket, routing.received, routing.splits)
    else:
        incoming = wire.exchange(wire.forward, "forward", outgoing, collectives, tag + "/rows",
                                 routing.bucket, routing.received)
    return tf.reshape(incoming, [-1, layout.dim])


def local_lookup(source, ids, tag):
    """Rows of `ids` from a source that is not split over workers (one shard)."""
    keys, _, inverse = ops.route_keys(ids, 1, source.layout.vocab_size, tag)
    return ops.gather_rows(source.gather(keys), inverse)


def sharded_lookup(source, ids, collectives, tag, hint, wire=None):
    """Returns `table_full[ids]` (`[n, dim]`) for a vector of int64 (fused) `ids` of `source`
    through one synchronous exchange (every stage, in order), on `wire` (None: fp32)."""
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    layout = source.layout
    if layout.num_shards == 1:
        return local_lookup(source, ids, tag)
    routing = route(ids, layout, collectives, tag, hint, wire=wire)
    owned = source.gather(routing.local_rows)  # IndexedSlices gradient on owned rows only
    incoming = exchange_rows(owned, routing, layout, collectives, tag, wire=wire)
    return ops.gather_rows(incoming, tf.gather(routing.slot_of_bucket_pos, routing.inverse))
