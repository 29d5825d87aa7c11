"""bench/dense_split.py times the same work whole and as micro-batches: its steps' gradients
agree for every M (no cluster is started)."""
import os
import sys

import numpy as np
import tensorflow as tf
import tf_keras

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import dense_split  # noqa: E402


def test_micro_batched_steps_compute_the_whole_batchs_gradients():
    rng = np.random.default_rng(0)
    features = {"dense": tf.constant(rng.normal(size=(8, 13)), tf.float32),
                "sparse": tf.constant(rng.integers(0, 50, (8, 3)))}
    labels = tf.constant(rng.integers(0, 2, 8), tf.float32)
    model = dense_split.DLRM(tf_keras.layers.Embedding(50, 4), dim=4)
    model(features)
    steps = {m: dense_split.make_step(model, model.trainable_variables, (features, labels), m)
             for m in (1, 2, 4)}
    whole = steps[1]()
    for m in (2, 4):
        parts = steps[m]()
        # Dense variables: the same gradient. The table's rows: the same sum per row (the
        # micro-batches' IndexedSlices list each part's rows, in part order).
        for a, b in zip(whole[1:], parts[1:]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(whole[0].numpy().sum(0), parts[0].numpy().sum(0), rtol=1e-5,
                                   atol=1e-6)
    # Positive control: another batch's gradients differ.
    other = dense_split.make_step(model, model.trainable_variables,
                                  (features, 1.0 - labels), 1)()
    assert not np.allclose(whole[-1].numpy(), other[-1].numpy())
