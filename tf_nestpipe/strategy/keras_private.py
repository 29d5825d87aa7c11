"""The one module through which tf_nestpipe's Keras surface reaches tf_keras / TensorFlow
internals (private modules and attributes). When tf_keras changes them, only this file changes.
"""
from tensorflow.python.saved_model import save_context as _save_context
from tf_keras.src.engine import training  # noqa: F401  (Model, reduce_per_replica)
from tf_keras.src.layers.core import embedding  # noqa: F401  (Embedding)
from tf_keras.src.saving import saving_api  # noqa: F401  (save_model, load_model)


def in_saved_model_trace():
    """True while `tf.saved_model.save` (or tf_keras' SavedModel save) traces functions."""
    return _save_context.in_save_context()


def is_graph_network(model):
    """True for a functional or Sequential-with-inputs model (its inputs are known)."""
    return bool(getattr(model, "_is_graph_network", False))


def nested_inputs(model):
    """A graph network's inputs in the structure it is called with (dict, list or tensor)."""
    return model._nested_inputs  # pylint: disable=protected-access


def cluster_coordinator(model):
    """The `ClusterCoordinator` tf_keras made for a model under a parameter-server strategy."""
    return model._cluster_coordinator  # pylint: disable=protected-access


def build_input_shape(model):
    """The input shape a model was built with (`model.build(shape)`)."""
    return model._build_input_shape  # pylint: disable=protected-access
