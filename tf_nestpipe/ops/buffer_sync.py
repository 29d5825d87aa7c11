"""Dual-Buffer Pipeline ops: the owner's sync plan and the requester's buffer patch."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library


def sync_plan(slot_to_unique, local_rows, updated_rows, num_requesters, all_updated=False):
    """Returns `(sync_slots [W, capacity], sync_counts [W], kept_slot_to_unique [W * capacity])`:
    for each requester, the positions of its prefetched slots whose row is in `updated_rows` (all
    valid slots if `all_updated`), compacted left and padded with -1; and `slot_to_unique`
    without those slots (each requester's others in slot order, compacted left, -1 padded)."""
    return load_op_library().nestpipe_sync_plan(
        tf.cast(slot_to_unique, tf.int32), tf.cast(local_rows, tf.int64),
        tf.cast(updated_rows, tf.int64), num_requesters=num_requesters, all_updated=all_updated)


def sync_header(sync_counts, dim, dtype):
    """`[W, 2, dim]` `dtype` header rows of a prefetch with a sync plan (`gather_blocks`' header):
    per requester its `sync_counts` entry (row 0) and the largest entry (row 1), in column 0 as
    floats (exact below 2**24), zeros elsewhere. One op."""
    return load_op_library().nestpipe_sync_header(tf.cast(sync_counts, tf.int32), dim=int(dim),
                                                  T=dtype)


def sync_plan_pad(sync_slots, largest, sync_counts, capacities, max_slots=0):
    """Finishes a `sync_plan` once every owner's largest count is known: returns `(slots [W, C],
    bucket, C, rows_sent)` (int32), C the bucketed capacity (`capacities`, as `capacity_bucket`)
    of max(max(`largest`), 1) (`largest`: float or int32 values, e.g. the counts the owners
    sent in their headers), `sync_slots` cut or padded with -1 to C columns, and the sum of
    `sync_counts`. With `max_slots` > 0 a `sync_slots` of `max_slots` columns or more raises
    (the sync's positions travel as floats). One op."""
    return load_op_library().nestpipe_sync_plan_pad(
        tf.cast(sync_slots, tf.int32), largest, tf.cast(sync_counts, tf.int32),
        capacities=list(capacities), max_slots=int(max_slots))


def buffer_sync(buffer, positions, fresh_rows):
    """Returns `buffer` with row `positions[k]` replaced by `fresh_rows[k]` (-1 skipped)."""
    return load_op_library().nestpipe_buffer_sync(buffer, tf.cast(positions, tf.int32), fresh_rows)


def gather_blocks(params, indices, header):
    """`[W, H + capacity, dim]`: for each of the W = `header.shape[0]` blocks, its `H` header rows
    then `params[indices]` of its `capacity = len(indices) / W` indices (a zero row for -1):
    what `tf.concat([header, reshape(gather_rows(params, indices), [W, capacity, dim])], 1)`
    gives, written once."""
    return load_op_library().nestpipe_gather_blocks(params, tf.cast(indices, tf.int32), header)


def gather_from_blocks(blocks, indices, header_rows):
    """Rows at flat positions `indices` (-1: a zero row) of the data rows of `blocks`
    (`[W, header_rows + capacity, dim]`): what `gather_rows(reshape(blocks[:, header_rows:],
    [-1, dim]), indices)` gives, without the slice's copy."""
    return load_op_library().nestpipe_gather_from_blocks(blocks, tf.cast(indices, tf.int32),
                                                         header_rows=header_rows)


def sync_rows(sync_slots, slot_to_unique, local_rows):
    """Owner side of the sync: `(rows, sync_counts)`, the local rows of every planned slot of
    `sync_slots` (`[W, cap_s]`, a `sync_plan`), requester by requester, and how many are each
    requester's."""
    return load_op_library().nestpipe_sync_rows(
        tf.cast(sync_slots, tf.int32), tf.cast(slot_to_unique, tf.int32),
        tf.cast(local_rows, tf.int64))


def sync_payload(fresh_rows, sync_slots):
    """`[W, cap_s, dim + 1]`: each requester's fresh rows (`fresh_rows`, in `sync_rows` order)
    compacted left, each followed by its slot position as a float; padding is a zero row with
    position -1."""
    return load_op_library().nestpipe_sync_payload(fresh_rows, tf.cast(sync_slots, tf.int32))


def apply_sync_payload(buffer, received, splits, kept_first=False):
    """Requester side of the sync: `(buffer patched with every received row at its owner's
    offset (the sum of `splits` before it) + its position, the number of rows copied)`. With
    `kept_first`, each owner's part of `buffer` holds only the rows it did not sync, first, in
    slot order: they move to the slots the fresh rows leave free (positions must ascend)."""
    return load_op_library().nestpipe_apply_sync_payload(buffer, received,
                                                         tf.cast(splits, tf.int32),
                                                         kept_first=kept_first)


tf.no_gradient("NestpipeSyncPlan")
tf.no_gradient("NestpipeSyncRows")
tf.no_gradient("NestpipeSyncPayload")
tf.no_gradient("NestpipeApplySyncPayload")
tf.no_gradient("NestpipeGatherBlocks")
tf.no_gradient("NestpipeGatherFromBlocks")
tf.no_gradient("NestpipeBufferSync")
tf.no_gradient("NestpipeSyncHeader")
tf.no_gradient("NestpipeSyncPlanPad")


def pack_per_peer(blocks, lengths, capacity):
    """`[W, capacity, ...]`: per worker j, the first `lengths[r][j]` entries of `blocks[r][j]`
    (each `[W, capacity_r, ...]`, one dtype) for r in order, then entries of -1; one op (a
    frozen window's sync payload: every round's fresh rows for a requester behind each other).
    A length outside `[0, capacity_r]` or a worker's total above `capacity` raises."""
    lengths = [tf.convert_to_tensor(length) for length in lengths]
    return load_op_library().nestpipe_pack_per_peer(
        list(blocks), [tf.cast(length, lengths[0].dtype) for length in lengths],
        tf.cast(capacity, tf.int32))


tf.no_gradient("NestpipePackPerPeer")
