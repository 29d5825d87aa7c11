"""ShardedEmbedding and NestPipeStrategy in one process (the W=1 case and the plain-Keras case)."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_nestpipe as tnp
from tf_nestpipe.collectives.communication import resolve_implementation
from tf_nestpipe.strategy.nestpipe_strategy import is_row_shard

Impl = tnp.CommunicationImplementation


@pytest.fixture(scope="module")
def strategy():
    return tnp.NestPipeStrategy()


def test_strategy_is_a_tf_distribute_strategy(strategy):
    assert isinstance(strategy, tf.distribute.Strategy)
    assert strategy.num_workers == 1 and strategy.worker_index == 0
    assert strategy.num_replicas_in_sync == 1


def test_communication_selection():
    assert resolve_implementation(Impl.AUTO, "CPU") == Impl.RING
    assert resolve_implementation(Impl.AUTO, "GPU") == Impl.NCCL
    assert resolve_implementation(Impl.NCCL, "CPU") == Impl.RING  # fallback without a GPU
    assert resolve_implementation(Impl.RING, "GPU") == Impl.RING


def _init():
    return tf_keras.initializers.RandomUniform(-1.0, 1.0, seed=21)


@pytest.mark.parametrize("in_scope", [False, True])
def test_matches_keras_embedding_for_dense_ids(strategy, in_scope):
    ids = np.array([[1, 5, 5], [0, 9, 2]], np.int64)
    reference = tf_keras.layers.Embedding(10, 3, embeddings_initializer=_init())
    expected = reference(ids).numpy()
    if in_scope:
        with strategy.scope():
            layer = tnp.ShardedEmbedding(10, 3, embeddings_initializer=_init())
    else:
        layer = tnp.ShardedEmbedding(10, 3, embeddings_initializer=_init())
    np.testing.assert_array_equal(layer(ids).numpy(), expected)
    np.testing.assert_array_equal(layer(ids[:, 0]).numpy(), expected[:, 0])
    np.testing.assert_array_equal(layer.full_table(), reference.embeddings.numpy())
    assert is_row_shard(layer.embeddings) == in_scope


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_combiners_on_dense_and_ragged_ids(strategy, combiner):
    with strategy.scope():
        layer = tnp.ShardedEmbedding(20, 4, combiner=combiner, embeddings_initializer=_init())
    ragged = tf.ragged.constant([[1, 2, 2], [7], [3, 19]], dtype=tf.int64)
    out = layer(ragged).numpy()
    table = layer.full_table()
    pool = np.sum if combiner == "sum" else np.mean
    expected = np.stack([pool(table[row], axis=0) for row in ragged.to_list()])
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    dense = np.array([[1, 2], [3, 3]], np.int64)
    np.testing.assert_allclose(layer(dense).numpy(), pool(table[dense], axis=1), rtol=1e-6)


def test_gradient_is_indexed_slices_on_touched_rows(strategy):
    with strategy.scope():
        layer = tnp.ShardedEmbedding(8, 2, embeddings_initializer=_init())
    ids = tf.constant([3, 1, 3], tf.int64)
    layer(ids)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids) * tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    grad = tape.gradient(loss, layer.embeddings)
    assert isinstance(grad, tf.IndexedSlices)
    dense = tf.convert_to_tensor(grad).numpy()
    expected = np.zeros((8, 2), np.float32)
    expected[3] = [6.0, 8.0]
    expected[1] = [3.0, 4.0]
    np.testing.assert_array_equal(dense, expected)


def test_invalid_ids_raise_by_default_naming_the_table(strategy):
    with strategy.scope():
        layer = tnp.ShardedEmbedding(8, 2, name="item_table")
    with pytest.raises(tf.errors.InvalidArgumentError, match="'item_table': id -4 at position 1"):
        layer(tf.constant([1, -4], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="'item_table': id 8 at position 0"):
        layer(tf.constant([8], tf.int64))


def test_invalid_id_policy_zero_gives_zero_rows_and_no_gradient(strategy):
    with strategy.scope():
        layer = tnp.ShardedEmbedding(8, 2, invalid_id_policy="zero", embeddings_initializer=_init())
    ids = tf.constant([2, -1, 99], tf.int64)
    with tf.GradientTape() as tape:
        out = layer(ids)
        loss = tf.reduce_sum(out)
    np.testing.assert_array_equal(out.numpy()[1:], 0.0)
    grad = tf.convert_to_tensor(tape.gradient(loss, layer.embeddings)).numpy()
    assert grad[2].tolist() == [1.0, 1.0] and np.abs(grad).sum() == 2.0


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="combiner"):
        tnp.ShardedEmbedding(8, 2, combiner="max")
    with pytest.raises(ValueError, match="invalid_id_policy"):
        tnp.ShardedEmbedding(8, 2, invalid_id_policy="clip")
    with pytest.raises(ValueError, match="positive"):
        tnp.ShardedEmbedding(0, 2)
    layer = tnp.ShardedEmbedding(8, 2)
    with pytest.raises(ValueError, match="set combiner"):
        layer(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64))
    with pytest.raises(ValueError, match="SparseTensor"):
        layer(tf.sparse.from_dense(tf.constant([[1, 0]], tf.int64)))
    pooled = tnp.ShardedEmbedding(8, 2, combiner="sum")
    with pytest.raises(ValueError, match="rank >= 2"):
        pooled(tf.constant([1, 2], tf.int64))


def test_fit_keeps_optimizer_slots_with_the_shard(strategy):
    with strategy.scope():
        inputs = tf_keras.Input(shape=(2,), dtype=tf.int64)
        table = tnp.ShardedEmbedding(50, 4, combiner="mean", name="fit_table")
        outputs = tf_keras.layers.Dense(1)(table(inputs))
        model = tf_keras.Model(inputs, outputs)
        model.compile(optimizer=tf_keras.optimizers.Adam(0.01), loss="mse")
    ids = np.random.default_rng(0).integers(0, 50, size=(64, 2))
    before = table.full_table().copy()
    model.fit(ids, ids[:, :1].astype(np.float32) / 50, batch_size=16, epochs=1, verbose=0)
    assert np.abs(table.full_table() - before).max() > 0
    slots = [v for v in model.optimizer.variables if "fit_table" in v.name]
    assert len(slots) == 2 and all(is_row_shard(v) for v in slots)
    assert all(tuple(v.shape) == (50, 4) for v in slots)


def _id_model(layer, ids_shape):
    ids = tf_keras.Input(ids_shape, dtype="int64")
    return tf_keras.Model(ids, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(layer(ids))))


@pytest.mark.parametrize("make", [
    lambda: tnp.ShardedEmbedding(20, 4, combiner="sum"),
    lambda: tnp.ShardedEmbeddingCollection([20, 7], 4),
    lambda: tnp.DynamicEmbedding(4, capacity_per_worker=64, combiner="sum")])
def test_keras_files_load_with_no_custom_objects(strategy, tmp_path, make):
    """Our layers are registered Keras serializables: a `.keras` file loads as written, in the
    scope, with no `custom_objects`, and predicts what the saved model did."""
    ids = np.array([[1, 2], [3, 5]], np.int64)
    with strategy.scope():
        model = _id_model(make(), (2,))
    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = tf_keras.models.load_model(path)
    assert type(loaded.layers[1]) is type(model.layers[1])  # noqa: E721
    np.testing.assert_array_equal(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0))


def test_keras_files_of_unregistered_layers_fail_to_load(strategy, tmp_path):
    """Positive control: the same round trip fails for a layer Keras cannot find by name."""
    class Unregistered(tnp.ShardedEmbedding):
        pass

    with strategy.scope():
        model = _id_model(Unregistered(20, 4, combiner="sum"), (2,))
    path = str(tmp_path / "model.keras")
    model.save(path)
    with pytest.raises((TypeError, ValueError)):
        with strategy.scope():
            tf_keras.models.load_model(path)


def test_metric_updates_trace_to_nothing_only_within_untouched_metrics():
    """The route pass's quiet metrics: inside the context neither `metric(value)` nor the
    model's metrics' `update_state` change a state; outside (positive control) both do."""
    from tf_nestpipe.pipeline.quiet_metrics import untouched_metrics

    model = tf_keras.Sequential([tf_keras.layers.Dense(1)])
    tracked = tf_keras.metrics.Sum(name="tracked")
    model.tracked = tracked
    loose = tf_keras.metrics.Sum(name="loose")
    with untouched_metrics(model):
        tracked.update_state(5.0)
        loose(3.0)
    assert float(tracked.result()) == 0.0 and float(loose.result()) == 0.0
    tracked.update_state(5.0)
    loose(3.0)
    assert float(tracked.result()) == 5.0 and float(loose.result()) == 3.0


def test_a_table_built_outside_a_multi_worker_scope_is_refused(strategy):
    """With a strategy of several workers in the process, a table built outside any strategy
    scope is refused with the fix; inside a scope, or with no such strategy, it builds."""
    from tf_nestpipe.sharding import embedding

    class TwoWorkers:  # stands for a 2-worker NestPipeStrategy of this process
        num_workers = 2

    layer = tnp.ShardedEmbedding(10, 3, name="outside")
    layer.build((None,))  # positive control: no multi-worker strategy yet
    two = TwoWorkers()
    embedding.register_multi_worker_strategy(two)
    try:
        with pytest.raises(ValueError, match="'outside2' is built outside the scope of the "
                                             "2-worker TwoWorkers.*inside `with strategy.scope"):
            tnp.ShardedEmbedding(10, 3, name="outside2").build((None,))
        with strategy.scope():
            tnp.ShardedEmbedding(10, 3).build((None,))  # in a scope: built
    finally:
        embedding._multi_worker_strategies.discard(two)  # pylint: disable=protected-access


class _TwoIdenticalWorkers:
    """A stand-in for a 2-worker strategy whose workers hold the same predictions."""
    num_workers = 2

    @staticmethod
    def gather(value, axis):
        return tf.concat([value, value], axis=axis)


@pytest.mark.parametrize("value", [np.arange(6, dtype=np.float32).reshape(3, 2),
                                   np.arange(3, dtype=np.float32), np.float32(4.0)])
def test_predictions_of_unknown_rank_are_concatenated(value):
    """`predict` of a model whose output has unknown rank (traced with an unknown-rank
    signature): every worker's rows in worker order, as for a known rank (positive control)."""
    from tf_nestpipe.pipeline.keras_outputs import concat_predictions

    def concat(v):
        return concat_predictions(_TwoIdenticalWorkers, v)

    unknown = tf.function(concat, input_signature=[tf.TensorSpec(None, tf.float32)])
    known = tf.function(concat)
    want = np.concatenate([np.reshape(value, (-1,) + np.shape(value)[1:])] * 2)
    np.testing.assert_array_equal(unknown(value).numpy(), want)
    np.testing.assert_array_equal(known(value).numpy(), want)


def test_tf_keras_backup_and_restore_accepts_the_strategy(strategy, tmp_path):
    """tf_keras' own BackupAndRestore (a script written for one process) backs up a fit in
    the scope: its `NotImplementedError` for strategies it does not know is not raised."""
    with strategy.scope():
        ids = tf_keras.Input((2,), dtype="int64")
        model = tf_keras.Model(ids, tf_keras.layers.Dense(1)(
            tnp.ShardedEmbedding(20, 4, combiner="sum")(ids)))
        model.compile("sgd", "mse")
    backup = tf_keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    x = np.arange(16, dtype=np.int64).reshape(8, 2)
    model.fit(x, np.ones((8, 1), np.float32), batch_size=4, epochs=1, callbacks=[backup],
              verbose=0)
    assert isinstance(strategy, backup._supported_strategies)  # pylint: disable=protected-access


def test_mixed_float16_is_refused_with_the_policy_to_use(strategy):
    """mixed_float16 (dynamic loss scaling) set once inside the scope: layers and loss scale
    optimizers are refused with our reason and the fix (mixed_bfloat16), not tf_keras' generic
    refusal; outside the scope (positive control) tf_keras' own check passes."""
    from tf_nestpipe.strategy.keras_checks import FLOAT16_MESSAGE

    try:
        with strategy.scope():
            tf_keras.mixed_precision.set_global_policy("mixed_float16")
            with pytest.raises(ValueError) as error:
                tf_keras.layers.Dense(1)
            with pytest.raises(ValueError, match="mixed_bfloat16"):
                tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD())
        assert str(error.value) == FLOAT16_MESSAGE
        tf_keras.layers.Dense(1)  # outside any strategy: allowed
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
