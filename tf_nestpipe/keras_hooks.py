"""The tf_keras hooks behind the Keras surface of `NestPipeStrategy` (installed at import).

The tf_keras internals it patches come from `tf_nestpipe.tf_private`; the logic lives in modules
of one job each:
- step outputs and predictions: `pipeline.keras_outputs` (raw values a step returns are summed
  over the workers, `predict` returns every worker's rows in input order);
- saving: `strategy.keras_saving` (`.h5`, `.weights.h5`, `.keras` files hold whole tables and
  load on any worker count; `model.save(dir)` writes a SavedModel that serves without
  tf_nestpipe);
- `get_weights` / `set_weights`: whole tables (`strategy.keras_weights`);
- checks: `strategy.keras_checks` (the tf_keras `Embedding` warning);
- losses a model's own step calls (TFRS tasks): reduced over the global batch as compile
  reduces its loss (`pipeline.task_losses`);
- metric results: a train / test step's reads of the metrics' states (tf_keras'
  `get_metrics_result`, a TFRS `train_step`'s `m.result()`) come from one packed sum, riding on
  the gradients' all-reduce when it can (`strategy.summed_reads`), instead of one collective per
  state variable;
- `BackupAndRestore(save_before_preemption=True)`: SIGTERM backs up the same step on every
  worker and exits; the relaunch resumes at the next step (`strategy.keras_preemption`);
- `fit` over a DOWNPOUR `tnp.ParameterServerStrategy(update_window=T)`: one window per step
  (`strategy.downpour_fit`).
"""
import contextlib
import functools
import os
import shutil
import tempfile
import threading

import numpy as np
import tensorflow as tf
import tf_keras

from tf_nestpipe.pipeline import keras_outputs, task_losses
from tf_nestpipe.strategy import (downpour_fit, keras_callbacks, keras_checks, keras_preemption,
                                  keras_saving, keras_weights)
from tf_nestpipe import ops, tf_private
from tf_nestpipe.tf_private import keras_embedding
from tf_nestpipe.tf_private import keras_saving_api as saving_api
from tf_nestpipe.tf_private import keras_training

_state = threading.local()
# Paths a non-chief worker of this process saved to (its copy went to a scratch path).
_diverted_paths = set()
_original_reduce_per_replica = keras_training.reduce_per_replica


def _is_nestpipe(strategy):
    from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy

    return isinstance(strategy, NestPipeStrategy)


@contextlib.contextmanager
def _tracing_model(model):
    """While a model's train / test function runs (and is traced), `reduce_per_replica` knows
    the model (its metric names tell metric results from raw values)."""
    previous = getattr(_state, "model", None)
    _state.model = model
    try:
        yield
    finally:
        _state.model = previous


def reduce_per_replica(values, strategy, reduction):
    """tf_keras' `reduce_per_replica`; under a multi-worker `NestPipeStrategy`, raw step values
    are summed over the workers and predictions concatenated over them (see keras_outputs)."""
    if _is_nestpipe(strategy) and strategy.num_workers > 1:
        if reduction == "concat":
            return tf.nest.map_structure(
                functools.partial(keras_outputs.concat_predictions, strategy), values)
        model = getattr(_state, "model", None)
        if model is not None:
            values = keras_outputs.reduce_step_outputs(model, strategy, values, reduction)
    return _original_reduce_per_replica(values, strategy, reduction)


def _with_model_context(make_function):
    """Wraps `Model.make_train_function` / `make_test_function`: the function it returns runs
    (and is traced) with the model known to `reduce_per_replica`, and with its metrics' reads
    packed (`metric_reads_within_step`)."""
    @functools.wraps(make_function)
    def make(self, force=False):
        if (make_function.__name__ == "make_train_function"
                and getattr(self.distribute_strategy, "update_window", 1) > 1):
            # DOWNPOUR windows through fit (strategy.downpour_fit).
            if self.train_function is None or force:
                self.train_function = downpour_fit.downpour_train_function(self)
            return self.train_function
        if _is_nestpipe(self.distribute_strategy):
            # Losses the model's own step calls (TFRS tasks): reduced as compile reduces.
            task_losses.reduce_like_compile(self)
        function = make_function(self, force)
        if function is None or tf_private.is_hooked(function):
            return function

        training = make_function.__name__ == "make_train_function"

        @functools.wraps(function)
        def run(*args, **kwargs):
            if training and args:
                # A fit resumed inside an epoch first skips what that epoch trained on.
                keras_preemption.skip_trained_batches(self, args[0])
            with _tracing_model(self), metric_reads_within_step(self):
                return function(*args, **kwargs)

        tf_private.mark_hooked(run)
        run.__wrapped__ = function
        return run

    return tf_private.mark_hooked(make)


def metric_reads_within_step(model):
    """Under a multi-worker `NestPipeStrategy`: the context in which the step functions of
    `model` are traced: every metric's states are summed once per step, packed, in the dense
    gradients' all-reduce if the step reaches it first, else in an all-reduce of their own at
    the first read, and the results read those sums (unless written after them). Elsewhere
    nothing."""
    strategy = model.distribute_strategy
    if not _is_nestpipe(strategy) or strategy.num_workers == 1:
        return contextlib.nullcontext()
    return strategy.extended.metric_reads_within_step(
        lambda: [v for metric in model.metrics for v in metric.variables])


def _non_chief_target(model, filepath):
    """A scratch path for a non-chief worker's copy of a file (None: write `filepath`). Every
    worker reads the whole tables (a collective), so every worker saves; only the chief's
    copy is kept, and a script written for one process may save to one path on every worker."""
    strategy = getattr(model, "distribute_strategy", None)
    if (not _is_nestpipe(strategy) or strategy.num_workers == 1 or strategy.worker_index == 0
            or not isinstance(filepath, (str, os.PathLike))):
        return None
    scratch = tempfile.mkdtemp(prefix="nestpipe_worker%d_" % strategy.worker_index)
    return scratch, os.path.join(scratch, os.path.basename(os.path.normpath(os.fspath(filepath))))


def _every_worker_saved(model, failure, diverted, filepath):
    """After a save on every worker: returns once every worker (the chief included) finished
    writing, so a worker that loads the path next finds the chief's complete file where the
    workers share a disk; raises on every worker when another one's save failed (`failure`:
    this worker's error, raised by the caller). Records a non-chief's diverted path for
    `_load`'s error."""
    strategy = getattr(model, "distribute_strategy", None)
    if not _is_nestpipe(strategy) or strategy.num_workers == 1:
        return
    failed = strategy.extended.collectives.all_gather(
        tf.constant([int(failure is not None)], tf.int32), "nestpipe/keras_saved").numpy()
    if diverted:
        _diverted_paths.add(os.path.abspath(os.fspath(filepath)))
    if failure is None and failed.any():
        raise RuntimeError("saving %s failed on worker(s) %s (their logs have the error)" % (
            filepath, [int(k) for k in np.flatnonzero(failed)]))


def _load(method, args, kwargs):
    """tf_keras' load: a path this (non-chief) worker saved to, missing here, is explained."""
    _state.saving = True
    try:
        with keras_saving.keras_saving_context(False):
            return method(*args, **kwargs)
    except (OSError, tf.errors.NotFoundError) as error:
        filepath = args[1] if len(args) > 1 else (args[0] if args and isinstance(
            args[0], (str, os.PathLike)) else kwargs.get("filepath"))
        if (isinstance(filepath, (str, os.PathLike))
                and os.path.abspath(os.fspath(filepath)) in _diverted_paths
                and not os.path.exists(filepath)):
            raise FileNotFoundError(
                "%s does not exist on this worker: only the chief (worker 0) writes a tf_keras "
                "save under NestPipeStrategy (as under MultiWorkerMirroredStrategy: this "
                "worker's copy went to a scratch path, removed after the save), and the "
                "chief's file is not on this worker's disk. Save to storage every worker "
                "reads (a shared or cloud path), or load on the chief." % filepath) from error
        raise
    finally:
        _state.saving = False


def _wrap_saving(name, method):
    serving = name in ("save", "save_model")  # may write a SavedModel
    writes = name in ("save", "save_model", "save_weights")

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        if getattr(_state, "saving", False):  # Model.save calls saving_api.save_model
            return method(*args, **kwargs)
        scratch = None
        if name == "load_weights" and args and (kwargs.get("by_name") or (
                len(args) > 2 and args[2])):  # (model, filepath, by_name, ...)
            keras_saving.check_load_by_name(args[0])
        if writes and args:  # (model, filepath, ...)
            filepath = args[1] if len(args) > 1 else kwargs.get("filepath")
            target = _non_chief_target(args[0], filepath)
            if target is not None:
                scratch, path = target
                if len(args) > 1:
                    args = (args[0], path) + tuple(args[2:])
                else:
                    kwargs["filepath"] = path
        if name in ("load_weights", "load_model"):
            return _load(method, args, kwargs)
        _state.saving = True
        failure = result = None
        try:
            with keras_saving.keras_saving_context(serving):
                result = method(*args, **kwargs)
        except Exception as error:  # pylint: disable=broad-except
            failure = error
        finally:
            _state.saving = False
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        if writes and args:
            _every_worker_saved(args[0], failure, scratch is not None, filepath)
        if failure is not None:
            raise failure
        return result

    return tf_private.mark_hooked(wrapped)


def _skipping_distinct_rows(deduplicate):
    """tf_keras' summing of duplicate rows in sparse gradients, skipping the gradients whose rows
    are distinct already (our tables' own rows after the exchange, `ops.has_distinct_indices`):
    it would sum each row with nothing, bitwise the same, at a `tf.unique` and a segment-sum per
    table per step."""
    @functools.wraps(deduplicate)
    def wrapped(self, grads):
        grads = list(grads)
        rest = [i for i, grad in enumerate(grads) if not ops.has_distinct_indices(grad)]
        for i, grad in zip(rest, deduplicate(self, [grads[i] for i in rest])):
            grads[i] = grad
        return grads
    return wrapped


def install():
    """Installs the hooks (idempotent). Call after `keras_integration.install()`."""
    if tf_private.is_hooked(keras_training.reduce_per_replica):
        return
    tf_private.mark_hooked(reduce_per_replica)
    keras_training.reduce_per_replica = reduce_per_replica
    model = keras_training.Model
    for name in ("make_train_function", "make_test_function"):
        original = getattr(model, name)
        if not tf_private.is_hooked(original):
            setattr(model, name, _with_model_context(original))
    # mixed_float16 (loss scaling) refused with the reason and the policy to use.
    scaling = tf_private.keras_loss_scale
    if not tf_private.is_hooked(scaling.strategy_supports_loss_scaling):
        scaling.strategy_supports_loss_scaling = keras_checks.refuse_loss_scaling(
            scaling.strategy_supports_loss_scaling)
    # tf_keras' own BackupAndRestore accepts NestPipeStrategy (strategy.keras_callbacks).
    backup = tf_keras.callbacks.BackupAndRestore
    if not tf_private.is_hooked(backup.__init__):
        wrapped_init = keras_callbacks.accept_nestpipe_strategy(backup.__init__)
        tf_private.mark_hooked(wrapped_init)
        backup.__init__ = wrapped_init
        # save_before_preemption under NestPipeStrategy (strategy.keras_preemption).
        for name, wrap in keras_preemption.WRAPPERS.items():
            wrapped = wrap(getattr(backup, name))
            tf_private.mark_hooked(wrapped)
            setattr(backup, name, wrapped)
    # get_weights / set_weights: whole tables (strategy.keras_weights).
    layer = tf_keras.layers.Layer
    if not tf_private.is_hooked(layer.get_weights):
        for name, wrap in (("get_weights", keras_weights.whole_get_weights),
                           ("set_weights", keras_weights.whole_set_weights)):
            wrapped = wrap(getattr(layer, name))
            tf_private.mark_hooked(wrapped)
            setattr(layer, name, wrapped)
    # Saving and loading: whole tables in Keras files, plain-TF serving in SavedModels.
    for name in ("save", "save_weights", "load_weights"):
        setattr(model, name, _wrap_saving(name, getattr(model, name)))
    for owner in (saving_api, tf_keras.models, tf_keras.saving):
        for name in ("load_model", "save_model"):
            if hasattr(owner, name) and not tf_private.is_hooked(getattr(owner, name)):
                setattr(owner, name, _wrap_saving(name, getattr(owner, name)))
    tf_private.wrap_keras_sparse_dedup(_skipping_distinct_rows)
    keras_embedding.Embedding.build = keras_checks.warn_replicated_embedding(
        keras_embedding.Embedding.build)
