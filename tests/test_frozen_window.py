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


def _regularized_model(regularized=True, own_compute_loss=False):
    """Dense 3 -> 4 -> 1 with (optionally) a kernel and an activity regularizer."""
    class OwnLoss(tf_keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            return super().compute_loss(x, y, y_pred, sample_weight)

    inputs = tf_keras.Input((3,))
    hidden = tf_keras.layers.Dense(
        4, activation="relu", kernel_initializer=tf_keras.initializers.GlorotUniform(seed=1),
        kernel_regularizer=tf_keras.regularizers.L2(0.05) if regularized else None,
        activity_regularizer=tf_keras.regularizers.L2(0.02) if regularized else None)(inputs)
    out = tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=2))(hidden)
    model = (OwnLoss if own_compute_loss else tf_keras.Model)(inputs, out)
    model.compile(tf_keras.optimizers.SGD(0.1), "mse")
    return model


def _fit_weights(strategy=None, **kwargs):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype(np.float32)
    y = rng.normal(size=(32, 1)).astype(np.float32)
    if strategy is None:
        model = _regularized_model(**kwargs)
    else:
        with strategy.scope():
            model = _regularized_model(**kwargs)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history["loss"]


@pytest.mark.parametrize("own_compute_loss", [False, True])
def test_micro_batched_fit_counts_the_model_losses_as_one_process(own_compute_loss):
    """fwp's train step computes the compiled loss once on the whole batch (or a model's own
    compute_loss per micro-batch, weighted by its share) and counts each call's regularization
    losses by its share: weights and loss history equal tf_keras' own fit. Positive control: the
    regularizers change the result (so counting them twice, or not at all, would fail)."""
    expected, expected_loss = _fit_weights()
    strategy = tnp.NestPipeStrategy(pipeline="fwp", micro_batches=2)
    weights, loss = _fit_weights(strategy, own_compute_loss=own_compute_loss)
    for got, want in zip(weights, expected):
        np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-6)
    unregularized, _ = _fit_weights(regularized=False)
    assert max(float(np.abs(a - b).max()) for a, b in zip(unregularized, expected)) > 1e-3


def test_a_scalar_mean_metric_in_call_counts_each_step_once_over_unequal_micro_batches():
    """A micro-batching step calls the model once per micro-batch: a mean metric updated with
    one scalar per call (add_metric, Mean.update_state) counts each part by its share, so a
    batch mean is the whole batch's and the step counts once. Control: unweighted, the same
    updates give the mean of the parts' means (5 rows in parts of 2 and 3) and count twice."""
    from tf_nestpipe.pipeline.quiet_metrics import share_weighted_metrics

    class MeanInCall(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.tracker = tf_keras.metrics.Mean(name="tracker")
            self.per_example = tf_keras.metrics.Mean(name="per_example")

        def call(self, x):
            self.add_metric(tf.reduce_mean(x), name="added")
            self.tracker.update_state(tf.reduce_mean(x))
            self.per_example.update_state(x)  # per-example values: never reweighted
            return x

    x = tf.constant([[1.0], [2.0], [3.0], [4.0], [10.0]])

    def run(weighted):
        model = MeanInCall()
        model(x[:1])  # creates add_metric's metric
        for metric in model.metrics:
            metric.reset_state()

        @tf.function
        def step():
            for part, share in split_batch({"x": x}, 2):
                if weighted:
                    with share_weighted_metrics(model, share):
                        model(part["x"])
                else:
                    model(part["x"])

        step()
        return {m.name: (float(m.result()), float(m.count)) for m in model.metrics}

    weighted, plain = run(True), run(False)
    for name in ("added", "tracker"):
        assert weighted[name] == pytest.approx((4.0, 1.0)), name
        assert plain[name] == pytest.approx(((1.5 + 17 / 3) / 2, 2.0)), name
    assert weighted["per_example"] == plain["per_example"] == pytest.approx((4.0, 5.0))
