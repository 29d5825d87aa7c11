"""The row-wise sharder's stages for one exchange (docs/design/design.md §2, §10).

`source` is the row source of the exchange: a `FusedTables` (one table, or every table of one
dim and dtype in one fused id space) with its `layout` and `gather(local_rows)`.

- route: fused dedup + bucket-by-owner (custom op); the keys all-to-all, padded to the tag's
  capacity hint and headed by the sender's split sizes, so every worker learns the whole count
  matrix from it (no separate counts all-gather); if a count exceeded the hint, a second
  all-to-all carries the overflow (every worker sees the same counts, so all take it or none:
  no key is ever dropped); the owner's dedup (custom op). `route_rounds` routes the rounds
  (micro-batches) of a frozen window with one keys exchange: one dedup of the whole window,
  each id fetched by the round that first reads it, one `RoutingRecord` per round.
- fetch: the owner gathers the owned rows (`source.gather`).
- output: the rows all-to-all back to the requesters and the inverse-index rebuild.
- backward (the adjoint): segment-sum per unique key (custom op), the reverse all-to-all and the
  owner's segment-sum into an `IndexedSlices` gradient of its own rows only.

`wire` (a `collectives.wire.Wire`) encodes the rows and gradient exchanges and counts the bytes
every exchange sends (the keys are never compressed); None is fp32, uncounted.
"""
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.collectives.communication import EXCHANGE_CAPACITIES, capacity_bucket
from tf_nestpipe.collectives.wire import PLAIN
from tf_nestpipe.sharding.records import RoutingRecord


def _padded(ragged_keys, width):
    """`[W, None]` ragged keys as a `[W, width]` tensor padded with -1."""
    return ragged_keys.to_tensor(default_value=-1, shape=tf.stack(
        [ragged_keys.nrows(), tf.cast(width, tf.int64)]))


def _send_keys(keys, splits, counts, share_size, layout, collectives, tag, hint, wire,
               rider=None):
    """The keys all-to-all of one route: `keys` (unique, bucketed by owner, `splits[j]` for
    owner j) padded to the tag's capacity hint, each block headed by this worker's `counts`
    (int32 `[W, rounds]`: keys it sends owner j in round r; one round: its splits) and
    `share_size`; if a split exceeded the hint, a second all-to-all carries the overflow (every
    worker sees the same counts, so all take it or none: no key is ever dropped). Returns (the
    `ops.RouteCounts` every sender's header gives, the received keys `[W, width]`, each row its
    sender's keys first, then -1 padding, the received rider).

    `rider` (optional, int64 `[W, R]`, R equal on every worker) travels in the same exchange,
    right behind the header: block j carries `rider[j]` to worker j, and the result's third
    element is `[W, R]`, row i from worker i (None without a rider). The keys then fill the
    bucketed size of R + the hint, so the exchange keeps one shape per instance key."""
    num_shards = layout.num_shards
    share = tf.constant(-1, tf.int64) if share_size is None else tf.cast(share_size, tf.int64)
    header = tf.concat([tf.cast(tf.reshape(counts, [-1]), tf.int64), [share]], 0)
    has_rider = rider is not None
    if not has_rider:
        rider_width, rider = 0, tf.zeros([num_shards, 0], tf.int64)
    else:
        rider = tf.cast(rider, tf.int64)
        rider_width = tf.shape(rider, out_type=tf.int32)[1]
    # One op: the block (header, rider, keys padded to what the bucket leaves them), its
    # entries that carry data, the bucket and the keys' capacity.
    first, first_counts, bucket, key_capacity = ops.keys_block(
        keys, splits, header, rider, hint.read_bucket(), EXCHANGE_CAPACITIES)
    # The keys' bytes without the rider's (its sender counts them as its own kind).
    with tf.control_dependencies(wire.count("keys", first, collectives,
                                            first_counts - rider_width, uncounted=rider_width)):
        received_first = collectives.all_to_all(first, tag + "/keys", bucket,
                                                send_counts=first_counts, fill=-1)
    # One op reads every sender's header: the counts every worker learns alike (so the
    # overflow decision is the same everywhere), this owner's slots, each round's capacity;
    # and splits off each sender's rider and keys.
    arrived = ops.route_counts(received_first, counts, layout.shard_index, EXCHANGE_CAPACITIES,
                               rider_width)
    largest = arrived.largest
    rider_in = arrived.rider if has_rider else None

    def overflow():
        by_owner = tf.RaggedTensor.from_row_lengths(keys, tf.cast(splits, tf.int64))
        extra_bucket, extra_capacity = capacity_bucket(largest - key_capacity)
        rest = _padded(by_owner[:, key_capacity:], extra_capacity)
        rest_counts = tf.maximum(splits - key_capacity, 0)
        with tf.control_dependencies([hint.count_overflow()]
                                     + wire.count("keys", rest, collectives, rest_counts)):
            return collectives.all_to_all(rest, tag + "/keys_overflow", extra_bucket,
                                          send_counts=rest_counts, fill=-1)

    extra = tf.cond(largest > key_capacity, overflow,
                    lambda: tf.fill([num_shards, 0], tf.constant(-1, tf.int64)))
    with tf.control_dependencies([hint.follow(largest)]):
        keys_in = tf.concat([arrived.keys_received, extra], axis=1)
    return arrived, keys_in, rider_in


def route(ids, layout, collectives, tag, hint, share_size=None, wire=None, rider=None,
          row_offsets=(0,)):
    """Route stage for a vector of int64 (fused) `ids` over more than one shard; returns a
    `RoutingRecord`. `hint` is the tag's `CapacityHint` (equal on every worker). `share_size`
    (optional int scalar: this worker's share of the batch) rides in the keys header, so every
    worker learns every worker's (`RoutingRecord.shares`); `wire` counts the keys' bytes.
    With a `rider` (int64 `[W, R]`, see `_send_keys`) it returns `(RoutingRecord, the received
    rider)`: the rider travels in the keys all-to-all, costing no collective of its own.
    `row_offsets`: the first local row of each table sharing the row space
    (`FusedTables.row_offsets`), by which the owner groups its local rows."""
    wire = wire or PLAIN
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    keys, splits, inverse = ops.route_keys(ids, layout.num_shards, layout.vocab_size, tag)
    arrived, keys_in, rider_in = _send_keys(keys, splits, splits[:, None], share_size, layout,
                                            collectives, tag, hint, wire, rider)
    # The rows exchange's slot layout: from requester i, its arrived.received[0][i] keys for
    # this owner, then padding up to the capacity (from every pair's count: equal everywhere).
    local_rows, slot_to_unique, table_sizes = ops.owner_rounds(
        keys_in, arrived.sent, arrived.capacities, layout.num_shards, layout.shard_index,
        row_offsets)
    capacity = arrived.capacity[0]
    record = RoutingRecord(splits=splits, inverse=inverse,
                           slot_of_bucket_pos=ops.bucket_slots(splits, capacity),
                           bucket=arrived.buckets[0], capacity=capacity,
                           local_rows=local_rows[0], slot_to_unique=slot_to_unique[0],
                           received=arrived.received[0], shares=arrived.shares,
                           table_sizes=table_sizes[0])
    return record if rider is None else (record, rider_in)


def route_rounds(ids, round_sizes, layout, collectives, tag, hint, share_size=None, wire=None,
                 rider=None, row_offsets=(0,)):
    """Routes the ids of a frozen window's rounds (micro-batches) with one keys exchange:
    `ids` (int64, the rounds' fused ids one after another, `round_sizes[r]` of round r: a list
    of scalars or an int32 vector of static length) are deduplicated once, each distinct id
    fetched by the round that first reads it. Returns (one `RoutingRecord` per round, whose
    buffer holds that round's new ids in its own bucketed order (its `inverse` is the
    identity); `window_inverse` `[n]`: each id's row among the rounds' buffers concatenated in
    round order).

    Each block of the keys all-to-all carries the sender's `[W, rounds]` count matrix, so every
    worker learns how many keys each requester sends each owner in each round: the owner slices
    each round's keys out of the one exchange, and each round's rows exchange has its own
    padded size, as if the round had been routed alone. With a `rider` (as in `route`) it
    returns `(records, window_inverse, the received rider)`; `row_offsets` as in `route`."""
    wire = wire or PLAIN
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    round_sizes = tf.convert_to_tensor(round_sizes, tf.int32)
    rounds = round_sizes.shape[0]
    if rounds is None:
        raise ValueError("route_rounds needs the number of rounds statically (round_sizes' "
                         "length)")
    keys, splits, inverse = ops.route_keys(ids, layout.num_shards, layout.vocab_size, tag)
    counts, window_inverse = ops.window_layout(inverse, splits, round_sizes)
    arrived, keys_in, rider_in = _send_keys(keys, splits, counts, share_size, layout,
                                            collectives, tag, hint, wire, rider)
    # Each round's rows exchange is padded to its own largest count, as if routed alone; every
    # round's fields come out of the one op that read the headers.
    local_rows, slot_to_unique, table_sizes = ops.owner_rounds(
        keys_in, arrived.sent, arrived.capacities, layout.num_shards, layout.shard_index,
        row_offsets)
    records = []
    for r in range(rounds):
        records.append(RoutingRecord(
            splits=arrived.splits[r], inverse=tf.range(arrived.keys[r]),
            slot_of_bucket_pos=ops.bucket_slots(arrived.splits[r], arrived.capacity[r]),
            bucket=arrived.buckets[r], capacity=arrived.capacity[r], local_rows=local_rows[r],
            slot_to_unique=slot_to_unique[r], received=arrived.received[r],
            shares=arrived.shares, table_sizes=table_sizes[r]))
    return (records, window_inverse) if rider is None else (records, window_inverse, rider_in)


def exchange_rows(owned, routing, layout, collectives, tag, wire=None):
    """Output stage: the owner's `owned` rows (one per `routing.local_rows`) go back to the
    requesters, in `wire`'s forward encoding (its backward one for the gradient). Returns the
    received rows in slot layout, `[num_shards * capacity, dim]`."""
    wire = wire or PLAIN
    outgoing = tf.reshape(ops.gather_rows(owned, routing.slot_to_unique),
                          [layout.num_shards, routing.capacity, layout.dim])
    # The gradient goes back to each owner for the rows received from it: splits[j].
    incoming = wire.differentiable_exchange(outgoing, collectives, tag + "/rows",
                                            routing.bucket, routing.received, routing.splits)
    return tf.reshape(incoming, [-1, layout.dim])


def fetched_rows(owned, routing, layout, collectives, tag, wire=None):
    """Output stage of a prefetch, without a gradient (a buffer's gradient path is its own):
    the owner's `owned` rows (float32 or float64, one per `routing.local_rows`) go back to the
    requesters in `wire`'s forward encoding. Returns (the rows of the requester's bucketed
    unique ids, in order (`[sum(splits), dim]`), the owner's blocks handed to the exchange).
    The owner's blocks are gathered and the requester's rows read out of them in one op each."""
    wire = wire or PLAIN
    no_header = tf.zeros([layout.num_shards, 0, layout.dim], owned.dtype)
    outgoing = ops.gather_blocks(owned, routing.slot_to_unique, no_header)
    incoming = wire.exchange(wire.forward, "forward", outgoing, collectives, tag + "/rows",
                             routing.bucket, routing.received)
    return ops.gather_from_blocks(incoming, routing.slot_of_bucket_pos, 0), outgoing


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
    return ops.gather_rows(incoming, routing.id_slots())
