"""Dual-Buffer Pipeline ops against NumPy references."""
import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe import ops


def sync_plan_reference(slot_to_unique, local_rows, updated, num_requesters, all_updated):
    capacity = len(slot_to_unique) // num_requesters
    plan = -np.ones((num_requesters, capacity), np.int32)
    counts = np.zeros(num_requesters, np.int32)
    for w in range(num_requesters):
        for p in range(capacity):
            u = slot_to_unique[w * capacity + p]
            if u >= 0 and (all_updated or local_rows[u] in set(updated)):
                plan[w, counts[w]] = p
                counts[w] += 1
    return plan, counts


@pytest.mark.parametrize("all_updated", [False, True])
def test_sync_plan_matches_numpy(all_updated):
    rng = np.random.default_rng(3)
    local_rows = rng.choice(100, size=12, replace=False).astype(np.int64)
    slot_to_unique = np.where(rng.random(3 * 8) < 0.7, rng.integers(0, 12, 3 * 8), -1).astype(np.int32)
    updated = rng.choice(100, size=30, replace=False).astype(np.int64)
    plan, counts = ops.sync_plan(slot_to_unique, local_rows, updated, 3, all_updated=all_updated)
    ref_plan, ref_counts = sync_plan_reference(slot_to_unique, local_rows, updated, 3, all_updated)
    np.testing.assert_array_equal(plan.numpy(), ref_plan)
    np.testing.assert_array_equal(counts.numpy(), ref_counts)
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
