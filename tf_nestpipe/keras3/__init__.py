"""tf_nestpipe for Keras 3 (`import keras`, TensorFlow backend).

    import keras
    import tf_nestpipe as tnp
    from tf_nestpipe import keras3 as tnpk

    strategy = tnp.NestPipeStrategy(pipeline="none")
    with strategy.scope():
        ids = keras.Input((4,), dtype="int64")
        ...tnpk.ShardedEmbedding(100_000, 16, combiner="sum")(ids)...

The same strategy serves tf_keras models (`tnp.ShardedEmbedding`) and Keras 3 models
(`tnpk.ShardedEmbedding`, `tnpk.DistributedEmbedding`): what the model is built with decides.
Importing this module imports Keras 3 and installs its hooks (`tf_nestpipe.keras3.hooks`).
"""
import keras as _keras

if not _keras.__version__.split(".")[0].isdigit() or int(_keras.__version__.split(".")[0]) < 3:
    raise ImportError("tf_nestpipe.keras3 needs Keras 3 (`pip install keras>=3`), found keras "
                      "%s; with tf_keras use tf_nestpipe.ShardedEmbedding" % _keras.__version__)
if _keras.backend.backend() != "tensorflow":
    raise ImportError("tf_nestpipe.keras3 needs Keras 3's TensorFlow backend "
                      "(KERAS_BACKEND=tensorflow), found %r" % _keras.backend.backend())

from tf_nestpipe.keras3 import hooks as _hooks  # noqa: E402
from tf_nestpipe.keras3.distributed_embedding import DistributedEmbedding  # noqa: E402
from tf_nestpipe.keras3.layers import ShardedEmbedding  # noqa: E402

_hooks.install()

__all__ = ["DistributedEmbedding", "ShardedEmbedding"]
