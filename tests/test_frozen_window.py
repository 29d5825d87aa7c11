"""The frozen window's cache and batch splitting, in one process."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_nestpipe as tnp
from tf_nestpipe.pipeline.frozen_window import WindowCache, split_batch, windowed_lookup


def test_window_cache_fetches_each_id_once_and_routes_gradients_back():
    table = tf.Variable(np.arange(40, dtype=np.float32).reshape(10, 4))
    fetched = []

    def lookup(ids):
        fetched.append(ids.numpy().tolist())
        return tf.gather(table, ids)

    cache = WindowCache()
    batches = [tf.constant([3, 1, 3], tf.int64), tf.constant([1, 7, 3, 0], tf.int64)]
    with tf.GradientTape() as tape:
        outs = [windowed_lookup(cache, "t", ids, lookup, 4, tf.float32) for ids in batches]
        loss = tf.reduce_sum(outs[0]) + 2.0 * tf.reduce_sum(outs[1])
    assert fetched == [[3, 1], [7, 0]]  # the second micro-batch fetched only its new ids
    for ids, out in zip(batches, outs):
        np.testing.assert_array_equal(out.numpy(), table.numpy()[ids.numpy()])
    grad = tf.convert_to_tensor(tape.gradient(loss, table)).numpy()
    counts = {3: 2 + 2, 1: 1 + 2, 7: 2, 0: 2}  # each use weighted by its micro-batch's factor
    expected = np.zeros((10, 4), np.float32)
    for row, weight in counts.items():
        expected[row] = weight
    np.testing.assert_array_equal(grad, expected)


def test_split_batch_covers_the_batch_with_shares_summing_to_one():
    batch = ({"ids": tf.range(10), "bag": tf.ragged.constant([[1], [2, 3]] * 5)}, tf.ones([10, 1]))
    parts = split_batch(batch, 3)
    assert [int(p[0][1].shape[0]) for p in parts] == [3, 3, 4]
    np.testing.assert_allclose(sum(float(s) for _, s in parts), 1.0)
    np.testing.assert_array_equal(tf.concat([p[0][0]["ids"] for p in parts], 0).numpy(), np.arange(10))
    assert parts[2][0][0]["bag"].to_list() == [[1], [2, 3], [1], [2, 3]]


@pytest.mark.parametrize("pipeline", ["fwp", "nested"])
def test_micro_batching_fit_refuses_models_with_their_own_train_step(pipeline):
    class Custom(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = tf_keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            return super().train_step(data)

    strategy = tnp.NestPipeStrategy(pipeline=pipeline, micro_batches=2)
    with strategy.scope():
        model = Custom()
        model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="overrides train_step"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
