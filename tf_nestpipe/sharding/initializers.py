"""Initialize only this worker's rows of a table, yet exactly as if the full table were built.

tf_keras initializers (RandomUniform, RandomNormal, TruncatedNormal and the VarianceScaling
family: glorot_*, he_*, lecun_*) draw from `tf.random.stateless_*` with the full table shape.
While one of them runs for a row shard, those three functions are replaced by versions that
compute only the owned rows with the `NestpipeStatelessRowInit` op (Philox counter offsets), so
one seed gives the same full table at any worker count and no worker materializes other rows.
"""
import contextlib
import threading

import tensorflow as tf
import tf_keras

from tf_nestpipe.ops.row_init import stateless_row_init

_patch_lock = threading.RLock()
# Tables up to this size may be built in full by initializers we cannot shard row-wise.
_MATERIALIZE_LIMIT_BYTES = 64 << 20
# Initializers whose values are elementwise functions of one stateless draw of the full shape
# (tf_keras' and Keras 3's classes of these names, and their subclasses: glorot_*, he_*, ...).
_ROW_WISE = ("RandomUniform", "RandomNormal", "TruncatedNormal", "VarianceScaling")
_KERAS_PACKAGES = ("tf_keras", "keras")


def _is_keras_initializer(init, names):
    """Whether `init` is a tf_keras or Keras 3 initializer of one of the classes `names` (or of
    a subclass of one)."""
    return any(cls.__name__ in names and cls.__module__.split(".")[0] in _KERAS_PACKAGES
               for cls in type(init).__mro__)


class _RowSubsetRandom:
    """Stand-ins for tf.random.stateless_* that return only `rows` of the requested full shape."""

    def __init__(self, full_shape, rows):
        self.full_shape = tuple(int(d) for d in full_shape)
        self.rows = rows
        self.used = False

    def _matches(self, shape, dtype):
        try:
            shape = tuple(int(d) for d in tf.TensorShape(shape).as_list())
        except (TypeError, ValueError):
            return False
        return shape == self.full_shape and tf.as_dtype(dtype or tf.float32) == tf.float32

    def _raw(self, seed, distribution):
        self.used = True
        return stateless_row_init(seed, self.rows, self.full_shape[1], distribution)

    def wrap(self, original, distribution):
        def stateless(shape, seed, *args, **kwargs):
            dtype = kwargs.get("dtype", tf.float32)
            if not self._matches(shape, dtype) or kwargs.get("alg", "auto_select") not in (
                    "auto_select", None):
                return original(shape, seed, *args, **kwargs)
            names = ("minval", "maxval") if distribution == "uniform" else ("mean", "stddev")
            defaults = (0.0, 1.0)
            params = list(args[:2]) + [None] * (2 - len(args[:2]))
            for i, name in enumerate(names):
                if name in kwargs:
                    params[i] = kwargs[name]
                if params[i] is None:
                    params[i] = defaults[i]
            a = tf.convert_to_tensor(params[0], tf.float32)
            b = tf.convert_to_tensor(params[1], tf.float32)
            rnd = self._raw(seed, distribution)
            if distribution == "uniform":  # same arithmetic as tf.random.stateless_uniform
                return tf.math.add(rnd * (b - a), a)
            return tf.math.add(rnd * b, a)  # stateless_(truncated_)normal: rnd * stddev + mean

        return stateless


def _random_modules():
    """The module objects through which code reaches tf.random (tf_keras uses tf.compat.v2)."""
    modules = [tf.random, tf.compat.v2.random]
    unique = []
    for module in modules:
        if all(module is not m for m in unique):
            unique.append(module)
    return unique


@contextlib.contextmanager
def _rows_only_random(full_shape, rows):
    subset = _RowSubsetRandom(full_shape, rows)
    names = {"stateless_uniform": "uniform", "stateless_normal": "normal",
             "stateless_truncated_normal": "truncated_normal"}
    with _patch_lock:
        saved = []
        for module in _random_modules():
            for name, distribution in names.items():
                original = getattr(module, name)
                saved.append((module, name, original))
                setattr(module, name, subset.wrap(original, distribution))
        try:
            yield subset
        finally:
            for module, name, original in saved:
                setattr(module, name, original)


class RowShardInitializer:
    """Wraps a tf_keras or Keras 3 initializer so that it fills only `layout`'s rows of the full
    table (a name is looked up as a tf_keras initializer)."""

    def __init__(self, initializer, layout):
        self.initializer = (initializer if callable(initializer)
                            else tf_keras.initializers.get(initializer))
        self.layout = layout

    def __call__(self, shape, dtype=None, **kwargs):
        layout = self.layout
        full_shape = (layout.vocab_size, layout.dim)
        local_shape = (layout.local_rows, layout.dim)
        dtype = tf.as_dtype(dtype or tf.float32)
        init = self.initializer
        if layout.local_rows == 0:  # a table-wise table on another worker: no rows here
            return tf.zeros(local_shape, dtype)
        if _is_keras_initializer(init, ("Zeros",)):
            return tf.zeros(local_shape, dtype)
        if _is_keras_initializer(init, ("Ones",)):
            return tf.ones(local_shape, dtype)
        if _is_keras_initializer(init, ("Constant",)):
            return tf.cast(tf.fill(local_shape, init.value), dtype)
        if layout.num_shards == 1:
            return init(full_shape, dtype=dtype)
        rows = layout.global_ids()
        if _is_keras_initializer(init, _ROW_WISE) and dtype == tf.float32:
            with _rows_only_random(full_shape, rows) as subset:
                values = init(full_shape, dtype=dtype)
            if subset.used and tuple(values.shape) == local_shape:
                return values
        full_bytes = layout.vocab_size * layout.dim * dtype.size
        if full_bytes > _MATERIALIZE_LIMIT_BYTES:
            raise ValueError(
                "initializer %r cannot be evaluated row-wise and the full table (%d MiB) is too "
                "large to build on one worker. Use a tf.keras initializer (RandomUniform, "
                "RandomNormal, TruncatedNormal, glorot_*/he_*/lecun_*, Zeros, Ones, Constant) "
                "or a float32 table." % (init, full_bytes >> 20))
        full = init(full_shape, dtype=dtype)
        return tf.gather(full, rows)
