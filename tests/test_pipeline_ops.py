"""Dual-Buffer Pipeline ops against NumPy references."""
import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe import ops


def sync_plan_reference(slot_to_unique, local_rows, updated, num_requesters, all_updated):
    capacity = len(slot_to_unique) // num_requesters
    plan = -np.ones((num_requesters, capacity), np.int32)
    counts = np.zeros(num_requesters, np.int32)
    kept = -np.ones(num_requesters * capacity, np.int32)
    updated = set(updated.tolist())
    for w in range(num_requesters):
        others = 0
        for p in range(capacity):
            u = slot_to_unique[w * capacity + p]
            if u >= 0 and (all_updated or local_rows[u] in updated):
                plan[w, counts[w]] = p
                counts[w] += 1
            elif u >= 0:
                kept[w * capacity + others] = u
                others += 1
    return plan, counts, kept


@pytest.mark.parametrize("all_updated", [False, True])
def test_sync_plan_matches_numpy(all_updated):
    rng = np.random.default_rng(3)
    local_rows = rng.choice(100, size=12, replace=False).astype(np.int64)
    slot_to_unique = np.where(rng.random(3 * 8) < 0.7, rng.integers(0, 12, 3 * 8), -1).astype(np.int32)
    updated = rng.choice(100, size=30, replace=False).astype(np.int64)
    _check_sync_plan(slot_to_unique, local_rows, updated, 3, all_updated)


def _check_sync_plan(slot_to_unique, local_rows, updated, num_requesters, all_updated):
    """The op against the reference; some but not all valid slots are planned (or all)."""
    plan, counts, kept = ops.sync_plan(slot_to_unique, local_rows, updated, num_requesters,
                                       all_updated=all_updated)
    ref_plan, ref_counts, ref_kept = sync_plan_reference(slot_to_unique, local_rows, updated,
                                                         num_requesters, all_updated)
    np.testing.assert_array_equal(plan.numpy(), ref_plan)
    np.testing.assert_array_equal(counts.numpy(), ref_counts)
    np.testing.assert_array_equal(kept.numpy(), ref_kept)
    assert 0 < ref_counts.sum() < (slot_to_unique >= 0).sum() or all_updated


def test_sync_plan_errors():
    with pytest.raises(tf.errors.InvalidArgumentError, match="not a multiple of 2"):
        ops.sync_plan(tf.constant([0, 1, 2], tf.int32), [1, 2, 3], [1], 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        ops.sync_plan(tf.constant([5, 0], tf.int32), [1], [1], 2)


def test_buffer_sync_copies_only_listed_rows():
    buffer = np.arange(12, dtype=np.float32).reshape(4, 3)
    fresh = -np.arange(9, dtype=np.float32).reshape(3, 3) - 1
    out = ops.buffer_sync(buffer, [3, -1, 0], fresh).numpy()
    expected = buffer.copy()
    expected[3] = fresh[0]
    expected[0] = fresh[2]
    np.testing.assert_array_equal(out, expected)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float64)])
    def in_function(b):
        result = ops.buffer_sync(b, [1], tf.ones([1, 3], tf.float64))
        assert result.shape.as_list() == [None, 3]
        return result

    assert in_function(tf.zeros([2, 3], tf.float64)).numpy()[1].tolist() == [1.0, 1.0, 1.0]


def test_buffer_sync_errors():
    with pytest.raises(tf.errors.InvalidArgumentError, match="position 4 at 0"):
        ops.buffer_sync(tf.zeros([4, 2]), [4], tf.zeros([1, 2]))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="fresh_rows|Dimension"):
        ops.buffer_sync(tf.zeros([4, 2]), [1, 2], tf.zeros([1, 2]))


@pytest.mark.parametrize("all_updated", [False, True])
def test_sync_plan_matches_numpy_at_scale(all_updated):
    """The flat hash set of the updated rows (ops/flat_hash.h) on thousands of rows whose low
    bits collide (strides of 2**20), half of them updated."""
    rng = np.random.default_rng(7)
    local_rows = (rng.choice(1 << 16, size=3000, replace=False).astype(np.int64) << 20)
    slot_to_unique = np.where(rng.random(2 * 4096) < 0.8, rng.integers(0, 3000, 2 * 4096),
                              -1).astype(np.int32)
    updated = np.concatenate([local_rows[:1500], (rng.integers(0, 1 << 16, 1500) << 20) + 1])
    _check_sync_plan(slot_to_unique, local_rows, updated, 2, all_updated)


@pytest.mark.parametrize("all_updated", [False, True])
def test_sync_plan_matches_numpy_on_a_shard_of_dense_rows(all_updated):
    """Local rows as a shard has them (dense indices): the updated rows' bitmap, with prefetched
    rows above the largest updated one (outside the bitmap: never planned unless all_updated)."""
    rng = np.random.default_rng(11)
    local_rows = rng.choice(400_000, size=5000, replace=False).astype(np.int64)
    slot_to_unique = np.where(rng.random(2 * 8192) < 0.7, rng.integers(0, 5000, 2 * 8192),
                              -1).astype(np.int32)
    updated = np.concatenate([np.sort(local_rows)[:2000],  # the lower rows only
                              rng.integers(0, 300_000, 4000)])
    assert local_rows.max() > updated.max()
    _check_sync_plan(slot_to_unique, local_rows, updated, 2, all_updated)


def test_buffer_sync_leaves_a_buffer_held_elsewhere_unchanged():
    """The op patches its input in place only when nothing else holds it: a buffer the caller
    still holds (here an eager tensor) is copied first and keeps its values."""
    buffer = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    out = ops.buffer_sync(buffer, [2], -tf.ones([1, 3]))
    np.testing.assert_array_equal(buffer.numpy(), np.arange(12, dtype=np.float32).reshape(4, 3))
    assert out.numpy()[2].tolist() == [-1.0, -1.0, -1.0]

    @tf.function
    def patched_intermediate(b):
        return ops.buffer_sync(b * 2.0, [0, -1], tf.fill([2, 3], 7.0))  # may patch in place

    np.testing.assert_array_equal(patched_intermediate(buffer).numpy(),
                                  np.concatenate([np.full([1, 3], 7.0, np.float32),
                                                  2 * buffer.numpy()[1:]]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gather_blocks_and_gather_from_blocks_match_concat_and_slice(dtype):
    """The prefetch's owner writes its blocks behind their header rows in one op and the
    requester reads past them in one op: the same values as concat + gather and slice + gather."""
    rng = np.random.default_rng(5)
    params = rng.standard_normal((9, 4)).astype(dtype)
    indices = rng.integers(-1, 9, 3 * 5).astype(np.int32)  # 3 blocks of capacity 5
    header = rng.standard_normal((3, 2, 4)).astype(dtype)
    gathered = np.where(indices[:, None] >= 0, params[np.maximum(indices, 0)], 0)
    expected = np.concatenate([header, gathered.reshape(3, 5, 4)], axis=1)
    blocks = ops.gather_blocks(params, indices, header)
    np.testing.assert_array_equal(blocks.numpy(), expected)
    positions = rng.integers(-1, 15, 11).astype(np.int32)
    data = expected[:, 2:].reshape(-1, 4)
    np.testing.assert_array_equal(
        ops.gather_from_blocks(blocks, positions, 2).numpy(),
        np.where(positions[:, None] >= 0, data[np.maximum(positions, 0)], 0))
    # No header rows: the plain gather.
    np.testing.assert_array_equal(
        ops.gather_from_blocks(expected[:, 2:], positions, 0).numpy(),
        ops.gather_rows(data, positions).numpy())

    @tf.function(input_signature=[tf.TensorSpec([None, 4], dtype), tf.TensorSpec([15], tf.int32),
                                  tf.TensorSpec([3, 2, 4], dtype)])
    def shapes(p, i, h):
        b = ops.gather_blocks(p, i, h)
        assert b.shape.as_list() == [3, 7, 4], b.shape
        r = ops.gather_from_blocks(b, i, 2)
        assert r.shape.as_list() == [15, 4], r.shape
        return r

    shapes(params, indices, header)


def test_gather_blocks_and_gather_from_blocks_errors():
    with pytest.raises(tf.errors.InvalidArgumentError, match="gather index 9 at position 1"):
        ops.gather_blocks(tf.zeros([9, 2]), [0, 9], tf.zeros([1, 1, 2]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="not a multiple of 2 blocks"):
        ops.gather_blocks(tf.zeros([9, 2]), [0, 1, 2], tf.zeros([2, 1, 2]))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="header|Dimension"):
        ops.gather_blocks(tf.zeros([9, 2]), [0, 1], tf.zeros([1, 1, 3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"position 6 at 1 is out of range"):
        ops.gather_from_blocks(tf.zeros([2, 5, 2]), [0, 6], 2)  # 2 blocks of 3 data rows
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="blocks|rank"):
        ops.gather_from_blocks(tf.zeros([2, 1, 2]), [0], 2)


def _sync_case(rng, num_workers=3, capacity=6, cap_s=4, num_unique=9):
    slot_to_unique = np.where(rng.random(num_workers * capacity) < 0.8,
                              rng.integers(0, num_unique, num_workers * capacity), -1).astype(np.int32)
    local_rows = rng.choice(1000, size=num_unique, replace=False).astype(np.int64)
    slots = -np.ones((num_workers, cap_s), np.int32)
    for w in range(num_workers):
        valid = [p for p in range(capacity) if slot_to_unique[w * capacity + p] >= 0]
        chosen = sorted(rng.choice(valid, size=min(len(valid), rng.integers(0, cap_s + 1)),
                                   replace=False).tolist())
        slots[w, :len(chosen)] = chosen
    return slot_to_unique, local_rows, slots, capacity


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sync_rows_payload_and_patch_match_numpy(dtype):
    """The sync's three ops against the ops and NumPy they replace: the owner's planned rows in
    plan order, the payload of rows and float positions (-1 rows of zeros as padding), and the
    requester's patch at each owner's offset."""
    rng = np.random.default_rng(11)
    slot_to_unique, local_rows, slots, capacity = _sync_case(rng)
    rows, counts = ops.sync_rows(slots, slot_to_unique, local_rows)
    expected_rows = [local_rows[slot_to_unique[w * capacity + p]]
                     for w in range(3) for p in slots[w] if p >= 0]
    np.testing.assert_array_equal(rows.numpy(), np.array(expected_rows, np.int64))
    np.testing.assert_array_equal(counts.numpy(), (slots >= 0).sum(1))
    fresh = rng.standard_normal((len(expected_rows), 5)).astype(dtype)
    payload = ops.sync_payload(fresh, slots).numpy()
    expected = np.zeros((3, 4, 6), dtype)
    expected[..., 5] = -1
    k = 0
    for w in range(3):
        for j in range(4):
            if slots[w, j] >= 0:
                expected[w, j, :5], expected[w, j, 5] = fresh[k], slots[w, j]
                k += 1
    np.testing.assert_array_equal(payload, expected)
    # The requester: owner o's rows go to offset sum(splits[:o]) + position.
    splits = np.array([6, 6, 6], np.int32)
    buffer = rng.standard_normal((18, 5)).astype(dtype)
    patched, copied = ops.apply_sync_payload(buffer, payload, splits)
    positions = np.where(slots >= 0, np.cumsum(splits)[:, None] - splits[:, None] + slots, -1)
    reference = ops.buffer_sync(buffer, positions.ravel(), payload[..., :5].reshape(-1, 5))
    np.testing.assert_array_equal(patched.numpy(), reference.numpy())
    assert int(copied) == len(expected_rows) > 0
    assert not np.array_equal(patched.numpy(), buffer)  # a positive control: rows changed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_patch_of_a_buffer_holding_only_the_kept_rows_matches_numpy(dtype):
    """A prefetch that sent only the rows it would not sync (`kept_slot_to_unique`): each
    owner's part of the buffer holds them first; the patch moves them to the slots the fresh
    rows leave free, giving the buffer a full prefetch patched as before would hold."""
    rng = np.random.default_rng(12)
    splits = np.array([6, 0, 5], np.int32)
    full = rng.standard_normal((11, 5)).astype(dtype)  # what a full prefetch would hold
    fresh_at = [[0, 2, 5], [], [4]]  # owner 0 syncs its first, third and last slot
    payload = np.zeros((3, 3, 6), dtype)
    payload[..., 5] = -1
    compact = np.zeros_like(full)
    offset = 0
    for o, positions in enumerate(fresh_at):
        kept = [p for p in range(splits[o]) if p not in positions]
        compact[offset:offset + len(kept)] = full[offset + np.array(kept, int)] if kept else 0
        for j, p in enumerate(positions):
            payload[o, j, :5] = rng.standard_normal(5)
            payload[o, j, 5] = p
        offset += splits[o]
    expected = full.copy()
    offset = 0
    for o, positions in enumerate(fresh_at):
        for j, p in enumerate(positions):
            expected[offset + p] = payload[o, j, :5]
        offset += splits[o]
    patched, copied = ops.apply_sync_payload(compact, payload, splits, kept_first=True)
    np.testing.assert_array_equal(patched.numpy(), expected)
    assert int(copied) == 4
    # The control: the same buffer patched in place (no kept-first move) differs.
    plain, _ = ops.apply_sync_payload(compact, payload, splits)
    assert not np.array_equal(plain.numpy(), expected)
    # No fresh rows: the buffer is the full prefetch already.
    unchanged, none = ops.apply_sync_payload(full, np.full((3, 1, 6), -1, dtype), splits,
                                             kept_first=True)
    np.testing.assert_array_equal(unchanged.numpy(), full)
    assert int(none) == 0


def test_kept_first_patch_errors():
    with pytest.raises(tf.errors.InvalidArgumentError, match="not ascending"):
        ops.apply_sync_payload(tf.zeros([4, 2]), [[[0, 0, 1], [0, 0, 0]], [[0, 0, -1]] * 2],
                               [2, 2], kept_first=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not ascending in"):
        ops.apply_sync_payload(tf.zeros([4, 2]), [[[0, 0, -1]], [[1, 1, 2]]], [2, 2],
                               kept_first=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="splits exceed"):
        ops.apply_sync_payload(tf.zeros([3, 2]), [[[0, 0, -1]], [[1, 1, -1]]], [2, 2],
                               kept_first=True)
    ops.apply_sync_payload(tf.zeros([4, 2]), [[[0, 0, 0], [0, 0, 1]], [[0, 0, -1]] * 2],
                           [2, 2], kept_first=True)  # the control: ascending, in range


def test_sync_rows_payload_and_patch_errors():
    with pytest.raises(tf.errors.InvalidArgumentError, match="not a multiple of 2"):
        ops.sync_rows(tf.zeros([2, 1], tf.int32), tf.zeros([3], tf.int32), [1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="sync slot 3 of requester 0"):
        ops.sync_rows([[3]], [0, 0], [7])  # capacity 2
    with pytest.raises(tf.errors.InvalidArgumentError, match="holds unique index -1"):
        ops.sync_rows([[1]], [0, -1], [7])
    with pytest.raises(tf.errors.InvalidArgumentError, match="plan 1 rows but 2"):
        ops.sync_payload(tf.zeros([2, 3]), [[0, -1]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="more rows than the 0"):
        ops.sync_payload(tf.zeros([0, 3]), [[0]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="owner 1 sent slot position 2"):
        ops.apply_sync_payload(tf.zeros([4, 2]), [[[0, 0, -1]], [[1, 1, 2]]], [2, 2])
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="received|Dimension"):
        ops.apply_sync_payload(tf.zeros([4, 2]), tf.zeros([2, 1, 2]), [2, 2])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sync_header_matches_numpy(dtype):
    """Row 0 of each requester's header block holds its sync count, row 1 the largest count, in
    column 0; everything else is zero."""
    counts = np.array([3, 0, 7], np.int32)
    expected = np.zeros([3, 2, 4], dtype)
    expected[:, 0, 0] = counts
    expected[:, 1, 0] = counts.max()
    header = ops.sync_header(counts, 4, tf.as_dtype(dtype))
    assert header.dtype == tf.as_dtype(dtype) and header.shape == [3, 2, 4]
    np.testing.assert_array_equal(header.numpy(), expected)
    np.testing.assert_array_equal(ops.sync_header(np.zeros([1], np.int32), 1, tf.float32).numpy(),
                                  np.zeros([1, 2, 1], np.float32))


def _plan_pad_reference(slots, largest, counts):
    """`sync_plan_pad` in NumPy and `capacity_bucket`."""
    from tf_nestpipe.collectives.communication import capacity_bucket
    bucket, capacity = (int(v) for v in capacity_bucket(max(1, int(np.max(largest, initial=0)))))
    padded = np.full([slots.shape[0], capacity], -1, np.int32)
    kept = min(capacity, slots.shape[1])
    padded[:, :kept] = slots[:, :kept]
    return padded, bucket, capacity, int(counts.sum())


@pytest.mark.parametrize("largest_dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("largest, width", [([2.0, 5.0], 9), ([30.0, 1.0], 4), ([0.0, 0.0], 3),
                                           ([], 2)])
def test_sync_plan_pad_matches_numpy(largest_dtype, largest, width):
    """The plan is cut (a wide plan) or padded with -1 (a narrow one) to the bucketed capacity
    of every owner's largest count (at least 1); rows_sent is the sum of this owner's counts."""
    from tf_nestpipe.collectives.communication import EXCHANGE_CAPACITIES
    rng = np.random.default_rng(width)
    slots = rng.integers(-1, 50, [2, width]).astype(np.int32)
    counts = np.array([4, 1], np.int32)
    largest = np.array(largest, largest_dtype)
    got = ops.sync_plan_pad(slots, largest, counts, EXCHANGE_CAPACITIES)
    expected = _plan_pad_reference(slots, largest, counts)
    np.testing.assert_array_equal(got[0].numpy(), expected[0])
    assert [int(v) for v in got[1:]] == list(expected[1:])
    assert all(t.dtype == tf.int32 for t in got)


def test_sync_plan_pad_errors():
    from tf_nestpipe.collectives.communication import EXCHANGE_CAPACITIES
    slots = np.zeros([2, 8], np.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="prefetch capacity 8 too large"):
        ops.sync_plan_pad(slots, [1.0], [0, 0], EXCHANGE_CAPACITIES, max_slots=8)
    ops.sync_plan_pad(slots, [1.0], [0, 0], EXCHANGE_CAPACITIES, max_slots=9)  # the control
    with pytest.raises(tf.errors.InvalidArgumentError, match="exceeds the largest capacity 9"):
        ops.sync_plan_pad(slots, [10.0], [0, 0], [1, 4, 9])
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="strictly increasing"):
        ops.sync_plan_pad(slots, [1.0], [0, 0], [1, 4, 4])
