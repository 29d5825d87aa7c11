"""Checks of the Keras environment a `NestPipeStrategy` runs in: refusals that name the fix,
instead of generic errors or silently different training.

- Keras 3 (`import keras`) is served by `tf_nestpipe.keras3` (its layers and hooks), which the
  strategy loads by itself (the package registers the loader, `set_keras3_support`): when a
  Keras 3 variable is created in a NestPipeStrategy scope (a Keras 3 model is being built there),
  and when a NestPipeStrategy is created or its scope entered while keras-rs is imported
  (keras-rs is Keras 3 only; its `DistributedEmbedding` must find the hooks when it makes its
  tables, before any variable). Whether `keras` is merely imported says nothing: TensorFlow
  imports Keras 3 itself unless TF_USE_LEGACY_KERAS is set, in tf_keras programs too.
- The `mixed_float16` policy (tf_keras' or Keras 3's) is refused: tf_keras' loss scaling would skip a step on the workers
  whose own row-shard gradients overflowed and apply it on the others (its finite check sees this
  worker's gradients only), so the workers' models would drift apart.
- A `tf_keras.layers.Embedding` built in the scope is a full table replicated on every worker
  (its gradient all-reduced densely): a warning names the layer, its size and `ShardedEmbedding`.
"""
import functools
import sys
import warnings

from tf_nestpipe import tf_private


class ReplicatedEmbeddingWarning(UserWarning):
    """A tf_keras `Embedding` under `NestPipeStrategy`: a replicated full table, not sharded."""


def _keras3_loaded():
    keras = sys.modules.get("keras")
    version = getattr(keras, "__version__", "") if keras is not None else ""
    return version.split(".")[0].isdigit() and int(version.split(".")[0]) >= 3


FLOAT16_MESSAGE = (
    "NestPipeStrategy does not support the mixed_float16 policy: tf_keras' dynamic loss "
    "scaling checks only this worker's gradients (its row-shard gradients differ per worker), "
    "so one worker would skip a step the others apply and the models would drift apart. Use "
    "the mixed_bfloat16 policy (bfloat16 compute needs no loss scaling; the tables stay "
    "float32): tf_keras.mixed_precision.set_global_policy('mixed_bfloat16'), or float32.")


def check_keras_environment():
    """Raises (with the fix) for the mixed_float16 policy of tf_keras or Keras 3 (see module)."""
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None:
        policy = tf_keras.mixed_precision.global_policy()
        if policy.name == "mixed_float16":
            raise ValueError(FLOAT16_MESSAGE)
    if _keras3_loaded():
        policy = sys.modules["keras"].config.dtype_policy()
        if getattr(policy, "name", "") == "mixed_float16":
            raise ValueError(FLOAT16_MESSAGE.replace(
                "tf_keras.mixed_precision.set_global_policy", "keras.config.set_dtype_policy"))


_keras3_support = []


def set_keras3_support(install):
    """Registers `install()`: loads and installs tf_nestpipe's Keras 3 support (idempotent).
    The package registers `tf_nestpipe.keras3.install`, a layer above the strategy."""
    _keras3_support[:] = [install]


def load_keras3_support_for_keras_rs():
    """Loads the Keras 3 support when keras-rs is imported (see module)."""
    if "keras_rs" in sys.modules and _keras3_support:
        _keras3_support[0]()


def check_keras3_variable(frame):
    """Loads the Keras 3 support when the variable being created by the code at `frame` (and its
    callers) comes from a Keras 3 (`keras.src`) layer or optimizer and it is not loaded yet.

    Raises:
        RuntimeError: No loader is registered (tf_nestpipe's package was not imported)."""
    if "tf_nestpipe.keras3" in sys.modules:
        return
    depth = 0
    while frame is not None and depth < 12:
        module = frame.f_globals.get("__name__", "")
        if module == "keras" or module.startswith("keras.src"):
            if _keras3_support:
                _keras3_support[0]()
                return
            raise RuntimeError(
                "a Keras 3 (`import keras`) variable is being created in a NestPipeStrategy "
                "scope (from %s), but tf_nestpipe's Keras 3 support is not loaded: its "
                "gradients would be all-reduced without the strategy knowing its tables. Add "
                "`from tf_nestpipe import keras3` (and use keras3.ShardedEmbedding for sharded "
                "tables), or build the model with tf_keras (`import tf_keras`, "
                "TF_USE_LEGACY_KERAS=1)." % module)
        frame, depth = frame.f_back, depth + 1


def warn_replicated_embedding(build):
    """Wraps `tf_keras.layers.Embedding.build`: built under a `NestPipeStrategy`, the layer warns
    that its table is replicated in full on every worker (name, size, the fix)."""
    def wrapped(self, input_shape=None):
        from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy  # avoid a cycle
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()
        if isinstance(strategy, NestPipeStrategy):
            size = int(self.input_dim) * int(self.output_dim)
            warnings.warn(
                "tf_keras.layers.Embedding %r (%d x %d = %d parameters, %.1f MiB in float32) in "
                "a NestPipeStrategy scope is a full table replicated on every one of the %d "
                "workers, its gradient all-reduced densely: it is not sharded. Use "
                "tnp.ShardedEmbedding(%d, %d, name=%r) for a row-sharded table."
                % (self.name, self.input_dim, self.output_dim, size, size * 4 / 2.0 ** 20,
                   strategy.num_workers, self.input_dim, self.output_dim, self.name),
                ReplicatedEmbeddingWarning, stacklevel=3)
        return build(self, input_shape)

    return tf_private.mark_hooked(wrapped)


def refuse_loss_scaling(supports_loss_scaling):
    """Wraps tf_keras' `strategy_supports_loss_scaling` (asked where a mixed_float16 layer or a
    `LossScaleOptimizer` is made): under a `NestPipeStrategy` it refuses with the reason and
    the policy to use, instead of tf_keras' generic "not supported with the Strategy"."""
    @functools.wraps(supports_loss_scaling)
    def wrapped():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy

        if tf.distribute.has_strategy() and isinstance(tf.distribute.get_strategy(),
                                                       NestPipeStrategy):
            raise ValueError(FLOAT16_MESSAGE)
        return supports_loss_scaling()

    return tf_private.mark_hooked(wrapped)
