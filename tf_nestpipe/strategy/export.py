"""`export_saved_model`: a SavedModel of a NestPipe-trained model that plain TensorFlow serves.

Every `ShardedEmbedding` table is assembled in full (a collective: every worker calls this) and
stored in the SavedModel as an ordinary variable; while the serving function is traced, the
layers look rows up in it with `tf.gather` only, so the SavedModel uses no tf_nestpipe op and
loads in a process that never imports tf_nestpipe. Worker 0 writes it. Without an
`input_signature` the signature is the model's own inputs (`model.inputs` of a functional model,
or the inputs a subclassed model was called or fitted on).

`tf_keras` `model.save(dir)` traces its functions inside `serving_trace()`, and so does
`tf.saved_model.save(model, dir)` (TensorFlow's save context): every layer then gathers rows
straight from its own table variable, which the SavedModel records (and restores)
as the whole table (see `row_shard_saving`), so that SavedModel too serves without tf_nestpipe.
"""
import contextlib

import numpy as np
import tensorflow as tf

from tf_nestpipe.sharding import fetch
from tf_nestpipe.sharding.dynamic_embedding import DynamicEmbedding
from tf_nestpipe.sharding.embedding import ShardedTableLayer
from tf_nestpipe import tf_private


class _FullTableFetcher(fetch.RowFetcher):
    """While `export_saved_model`'s serving function is traced: every lookup is a `tf.gather`
    from the layer's gathered full table (core ops only)."""

    def __init__(self, tables_by_layer):
        self._tables = tables_by_layer

    def lookup(self, layer, flat_ids):
        return tf.gather(self._tables[id(layer)], flat_ids)

    def lookup_dynamic(self, layer, flat_ids):
        # A core static hash table id -> row index; unknown ids -> the appended zero row.
        index, rows = self._tables[id(layer.layer)]
        return tf.gather(rows, index.lookup(flat_ids))


class _OwnTableFetcher(fetch.RowFetcher):
    """While a SavedModel of the model itself is traced (`model.save(dir)`,
    `tf.saved_model.save`): a `tf.gather` from each layer's own table variable, which the
    SavedModel records (and restores) as the whole table; ps tables keep their own lookup."""

    def lookup(self, layer, flat_ids):
        if getattr(layer, "_ps_row_order", None) is not None:
            return layer.direct_lookup(flat_ids)
        return tf.gather(layer.embeddings, flat_ids)


_OWN_TABLES = _OwnTableFetcher()


@contextlib.contextmanager
def serving_trace():
    """Within this context, functions traced for a SavedModel look rows up with `tf.gather` in
    each layer's own table variable (recorded in the SavedModel as the whole table)."""
    with fetch.installed(_OWN_TABLES, any_graph=True):
        yield


def _fetcher_in_save_context():
    """TensorFlow's save context (tf.saved_model.save traces the model itself): no collective
    may be traced, so lookups read the layer's own (whole-table) variable."""
    return _OWN_TABLES if tf_private.in_saved_model_trace() else None


fetch.set_fallback(_fetcher_in_save_context)


def _sharded_layers(model):
    return [layer for layer in tf_private.flatten_layers(model)
            if isinstance(layer, ShardedTableLayer)]


def _dynamic_layers(model):
    return [layer for layer in tf_private.flatten_layers(model)
            if isinstance(layer, DynamicEmbedding)]


def _dynamic_serving_table(layer, ids, rows):
    """`(index, rows)` serving a dynamic table with core ops: a `tf.lookup.StaticHashTable` from
    each admitted id to its row and `[n + 1, dim]` rows whose last one (unknown ids) is zero."""
    index = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(ids, tf.int64),
                                            tf.range(len(ids), dtype=tf.int64)),
        default_value=len(ids))
    padded = np.concatenate([rows, np.zeros((1, layer.dim), rows.dtype)], axis=0)
    return index, tf.Variable(padded, trainable=False, name=layer.name + "_rows")


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


def tracked_resources(model):
    """Every resource other than a variable that `model` tracks (the lookup tables of
    `StringLookup` / `IntegerLookup` / `Hashing`-style layers, `tf.lookup` hash tables, ...):
    the serving function captures them, so the SavedModel must hold them too."""
    objects, _ = tf_private.graph_view.ObjectGraphView(model).breadth_first_traversal()
    return [obj for obj in objects
            if isinstance(obj, tf.saved_model.experimental.TrackableResource)]


def _serving_module(model, tables_by_layer, input_signature, pack=lambda inputs: inputs):
    """A tf.Module tracking the model's dense variables and the full tables (not the Keras
    model itself: saving it would trace its distributed call), with a `serve` function."""
    module = tf.Module()
    shards = {id(layer.embeddings) for layer in _sharded_layers(model)}
    shards |= {id(layer.rows) for layer in _dynamic_layers(model)}
    variables = [tf_private.keras3_variable_value(v) for v in model.variables]
    module.dense_variables = [v for v in variables if id(v) not in shards]
    module.tables = list(tables_by_layer.values())
    module.resources = tracked_resources(model)
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
        with fetch.installed(_FullTableFetcher(tables_by_layer)):
            outputs = model(pack(inputs), training=False)
        return {"outputs": outputs}

    module.serve = tf.function(serve, input_signature=_flat_signature(input_signature))
    return module


def infer_input_signature(model):
    """`(signature, pack)`: the model's inputs as {name: spec} and the function that turns such a
    dict back into the structure the model is called with. Refused with the fix when the model
    has no known inputs."""
    structure = None
    if tf_private.is_keras3_object(model):
        structure = tf_private.keras3_input_structure(model)
    elif tf_private.is_graph_network(model) and model.inputs:
        structure = tf.nest.map_structure(lambda t: t.type_spec,
                                          tf_private.nested_inputs(model))
    else:
        spec = model.save_spec(dynamic_batch=True) if hasattr(model, "save_spec") else None
        if spec is not None:
            args, kwargs = spec
            if args and not kwargs:
                structure = args[0]
    if structure is None:
        raise TypeError(
            "export_saved_model: %s has no known inputs to infer the serving signature from "
            "(a subclassed model that was never called or fitted). Call the model on a batch "
            "first, or pass input_signature={name: tf.TensorSpec(...)}" % type(model).__name__)
    if isinstance(structure, dict):
        return dict(structure), lambda inputs: inputs
    flat = tf.nest.flatten(structure, expand_composites=False)
    names = []
    for i, spec in enumerate(flat):
        name = getattr(spec, "name", None) or "input_%d" % i
        names.append(name if name not in names else "%s_%d" % (name, i))
    signature = dict(zip(names, flat))
    return signature, lambda inputs: tf.nest.pack_sequence_as(
        structure, [inputs[n] for n in names], expand_composites=False)


def export_saved_model(model, path, input_signature=None, strategy=None):
    """Writes `model` as a SavedModel at `path` with a `serving_default` signature taking the
    features of `input_signature` (name -> `tf.TensorSpec`, or `tf.RaggedTensorSpec` passed as
    `<name>_values` and `<name>_row_splits`; by default the model's own inputs, see
    `infer_input_signature`) and returning {"outputs": ...}. Call on every worker (the tables
    are gathered); worker 0 writes. The SavedModel serves without tf_nestpipe.

    Args:
        model: A tf_keras or Keras 3 model built under a `NestPipeStrategy`.
        path: The SavedModel directory.
        input_signature: {feature name: `tf.TensorSpec` or `tf.RaggedTensorSpec`}; default:
            the model's own inputs.
        strategy: Default: the model's.

    Returns:
        `path`.

    Raises:
        TypeError: No signature given and the model has no known inputs (call it first)."""
    pack = lambda inputs: inputs  # noqa: E731
    if input_signature is None:
        input_signature, pack = infer_input_signature(model)
    layers = _sharded_layers(model)
    full = [layer.full_table() for layer in layers]  # collectives, in the same order everywhere
    dynamic = [(layer, layer.full_table()) for layer in _dynamic_layers(model)]
    if strategy is None:
        strategy = getattr(model, "distribute_strategy", None)
    worker = getattr(strategy, "worker_index", 0)
    tables = {id(layer): tf.Variable(table, trainable=False, name=layer.name + "_full_table")
              for layer, table in zip(layers, full)}
    tables.update({id(layer): _dynamic_serving_table(layer, ids, rows)
                   for layer, (ids, rows) in dynamic})
    module = _serving_module(model, tables, input_signature, pack)
    # Every worker traces the serving function, so a model that cannot be served fails on
    # every worker alike, not on the writing one only.
    module.serve.get_concrete_function()
    failure = None
    if worker == 0:
        try:
            tf.saved_model.save(module, path, signatures={"serving_default": module.serve})
        except Exception as error:  # pylint: disable=broad-except
            failure = error
    _agree_on_write(strategy, failure, path)
    return path


def _agree_on_write(strategy, failure, path):
    """Raises on every worker when the writing worker failed (its own error there)."""
    collectives = getattr(getattr(strategy, "extended", None), "collectives", None)
    if collectives is not None and getattr(strategy, "num_workers", 1) > 1:
        failed = collectives.all_gather(tf.constant([int(failure is not None)], tf.int32),
                                        "nestpipe/export_written")
        if failure is None and int(tf.reduce_max(failed)):
            raise RuntimeError(
                "export_saved_model: worker 0 failed to write the SavedModel %s; its log has "
                "the error" % path)
    if failure is not None:
        raise failure
