"""Key routing: requester-side dedup + bucket-by-owner, owner-side dedup (round by round),
and the requester's layout of a frozen window."""
from typing import NamedTuple

import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library


def route_keys(ids, num_shards, vocab_size, table_name=""):
    """Dedups a vector of int64 ids and buckets the unique ids by owner (id mod num_shards).

    Returns `(bucketed_keys, split_sizes, inverse)`: unique ids grouped by owner, the count per
    owner, and for each input position the index of its id in `bucketed_keys`. Ids outside
    `[0, vocab_size)` raise `InvalidArgumentError` naming `table_name` and the id.
    """
    ids = tf.convert_to_tensor(ids, tf.int64)
    return load_op_library().nestpipe_route_keys(
        ids, num_shards=num_shards, vocab_size=vocab_size, table_name=table_name)


def check_ids(ids, vocab_size, table_name=""):
    """`ids` (int64), after checking that each lies in `[0, vocab_size)`: an out-of-range id
    raises `InvalidArgumentError` naming `table_name`, the id and its position."""
    return load_op_library().nestpipe_check_ids(tf.convert_to_tensor(ids, tf.int64),
                                                vocab_size=vocab_size, table_name=table_name)


def fuse_ids(ids, vocab_sizes, offsets, table_names, segment_ends=None):
    """The lookups of one exchange in one fused id space, in one op: `ids[i]` (int64, any
    shape, read flat) checked against `[0, vocab_sizes[i])` (0: not checked; an out-of-range id
    raises `InvalidArgumentError` naming `table_names[i]`, the id and its position), plus
    `offsets[i]`, all inputs one after another. Returns `(fused, sizes, segment_sizes)`:
    `sizes[i]` (int32) the ids of input i; the inputs are cut into segments (a frozen window's
    rounds) ending after input `segment_ends[s] - 1` (default: one segment), `segment_sizes[s]`
    (int32) the ids of segment s."""
    ids = [tf.convert_to_tensor(t, tf.int64) for t in ids]
    segment_ends = [len(ids)] if segment_ends is None else [int(e) for e in segment_ends]
    return load_op_library().nestpipe_fuse_ids(
        ids, vocab_sizes=[int(v) for v in vocab_sizes], offsets=[int(o) for o in offsets],
        table_names=list(table_names), segment_ends=segment_ends)


def owner_rounds(received_keys, sent, capacities, num_shards, shard_index, row_offsets=(0,)):
    """The owner's side of one keys exchange that carried one or more rounds (a frozen
    window's micro-batches; one round for a plain route).

    `received_keys` `[W, n]`: requester i's keys for this owner, round after round, then -1;
    `sent` `[W, rounds]` (int32): the keys of round r requester i sent; `capacities` `[rounds]`
    (int32): the slots per requester of round r's rows exchange (>= every `sent[:, r]`);
    `row_offsets` (int64 `[T]`, ascending from 0): the first local row of each table sharing
    the row space (`read_table_rows`' layout; one table by default).
    Returns `(local_rows, slot_to_unique, table_sizes)`, lists with one tensor per round: round
    r's distinct local rows (key // num_shards), grouped by table (table 0's first), first seen
    in slot order within a table; for each of its `W * capacities[r]` slots (requester i's k-th
    key at `i * capacities[r] + k`), its index into `local_rows[r]` (-1 for an empty slot); and
    the rows of each table (int32 `[T]`). A key owned by another shard raises `InternalError`.
    """
    sent = tf.convert_to_tensor(sent, tf.int32)
    rounds = sent.shape[1]
    if rounds is None:
        raise ValueError("owner_rounds needs the number of rounds statically (sent's dim 1)")
    local_rows, slot_to_unique, table_sizes = load_op_library().nestpipe_owner_rounds(
        tf.convert_to_tensor(received_keys, tf.int64), sent,
        tf.convert_to_tensor(capacities, tf.int32), tf.convert_to_tensor(row_offsets, tf.int64),
        num_shards=num_shards, shard_index=shard_index, rounds=rounds)
    return list(local_rows), list(slot_to_unique), list(table_sizes)


def window_layout(inverse, splits, round_sizes):
    """The requester's layout of a frozen window routed as one keys exchange, from
    `route_keys(ids)`'s `inverse` (each id -> its key) and `splits` (keys per owner, an
    owner's keys first-seen, so in round order) and `round_sizes` (ids per round; the rounds'
    ids lie one after another). Returns (`counts` `[W, rounds]`: the keys first read by round r
    owned by shard j; `window_inverse` `[ids]`: each id's row in the window, the rounds' new
    keys one round after another, a round's keys in key (owner) order)."""
    return load_op_library().nestpipe_window_layout(
        tf.convert_to_tensor(inverse, tf.int32), tf.convert_to_tensor(splits, tf.int32),
        tf.convert_to_tensor(round_sizes, tf.int32))


def capacity_bucket(capacity, capacities):
    """`(bucket, padded)` (int32, `capacity`'s shape): for each capacity, the index of the
    smallest entry of `capacities` (a strictly increasing list of ints) >= it, and that entry. A
    capacity above the largest entry raises `InvalidArgumentError`."""
    return load_op_library().nestpipe_capacity_bucket(tf.cast(capacity, tf.int32),
                                                      capacities=list(capacities))


def keys_block(keys, splits, header, rider, hint_bucket, capacities):
    """The first keys all-to-all's block, in one op: returns `(block [W, H + R + key_capacity]
    int64, send_counts [W], bucket, key_capacity)` (int32). `keys` are bucketed by owner
    (`splits`); the exchange is padded to the bucketed capacity (`capacities`, as
    `capacity_bucket`) of R + `capacities[hint_bucket]`, R = `rider`'s width (`[W, R]` int64;
    `[W, 0]` for none). Row j: `header` (`[H]`), `rider[j]`, owner j's first
    min(splits[j], key_capacity) keys, then -1; `send_counts[j]` the entries that carry data."""
    return load_op_library().nestpipe_keys_block(
        tf.convert_to_tensor(keys, tf.int64), tf.convert_to_tensor(splits, tf.int32),
        tf.convert_to_tensor(header, tf.int64), tf.convert_to_tensor(rider, tf.int64),
        tf.convert_to_tensor(hint_bucket, tf.int32), capacities=list(capacities))


class RouteCounts(NamedTuple):
    """What a worker learns from a route's keys all-to-all (`route_counts`): `largest` (the
    most keys any requester sent any owner, all rounds), `sent` `[W, rounds]` (keys requester i
    sent this worker in round r), `capacities` `[rounds]` (each round's rows exchange slots per
    requester), `shares` `[W]` (each sender's share entry), and per round (lists): `splits`
    (this worker's keys per owner), `received` (`sent[:, r]`), `buckets`, `capacity` and
    `keys` (this worker's distinct keys of the round), all int32; then the exchange's columns
    behind the headers, int64: `rider` `[W, R]` and `keys_received` (each sender's keys and
    their padding)."""

    largest: tf.Tensor
    sent: tf.Tensor
    capacities: tf.Tensor
    shares: tf.Tensor
    splits: list
    received: list
    buckets: list
    capacity: list
    keys: list
    rider: tf.Tensor
    keys_received: tf.Tensor


def route_counts(received, counts, shard_index, capacities, rider_width=0):
    """One op: a `RouteCounts` from the keys all-to-all as received (`[W, n]` int64, row i
    headed by sender i's counts `[W, rounds]` flattened owner-major, then its share, then its
    `rider_width` rider columns, then its keys) and this worker's own `counts` (`[W, rounds]`
    int32, rounds static); round r's capacity is the bucketed capacity (`capacities`, as
    `capacity_bucket`) of max(1, the most keys any requester sent any owner in round r)."""
    counts = tf.convert_to_tensor(counts, tf.int32)
    rounds = counts.shape[1]
    if rounds is None:
        raise ValueError("route_counts needs the number of rounds statically (counts' dim 1)")
    out = load_op_library().nestpipe_route_counts(
        tf.convert_to_tensor(received, tf.int64), counts,
        tf.convert_to_tensor(rider_width, tf.int32), shard_index=shard_index, rounds=rounds,
        capacities=list(capacities))
    return RouteCounts(*out[:4], *(list(part) for part in out[4:9]), *out[9:])


def bucket_slots(splits, capacity):
    """The slot of each bucketed key in a rows exchange (`[sum(splits)]` int32): owner j's
    `splits[j]` keys at slots `j * capacity + 0, 1, ...` (a split above `capacity` raises)."""
    return load_op_library().nestpipe_bucket_slots(tf.convert_to_tensor(splits, tf.int32),
                                                   tf.convert_to_tensor(capacity, tf.int32))


def window_grad_index(routings, capacity):
    """The layout of a frozen window's one reverse all-to-all, from its rounds' `RoutingRecord`s
    (round r's gradient rows for owner j packed behind those of rounds < r, `capacity` slots per
    owner). Returns (`targets`: each round's bucketed keys, round after round -> its packed slot,
    -1 none; `send_counts` `[W]`: rows sent to each owner; `receive_index` `[W * capacity]`:
    as the owner, each packed slot -> its row of `window_rows`, -1 for padding; `window_rows`
    (int64): the distinct rows of the rounds' `local_rows` (a row two requesters first read in
    different rounds is in both), grouped by table, first seen in round order within a table;
    `window_table_sizes` (int32 `[T]`): the rows of each table among them)."""
    def ints(name):
        return [tf.cast(getattr(r, name), tf.int32) for r in routings]

    return load_op_library().nestpipe_window_grad_index(
        ints("slot_of_bucket_pos"), ints("splits"), ints("slot_to_unique"), ints("received"),
        [tf.cast(r.local_rows, tf.int64) for r in routings], ints("table_sizes"),
        tf.stack(ints("capacity")), tf.cast(capacity, tf.int32))


tf.no_gradient("NestpipeCheckIds")
tf.no_gradient("NestpipeFuseIds")
tf.no_gradient("NestpipeRouteKeys")
tf.no_gradient("NestpipeKeysBlock")
tf.no_gradient("NestpipeRouteCounts")
tf.no_gradient("NestpipeOwnerRounds")
tf.no_gradient("NestpipeWindowLayout")
tf.no_gradient("NestpipeBucketSlots")
tf.no_gradient("NestpipeCapacityBucket")
tf.no_gradient("NestpipeWindowGradIndex")
