"""Keras 3 (TensorFlow backend) under `NestPipeStrategy`: the hooks that make its `fit` /
`evaluate` / `predict` and its saving exact on several workers (installed at
`import tf_nestpipe.keras3`, idempotent; the Keras 3 internals come from `tf_private`).

- Gradients: Keras 3's optimizer all-reduces every gradient (`replica_context.all_reduce`), not
  knowing which variable each belongs to; under a NestPipeStrategy it asks the strategy with the
  (gradient, variable) pairs instead (`batch_reduce_to`, as tf_keras does), so a row shard's
  gradient (already summed by the exchange) stays this worker's and the rest is all-reduced.
- Step outputs: per-step logs are averaged over the workers (one packed all-reduce); the epoch's
  and `evaluate`'s results read the metrics' states summed over the workers (Keras 3 reads them
  after the loop); `predict` concatenates every worker's rows in worker order.
- The train function: under several workers, Keras 3's standard `train_step` (or a model with
  `nestpipe_route(data)`) runs in a `TrainPipeline`, every table of a step in one fused exchange
  per group ("none", lookahead 0) or with the dual-buffer pipeline ("dbp"). The micro-batching
  modes ("fwp", "nested") split a batch inside tf_keras's train step and are refused.
- Adagrad: a table's sparse gradient updates only the rows it touches (Keras 3 would update the
  whole table and accumulator densely every step), with the same arithmetic.
- Saving: `save` / `save_weights` / `load_weights` / `load_model` / `get_weights` /
  `set_weights` hold whole tables (any worker count loads them); non-chief workers write to a
  scratch path, as under tf_keras.
- Export: `model.export(path)` and `keras.export.ExportArchive.write_out` trace the serving
  functions with plain `tf.gather` lookups in each table's variable, which the SavedModel holds
  whole, so plain TensorFlow serves it (as `tnp.export_saved_model`); a SavedModel that would
  still need tf_nestpipe's ops (an endpoint traced before `write_out`) is refused, and so are
  `model.export`'s other formats for a model with sharded tables.
"""
import contextlib
import functools
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from tf_nestpipe import keras_hooks, tf_private
from tf_nestpipe.keras3.checks import check_pipeline, refuse_parameter_server
from tf_nestpipe.keras3.layers import own_rows_of
from tf_nestpipe.pipeline import keras_outputs
from tf_nestpipe.pipeline.modes import LOOKAHEAD
from tf_nestpipe.pipeline.train_pipeline import TrainPipeline
from tf_nestpipe.sharding.embedding import ShardedTableLayer
from tf_nestpipe.strategy.keras_saving import keras_saving_context
from tf_nestpipe.strategy.row_shard_saving import whole_table_values, whole_tables_gathered


def _is_nestpipe(strategy):
    from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy  # pylint: disable=import-outside-toplevel

    return isinstance(strategy, NestPipeStrategy)


def _several_workers(strategy):
    return _is_nestpipe(strategy) and strategy.num_workers > 1


# --- gradients ------------------------------------------------------------------------------
def _all_reduce_sum_gradients(original):
    @functools.wraps(original)
    def wrapped(self, grads_and_vars):
        context = tf.distribute.get_replica_context()
        strategy = getattr(self, "_distribution_strategy", None)
        if context is None or not _is_nestpipe(strategy):
            return original(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        present = [(g, v) for g, v in grads_and_vars if g is not None]
        reduced = iter(context.merge_call(
            lambda distribution, pairs: distribution.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, pairs), args=(present,)) if present else [])
        return [(None if g is None else next(reduced), v) for g, v in grads_and_vars]

    return tf_private.mark_hooked(wrapped)


def _sparse_adagrad_update_step(original):
    """Keras 3's `Adagrad.update_step` for a sparse gradient (a table's `IndexedSlices`): the
    same arithmetic on the rows the gradient touches only (duplicate ids summed first, as the
    dense conversion sums them), instead of a dense update of the whole table and accumulator
    every step. Other rows' update is zero either way."""
    @functools.wraps(original)
    def wrapped(self, gradient, variable, learning_rate):
        if not isinstance(gradient, tf.IndexedSlices):
            return original(self, gradient, variable, learning_rate)
        target = tf_private.keras3_variable_value(variable)
        accumulator = tf_private.keras3_variable_value(
            self._accumulators[self._get_variable_index(variable)])  # pylint: disable=protected-access
        lr = tf.cast(learning_rate, target.dtype)
        rows, positions = tf.unique(gradient.indices)
        summed = tf.math.unsorted_segment_sum(tf.cast(gradient.values, target.dtype), positions,
                                              tf.size(rows))
        accumulated = tf.gather(accumulator, rows) + tf.square(summed)
        accumulator.scatter_update(tf.IndexedSlices(accumulated, rows))
        target.scatter_sub(tf.IndexedSlices(
            lr * summed / tf.sqrt(accumulated + tf.cast(self.epsilon, target.dtype)), rows))

    return tf_private.mark_hooked(wrapped)


# --- step outputs ---------------------------------------------------------------------------
def _mean_over_workers(strategy, values):
    """Every float scalar of `values` averaged over the workers in one all-reduce (others as
    they are)."""
    flat = tf.nest.flatten(values)
    picked = [i for i, v in enumerate(flat)
              if tf.is_tensor(v) and v.dtype.is_floating and v.shape.rank == 0]
    if not picked:
        return values
    packed = tf.stack([tf.cast(flat[i], tf.float32) for i in picked])
    mean = strategy.reduce(tf.distribute.ReduceOp.MEAN, packed, axis=None)
    for k, i in enumerate(picked):
        flat[i] = tf.cast(mean[k], flat[i].dtype)
    return tf.nest.pack_sequence_as(values, flat)


def _reduce_per_replica(original):
    @functools.wraps(original)
    def wrapped(values, strategy, reduction):
        if not _several_workers(strategy):
            return original(values, strategy, reduction)
        if reduction == "concat":
            values = tf.nest.map_structure(
                functools.partial(keras_outputs.concat_predictions, strategy), values)
        elif reduction in ("auto", "mean"):
            values = _mean_over_workers(strategy, values)
        elif reduction == "sum":
            values = tf.nest.map_structure(
                lambda v: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None), values)
        return original(values, strategy, "first" if reduction != "concat" else reduction)

    return tf_private.mark_hooked(wrapped)


# --- the train function ---------------------------------------------------------------------
def _standard_train_step(model):
    trainer = tf_private.keras3_tf_trainer_module().TensorFlowTrainer
    return type(model).train_step is trainer.train_step


def _route_of(model):
    """What the model's train step looks up: `nestpipe_route(data)` if it has one, else the
    model called on the batch's inputs (Keras 3's standard train step)."""
    route = getattr(model, "nestpipe_route", None)
    if callable(route):
        return route

    def route_fn(data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        model(x, training=False)

    return route_fn


def _log(strategy, text):
    if strategy.worker_index == 0:
        print(text, file=sys.stderr, flush=True)


def _make_train_function(original):
    @functools.wraps(original)
    def make(self, force=False):
        strategy = self.distribute_strategy
        refuse_parameter_server(strategy, "Keras 3 fit")
        if not _is_nestpipe(strategy):
            return original(self, force)
        check_pipeline(strategy)
        if self.train_function is not None and not force:
            return self.train_function
        routable = _standard_train_step(self) or callable(getattr(self, "nestpipe_route", None))
        if (strategy.num_workers == 1 or self.run_eagerly or self.steps_per_execution != 1
                or not routable):
            if strategy.pipeline == "dbp" and strategy.num_workers > 1:
                raise ValueError(
                    "pipeline='dbp' needs a route pass: %s overrides train_step (give it a "
                    "nestpipe_route(data) method that looks up what train_step looks up), "
                    "and needs steps_per_execution=1 and run_eagerly=False; or use "
                    "pipeline='none'" % type(self).__name__)
            # Keras's own train function: each table its own exchange.
            return original(self, force)
        mode = "none" if strategy.pipeline == "auto" else strategy.pipeline
        if strategy.pipeline == "auto":
            _log(strategy, "tf_nestpipe: pipeline='auto' runs the Keras 3 model %s with 'none' "
                 "(one fused exchange per step); pipeline='dbp' overlaps the next batch's "
                 "exchange" % type(self).__name__)
        trainer = tf_private.keras3_tf_trainer_module()
        pipeline = TrainPipeline(
            strategy, self.train_step, _route_of(self), optimizer=self.optimizer,
            reduce_fn=lambda outputs: trainer.reduce_per_replica(outputs, strategy, "auto"),
            skip_buffer_sync=strategy.unsafe_skip_buffer_sync, lookahead=LOOKAHEAD[mode])
        self._nestpipe_pipeline = pipeline  # pylint: disable=protected-access
        self.train_function = pipeline.progress
        return self.train_function

    return tf_private.mark_hooked(make)


# --- saving and weights -----------------------------------------------------------------------
def _saving(method, writes):
    @functools.wraps(method)
    def wrapped(self_or_model, filepath=None, *args, **kwargs):
        model = self_or_model
        target = (keras_hooks._non_chief_target(model, filepath)  # pylint: disable=protected-access
                  if writes else None)
        path = target[1] if target is not None else filepath
        failure = result = None
        try:
            # Writes read whole tables (a row shard's numpy()); loads take this worker's rows
            # where Keras assigns (the layer's and the optimizer's load_own_variables).
            with whole_table_values() if writes else contextlib.nullcontext():
                result = method(model, path, *args, **kwargs)
        except Exception as error:  # pylint: disable=broad-except
            failure = error
        finally:
            if target is not None:
                import shutil  # pylint: disable=import-outside-toplevel
                shutil.rmtree(target[0], ignore_errors=True)
        if writes:
            keras_hooks._every_worker_saved(model, failure, target is not None, filepath)  # pylint: disable=protected-access
        if failure is not None:
            raise failure
        return result

    return tf_private.mark_hooked(wrapped)


def _optimizer_load_own_variables(original):
    @functools.wraps(original)
    def wrapped(self, store):
        variables = self.variables
        if len(store.keys()) == len(variables):
            store = {str(i): own_rows_of(v, store[str(i)]) for i, v in enumerate(variables)}
        return original(self, store)

    return tf_private.mark_hooked(wrapped)


def _get_weights(original):
    @functools.wraps(original)
    def wrapped(self):
        with whole_table_values():
            return original(self)

    return tf_private.mark_hooked(wrapped)


def _set_weights(original):
    @functools.wraps(original)
    def wrapped(self, weights):
        variables = self.weights
        if len(variables) == len(weights):
            weights = [own_rows_of(v, np.asarray(w)) for v, w in zip(variables, weights)]
        return original(self, weights)

    return tf_private.mark_hooked(wrapped)


# --- export -----------------------------------------------------------------------------------
_OUR_OPS = "Nestpipe"  # the prefix of every op tf_nestpipe's library registers


def refuse_unservable(path):
    """Raises when the SavedModel at `path` uses tf_nestpipe's ops (plain TensorFlow could not
    load it).

    Raises:
        ValueError: naming the ops and the export to use."""
    ours = sorted(t for t in tf_private.saved_model_op_types(path) if t.startswith(_OUR_OPS))
    if ours:
        raise ValueError(
            "the SavedModel written to %s needs tf_nestpipe to load (its functions use %s): "
            "an endpoint was traced before ExportArchive.write_out (e.g. a tf.function called "
            "before add_endpoint), so its lookups are the training ones. Give add_endpoint an "
            "input_signature so that write_out traces it, use model.export(path), or "
            "tnp.export_saved_model(model, path)" % (path, ", ".join(ours)))


def _write_out(original):
    @functools.wraps(original)
    def wrapped(self, filepath, *args, **kwargs):
        # Traced here: lookups gather from each table's own variable, which the SavedModel
        # records as the whole table (row_shard_saving), so no tf_nestpipe op is traced. The
        # whole tables are gathered first, in one order on every worker (see
        # whole_tables_gathered).
        with keras_saving_context(serving=True):
            variables = sorted(tf_private.keras3_export_archive_variables(self),
                               key=lambda v: v.name)
            with whole_tables_gathered(variables):
                result = original(self, filepath, *args, **kwargs)
        refuse_unservable(os.fspath(filepath))
        return result

    return tf_private.mark_hooked(wrapped)


def _has_sharded_tables(model):
    return any(isinstance(layer, ShardedTableLayer)
               for layer in tf_private.keras3_trackable_layers(model))


def _export(original):
    saving = _saving(original, writes=True)

    @functools.wraps(original)
    def wrapped(self, filepath, format="tf_saved_model", *args, **kwargs):  # pylint: disable=redefined-builtin
        if format != "tf_saved_model" and _has_sharded_tables(self):
            raise ValueError(
                "model.export(format=%r) of a model with tf_nestpipe tables is not supported "
                "(its lookups would trace tf_nestpipe's ops): use format='tf_saved_model' "
                "(served by plain TensorFlow) or tnp.export_saved_model(model, path)" % format)
        return saving(self, filepath, format, *args, **kwargs)

    return tf_private.mark_hooked(wrapped)


def install():
    """Installs the Keras 3 hooks (idempotent)."""
    from tf_nestpipe.strategy.nestpipe_strategy import NestPipeExtended  # pylint: disable=import-outside-toplevel
    NestPipeExtended.reduce_structures_elementwise = True
    optimizer = tf_private.keras3_tf_optimizer_class()
    if tf_private.is_hooked(optimizer._all_reduce_sum_gradients):  # pylint: disable=protected-access
        return
    optimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients(  # pylint: disable=protected-access
        optimizer._all_reduce_sum_gradients)  # pylint: disable=protected-access
    trainer = tf_private.keras3_tf_trainer_module()
    trainer.reduce_per_replica = _reduce_per_replica(trainer.reduce_per_replica)
    trainer.TensorFlowTrainer.make_train_function = _make_train_function(
        trainer.TensorFlowTrainer.make_train_function)
    keras.optimizers.Adagrad.update_step = _sparse_adagrad_update_step(
        keras.optimizers.Adagrad.update_step)
    base = tf_private.keras3_base_optimizer_class()
    base.load_own_variables = _optimizer_load_own_variables(base.load_own_variables)
    model = keras.Model
    model.save = _saving(model.save, writes=True)
    model.save_weights = _saving(model.save_weights, writes=True)
    model.load_weights = _saving(model.load_weights, writes=False)
    model.export = _export(model.export)
    archive = tf_private.keras3_export_archive_class()
    archive.write_out = _write_out(archive.write_out)
    layer = keras.layers.Layer
    layer.get_weights = _get_weights(layer.get_weights)
    layer.set_weights = _set_weights(layer.set_weights)
