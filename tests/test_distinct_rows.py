"""Our tables' gradients after the exchange hold each row once (`ops.has_distinct_indices`), and
tf_keras optimizers skip summing their duplicates (keras_hooks); anything else is deduplicated
as before."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_nestpipe  # noqa: F401  (installs the Keras hooks)
from tf_nestpipe import ops

ROW_VALUES = [3, 0, 5]


def _rows():
    """The carriers' local rows, made in the trace (a captured constant stays unmarked)."""
    return tf.constant(ROW_VALUES, tf.int64)


def _carrier_gradients(distinct_rows):
    table = tf.Variable(tf.zeros([8, 2]))
    grads = []

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            carrier = ops.gradient_carrier([table], _rows(), [0], tf.float32, 2,
                                           distinct_rows=distinct_rows)
            loss = tf.reduce_sum(carrier * tf.constant([[1.0, 2.0]]))
        gradient = tape.gradient(loss, table)
        grads.append(gradient)
        return gradient.values

    step()
    return grads[0]


def test_a_distinct_carrier_marks_its_gradient_and_a_plain_one_does_not():
    assert ops.has_distinct_indices(_carrier_gradients(True))
    assert not ops.has_distinct_indices(_carrier_gradients(False))  # the control
    assert not ops.has_distinct_indices(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])))
    assert not ops.has_distinct_indices(tf.ones([2]))
    assert not ops.has_distinct_indices(None)


def test_a_gradient_rebuilt_from_the_marked_one_is_not_marked():
    table = tf.Variable(tf.zeros([8, 2]))
    found = {}

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            rows = _rows()
            first = ops.gradient_carrier([table], rows, [0], tf.float32, 2, distinct_rows=True)
            second = ops.gradient_carrier([table], rows, [0], tf.float32, 2, distinct_rows=True)
            loss = tf.reduce_sum(first) + tf.reduce_sum(second)
        gradient = tape.gradient(loss, table)  # two lookups of the same rows: concatenated
        found["marked"] = ops.has_distinct_indices(gradient)
        return tf.convert_to_tensor(gradient)

    summed = step()
    assert not found["marked"]
    np.testing.assert_array_equal(summed.numpy()[[0, 3, 5]], 2.0)


def _graph_ops(optimizer_step):
    return {op.type for op in optimizer_step.get_concrete_function().graph.get_operations()}


@pytest.mark.parametrize("distinct_rows", [True, False])
def test_adagrad_skips_the_dedup_of_distinct_rows_only_and_updates_the_same(distinct_rows):
    table = tf.Variable(tf.reshape(tf.range(16, dtype=tf.float32), [8, 2]) / 10.0)
    optimizer = tf_keras.optimizers.Adagrad(0.1)
    optimizer.build([table])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            rows = _rows()
            carrier = ops.gradient_carrier([table], rows, [0], tf.float32, 2,
                                           distinct_rows=distinct_rows)
            loss = tf.reduce_sum((carrier + tf.gather(tf.stop_gradient(table), rows)) ** 2)
        optimizer.apply_gradients([(tape.gradient(loss, table), table)])

    types = _graph_ops(step)
    # The positive control is the plain carrier: tf_keras' own dedup (tf.unique) runs there.
    assert ("Unique" in types) != distinct_rows, sorted(types)
    step()
    before = np.reshape(np.arange(16, dtype=np.float32), [8, 2]) / 10.0
    gradient = 2 * before[ROW_VALUES]
    accumulator = 0.1 + gradient ** 2  # Adagrad's initial accumulator is 0.1
    expected = before.copy()
    expected[ROW_VALUES] -= 0.1 * gradient / (np.sqrt(accumulator) + 1e-7)
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)


def test_each_table_of_a_fused_carrier_gets_marked_rows():
    first, second = tf.Variable(tf.zeros([4, 2])), tf.Variable(tf.zeros([6, 2]))
    found = {}

    @tf.function
    def step(distinct_rows):
        with tf.GradientTape() as tape:
            # Fused local rows: table 0 holds 0-3, table 1 from 4 on.
            rows = tf.constant([1, 5, 2, 9], tf.int64)
            carrier = ops.gradient_carrier([first, second], rows, [0, 4], tf.float32, 2,
                                           distinct_rows=distinct_rows)
            loss = tf.reduce_sum(carrier)
        grads = tape.gradient(loss, [first, second])
        found[distinct_rows] = [ops.has_distinct_indices(g) for g in grads]
        return [tf.convert_to_tensor(g) for g in grads]

    step(True)
    step(False)
    assert found == {True: [True, True], False: [False, False]}
