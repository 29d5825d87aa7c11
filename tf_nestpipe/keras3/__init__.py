"""tf_nestpipe for Keras 3 (`import keras`, TensorFlow backend).

    import keras
    import tf_nestpipe as tnp
    from tf_nestpipe import keras3 as tnpk

    strategy = tnp.NestPipeStrategy(pipeline="none")
    with strategy.scope():
        ids = keras.Input((4,), dtype="int64")
        ...tnpk.ShardedEmbedding(100_000, 16, combiner="sum")(ids)...

The same strategy serves tf_keras models (`tnp.ShardedEmbedding`) and Keras 3 models
(`tnpk.ShardedEmbedding`, `tnpk.DistributedEmbedding`, and keras-rs's own
`keras_rs.layers.DistributedEmbedding` created in the strategy's scope): what the model is
built with decides.

Importing this module imports Keras 3 and installs its hooks (`install()`); a NestPipeStrategy
loads it by itself when a Keras 3 variable is created in its scope, or when keras-rs is
imported (see `tf_nestpipe.strategy.keras_checks`), so the strategy line alone serves a Keras 3
model.
"""
import sys as _sys

import keras as _keras

if not _keras.__version__.split(".")[0].isdigit() or int(_keras.__version__.split(".")[0]) < 3:
    raise ImportError("tf_nestpipe.keras3 needs Keras 3 (`pip install keras>=3`), found keras "
                      "%s; with tf_keras use tf_nestpipe.ShardedEmbedding" % _keras.__version__)
if _keras.backend.backend() != "tensorflow":
    raise ImportError("tf_nestpipe.keras3 needs Keras 3's TensorFlow backend "
                      "(KERAS_BACKEND=tensorflow), found %r" % _keras.backend.backend())

from tf_nestpipe.keras3 import hooks as _hooks  # noqa: E402
from tf_nestpipe.keras3.distributed_embedding import DistributedEmbedding  # noqa: E402
from tf_nestpipe.keras3.layers import EmbedReduce, ShardedEmbedding  # noqa: E402


def install():
    """Installs tf_nestpipe's Keras 3 hooks, and its keras-rs hooks (keras-rs's
    `DistributedEmbedding` sharded under a NestPipeStrategy) once keras-rs is imported.
    Idempotent: importing this module calls it, and so does a NestPipeStrategy (created, or its
    scope entered) once keras-rs is imported."""
    _hooks.install()
    if "keras_rs" in _sys.modules:
        from tf_nestpipe.keras3 import keras_rs_front  # pylint: disable=import-outside-toplevel
        keras_rs_front.install()


install()

__all__ = ["DistributedEmbedding", "EmbedReduce", "ShardedEmbedding", "install"]
