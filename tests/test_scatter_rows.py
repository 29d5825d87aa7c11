"""`ops.scatter_rows` (a table's sparse in-place updates) against NumPy and TensorFlow's own
scatter ops, its errors, and the row-shard variables whose `scatter_add` / `scatter_sub` take it."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_nestpipe as tnp
from tf_nestpipe import ops
from tf_nestpipe.strategy import is_row_shard


def _scatter_reference(table, indices, updates, subtract):
    out = table.copy()
    for i, row in enumerate(indices):  # in order: repeats apply one after another
        out[row] = out[row] - updates[i] if subtract else out[row] + updates[i]
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("subtract", [False, True])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_scatter_rows_matches_numpy_and_tensorflow_bitwise(dtype, subtract, index_dtype):
    """With repeated rows, eager and traced, and an empty update; TensorFlow's own
    ResourceScatterAdd / Sub as the second reference (the same bits)."""
    rng = np.random.default_rng(7)
    table = rng.normal(size=(50, 3, 2)).astype(dtype)
    indices = np.array([4, 0, 49, 4, 17, 4], index_dtype)
    updates = rng.normal(size=(6, 3, 2)).astype(dtype)
    expected = _scatter_reference(table, indices, updates, subtract)
    for run in (lambda f: f(), lambda f: tf.function(f)()):
        ours, theirs = tf.Variable(table), tf.Variable(table)

        def update_ours():
            ops.scatter_rows(ours.handle, indices, updates, subtract=subtract)

        def update_theirs():
            delta = tf.IndexedSlices(tf.constant(updates), tf.constant(indices))
            theirs.scatter_sub(delta) if subtract else theirs.scatter_add(delta)

        run(update_ours)
        run(update_theirs)
        np.testing.assert_array_equal(ours.numpy(), expected)
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    empty = tf.Variable(table)
    ops.scatter_rows(empty.handle, np.zeros([0], index_dtype), np.zeros([0, 3, 2], dtype))
    np.testing.assert_array_equal(empty.numpy(), table)


def test_scatter_rows_checks_every_index_before_updating_any_row():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    variable = tf.Variable(table)
    for bad in ([0, 4], [-1, 0]):
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[\d\] = -?\d+ is not"):
            ops.scatter_rows(variable.handle, bad, np.ones([2, 3], np.float32))
        np.testing.assert_array_equal(variable.numpy(), table)  # the valid row 0 untouched too
    with pytest.raises(tf.errors.InvalidArgumentError, match="updates must be"):
        ops.scatter_rows(variable.handle, [0, 1], np.ones([2, 4], np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="indices must be a vector"):
        ops.scatter_rows(variable.handle, [[0]], np.ones([1, 3], np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="expected double"):
        ops.scatter_rows(variable.handle, [0], np.ones([1, 3], np.float64))


def test_scatter_rows_leaves_an_earlier_read_unchanged():
    """A value read before the update keeps its rows (the variable's buffer is copied before
    the in-place update while the read holds it, as TensorFlow's scatters do); positive
    control: the variable itself changed."""
    variable = tf.Variable(np.zeros([3, 2], np.float32))

    @tf.function
    def read_update_read():
        before = variable.read_value()
        with tf.control_dependencies([before]):
            update = ops.scatter_rows(variable.handle, [1], [[5.0, 6.0]])
        with tf.control_dependencies([update]):
            return tf.identity(before), variable.read_value()

    before, after = read_update_read()
    np.testing.assert_array_equal(before.numpy(), np.zeros([3, 2]))
    np.testing.assert_array_equal(after.numpy()[1], [5.0, 6.0])


def _trained(table, gradient, make_optimizer, sharded):
    """A table after 3 steps of `make_optimizer()` on `gradient`: a ShardedEmbedding's row
    shard under a one-worker NestPipeStrategy (its optimizer slots row shards too), or a plain
    variable. Returns (its value, the op types of the traced step and its functions)."""
    if sharded:
        with tnp.NestPipeStrategy().scope():
            layer = tnp.ShardedEmbedding(table.shape[0], table.shape[1])
            layer.build(None)
            optimizer = make_optimizer()
            optimizer.build([layer.embeddings])  # as fit does: its slots are row shards too
        variable = layer.embeddings
        variable.assign(table)
        assert is_row_shard(variable)
    else:
        variable, optimizer = tf.Variable(table), make_optimizer()
    step = tf.function(lambda: [optimizer.apply_gradients([(gradient, variable)])][:0])
    for _ in range(3):
        step()
    graph = step.get_concrete_function().graph
    types = {op.type for op in graph.get_operations()} | {
        node.op for function in graph.as_graph_def().library.function
        for node in function.node_def}
    return variable.numpy(), types


@pytest.mark.parametrize("make_optimizer", [lambda: tf_keras.optimizers.Adagrad(0.1),
                                            lambda: tf_keras.optimizers.SGD(0.1)],
                         ids=["adagrad", "sgd"])
def test_row_shards_apply_keras_sparse_updates_with_scatter_rows(make_optimizer):
    """tf_keras Adagrad (accumulator and rows) and SGD on an IndexedSlices gradient with
    repeated rows: a row shard ends bitwise where a plain variable does; its traced step runs
    NestpipeScatterRows and no ResourceScatterAdd / Sub (the plain variable's, the positive
    control, runs them)."""
    rng = np.random.default_rng(3)
    table = rng.normal(size=(20, 4)).astype(np.float32)
    gradient = tf.IndexedSlices(tf.constant(rng.normal(size=(5, 4)).astype(np.float32)),
                                tf.constant([3, 7, 3, 19, 0]))
    ours, our_types = _trained(table, gradient, make_optimizer, sharded=True)
    plain, plain_types = _trained(table, gradient, make_optimizer, sharded=False)
    np.testing.assert_array_equal(ours, plain)
    assert not np.array_equal(ours, table)
    assert "NestpipeScatterRows" in our_types
    assert not {"ResourceScatterAdd", "ResourceScatterSub"} & our_types
    assert {"ResourceScatterAdd", "ResourceScatterSub"} & plain_types
    assert "NestpipeScatterRows" not in plain_types
