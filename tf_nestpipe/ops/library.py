"""Loads the compiled op library (built by setup.py) once per process."""
import functools
import os

import tensorflow as tf

_LIBRARY_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "_nestpipe_ops.so")


@functools.lru_cache(maxsize=None)
def load_op_library():
    """Returns the loaded `_nestpipe_ops.so` module, with a clear error if it was never built."""
    if not os.path.exists(_LIBRARY_PATH):
        raise ImportError(
            "tf_nestpipe's custom ops are not built (%s is missing). Build them against the "
            "installed TensorFlow with: pip install --no-build-isolation -e ." % _LIBRARY_PATH)
    return tf.load_op_library(_LIBRARY_PATH)
