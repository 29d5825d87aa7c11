"""Custom ops against NumPy references: eager, tf.function, shape inference, errors, gradients."""
import collections

import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.ops import load_op_library


def route_keys_reference(ids, num_shards):
    """NumPy reference of NestpipeRouteKeys."""
    uniq = list(dict.fromkeys(ids.tolist()))
    buckets = [[k for k in uniq if k % num_shards == s] for s in range(num_shards)]
    keys = [k for b in buckets for k in b]
    pos = {k: i for i, k in enumerate(keys)}
    return (np.array(keys, np.int64), np.array([len(b) for b in buckets], np.int32),
            np.array([pos[k] for k in ids.tolist()], np.int32))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
@pytest.mark.parametrize("as_function", [False, True])
def test_route_keys_matches_numpy(num_shards, as_function):
    rng = np.random.default_rng(num_shards)
    ids = np.minimum(rng.zipf(1.3, size=200) - 1, 999).astype(np.int64)
    fn = (tf.function(lambda x: ops.route_keys(x, num_shards, 1000, "t")) if as_function
          else lambda x: ops.route_keys(x, num_shards, 1000, "t"))
    keys, splits, inverse = fn(tf.constant(ids))
    ref_keys, ref_splits, ref_inverse = route_keys_reference(ids, num_shards)
    np.testing.assert_array_equal(keys.numpy(), ref_keys)
    np.testing.assert_array_equal(splits.numpy(), ref_splits)
    np.testing.assert_array_equal(inverse.numpy(), ref_inverse)
    np.testing.assert_array_equal(keys.numpy()[inverse.numpy()], ids)


def test_route_keys_empty_and_shape_inference():
    keys, splits, inverse = ops.route_keys(tf.zeros([0], tf.int64), 4, 10)
    assert keys.shape == (0,) and splits.numpy().tolist() == [0, 0, 0, 0] and inverse.shape == (0,)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def f(x):
        k, s, i = ops.route_keys(x, 3, 10)
        assert s.shape.as_list() == [3] and i.shape.as_list() == [None] and k.shape.rank == 1
        return k

    f(tf.constant([1, 2], tf.int64))


@pytest.mark.parametrize("bad_id", [-1, 10, 1 << 40])
def test_route_keys_rejects_out_of_range_ids_naming_table_and_id(bad_id):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"ShardedEmbedding 'user_table': id %d at position 1 is out of range"
                             r" \[0, 10\).*invalid_id_policy" % bad_id):
        ops.route_keys([3, bad_id], 2, 10, "user_table")


def test_route_keys_rejects_non_vector():
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        ops.route_keys(tf.zeros([2, 2], tf.int64), 2, 10)


def owner_rounds_reference(received, sent, capacities, num_shards, row_offsets=(0,)):
    """NumPy reference of `ops.owner_rounds`: per round, requester i's keys of the round are the
    `sent[i, r]` after its earlier rounds' in its row; slot i * capacity + k; the distinct rows
    first-seen, then stably grouped by table (the last of `row_offsets` at or before a row)."""
    first = np.cumsum(sent, axis=1) - sent
    rows, slots, sizes = [], [], []
    for r, capacity in enumerate(capacities):
        slot = -np.ones(len(received) * capacity, np.int64)
        seen = {}
        for i, row in enumerate(received):
            for k in range(sent[i, r]):
                local = int(row[first[i, r] + k]) // num_shards
                slot[i * capacity + k] = seen.setdefault(local, len(seen))
        seen_rows = list(seen)
        table = np.searchsorted(row_offsets, seen_rows, side="right") - 1
        order = np.argsort(table, kind="stable")
        place = np.empty(len(order), np.int64)
        place[order] = np.arange(len(order))
        rows.append([seen_rows[k] for k in order])
        slots.append(np.where(slot >= 0, place[np.maximum(slot, 0)], -1))
        sizes.append(np.bincount(table, minlength=len(row_offsets)).tolist())
    return rows, slots, sizes


def test_owner_rounds_matches_numpy():
    """Requester i's row holds its keys round after round (a round may be empty), then -1;
    each round's slots are laid out at its own capacity."""
    received = np.array([[4, 2, 8, 2, -1, -1], [2, 6, -1, -1, -1, -1], [8, 8, 0, 4, 6, -1]],
                        np.int64)
    sent = np.array([[2, 0, 2], [1, 1, 0], [3, 1, 1]], np.int32)
    capacities = [4, 1, 2]
    rows, slots, sizes = ops.owner_rounds(received, sent, capacities, num_shards=2,
                                          shard_index=0)
    ref_rows, ref_slots, ref_sizes = owner_rounds_reference(received, sent, capacities, 2)
    for r in range(3):
        np.testing.assert_array_equal(rows[r].numpy(), ref_rows[r])
        np.testing.assert_array_equal(slots[r].numpy(), ref_slots[r])
        np.testing.assert_array_equal(sizes[r].numpy(), ref_sizes[r])
    assert rows[0].numpy().tolist() == [2, 1, 4, 0]  # positive control of the reference
    assert slots[1].numpy().tolist() == [-1, 0, 1]


def test_owner_rounds_groups_rows_by_table():
    """With several tables in the row space (table t from `row_offsets[t]`; table 1 reserves no
    rows here), each round's rows come grouped by table, first-seen within a table, and every
    slot follows its row to its new place."""
    received = np.array([[10, 2, 14, 6, 0, -1], [4, 12, 2, 8, -1, -1]], np.int64)
    sent = np.array([[3, 2], [2, 2]], np.int32)
    offsets = [0, 3, 3, 5]
    rows, slots, sizes = ops.owner_rounds(received, sent, [3, 2], 2, 0, row_offsets=offsets)
    ref_rows, ref_slots, ref_sizes = owner_rounds_reference(received, sent, [3, 2], 2, offsets)
    for r in range(2):
        np.testing.assert_array_equal(rows[r].numpy(), ref_rows[r])
        np.testing.assert_array_equal(slots[r].numpy(), ref_slots[r])
        np.testing.assert_array_equal(sizes[r].numpy(), ref_sizes[r])
    # Positive control of the reference: round 0 first sees rows 5, 1, 7 then 2, 6 (tables
    # 3, 0, 3, 0, 3); round 1 rows 3, 0 then 1, 4 (tables 2, 0, 0, 2).
    assert ref_rows[0] == [1, 2, 5, 7, 6] and ref_sizes[0] == [2, 0, 0, 3]
    assert ref_slots[0].tolist() == [2, 0, 3, 1, 4, -1]
    assert ref_rows[1] == [0, 1, 3, 4] and ref_sizes[1] == [2, 0, 2, 0]


def test_owner_rounds_refuses_row_offsets_that_do_not_ascend_from_zero():
    for offsets in ([1, 4], [0, 4, 2], []):
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="row_offsets"):
            ops.owner_rounds(np.array([[2]], np.int64), [[1]], [1], 2, 0, row_offsets=offsets)


def test_owner_rounds_rejects_foreign_keys_and_miscounted_rows():
    with pytest.raises(tf.errors.InternalError, match="owned by shard 1"):
        ops.owner_rounds(np.array([[3]], np.int64), [[1]], [1], num_shards=2, shard_index=0)
    with pytest.raises(tf.errors.InternalError, match="key 1 is padding"):
        ops.owner_rounds(np.array([[2, -1]], np.int64), [[2]], [2], num_shards=2, shard_index=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="counted 3 keys but its row holds 2"):
        ops.owner_rounds(np.array([[2, 4]], np.int64), [[2, 1]], [2, 2], 2, 0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside \\[0, capacity 1\\]"):
        ops.owner_rounds(np.array([[2, 4]], np.int64), [[2]], [1], 2, 0)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="sent must be"):
        ops.owner_rounds(np.array([[2, 4]], np.int64), [[1], [1]], [2], 2, 0)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
def test_gather_rows_and_segment_sum_match_numpy(dtype, index_dtype):
    rng = np.random.default_rng(0)
    params = rng.normal(size=(7, 3))
    indices = np.array([3, -1, 0, 3, 6, -1], np.int64)
    out = ops.gather_rows(tf.constant(params, dtype), tf.constant(indices, index_dtype)).numpy()
    expected = np.where(indices[:, None] >= 0, params[np.maximum(indices, 0)], 0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    data = rng.normal(size=(6, 3))
    summed = ops.segment_sum(tf.constant(data, dtype), tf.constant(indices, index_dtype), 7).numpy()
    ref = np.zeros((7, 3))
    for i, s in enumerate(indices):
        if s >= 0:
            ref[s] += data[i]
    np.testing.assert_allclose(summed, ref, rtol=1e-6)


def test_gather_rows_and_segment_sum_errors():
    with pytest.raises(tf.errors.InvalidArgumentError, match="gather index 7 at position 0"):
        ops.gather_rows(tf.zeros([7, 2]), tf.constant([7]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment id 3 at position 1"):
        ops.segment_sum(tf.zeros([2, 2]), tf.constant([0, 3]), 3)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="segment_ids|rank|Shape"):
        ops.segment_sum(tf.zeros([2, 2]), tf.constant([0, 1, 2]), 3)


def test_gather_rows_gradient_is_segment_sum():
    params = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))
    indices = tf.constant([2, 0, 2, -1, 3])
    upstream = tf.constant(np.random.default_rng(1).normal(size=(5, 3)), tf.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ops.gather_rows(params, indices) * upstream)
    grad = tf.convert_to_tensor(tape.gradient(loss, params)).numpy()
    expected = np.zeros((4, 3), np.float32)
    for i, r in enumerate(indices.numpy()):
        if r >= 0:
            expected[r] += upstream.numpy()[i]
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    theoretical, numerical = tf.test.compute_gradient(
        lambda p: ops.gather_rows(p, indices), [tf.constant(params)])
    np.testing.assert_allclose(theoretical[0], numerical[0], atol=1e-2)



def _gradient_op_types(fn, variable):
    """(the gradient of `fn()` wrt `variable`, the op types of its traced graph)."""
    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            loss = fn()
        return tf.convert_to_tensor(tape.gradient(loss, variable))

    graph = gradient.get_concrete_function().graph
    return gradient().numpy(), {op.type for op in graph.get_operations()}


def test_slices_of_gathered_rows_send_their_gradients_straight_to_params():
    """Slices of `gather_rows` output taken as gathers (an `IndexedSlices` upstream gradient):
    the gradient equals NumPy's, and it reaches the params as one sparse segment-sum, never
    padded per slice (StridedSliceGrad) nor densified on the way (UnsortedSegmentSum); the
    positive control, plain slices, does pad."""
    rng = np.random.default_rng(3)
    params = tf.Variable(rng.normal(size=(6, 2)).astype(np.float32))
    indices = tf.constant([4, -1, 0, 4, 5, 2, 0, 1])
    weights = [1.0, 2.0, 3.0]
    bounds = [(0, 3), (3, 5), (5, 8)]

    def loss_of(take):
        rows = ops.gather_rows(params * 1.0, indices)
        return tf.add_n([w * tf.reduce_sum(take(rows, s, e)) for w, (s, e) in zip(weights, bounds)])

    expected = np.zeros((6, 2), np.float32)
    for w, (s, e) in zip(weights, bounds):
        for r in indices.numpy()[s:e]:
            if r >= 0:
                expected[r] += w
    grad, types = _gradient_op_types(
        lambda: loss_of(lambda r, s, e: tf.gather(r, tf.range(s, e))), params)
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    assert "StridedSliceGrad" not in types and "UnsortedSegmentSum" not in types, types
    grad, types = _gradient_op_types(lambda: loss_of(lambda r, s, e: r[s:e]), params)
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    assert "StridedSliceGrad" in types  # the control: plain slices pad their gradients

def test_segment_sum_of_pieces_equals_segment_sum_of_their_concatenation():
    rng = np.random.default_rng(4)
    pieces = [rng.normal(size=(n, 3)).astype(np.float32) for n in (2, 0, 4)]
    ids = tf.constant([3, -1, 0, 3, 1, 3])
    summed = ops.segment_sum([tf.constant(p) for p in pieces], ids, 5).numpy()
    whole = ops.segment_sum(tf.constant(np.concatenate(pieces)), ids, 5).numpy()
    np.testing.assert_array_equal(summed, whole)  # bitwise: the same rows in the same order
    theoretical, numerical = tf.test.compute_gradient(
        lambda a, b: ops.segment_sum([a, b], ids, 5), [tf.constant(pieces[0]),
                                                       tf.constant(pieces[2])])
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, atol=1e-2)


def test_segment_sum_of_pieces_errors():
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="width|Dimensions"):
        ops.segment_sum([tf.zeros([1, 2]), tf.zeros([1, 3])], tf.constant([0, 1]), 2)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError),
                       match="length 3 \\(the data's rows\\)|Shape"):
        ops.segment_sum([tf.zeros([1, 2]), tf.zeros([2, 2])], tf.constant([0, 1]), 2)


@pytest.mark.parametrize("traced", [False, True])
def test_gather_pieces_match_numpy_and_sum_their_gradients_without_a_concat(traced):
    """`gather_pieces`: the pieces of a gather, and a gradient equal to NumPy's (pieces left
    unused get none) whose graph holds no concatenation of the pieces' gradients; the control,
    a split of `gather_rows`, concatenates them."""
    rng = np.random.default_rng(5)
    params = tf.Variable(rng.normal(size=(6, 4)).astype(np.float32))
    indices = tf.constant([5, 0, 5, 2, 1, 0, 3])
    sizes = tf.constant([3, 1, 3])
    weights = [1.0, 0.0, 2.0]  # the middle piece unused

    def loss_of(split):
        pieces = split()
        assert len(pieces) == 3
        return tf.add_n([w * tf.reduce_sum(p * p) for w, p in zip(weights, pieces) if w])

    def expected():
        rows, grad = params.numpy()[indices.numpy()], np.zeros((6, 4), np.float32)
        for (start, end), w in zip([(0, 3), (3, 4), (4, 7)], weights):
            for i in range(start, end):
                grad[indices.numpy()[i]] += 2 * w * rows[i]
        return grad

    pieces = ops.gather_pieces(params, indices, sizes, 3)
    np.testing.assert_array_equal(tf.concat(pieces, 0).numpy(), params.numpy()[indices.numpy()])
    ours = lambda: loss_of(lambda: ops.gather_pieces(params, indices, sizes, 3))
    control = lambda: loss_of(lambda: tf.split(ops.gather_rows(params, indices), sizes, num=3))
    if traced:
        grad, types = _gradient_op_types(ours, params)
        assert "ConcatV2" not in types, types
        _, control_types = _gradient_op_types(control, params)
        assert "ConcatV2" in control_types
    else:
        with tf.GradientTape() as tape:
            loss = ours()
        grad = tf.convert_to_tensor(tape.gradient(loss, params)).numpy()
    np.testing.assert_allclose(grad, expected(), rtol=1e-6)


def test_segment_sum_gradient_is_gather():
    data = tf.constant(np.random.default_rng(2).normal(size=(5, 2)), tf.float32)
    ids = tf.constant([1, 1, -1, 0, 2])
    theoretical, numerical = tf.test.compute_gradient(
        lambda d: ops.segment_sum(d, ids, 3), [data])
    np.testing.assert_allclose(theoretical[0], numerical[0], atol=1e-2)


@pytest.mark.parametrize("distribution,reference", [
    ("uniform", tf.random.stateless_uniform),
    ("normal", tf.random.stateless_normal),
    ("truncated_normal", tf.random.stateless_truncated_normal),
])
@pytest.mark.parametrize("dim", [1, 3, 4, 7])
def test_stateless_row_init_equals_full_tensor_rows(distribution, reference, dim):
    vocab = 53
    full = reference([vocab, dim], seed=[11, 5]).numpy()
    rows = np.array([52, 0, 17, 3, 17, 40], np.int64)
    got = ops.stateless_row_init([11, 5], rows, dim, distribution).numpy()
    np.testing.assert_array_equal(got, full[rows])


def test_stateless_row_init_rejects_unknown_distribution():
    with pytest.raises(ValueError, match="distribution must be one of"):
        ops.stateless_row_init([1, 2], [0], 4, "poisson")


def test_gather_and_segment_sum_in_function_with_shape_inference():
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int32)])
    def f(params, indices):
        rows = ops.gather_rows(params, indices)
        assert rows.shape.as_list() == [None, 3]
        summed = ops.segment_sum(rows, indices, 5)
        assert summed.shape.as_list() == [5, 3]
        return summed

    params = np.arange(15, dtype=np.float32).reshape(5, 3)
    out = f(params, np.array([4, 4, -1, 0], np.int32)).numpy()
    expected = np.zeros((5, 3), np.float32)
    expected[4] = 2 * params[4]
    expected[0] = params[0]
    np.testing.assert_array_equal(out, expected)


def _hash_stress_ids(rng, n):
    """Ids that stress an open-addressing table: many repeats, strides of large powers of two
    (equal low bits), values near 2**62 and 0."""
    pools = [rng.integers(0, 1 << 62, 64), np.arange(0, 1 << 40, 1 << 30)[:200],
             np.arange(5000), np.array([0, 1, (1 << 62) - 1])]
    pool = np.unique(np.concatenate(pools)).astype(np.int64)
    return pool[rng.zipf(1.2, size=n) % len(pool)] if n else pool[:0]


@pytest.mark.parametrize("n", [0, 1, 7, 20000])
def test_route_keys_and_owner_rounds_match_numpy_at_scale(n):
    """The flat hash tables (ops/flat_hash.h) against Python dicts on thousands of ids whose
    low bits collide; the reference keeps first-seen order, as the ops must."""
    rng = np.random.default_rng(n)
    ids = _hash_stress_ids(rng, n)
    keys, splits, inverse = ops.route_keys(ids, 3, 1 << 62, "t")
    ref_keys, ref_splits, ref_inverse = route_keys_reference(ids, 3)
    np.testing.assert_array_equal(keys.numpy(), ref_keys)
    np.testing.assert_array_equal(splits.numpy(), ref_splits)
    np.testing.assert_array_equal(inverse.numpy(), ref_inverse)
    # The owner's side: shard 1's keys from 2 requesters, padded with -1.
    owned = ids[ids % 3 == 1]
    half = (len(owned) + 1) // 2
    received = -np.ones((2, half + 3), np.int64)
    received[0, :half], received[1, :len(owned) - half] = owned[:half], owned[half:]
    sent = (received >= 0).sum(axis=1, keepdims=True).astype(np.int32)
    rows, slots, _ = ops.owner_rounds(received, sent, [half + 3], num_shards=3, shard_index=1)
    flat = received.ravel()
    expected_rows = list(dict.fromkeys((flat[flat >= 0] // 3).tolist()))
    np.testing.assert_array_equal(rows[0].numpy(), np.array(expected_rows, np.int64))
    where = {k: i for i, k in enumerate(expected_rows)}
    np.testing.assert_array_equal(slots[0].numpy(), [where[k // 3] if k >= 0 else -1 for k in flat])


def fuse_ids_reference(ids, vocab_sizes, offsets, segment_ends):
    """NumPy reference of NestpipeFuseIds (valid ids)."""
    flat = [np.asarray(t, np.int64).reshape(-1) for t in ids]
    fused = np.concatenate([t + o for t, o in zip(flat, offsets)])
    starts = [0] + list(segment_ends[:-1])
    sizes = [sum(len(flat[i]) for i in range(a, b)) for a, b in zip(starts, segment_ends)]
    return fused, np.asarray(sizes, np.int32)


@pytest.mark.parametrize("segment_ends", [None, [4], [2, 4], [0, 1, 1, 4]])
@pytest.mark.parametrize("as_function", [False, True])
def test_fuse_ids_matches_numpy(segment_ends, as_function):
    rng = np.random.default_rng(7)
    ids = [rng.integers(0, 10, size=[3, 2]), rng.integers(0, 50, size=[5]),
           np.zeros([0], np.int64), rng.integers(0, 10, size=[4])]
    vocab, offsets, names = [10, 50, 5, 0], [0, 20, 70, 1000], ["a", "b", "c", "d"]

    def fuse(*t):
        return ops.fuse_ids(list(t), vocab, offsets, names, segment_ends)

    fn = tf.function(fuse) if as_function else fuse
    fused, input_sizes, sizes = fn(*[tf.constant(t, tf.int64) for t in ids])
    ref_fused, ref_sizes = fuse_ids_reference(ids, vocab, offsets, segment_ends or [4])
    np.testing.assert_array_equal(fused.numpy(), ref_fused)
    assert input_sizes.numpy().tolist() == [6, 5, 0, 4]
    np.testing.assert_array_equal(sizes.numpy(), ref_sizes)
    assert sizes.shape == (len(segment_ends or [4]),)


def test_fuse_ids_checks_each_table_against_its_own_vocabulary():
    # Positive control: 7 is valid for "wide" (vocab 8) and not for "narrow" (vocab 6); an
    # unchecked table (0) passes anything through.
    fused, _, _ = ops.fuse_ids([[7], [5], [123]], [8, 6, 0], [0, 8, 100],
                               ["wide", "narrow", "free"])
    assert fused.numpy().tolist() == [7, 13, 223]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"ShardedEmbedding 'narrow': id 7 at position 1 is out of range"
                             r" \[0, 6\).*invalid_id_policy"):
        ops.fuse_ids([[7], [5, 7]], [8, 6], [0, 8], ["wide", "narrow"])
    with pytest.raises(tf.errors.InvalidArgumentError, match="'wide': id -1 at position 0"):
        ops.fuse_ids([[-1]], [8], [0], ["wide"])


def test_fuse_ids_rejects_inconsistent_attributes():
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="one entry per input"):
        ops.fuse_ids([[1], [2]], [8], [0, 0], ["a", "b"])
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="must end at"):
        ops.fuse_ids([[1], [2]], [8, 8], [0, 0], ["a", "b"], [1])
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="must not decrease"):
        ops.fuse_ids([[1], [2]], [8, 8], [0, 0], ["a", "b"], [2, 1, 2])


@pytest.mark.parametrize("shape", [[], [5], [0]])
def test_capacity_bucket_matches_numpy_searchsorted(shape):
    from tf_nestpipe.collectives.communication import _CAPACITIES
    rng = np.random.default_rng(len(shape))
    capacity = rng.integers(0, _CAPACITIES[-1] + 1, size=shape).astype(np.int32)
    bucket, padded = ops.capacity_bucket(capacity, _CAPACITIES)
    expected = np.searchsorted(np.asarray(_CAPACITIES), capacity, side="left")
    np.testing.assert_array_equal(bucket.numpy(), expected)
    np.testing.assert_array_equal(padded.numpy(), np.asarray(_CAPACITIES)[expected])
    assert bucket.shape == padded.shape == tuple(shape)


def _keys_block_reference(keys, splits, header, rider, hint_bucket, capacities):
    """NestpipeKeysBlock in NumPy."""
    w, r = len(splits), rider.shape[1]
    bucket = int(np.searchsorted(capacities, r + capacities[hint_bucket], side="left"))
    key_capacity = capacities[bucket] - r
    block = np.full([w, len(header) + r + key_capacity], -1, np.int64)
    counts, start = [], 0
    for j, n in enumerate(splits):
        sent = min(n, key_capacity)
        block[j, :len(header)] = header
        block[j, len(header):len(header) + r] = rider[j]
        block[j, len(header) + r:len(header) + r + sent] = keys[start:start + sent]
        counts.append(len(header) + r + sent)
        start += n
    return block, counts, bucket, key_capacity


@pytest.mark.parametrize("splits, rider_width, hint_bucket", [
    ([3, 0, 2], 0, 1),  # every key fits (capacity 4)
    ([6, 1, 2], 0, 1),  # owner 0's keys beyond the capacity stay out (the overflow round's)
    ([3, 0, 2], 3, 1),  # a rider: the bucket of 3 + 4 (9) leaves 6 for keys
    ([2, 2, 2], 0, 0),  # a hint of 1
])
def test_keys_block_matches_numpy(splits, rider_width, hint_bucket):
    capacities = [1, 4, 9, 16]
    rng = np.random.default_rng(sum(splits) + rider_width)
    keys = rng.integers(0, 1000, sum(splits)).astype(np.int64)
    header = np.array(splits + [77], np.int64)
    rider = rng.integers(-5, 5, [len(splits), rider_width]).astype(np.int64)
    got = ops.keys_block(keys, splits, header, rider, hint_bucket, capacities)
    expected = _keys_block_reference(keys, splits, header, rider, hint_bucket, capacities)
    np.testing.assert_array_equal(got[0].numpy(), expected[0])
    assert got[1].numpy().tolist() == expected[1]
    assert [int(got[2]), int(got[3])] == list(expected[2:])


def test_keys_block_errors():
    capacities = [1, 4, 9]
    none = np.zeros([2, 0], np.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="splits sum to 3 but there are 2"):
        ops.keys_block([1, 2], [1, 2], [0], none, 0, capacities)
    with pytest.raises(tf.errors.InvalidArgumentError, match="hint bucket 3 is out of range"):
        ops.keys_block([1, 2], [1, 1], [0], none, 3, capacities)
    with pytest.raises(tf.errors.InvalidArgumentError, match="rider must be"):
        ops.keys_block([1, 2], [1, 1], [0], np.zeros([3, 1], np.int64), 0, capacities)
    with pytest.raises(tf.errors.InvalidArgumentError, match="exceeds the largest capacity 9"):
        ops.keys_block([1, 2], [1, 1], [0], np.zeros([2, 6], np.int64), 1, capacities)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="must be a matrix"):
        ops.keys_block([1, 2], [1, 1], [0], np.zeros([2], np.int64), 0, capacities)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="scalar"):
        ops.keys_block([1, 2], [1, 1], [0], none, [0, 1], capacities)


def _route_counts_reference(received, counts, shard_index, capacities, rider_width=0):
    """NestpipeRouteCounts in NumPy."""
    w, rounds = counts.shape
    lead = w * rounds + 1 + rider_width
    every = received[:, :w * rounds].reshape(w, w, rounds)  # [requester, owner, round]
    largest = int(every.sum(axis=2).max())
    sent = every[:, shard_index, :]
    round_max = np.maximum(every.max(axis=(0, 1)), 1)
    buckets = np.searchsorted(capacities, round_max, side="left")
    return {"largest": largest, "sent": sent, "capacities": np.asarray(capacities)[buckets],
            "shares": received[:, w * rounds], "splits": [counts[:, r] for r in range(rounds)],
            "received": [sent[:, r] for r in range(rounds)], "buckets": list(buckets),
            "keys": [counts[:, r].sum() for r in range(rounds)],
            "rider": received[:, w * rounds + 1:lead], "keys_received": received[:, lead:]}


@pytest.mark.parametrize("workers, rounds, shard_index, rider_width",
                         [(2, 1, 0, 0), (3, 1, 2, 0), (3, 2, 1, 0), (2, 3, 1, 0), (2, 1, 1, 3),
                          (3, 2, 0, 7)])
def test_route_counts_matches_numpy(workers, rounds, shard_index, rider_width):
    capacities = [1, 4, 9, 16, 30]
    rng = np.random.default_rng(workers * 10 + rounds)
    headers = rng.integers(0, 12, [workers, workers * rounds]).astype(np.int64)
    if rounds > 1:
        headers[:, rounds - 1::rounds] = 0  # a round nobody sends keys in: capacity 1
    shares = rng.integers(1, 100, [workers, 1]).astype(np.int64)
    keys = rng.integers(-1, 50, [workers, 7]).astype(np.int64)
    received = np.concatenate([headers, shares, keys], axis=1)
    counts = rng.integers(0, 9, [workers, rounds]).astype(np.int32)
    got = ops.route_counts(received, counts, shard_index, capacities, rider_width)
    expected = _route_counts_reference(received, counts, shard_index, capacities, rider_width)
    np.testing.assert_array_equal(got.rider.numpy(), expected["rider"])
    np.testing.assert_array_equal(got.keys_received.numpy(), expected["keys_received"])
    assert got.rider.shape == (workers, rider_width)
    assert int(got.largest) == expected["largest"]
    np.testing.assert_array_equal(got.sent.numpy(), expected["sent"])
    np.testing.assert_array_equal(got.capacities.numpy(), expected["capacities"])
    np.testing.assert_array_equal(got.shares.numpy(), expected["shares"])
    for r in range(rounds):
        np.testing.assert_array_equal(got.splits[r].numpy(), expected["splits"][r])
        np.testing.assert_array_equal(got.received[r].numpy(), expected["received"][r])
        assert int(got.buckets[r]) == expected["buckets"][r]
        assert int(got.capacity[r]) == expected["capacities"][r]
        assert int(got.keys[r]) == expected["keys"][r]


def test_route_counts_errors():
    capacities = [1, 4, 9]
    counts = np.zeros([2, 1], np.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="each row headed by"):
        ops.route_counts(np.zeros([2, 2], np.int64), counts, 0, capacities)  # needs 3 columns
    with pytest.raises(tf.errors.InvalidArgumentError, match="header counts -3 keys for owner 1"):
        ops.route_counts(np.array([[0, -3, 1], [0, 0, 1]], np.int64), counts, 0, capacities)
    with pytest.raises(tf.errors.InvalidArgumentError, match="exceeds the largest capacity 9"):
        ops.route_counts(np.array([[0, 10, 1], [0, 0, 1]], np.int64), counts, 0, capacities)
    with pytest.raises(tf.errors.InvalidArgumentError, match="shard_index 2 of 2 workers"):
        ops.route_counts(np.zeros([2, 3], np.int64), counts, 2, capacities)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="rider_width 2 does not fit behind the 3-column header in 4"):
        ops.route_counts(np.zeros([2, 4], np.int64), counts, 0, capacities, 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="rider_width -1 does not fit"):
        ops.route_counts(np.zeros([2, 3], np.int64), counts, 0, capacities, -1)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="scalar"):
        ops.route_counts(np.zeros([2, 3], np.int64), counts, 0, capacities, [0])
    # The positive control: a rider of 1 column fits there, leaving no key columns.
    assert ops.route_counts(np.zeros([2, 4], np.int64), counts, 0, capacities,
                            1).keys_received.shape == (2, 0)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="counts must be"):
        load_op_library().nestpipe_route_counts(np.zeros([2, 3], np.int64),
                                                np.zeros([2], np.int32), 0, shard_index=0,
                                                rounds=1, capacities=capacities)
    with pytest.raises(ValueError, match="number of rounds statically"):
        tf.function(lambda c: ops.route_counts(np.zeros([2, 3], np.int64), c, 0, capacities),
                    input_signature=[tf.TensorSpec([2, None], tf.int32)]).get_concrete_function()


def test_capacity_bucket_boundaries_and_errors():
    bucket, padded = ops.capacity_bucket([1, 2, 3, 4, 9], [1, 4, 9])
    assert bucket.numpy().tolist() == [0, 1, 1, 1, 2]
    assert padded.numpy().tolist() == [1, 4, 4, 4, 9]
    with pytest.raises(tf.errors.InvalidArgumentError, match="10 entries per worker exceeds "
                                                             "the largest capacity 9"):
        ops.capacity_bucket(10, [1, 4, 9])
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="strictly increasing"):
        ops.capacity_bucket(1, [1, 4, 4])


def test_bucket_slots_lays_each_owners_keys_at_its_block():
    slots = ops.bucket_slots([2, 0, 3], 4).numpy().tolist()
    assert slots == [0, 1, 8, 9, 10]
    assert ops.bucket_slots(np.zeros([2], np.int32), 1).numpy().tolist() == []
    with pytest.raises(tf.errors.InvalidArgumentError, match="owner 1 has 5 keys, outside"):
        ops.bucket_slots([1, 5], 4)


class _Round(collections.namedtuple("_Round", "slot_of_bucket_pos splits slot_to_unique "
                                              "received capacity local_rows table_sizes")):
    """The fields of a RoutingRecord that `ops.window_grad_index` reads."""


def window_rows_reference(rounds):
    """NumPy reference of the window's distinct rows: table by table, each table's rows of
    round 0, then of round 1, ..., each row once. Returns (rows, rows per table, each round's
    local row -> its window row)."""
    starts = [np.concatenate([[0], np.cumsum(r.table_sizes)]) for r in rounds]
    rows, index, sizes = [], {}, []
    window_of = [np.zeros(len(r.local_rows), np.int64) for r in rounds]
    for t in range(len(rounds[0].table_sizes)):
        before = len(rows)
        for i, r in enumerate(rounds):
            for k in range(starts[i][t], starts[i][t + 1]):
                row = int(r.local_rows[k])
                if row not in index:
                    index[row] = len(rows)
                    rows.append(row)
                window_of[i][k] = index[row]
        sizes.append(len(rows) - before)
    return rows, sizes, window_of


def window_grad_index_reference(rounds, capacity):
    """NumPy reference: round by round, owner j's gradient rows go behind its earlier rounds';
    each received row goes to its window row."""
    shards = len(rounds[0].splits)
    rows, sizes, window_of = window_rows_reference(rounds)
    targets, receive = [], -np.ones(shards * capacity, np.int64)
    sent, got = np.zeros(shards, np.int64), np.zeros(shards, np.int64)
    for i, r in enumerate(rounds):
        for slot in r.slot_of_bucket_pos:
            owner = slot // r.capacity
            targets.append(-1 if slot < 0 else owner * capacity + sent[owner] + slot % r.capacity)
        for j in range(shards):
            for k in range(r.received[j]):
                u = r.slot_to_unique[j * r.capacity + k]
                receive[j * capacity + got[j] + k] = -1 if u < 0 else window_of[i][u]
        sent += r.splits
        got += r.received
    return targets, sent, receive, rows, sizes


def _window_rounds():
    """Two owners, three rounds of different capacities (one round empty for an owner), two
    tables (rows 0-9 and 10-): rows 1 and 10 are each read in two rounds."""
    return [
        _Round(np.array([0, 1, 3], np.int32), np.array([2, 1], np.int32),
               np.array([0, 1, -1, 2, -1, -1], np.int32), np.array([2, 1], np.int32), 3,
               np.array([3, 1, 10], np.int64), np.array([2, 1], np.int32)),
        _Round(np.array([2, 3], np.int32), np.array([0, 2], np.int32),
               np.array([-1, -1, 0, 1], np.int32), np.array([0, 2], np.int32), 2,
               np.array([1, 12], np.int64), np.array([1, 1], np.int32)),
        _Round(np.array([0], np.int32), np.array([1, 0], np.int32),
               np.array([0, -1], np.int32), np.array([1, 0], np.int32), 1,
               np.array([10], np.int64), np.array([0, 1], np.int32)),
    ]


def test_window_grad_index_matches_numpy():
    rounds = _window_rounds()
    targets, counts, receive, rows, sizes = ops.window_grad_index(rounds, 8)
    ref_targets, ref_counts, ref_receive, ref_rows, ref_sizes = window_grad_index_reference(
        rounds, 8)
    np.testing.assert_array_equal(targets.numpy(), ref_targets)
    np.testing.assert_array_equal(counts.numpy(), ref_counts)
    np.testing.assert_array_equal(receive.numpy(), ref_receive)
    np.testing.assert_array_equal(rows.numpy(), ref_rows)
    np.testing.assert_array_equal(sizes.numpy(), ref_sizes)
    # Positive control: owner 0 gets round 0's two rows then round 2's one; owner 1 round 0's
    # one then round 1's two. Rows 1 and 10, read in two rounds, are one window row each,
    # grouped by table.
    assert ref_targets == [0, 1, 8, 9, 10, 2]
    assert ref_rows == [3, 1, 10, 12] and ref_sizes == [2, 2]
    assert ref_receive[:3].tolist() == [0, 1, 2] and ref_receive[8:11].tolist() == [2, 1, 3]


def test_window_gradient_sums_a_row_read_in_two_rounds_into_one_row():
    """The owner's sum through the op's indices: every packed row lands on its distinct row,
    against a NumPy sum per row id."""
    rounds = _window_rounds()
    _, _, receive, rows, _ = ops.window_grad_index(rounds, 8)
    back = np.random.default_rng(0).normal(size=[16, 4]).astype(np.float32)
    summed = ops.segment_sum(back, receive, tf.size(rows)).numpy()
    expected, got = {}, np.zeros(2, np.int64)
    for r in rounds:
        for j in range(2):
            for k in range(r.received[j]):
                row = int(r.local_rows[r.slot_to_unique[j * r.capacity + k]])
                expected[row] = expected.get(row, 0) + back[j * 8 + got[j] + k]
        got += r.received
    assert len(expected) == len(rows.numpy()) == 4
    for w, row in enumerate(rows.numpy()):
        np.testing.assert_allclose(summed[w], expected[int(row)], rtol=1e-6)


def test_window_grad_index_refuses_a_window_above_its_capacity():
    r = _Round(np.array([0, 1], np.int32), np.array([2, 0], np.int32),
               np.array([0, 1, -1, -1], np.int32), np.array([2, 0], np.int32), 2,
               np.arange(2), np.array([2], np.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="exceed capacity 3"):
        ops.window_grad_index([r, r], 3)
    # A round that claims more received rows than its slots (would read past slot_to_unique).
    overfull = r._replace(received=np.array([0, 3], np.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="receives 3 rows for worker 1"):
        ops.window_grad_index([overfull], 8)
    # Table sizes that do not cover the round's local rows, or a table count that changes
    # between rounds (the window's rows could not be grouped by table).
    with pytest.raises(tf.errors.InvalidArgumentError, match="table sizes sum to 1, its local "
                                                            "rows are 2"):
        ops.window_grad_index([r._replace(table_sizes=np.array([1], np.int32))], 8)
    with pytest.raises(tf.errors.InvalidArgumentError, match="round 1 has 2 table sizes, round "
                                                            "0 has 1"):
        ops.window_grad_index([r, r._replace(table_sizes=np.array([1, 1], np.int32))], 8)
    # A negative table size, even where the sizes still sum to the round's rows.
    with pytest.raises(tf.errors.InvalidArgumentError, match="gives table 1 -1 rows"):
        ops.window_grad_index([r._replace(table_sizes=np.array([3, -1], np.int32))], 8)
    # A slot naming a local row the round does not have.
    with pytest.raises(tf.errors.InvalidArgumentError, match="names local row 5 of 2"):
        ops.window_grad_index([r._replace(slot_to_unique=np.array([0, 5, -1, -1], np.int32))],
                              8)
