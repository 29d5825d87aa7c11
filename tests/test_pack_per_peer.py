"""`ops.pack_per_peer` (a frozen window's sync payload: every round's valid entries per worker
packed behind each other) against a NumPy reference, eagerly and traced, and its errors."""
import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe import ops


def _reference(blocks, lengths, capacity):
    workers = blocks[0].shape[0]
    out = np.full((workers, capacity) + blocks[0].shape[2:], -1, blocks[0].dtype)
    for j in range(workers):
        kept = [b[j, :n] for b, n in zip(blocks, (l[j] for l in lengths))]
        packed = np.concatenate(kept, axis=0)
        out[j, :len(packed)] = packed
    return out


@pytest.mark.parametrize("seed", range(6))
def test_packs_every_round_behind_the_earlier_ones_per_worker(seed):
    rng = np.random.default_rng(seed)
    workers, rounds = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    inner = [3] if seed % 2 else []
    dtype = [np.float32, np.int32, np.float16, np.int8, np.int64, np.float64][seed]
    length_dtype = np.int32 if seed < 4 else np.int64
    blocks, lengths = [], []
    for _ in range(rounds):
        width = int(rng.integers(0, 6))
        blocks.append(rng.integers(0, 100, [workers, width] + inner).astype(dtype))
        lengths.append(rng.integers(0, width + 1, workers).astype(length_dtype))
    capacity = max(1, int(sum(lengths).max()) + int(rng.integers(0, 3)))
    expected = _reference(blocks, lengths, capacity)
    args = ([tf.constant(b) for b in blocks], [tf.constant(l) for l in lengths],
            tf.constant(capacity, tf.int32))
    np.testing.assert_array_equal(ops.pack_per_peer(*args).numpy(), expected)
    np.testing.assert_array_equal(tf.function(ops.pack_per_peer)(*args).numpy(), expected)


def test_the_reference_sees_a_misplaced_entry():
    # Positive control: the reference tells rounds apart (a pack that swapped them differs).
    blocks = [np.array([[1, 2]], np.int32), np.array([[7, 8]], np.int32)]
    lengths = [np.array([1], np.int32), np.array([2], np.int32)]
    assert _reference(blocks, lengths, 4).tolist() == [[1, 7, 8, -1]]
    assert _reference(blocks[::-1], lengths[::-1], 4).tolist() != [[1, 7, 8, -1]]


def test_pack_per_peer_refuses_miscounted_or_oversized_rounds():
    blocks = [tf.constant([[1, 2], [3, 4]], tf.int32), tf.constant([[5], [6]], tf.int32)]
    ok = ops.pack_per_peer(blocks, [[2, 1], [1, 0]], 3)  # positive control
    assert ok.numpy().tolist() == [[1, 2, 5], [3, -1, -1]]
    with pytest.raises(tf.errors.InvalidArgumentError, match="round 1 keeps 2 entries"):
        ops.pack_per_peer(blocks, [[2, 1], [2, 0]], 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="worker 0's entries exceed"):
        ops.pack_per_peer(blocks, [[2, 1], [1, 0]], 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="block 1 has shape"):
        ops.pack_per_peer([blocks[0], tf.constant([[5]], tf.int32)], [[2, 1], [1]], 3)
