"""`export_saved_model`: a SavedModel of a NestPipe-trained model that plain TensorFlow serves.

Every `ShardedEmbedding` table is assembled in full (a collective: every worker calls this) and
stored in the SavedModel as an ordinary variable; while the serving function is traced, the
layers look rows up in it with `tf.gather` only, so the SavedModel uses no tf_nestpipe op and
loads in a process that never imports tf_nestpipe. Worker 0 writes it.
"""
import tensorflow as tf

from tf_nestpipe.sharding.embedding import ShardedEmbedding
from tf_nestpipe.sharding.fetch import RowFetcher, installed


class _FullTableFetcher(RowFetcher):
    """While a serving function is traced: every lookup is a `tf.gather` from the layer's full
    table (core ops only)."""

    def __init__(self, tables_by_layer):
        self._tables = tables_by_layer

    def lookup(self, layer, flat_ids):
        return tf.gather(self._tables[id(layer)], flat_ids)


def _sharded_layers(model):
    return [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
            if isinstance(layer, ShardedEmbedding)]


def _flat_signature(input_signature):
    """Flat TensorSpecs for a signature: ragged features as <name>_values, <name>_row_splits."""
    flat = []
    for name, spec in sorted(input_signature.items()):
        if isinstance(spec, tf.RaggedTensorSpec):
            flat.append(tf.TensorSpec([None], spec.dtype, name=name + "_values"))
            flat.append(tf.TensorSpec([None], spec.row_splits_dtype, name=name + "_row_splits"))
        else:
            flat.append(tf.TensorSpec(spec.shape, spec.dtype, name=name))
    return flat


def _serving_module(model, tables_by_layer, input_signature):
    """A tf.Module tracking the model's dense variables and the full tables (not the Keras
    model itself: saving it would trace its distributed call), with a `serve` function."""
    module = tf.Module()
    shards = {id(layer.embeddings) for layer in _sharded_layers(model)}
    module.dense_variables = [v for v in model.variables if id(v) not in shards]
    module.tables = list(tables_by_layer.values())
    names = sorted(input_signature)
    ragged = {n for n in names if isinstance(input_signature[n], tf.RaggedTensorSpec)}

    def serve(*flat):
        inputs, position = {}, 0
        for name in names:
            if name in ragged:
                inputs[name] = tf.RaggedTensor.from_row_splits(flat[position], flat[position + 1])
                position += 2
            else:
                inputs[name] = flat[position]
                position += 1
        with installed(_FullTableFetcher(tables_by_layer)):
            outputs = model(inputs, training=False)
        return {"outputs": outputs}

    module.serve = tf.function(serve, input_signature=_flat_signature(input_signature))
    return module


def export_saved_model(model, path, input_signature, strategy=None):
    """Writes `model` as a SavedModel at `path` with a `serving_default` signature taking the
    features of `input_signature` (name -> `tf.TensorSpec`, or `tf.RaggedTensorSpec` passed as
    `<name>_values` and `<name>_row_splits`) and returning {"outputs": ...}. Call on every worker
    (the tables are gathered); worker 0 writes. Returns `path`."""
    layers = _sharded_layers(model)
    full = [layer.full_table() for layer in layers]  # collectives, in the same order everywhere
    worker = strategy.worker_index if strategy is not None else 0
    if worker != 0:
        return path
    tables = {id(layer): tf.Variable(table, trainable=False, name=layer.name + "_full_table")
              for layer, table in zip(layers, full)}
    module = _serving_module(model, tables, input_signature)
    tf.saved_model.save(module, path, signatures={"serving_default": module.serve})
    return path
