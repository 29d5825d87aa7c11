"""A seeded initializer gives the same full table at any worker count, built row shard by shard."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_nestpipe.sharding.initializers import RowShardInitializer
from tf_nestpipe.sharding.layout import ShardLayout

VOCAB, DIM = 101, 6

INITIALIZERS = [
    lambda: tf_keras.initializers.RandomUniform(-0.1, 0.2, seed=3),
    lambda: tf_keras.initializers.RandomNormal(0.5, 2.0, seed=3),
    lambda: tf_keras.initializers.TruncatedNormal(stddev=0.3, seed=4),
    lambda: tf_keras.initializers.GlorotUniform(seed=5),
    lambda: tf_keras.initializers.HeNormal(seed=6),
    lambda: tf_keras.initializers.LecunUniform(seed=7),
    lambda: tf_keras.initializers.Zeros(),
    lambda: tf_keras.initializers.Constant(0.25),
    lambda: tf_keras.initializers.get({"class_name": "RandomUniform", "config": {"seed": 9}}),
]


def assemble(num_shards, make_initializer):
    """Builds every shard separately and interleaves them back into the full table."""
    full = np.zeros((VOCAB, DIM), np.float32)
    for shard in range(num_shards):
        layout = ShardLayout(VOCAB, DIM, num_shards, shard)
        values = RowShardInitializer(make_initializer(), layout)((layout.local_rows, DIM)).numpy()
        assert values.shape == (layout.local_rows, DIM)
        full[layout.global_ids()] = values
    return full


@pytest.mark.parametrize("make_initializer", INITIALIZERS)
@pytest.mark.parametrize("num_shards", [2, 3, 8])
def test_sharded_initialization_equals_unsharded(make_initializer, num_shards):
    reference = make_initializer()((VOCAB, DIM)).numpy()
    np.testing.assert_array_equal(assemble(num_shards, make_initializer), reference)


@pytest.mark.parametrize("in_function", [False, True])
@pytest.mark.parametrize("make_initializer", INITIALIZERS[:6])
def test_row_init_never_draws_the_full_table(monkeypatch, make_initializer, in_function):
    from tensorflow.python.ops import gen_stateless_random_ops_v2 as kernels

    shapes = []
    for name in ("stateless_random_uniform_v2", "stateless_random_normal_v2",
                 "stateless_truncated_normal_v2"):
        original = getattr(kernels, name)

        def spy(*args, _original=original, **kwargs):
            shapes.append(tuple(tf.get_static_value(kwargs.get("shape", args[0] if args else None))))
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, spy)
    # Positive control: the spy sees the full-shape draw of the unsharded initializer (so it
    # hooks the kernels these initializers really use, eagerly and in a function).
    full = tf.function(lambda: make_initializer()((VOCAB, DIM))) if in_function else (
        lambda: make_initializer()((VOCAB, DIM)))
    full()
    assert (VOCAB, DIM) in shapes, shapes
    shapes.clear()
    layout = ShardLayout(VOCAB, DIM, 4, 1)
    initializer = RowShardInitializer(make_initializer(), layout)
    build = tf.function(lambda: initializer((layout.local_rows, DIM))) if in_function else (
        lambda: initializer((layout.local_rows, DIM)))
    values = build().numpy()
    assert values.shape == (layout.local_rows, DIM)
    assert (VOCAB, DIM) not in shapes, shapes  # the full-shape kernel never ran (rows: our op)
    np.testing.assert_array_equal(values, make_initializer()((VOCAB, DIM)).numpy()[layout.global_ids()])


def test_unshardable_initializer_on_a_huge_table_is_refused():
    layout = ShardLayout(10_000_000, 16, 2, 0)
    with pytest.raises(ValueError, match="cannot be evaluated row-wise.*too large"):
        RowShardInitializer(tf_keras.initializers.Orthogonal(seed=1), layout)((layout.local_rows, 16))


def test_shard_layout_rule():
    layout = ShardLayout(10, 2, 3, 1)
    assert layout.local_rows == 3 and layout.global_ids().tolist() == [1, 4, 7]
    assert [layout.rows_of_shard(s) for s in range(3)] == [4, 3, 3]
    assert layout.owner([0, 1, 5]).tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        ShardLayout(10, 2, 3, 3)
    with pytest.raises(ValueError):
        ShardLayout(0, 2)
