"""The initial row of an id of a dynamic table: a function of (initializer seed, id) only.

Supported initializers: `RandomUniform(minval, maxval, seed)`, `RandomNormal(mean, stddev,
seed)`, `TruncatedNormal(mean, stddev, seed)` (a seed is required) and `Zeros`, `Ones`,
`Constant`. Row of id k = `a + b * raw(seed, k)` where `raw` is `ops.dynamic_row_init` (the
first `dim` U[0,1) / N(0,1) / truncated N(0,1) samples of a Philox stream keyed by the seed and
the id; seed pair `[seed, 0]`) and (a, b) = (minval, maxval - minval) or (mean, stddev). So one
seed gives one model at any worker count, whichever worker owns the id and whenever it is
(re-)admitted.
"""
import tensorflow as tf
import tf_keras

from tf_nestpipe.ops.dynamic_table import dynamic_row_init

_RANDOM = {tf_keras.initializers.RandomUniform: "uniform",
           tf_keras.initializers.RandomNormal: "normal",
           tf_keras.initializers.TruncatedNormal: "truncated_normal"}
_CONSTANT = (tf_keras.initializers.Zeros, tf_keras.initializers.Ones,
             tf_keras.initializers.Constant)


def check_dynamic_initializer(initializer, name):
    """`initializer` (a tf_keras initializer) if a dynamic table can compute it per id, else a
    ValueError naming the fix."""
    initializer = tf_keras.initializers.get(initializer)
    if isinstance(initializer, _CONSTANT):
        return initializer
    kind = _RANDOM.get(type(initializer))
    if kind is None:
        raise ValueError(
            "DynamicEmbedding '%s': initializer %r cannot be computed per id (a dynamic table has "
            "no fixed shape). Use RandomUniform, RandomNormal or TruncatedNormal with a seed, or "
            "Zeros / Ones / Constant." % (name, initializer))
    if initializer.seed is None:
        raise ValueError(
            "DynamicEmbedding '%s': give the initializer a seed (e.g. RandomUniform(-0.05, 0.05, "
            "seed=1)): an id's initial row is a function of (seed, id), the same on any worker "
            "count." % name)
    return initializer


def initial_rows(initializer, ids, dim):
    """Initial rows `[n, dim]` float32 of the int64 `ids` (see module)."""
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    shape = tf.stack([tf.size(ids), dim])
    if isinstance(initializer, tf_keras.initializers.Zeros):
        return tf.zeros(shape, tf.float32)
    if isinstance(initializer, tf_keras.initializers.Ones):
        return tf.ones(shape, tf.float32)
    if isinstance(initializer, tf_keras.initializers.Constant):
        return tf.fill(shape, tf.cast(initializer.value, tf.float32))
    kind = _RANDOM[type(initializer)]
    raw = dynamic_row_init(tf.constant([int(initializer.seed), 0], tf.int64), ids, dim, kind)
    if kind == "uniform":
        a, b = float(initializer.minval), float(initializer.maxval) - float(initializer.minval)
    else:
        a, b = float(initializer.mean), float(initializer.stddev)
    return raw * b + a
