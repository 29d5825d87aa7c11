"""Key-centric sample clustering: a permutation that groups samples by shared keys and puts the
micro-batch with the fewest distinct keys first."""
import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe.pipeline import cluster_batch, cluster_permutation, integer_leaves, split_batch


def _distinct_per_chunk(columns, order, micro_batches):
    chunks = np.array_split(np.asarray(order), micro_batches)
    return [sum(len(set(col[c].tolist())) for col in columns) for c in chunks]


def test_samples_sharing_a_key_land_in_one_micro_batch():
    # 8 samples, 4 keys each shared by 2 samples, interleaved: unclustered, every micro-batch of
    # 2 samples holds 2 distinct keys; clustered, 1.
    ids = tf.constant([10, 11, 12, 13, 10, 11, 12, 13], tf.int64)
    order = cluster_permutation([ids], 8, 4).numpy()
    assert sorted(order.tolist()) == list(range(8))
    assert _distinct_per_chunk([ids.numpy()], np.arange(8), 4) == [2, 2, 2, 2]
    assert _distinct_per_chunk([ids.numpy()], order, 4) == [1, 1, 1, 1]


def test_the_micro_batch_with_fewest_keys_goes_first():
    rng = np.random.default_rng(3)
    a = np.minimum(rng.zipf(1.3, 64) - 1, 50)
    bag = tf.RaggedTensor.from_row_lengths(np.minimum(rng.zipf(1.2, 128) - 1, 40),
                                           np.full(64, 2))
    order = cluster_permutation([tf.constant(a), bag], 64, 4).numpy()
    assert sorted(order.tolist()) == list(range(64))
    rows = bag.to_list()
    per_chunk = [len({("a", int(a[i])) for i in c} | {("b", v) for i in c for v in rows[i]})
                 for c in np.array_split(order, 4)]
    assert per_chunk[0] == min(per_chunk)


def test_clustering_reduces_first_micro_batch_keys_on_zipf_data():
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.2, (512, 3)) - 1, 999)
    columns = [ids[:, f] for f in range(3)]
    order = cluster_permutation([tf.constant(ids)], 512, 4).numpy()
    plain, clustered = (_distinct_per_chunk(columns, o, 4) for o in (np.arange(512), order))
    assert clustered[0] < plain[0]
    assert sum(clustered) < sum(plain)


def test_cluster_batch_permutes_every_tensor_alike_and_split_keeps_all_samples():
    x = {"ids": tf.constant([5, 6, 5, 6, 7, 7], tf.int64),
         "dense": tf.constant([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0]])}
    y = tf.constant([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0]])
    permuted = cluster_batch((x, y), integer_leaves(x), 3)
    np.testing.assert_array_equal(permuted[0]["dense"].numpy(), permuted[1].numpy())
    assert sorted(permuted[1].numpy().ravel().tolist()) == [0, 1, 2, 3, 4, 5]
    parts = split_batch((x, y), 3, cluster_keys=integer_leaves(x))
    assert [sorted(set(p[0]["ids"].numpy().tolist())) for p, _ in parts] in (
        [[5], [6], [7]], [[5], [7], [6]], [[6], [5], [7]], [[6], [7], [5]], [[7], [5], [6]],
        [[7], [6], [5]])


def test_integer_leaves_picks_id_tensors_only():
    x = {"ids": tf.constant([1], tf.int64), "dense": tf.constant([[1.0]]),
         "bag": tf.ragged.constant([[1, 2]], dtype=tf.int32)}
    assert len(integer_leaves(x)) == 2


def test_cluster_permutation_rejects_bad_inputs():
    with pytest.raises(ValueError, match="at least one id tensor"):
        cluster_permutation([], 4, 2)
    with pytest.raises(ValueError, match="must be \\[batch\\]"):
        cluster_permutation([tf.zeros([2, 2, 2], tf.int64)], 2, 2)
