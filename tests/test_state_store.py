"""`TensorStore`: a structure kept between steps in one variable, read back with its static
shapes; a value of another shape relaxes the spec (and counts a version); a value of another
structure or dtype is refused."""
import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe.pipeline.state_store import (KEEP_SHAPES, VARY_ALL_DIMS, VARY_FIRST_DIM,
                                              TensorStore)


def _batch(rows):
    return {"ids": tf.reshape(tf.range(rows * 2, dtype=tf.int64), [rows, 2]),
            "bag": tf.RaggedTensor.from_row_lengths(tf.range(rows, dtype=tf.int64),
                                                    tf.ones([rows], tf.int64))}


def _round_trip(store, value, admit=None):
    """Stores `value` and reads it back in one traced function; returns (what was read, the
    static shapes the read had)."""
    shapes = []

    @tf.function
    def step(value):
        with tf.control_dependencies(store.assign(value, admit=admit)):
            read = store.read()
        shapes.append(tf.nest.map_structure(lambda t: t.shape, read))
        return read

    return step(value), shapes[-1]


def test_a_read_keeps_the_static_shapes_and_values():
    store = TensorStore("/cpu:0", "batch")
    read, shapes = _round_trip(store, _batch(4))
    assert shapes["ids"] == [4, 2] and shapes["bag"] == [4, None]
    assert read["ids"].numpy().tolist() == _batch(4)["ids"].numpy().tolist()
    assert read["bag"].to_list() == _batch(4)["bag"].to_list()
    assert store.version == 0


def test_another_size_relaxes_the_spec_once_and_counts_a_version():
    store = TensorStore("/cpu:0", "batch")
    _round_trip(store, _batch(4))
    read, shapes = _round_trip(store, _batch(3))
    assert shapes["ids"] == [None, 2] and store.version == 1
    assert read["bag"].to_list() == _batch(3)["bag"].to_list()
    _round_trip(store, _batch(5))  # fits the relaxed spec: no new version
    assert store.version == 1


def test_admit_relaxes_the_first_spec_without_a_version():
    store = TensorStore("/cpu:0", "batch")
    admit = tf.nest.map_structure(tf.type_spec_from_value, _batch(4))
    admit["ids"] = tf.TensorSpec([None, 2], tf.int64)
    _, shapes = _round_trip(store, _batch(4), admit=admit)
    assert shapes["ids"] == [None, 2] and store.version == 0


def test_shape_policies_vary_the_dimensions_from_the_start():
    first, every = TensorStore("/cpu:0", "a", VARY_FIRST_DIM), TensorStore("/cpu:0", "b",
                                                                          VARY_ALL_DIMS)
    assert _round_trip(first, tf.zeros([3, 4]))[1] == [None, 4]
    assert _round_trip(every, tf.zeros([3, 4]))[1] == [None, None]
    with pytest.raises(ValueError, match="shapes must be one of"):
        TensorStore("/cpu:0", "c", shapes="dim0")


def test_an_empty_structure_needs_no_variable():
    store = TensorStore("/cpu:0", "nothing")
    read, _ = _round_trip(store, {})
    assert read == {}


def test_another_dtype_or_structure_is_refused():
    store = TensorStore("/cpu:0", "batch")
    _round_trip(store, tf.zeros([2, 3]))
    with pytest.raises(ValueError, match="batch: component 0 is .*int32"):
        _round_trip(store, tf.zeros([2, 3], tf.int32))
    with pytest.raises(ValueError, match="batch: the stored structure changed"):
        _round_trip(store, (tf.zeros([2, 3]), tf.zeros([2, 3])))
    # Positive control: the stored structure and dtype are accepted.
    _round_trip(store, tf.ones([2, 3]))


def test_a_store_of_parts_keeps_each_parts_policy_in_one_variable():
    """A tuple of policies: part i relaxed as policy i says, all parts in one variable (two ops
    to store and two to read); admit's None entries admit nothing more for their part."""
    store = TensorStore("/cpu:0", "parts", (KEEP_SHAPES, VARY_FIRST_DIM, VARY_ALL_DIMS))
    value = (_batch(4), tf.zeros([4, 3]), {"slots": tf.zeros([2, 5], tf.int32)})
    admit = (dict(tf.nest.map_structure(tf.type_spec_from_value, _batch(4)),
                  ids=tf.TensorSpec([None, 2], tf.int64)), None, None)
    traced = []

    @tf.function
    def step(value):
        with tf.control_dependencies(store.assign(value, admit=admit)):
            read = store.read()
        traced.append((tf.nest.map_structure(lambda t: t.shape, read),
                       [op.type for op in tf.compat.v1.get_default_graph().get_operations()]))
        return read

    read = step(value)
    (batch, rows, plan), types = traced[-1]
    assert batch["ids"] == [None, 2] and batch["bag"] == [4, None]
    assert rows == [None, 3] and plan["slots"] == [None, None]
    assert store.version == 0
    np.testing.assert_array_equal(read[0]["ids"].numpy(), _batch(4)["ids"].numpy())
    np.testing.assert_array_equal(read[2]["slots"].numpy(), np.zeros([2, 5]))
    assert types.count("AssignVariableOp") == 1 and types.count("OptionalGetValue") == 1
    with pytest.raises(ValueError, match="holds a tuple of 3 parts"):
        store.assign((_batch(4), tf.zeros([4, 3])))


def test_a_bad_policy_is_refused():
    with pytest.raises(ValueError, match="shapes must be one of"):
        TensorStore("/cpu:0", "bad", "every")
    with pytest.raises(ValueError, match="shapes must be one of"):
        TensorStore("/cpu:0", "bad", (KEEP_SHAPES, "every"))
