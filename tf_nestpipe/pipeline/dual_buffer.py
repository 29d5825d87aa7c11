"""Dual-Buffer Pipeline stages for one exchange (docs/design/design.md §3). `tables` is the
exchange's row source (`FusedTables`: one table or a group fused in one id space).

- `fetch`: retrieval (stage 4) of a batch's routed fused ids (routing, stage 3, is
  `sharding.lookup.route` / `route_rounds`), reading the tables before any later update. The
  result is a `PrefetchedRows` buffer: one row per unique id plus the routing its backward pass
  needs. Under DBP it also plans the sync: the owner finds
  which prefetched slots hold rows that the current batch updates (keys updated ∩ keys
  prefetched; only routing data, so before the update finishes), and the counts ride on the rows
  all-to-all, so the sync's padded size is agreed without a collective of its own. On the
  exact wire that all-to-all leaves the planned rows out (they would only be overwritten):
  each owner's part of the buffer holds the other rows first, until the sync moves them into
  place, and every row crosses the network once per step.
- sync: after the update, the owner sends just those rows, fresh (`sync_payload`); the
  requester copies them into its prefetch buffer (`patch_buffers`). The payload rides on the
  next step's keys all-to-all (`sync_rider`: it is read at the start of the next step, after
  the update, and patched in before that step's compute; the drain's step prefetches the last
  batch again for it) or, for a group the next batch's keys exchanges do not carry, travels in
  an exchange of its own (`apply_sync`).
- `lookup_from_buffer`: the compute stage reads a buffer; its gradient goes back to the owners by
  the reverse all-to-all, as in the synchronous lookup.

`wire` (a `collectives.wire.Wire`, None: fp32 uncounted) encodes the prefetched rows (forward)
and the gradients (backward). With a compressed forward the sync plan's counts travel as bit
copies in the encoded block's header entries, and the sync's fresh rows are encoded too (they
are rows sent to a requester like any other) while their slot positions travel as exact bit
copies next to them; with fp32 both are float columns, as before (exact below 2**24).
"""
from typing import NamedTuple

import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.collectives.communication import EXCHANGE_CAPACITIES, capacity_bucket
from tf_nestpipe.collectives.wire import (PLAIN, from_int32_bits, header_rows, int32_bits,
                                          pack_header, unpack_header)
from tf_nestpipe.sharding.lookup import fetched_rows
from tf_nestpipe.sharding.records import PrefetchedRows

# Float32 carries the slot position next to each synced row; exact below 2**24.
_MAX_EXACT_POSITION = 1 << 24


# Rows prefetched with a sync plan travel behind this many header rows per block (column 0):
# the owner's sync count for that requester and its largest sync count over all requesters.
_SYNC_HEADER_ROWS = 2


def check_dtype(tables, tag):
    """Refuses tables the pipelines cannot buffer (the sync's positions ride as floats)."""
    if tables.dtype not in (tf.float32, tf.float64):
        raise ValueError("the pipelines need float32 or float64 tables; '%s' is %s"
                         % (tag, tables.dtype.name))


def fetch(tables, routing, collectives, tag, updated_rows=None, all_updated=False, wire=None):
    """Retrieval (stage 4) of a routed exchange (`routing`, a `RoutingRecord` of
    `sharding.lookup.route` or `route_rounds`): the owners' rows, read before any later update;
    returns `(PrefetchedRows, plan, sent)`, `sent` the owner's blocks handed to the rows
    all-to-all (a reader that should wait until they are on their way depends on it).

    With `updated_rows` (the local rows the batch computed meanwhile updates), the owner also
    plans the buffer sync: which prefetched slots hold one of those rows (every slot if
    `all_updated`). Its counts ride on the rows all-to-all (a header per block), so every worker
    learns the largest and agrees the sync's padded size with no collective of its own. The
    plan is None without `updated_rows`."""
    wire = wire or PLAIN
    layout = tables.layout
    # One op reads the rows (no partition / gather per table / stitch). The buffer read's own
    # gradient path (`lookup_from_buffer`) reads no row (`FusedTables.gradient_carrier`).
    owned = tables.read_rows(routing.local_rows)
    if updated_rows is None:
        rows, sent = fetched_rows(owned, routing, layout, collectives, tag, wire=wire)
        return PrefetchedRows(routing, rows), None, sent
    num_shards, dim = layout.num_shards, layout.dim
    slots, counts, kept = ops.sync_plan(routing.slot_to_unique, routing.local_rows,
                                        updated_rows, num_shards, all_updated=all_updated)
    if wire.forward.exact:
        rows, largest, sent = _rows_with_plan_fp32(owned, routing, counts, kept, collectives,
                                                   tag, wire, num_shards, dim)
    else:
        rows, largest, sent = _rows_with_plan_encoded(owned, routing, counts, collectives, tag,
                                                      wire, num_shards, dim)
    # One op: the sync's padded size (every owner's largest count, bucketed) and the slots cut
    # or padded to it; the sync (apply_sync) sends each row's slot position in a float column,
    # so a prefetch of 2**24 slots or more per requester is refused.
    slots, bucket, capacity, rows_sent = ops.sync_plan_pad(
        slots, largest, counts, EXCHANGE_CAPACITIES, max_slots=_MAX_EXACT_POSITION)
    plan = {"slots": slots, "bucket": bucket, "capacity": capacity, "rows_sent": rows_sent}
    return PrefetchedRows(routing, rows), plan, sent


def _rows_with_plan_fp32(owned, routing, counts, kept, collectives, tag, wire, num_shards, dim):
    """The rows all-to-all headed by the sync counts as float rows (exact below 2**24), without
    the planned rows (`kept`: the other slots' rows, `sync_plan`): the sync sends those once,
    fresh, so each crosses the network once, as without a pipeline. Returns (the received rows,
    one per bucketed unique id, each owner's part holding its kept rows first: the sync moves
    them into place, `patch_buffers`; every owner's largest sync count; the blocks sent). The
    blocks are gathered behind their header rows and read past them by two ops, never
    concatenated or sliced (each a copy of the whole exchange)."""
    header = ops.sync_header(counts, dim, owned.dtype)  # [W, 2, dim]
    outgoing = ops.gather_blocks(owned, kept, header)
    # Its own tag: instance keys fix a shape, and these blocks are 2 rows longer.
    send_counts = _SYNC_HEADER_ROWS + routing.received - counts
    with tf.control_dependencies(wire.count("forward", outgoing, collectives, send_counts)):
        received = collectives.all_to_all(outgoing, tag + "/rows_with_plan", routing.bucket,
                                          send_counts=send_counts)
    rows = ops.gather_from_blocks(received, routing.slot_of_bucket_pos, _SYNC_HEADER_ROWS)
    return rows, received[:, 1, 0], outgoing  # every owner's largest count


def _rows_with_plan_encoded(owned, routing, counts, collectives, tag, wire, num_shards, dim):
    """`_rows_with_plan_fp32` in the wire's forward encoding: the counts ride as bit copies in
    header entries of the encoded block (exact at any size)."""
    codec = wire.forward
    rows = codec.encode(tf.reshape(ops.gather_rows(owned, routing.slot_to_unique),
                                   [num_shards, routing.capacity, dim]), wire.stats)
    header_counts = tf.stack([counts, tf.fill([num_shards], tf.reduce_max(counts))], 1)
    header = pack_header(header_counts, codec.wire_width(dim), rows.dtype)
    head = header_rows(2, codec.wire_width(dim), rows.dtype)
    outgoing = tf.concat([header, rows], axis=1)
    send_counts = head + routing.received
    with tf.control_dependencies(wire.count("forward", outgoing, collectives, send_counts)):
        received = collectives.all_to_all(outgoing, codec.tag(tag + "/rows_with_plan"),
                                          routing.bucket, send_counts=send_counts)
    incoming = tf.reshape(codec.decode(received[:, head:], dim, owned.dtype), [-1, dim])
    largest = unpack_header(received[:, :head], 2)[:, 1]  # every owner's largest count
    return ops.gather_rows(incoming, routing.slot_of_bucket_pos), largest, outgoing


class SyncPayload(NamedTuple):
    """The owner's side of one group's buffer sync (`sync_payload`): `block` `[W, C, K]` (each
    requester's fresh rows with their slot positions, in the wire's forward encoding, then
    padding whose position is -1), `send_counts` `[W]` (entries of each block that carry
    rows) and `bucket` (the instance-key offset of the padded size C)."""

    block: tf.Tensor
    send_counts: tf.Tensor
    bucket: tf.Tensor


def sync_payload(tables, prefetched_rounds, plans, wire=None):
    """Owner side of the sync of one group's buffers (`prefetched_rounds`, round order, each
    with its `plans` entry from `fetch`), after the update: the planned rows read fresh, as a
    `SyncPayload`. One round: its rows and positions (`_fresh_payload`); a frozen window's
    rounds: every round's rows for a requester packed behind each other, their positions offset
    by the capacities of the rounds before (`[0, capacity_0)` round 0's slots, then round 1's,
    ...). The requester patches them in with `patch_buffers`; the payload travels in an
    exchange of its own (`apply_sync`) or rides on another (`sync_rider`)."""
    wire = wire or PLAIN
    if len(prefetched_rounds) == 1:
        payload, counts = _fresh_payload(tables, prefetched_rounds[0].routing, plans[0]["slots"])
        if not wire.forward.exact:  # fp32: the payload's float position column as it is
            payload = _encoded_payload(payload, plans[0]["slots"], tables.layout.dim, wire)
        return SyncPayload(payload, counts, plans[0]["bucket"])
    payloads, counts = [], []
    base = tf.constant(0, tf.int32)
    for prefetched, plan in zip(prefetched_rounds, plans):
        slots = plan["slots"]
        payload, sync_counts = _fresh_payload(tables, prefetched.routing, slots)
        offset = tf.where(slots >= 0, slots + base, -1)
        payloads.append(_encoded_payload(payload, offset, tables.layout.dim, wire))
        counts.append(sync_counts)
        base = base + prefetched.routing.capacity
    tf.debugging.assert_less(base, _MAX_EXACT_POSITION,
                             message="window capacity too large for the float position column")
    bucket, capacity = capacity_bucket(tf.maximum(tf.add_n([p["capacity"] for p in plans]), 1))
    return SyncPayload(ops.pack_per_peer(payloads, counts, capacity), tf.add_n(counts), bucket)


def _encoded_payload(payload, positions, dim, wire):
    """A fresh payload (`[W, cap_s, dim + 1]`: rows, then the float position) with `positions`
    in its position column, in `wire`'s forward encoding (positions as exact bit copies)."""
    codec = wire.forward
    if codec.exact:
        return tf.concat([payload[..., :dim], tf.cast(positions, payload.dtype)[..., None]], -1)
    encoded = codec.encode(payload[..., :dim], wire.stats)
    return tf.concat([encoded, int32_bits(positions, encoded.dtype)], axis=-1)


def patch_buffers(tables, prefetched_rounds, received, wire=None):
    """Requester side of a sync: `received` (`[W, C, K]`, row i the `SyncPayload.block` owner i
    sent this worker) patched into the buffers `prefetched_rounds` (round order). Returns (the
    patched buffers, the number of rows received, int64)."""
    wire = wire or PLAIN
    codec = wire.forward
    dim = tables.layout.dim
    single = len(prefetched_rounds) == 1
    if codec.exact and single:
        prefetched = prefetched_rounds[0]
        patched, count = ops.apply_sync_payload(prefetched.rows, received,
                                                prefetched.routing.splits, kept_first=True)
        return [prefetched._replace(rows=patched)], tf.cast(count, tf.int64)
    if codec.exact:
        rows, position = received[..., :dim], tf.cast(received[..., dim], tf.int32)
    else:
        row_width = codec.wire_width(dim)
        rows = codec.decode(received[..., :row_width], dim, tables.dtype)
        position = from_int32_bits(received[..., row_width:])
    patched, total = [], tf.constant(0, tf.int64)
    low = tf.constant(0, tf.int32)
    for prefetched in prefetched_rounds:
        high = low + prefetched.routing.capacity
        mine = position if single else tf.where((position >= low) & (position < high),
                                                position - low, -1)
        if codec.exact:
            buffer_rows, count = ops.apply_sync_payload(
                prefetched.rows, tf.concat([rows, tf.cast(mine, rows.dtype)[..., None]], -1),
                prefetched.routing.splits, kept_first=True)
            synced = prefetched._replace(rows=buffer_rows)
        else:
            synced, count = _patch_at_positions(prefetched, rows, mine)
        patched.append(synced)
        total += tf.cast(count, tf.int64)
        low = high
    return patched, total


def apply_sync(tables, prefetched_rounds, plans, collectives, tag, wire=None):
    """After the update, in an exchange of its own: owners send the planned rows of one group's
    buffers, fresh (`sync_payload`); requesters patch them in (`patch_buffers`). Returns the
    patched buffers (round order) and the number of rows this worker received."""
    wire = wire or PLAIN
    payload = sync_payload(tables, prefetched_rounds, plans, wire)
    with tf.control_dependencies(wire.count("sync", payload.block, collectives,
                                            payload.send_counts)):
        received = collectives.all_to_all(payload.block, wire.forward.tag(tag + "/sync"),
                                          payload.bucket, send_counts=payload.send_counts,
                                          fill=-1)  # the position column's padding is -1
    return patch_buffers(tables, prefetched_rounds, received, wire)


def sync_rider(payload, collectives, wire=None):
    """`payload` (a `SyncPayload`) as the int64 rider of another all-to-all (`sharding.lookup.
    route`'s keys exchange): the whole padded block, as bit copies (`ops.to_int64_words`, one
    op). Counts its bytes as the sync's. Read what arrives with `from_sync_rider`."""
    wire = wire or PLAIN
    with tf.control_dependencies(wire.count("sync", payload.block, collectives,
                                            payload.send_counts)):
        return ops.to_int64_words(payload.block)


def from_sync_rider(received, payload):
    """The `[W, C, K]` sync blocks this worker received as a rider (`sync_rider`), shaped and
    typed as its own `payload` (every worker's is)."""
    return ops.from_int64_words(received, payload.block.dtype, tf.shape(payload.block))


def _fresh_payload(tables, routing, slots):
    """Owner side of a sync: `(payload [W, cap_s, dim + 1], sync_counts [W])`, the planned
    `slots`' rows read fresh, each followed by its slot position (`ops.sync_payload`). Only the
    planned positions are read (a lookup may own no rows at all: gather nothing)."""
    rows_to_send, sync_counts = ops.sync_rows(slots, routing.slot_to_unique, routing.local_rows)
    return ops.sync_payload(tables.read_rows(rows_to_send), slots), sync_counts


def _patch_at_positions(prefetched, rows, position):
    """Requester side of an encoded sync: `prefetched` with each decoded row of `rows`
    (`[W, cap_s, dim]`) copied to its owner's offset + `position` (-1: none), and the count."""
    offsets = tf.cumsum(prefetched.routing.splits, exclusive=True)
    target = tf.where(position >= 0, offsets[:, None] + position, -1)
    patched = ops.buffer_sync(prefetched.rows, tf.reshape(target, [-1]),
                              tf.reshape(rows, [-1, rows.shape[-1]]))
    return prefetched._replace(rows=patched), tf.reduce_sum(tf.cast(position >= 0, tf.int64))


def lookup_from_buffer(tables, prefetched, collectives, tag, wire=None, distinct=False,
                       sizes=None, num=1):
    """Compute stage: the buffer's rows of every id it was routed for, in order, as `num` pieces
    of `sizes` rows (one piece: all of them); with `distinct`, its distinct rows instead, in
    bucketed order, for a frozen window's own indexing (one piece). The gradient flows to the
    owners' rows through the reverse all-to-all (an `IndexedSlices` gradient of each table) in
    `wire`'s backward encoding: the pieces' gradients are summed straight into the exchange's
    slots, in one op.

    Args:
      tables: The exchange's `FusedTables`.
      prefetched: The `PrefetchedRows` buffer.
      collectives: The exchange's collectives.
      tag: The gradient exchange's tag prefix.
      wire: A `collectives.wire.Wire` (None: fp32).
      distinct: Whether to give the buffer's distinct rows (one piece) rather than a row per
        id routed.
      sizes: int32 `[num]` summing to `n`: each piece's rows (None with `num` 1).
      num: The number of pieces (static).

    Returns:
      A list of `num` tensors, `[sizes[i], dim]`.

    Raises:
      ValueError: `distinct` with more than one piece.
    """
    wire = wire or PLAIN
    num_shards, dim = tables.layout.num_shards, tables.layout.dim
    routing = prefetched.routing
    if distinct and num != 1:
        raise ValueError("lookup_from_buffer gives a buffer's distinct rows as one piece, got "
                         "num=%d" % num)
    # The gradient path to the rows; one round's local rows are distinct and grouped by table
    # (`ops.owner_rounds`).
    owned = tables.gradient_carrier(routing.local_rows, distinct_rows=True,
                                    table_sizes=routing.table_sizes)

    @tf.custom_gradient
    def active_rows(owned_rows):
        del owned_rows  # the values come from the buffer; only the gradient path is needed
        if distinct:
            pieces = [tf.identity(prefetched.rows)]
        else:
            rows = ops.gather_rows(prefetched.rows, routing.inverse)
            pieces = [rows] if num == 1 else tf.split(rows, sizes, num=num)

        def grad(*d_pieces):
            # Each row's slot in the exchange: its distinct row's.
            slots = routing.slot_of_bucket_pos if distinct else routing.id_slots()
            d_slots = ops.segment_sum(ops.dense_pieces(d_pieces, pieces), slots,
                                      num_shards * routing.capacity)
            back = wire.exchange(wire.backward, "backward",
                                 tf.reshape(d_slots, [num_shards, routing.capacity, dim]),
                                 collectives, tag + "/rows/grad", routing.bucket,
                                 send_counts=routing.splits)
            return ops.segment_sum(tf.reshape(back, [-1, dim]), routing.slot_to_unique,
                                   tf.size(routing.local_rows))

        return pieces, grad

    return active_rows(owned)


def lookup_window_from_buffers(tables, prefetched_rounds, collectives, tag, wire=None):
    """Compute stage of a frozen window: `lookup_from_buffer` of each round's buffer (in round
    order; the buffers of `route_rounds`, whose `inverse` is the identity), with one reverse
    all-to-all for the gradients of all rounds instead of one per round.

    Round r's rows are its buffer's own values (they never wait for a later round's exchange);
    only their gradients meet, after the window's last backward, in one exchange: to each owner
    every round's gradient rows for it, round by round, packed behind each other. Each owner sums
    them straight into the window's distinct rows (a row two requesters first read in different
    rounds is one row; `ops.window_grad_index`), grouped by table as a single round's rows are:
    each table's gradient is a split of the window's, not a partition, and marked distinct, so
    no optimizer sums duplicates again."""
    wire = wire or PLAIN
    num_shards, dim = tables.layout.num_shards, tables.layout.dim
    routings = [prefetched.routing for prefetched in prefetched_rounds]
    sizes = tf.stack([tf.shape(prefetched.rows, out_type=tf.int32)[0]
                      for prefetched in prefetched_rounds])
    bucket, capacity = capacity_bucket(tf.add_n([r.capacity for r in routings]))
    targets, send_counts, receive, window_rows, table_sizes = ops.window_grad_index(routings,
                                                                                    capacity)
    owned = tables.gradient_carrier(window_rows, distinct_rows=True, table_sizes=table_sizes)

    @tf.custom_gradient
    def window_carrier(owned_rows):
        # Only the gradient path: every round's values come from its buffer.
        window_count = tf.shape(owned_rows, out_type=tf.int32)[0]

        def grad(d_window):
            # To each owner every round's slot gradients, packed in round order; each goes
            # straight to its packed position, and each packed row to its window row.
            outgoing = tf.reshape(ops.segment_sum(tf.convert_to_tensor(d_window), targets,
                                                  num_shards * capacity),
                                  [num_shards, capacity, dim])
            back = wire.exchange(wire.backward, "backward", outgoing, collectives,
                                 tag + "/window/grad", bucket, send_counts=send_counts)
            return ops.segment_sum(tf.reshape(back, [-1, dim]), receive, window_count)

        return tf.zeros([tf.reduce_sum(sizes), dim], tables.dtype), grad

    carriers = tf.split(window_carrier(owned), sizes, num=len(routings))
    # A window round's buffer holds its new ids in their own order (`route_rounds`: its
    # `inverse` is the identity), so its rows are the round's output as they are.
    return [_round_rows(carrier, prefetched.rows)
            for prefetched, carrier in zip(prefetched_rounds, carriers)]


def _round_rows(carrier, rows):
    """`rows` (a buffer's values), whose gradient flows to `carrier` (its part of the window)."""
    @tf.custom_gradient
    def round_rows(part):
        del part

        def grad(d_rows):
            return tf.convert_to_tensor(d_rows)

        return tf.identity(rows), grad

    return round_rows(carrier)
