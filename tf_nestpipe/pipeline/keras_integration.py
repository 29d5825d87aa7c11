"""tf_keras `fit` through the fused exchange and the NestPipe pipelines.

`Model.make_train_function` is wrapped once (at `import tf_nestpipe`). For a model built under a
`NestPipeStrategy` with several workers, the train function becomes a `TrainPipeline` whose
route pass calls the model on the batch's inputs, so every row-wise lookup of a step goes
through one exchange per group of tables, however many layers the model has:

- `pipeline="none"`: the model's own `train_step`, after its batch's exchange (lookahead 0);
- `pipeline="fwp"`: tf_keras's standard train step over `micro_batches` micro-batches in a
  frozen window, one exchange per micro-batch (lookahead 0, one tape, one update);
- `pipeline="dbp"`: the model's own `train_step` with the Dual-Buffer Pipeline (lookahead 1);
- `pipeline="nested"`: both: the next batch prefetched a step ahead (its whole frozen window in
  one exchange per group), then trained over micro-batches in a frozen window;
- `pipeline="auto"` (the default): the first steps try each of these on real batches and the
  workers continue with the fastest (`tf_nestpipe.pipeline.auto`).

tf_keras's standard train step runs with its compiled metrics updated before the optimizer
update instead of after (same values: they read only y and y_pred), so the metrics' states ride
on the dense gradients' all-reduce and their results need no collective of their own.

With `cluster_samples=True` the micro-batches are formed by key-centric clustering of the
batch's integer features. A TFRS model that keeps `tfrs.Model`'s train step is routed through
its `compute_loss`; a model that overrides `train_step` otherwise can define
`nestpipe_route(data)`, looking up what its train step looks up (e.g. calling its towers on the
features): it becomes the route pass.
Keras's own train function stays for one worker under "none" and "auto", for a `train_step`
override without `nestpipe_route` under "none" and "auto" (a route pass could not know what it
looks up, so each table keeps its own exchange), and for `steps_per_execution > 1`, `run_eagerly` or a cluster
coordinator.
"""
import functools
import sys
import threading

import tensorflow as tf
import tf_keras
from tf_nestpipe.tf_private import keras_training

from tf_nestpipe.pipeline.auto import AutoPipeline, auto_candidates
from tf_nestpipe.pipeline.clustering import integer_leaves
from tf_nestpipe.pipeline.frozen_window import cluster_batch, frozen_window, split_batch
from tf_nestpipe.pipeline.modes import LOOKAHEAD, MICRO_BATCHED
from tf_nestpipe.pipeline.quiet_metrics import share_weighted_metrics, untouched_metrics
from tf_nestpipe.pipeline.task_losses import tfrs_base_step
from tf_nestpipe.pipeline.train_pipeline import TrainPipeline
from tf_nestpipe import tf_private

_ORIGINAL = keras_training.Model.make_train_function
_ORIGINAL_FIT = keras_training.Model.fit
_ORIGINAL_CALLBACK_LIST_INIT = tf_keras.callbacks.CallbackList.__init__
_PATCHED_ATTR = "_nestpipe_patched"
_fit_state = threading.local()


def _standard_train_step(model):
    return type(model).train_step is keras_training.Model.train_step


def _routable(model):
    """Whether a route pass can trace what `model`'s train step looks up: tf_keras's standard
    train step (it calls the model on the inputs), TFRS's (it calls `compute_loss`) or a model
    with `nestpipe_route(data)`."""
    return (_standard_train_step(model) or tfrs_base_step(model, "train_step")
            or callable(getattr(model, "nestpipe_route", None)))


def _route_of(model):
    """The route pass of `model`'s train step: `model.nestpipe_route(data)` if it has one; for
    TFRS's train step its `compute_loss` on a copy of the batch's structure (it may pop the
    labels); else the model called on the batch's inputs (what the standard train step looks
    up). Metric updates on the way trace to nothing (`quiet_metrics`)."""
    route = getattr(model, "nestpipe_route", None)
    if callable(route):
        return route

    def route_fn(data):
        with untouched_metrics(model):
            if tfrs_base_step(model, "train_step"):
                model.compute_loss(tf.nest.map_structure(lambda t: t, data), training=False)
                return
            x, _, _ = tf_keras.utils.unpack_x_y_sample_weight(data)
            model(x, training=False)

    return route_fn


def _pipelined_strategy(model):
    """The NestPipeStrategy whose exchange and pipeline run `model`'s fit, else None."""
    strategy = model.distribute_strategy
    if getattr(strategy, "update_window", 1) > 1:
        raise ValueError(
            "tf_keras fit pushes every step's update to the ps, but this "
            "tnp.ParameterServerStrategy has update_window=%d: train with "
            "tnp.DownpourTrainer, or use update_window=1 with fit" % strategy.update_window)
    if getattr(strategy.extended, "embedding_exchange", None) is None:
        return None  # not a NestPipeStrategy
    if strategy.pipeline in ("none", "auto") and (strategy.num_workers == 1
                                                  or not _routable(model)):
        if strategy.pipeline == "auto" and strategy.num_workers > 1:
            _log(strategy, "tf_nestpipe: pipeline='auto' runs %s with 'none' (each table its "
                 "own exchange): it overrides train_step, so a route pass cannot know what it "
                 "looks up. Give it a nestpipe_route(data) method that looks up what its "
                 "train_step looks up (e.g. calls its towers on the features) for the fused "
                 "exchange and the pipelines." % type(model).__name__)
        return None
    if model.run_eagerly or tf_private.keras_cluster_coordinator(model):
        return None
    steps = tf_private.steps_per_execution(model)
    if steps is not None and int(steps.numpy()) != 1:
        return None
    return strategy


def make_train_function(self, force=False):
    """`Model.make_train_function`, through the fused exchange and the pipeline of the model's
    `NestPipeStrategy` ("none", "dbp", "fwp" or "nested")."""
    strategy = _pipelined_strategy(self)
    if strategy is None:
        return _ORIGINAL(self, force)
    if self.train_function is not None and not force:
        return self.train_function
    if strategy.pipeline == "auto":
        # Micro-batching needs tf_keras's standard train step (it splits the batch itself).
        candidates = auto_candidates(strategy.auto_micro_batches, _standard_train_step(self))
        pipeline = AutoPipeline(
            [(c, _train_pipeline(self, strategy, c.mode, c.micro_batches)) for c in candidates],
            agree=lambda times: _slowest_worker(strategy, times),
            warmup_steps=strategy.auto_warmup_steps, timed_steps=strategy.auto_timed_steps,
            rounds=strategy.auto_probe_rounds, log=lambda text: _log(strategy, text),
            epoch_steps=(None if getattr(strategy, "auto_probe_budget", None) is None
                         else lambda: fit_epoch_steps(self)),
            budget=getattr(strategy, "auto_probe_budget", None) or 0.05,
            agree_budget=lambda values: _slowest_worker(strategy, values, "nestpipe/auto_budget"))
    else:
        pipeline = _train_pipeline(self, strategy, strategy.pipeline)
    self._nestpipe_pipeline = pipeline  # pylint: disable=protected-access
    self.train_function = pipeline.progress
    return self.train_function


def _train_pipeline(model, strategy, pipeline, micro_batches=None):
    """The `TrainPipeline` of `model`'s fit under `pipeline` (none, fwp, dbp or nested); the
    micro-batching modes split each batch into `micro_batches` (default: the strategy's)."""
    if pipeline in MICRO_BATCHED:
        _check_standard_train_step(model, pipeline)
        micro_batches = micro_batches or strategy.micro_batches
        cluster = strategy.cluster_samples
        step_fn = _counting_step(
            model, lambda data: _frozen_window_train_step(model, data, micro_batches, cluster))

        def route_fn(data):
            with frozen_window(), untouched_metrics(model):
                for part, _ in _micro_batches(data, micro_batches, cluster)[1]:
                    model(part["x"], training=False)
    else:
        train_step = (functools.partial(_metrics_first_train_step, model)
                      if _standard_train_step(model) else model.train_step)
        step_fn = _counting_step(model, train_step)
        route_fn = _route_of(model)

    return TrainPipeline(strategy, step_fn, route_fn, optimizer=model.optimizer,
                         reduce_fn=_reducer(model, strategy),
                         skip_buffer_sync=strategy.unsafe_skip_buffer_sync,
                         lookahead=LOOKAHEAD[pipeline],
                         trainable_variables=lambda: model.trainable_variables)


def _slowest_worker(strategy, times, tag="nestpipe/auto"):
    """Each of `times` (this worker's seconds per candidate) as its max over the workers."""
    gathered = strategy.extended.embedding_exchange.collectives.all_gather(
        tf.constant([times], tf.float32), tag)
    return tf.reduce_max(gathered, axis=0).numpy().tolist()


def _log(strategy, text):
    """Prints `text` on worker 0 (stderr)."""
    if strategy.worker_index == 0:
        print(text, file=sys.stderr, flush=True)


def _counting_step(model, train_step):
    """`train_step` followed by the model's train-counter increment, as in Keras's own step."""
    def step_fn(data):
        outputs = train_step(data)
        with tf.control_dependencies(tf_private.minimum_control_deps(outputs)):
            tf_private.train_counter(model).assign_add(1)
        return outputs

    return step_fn


def _reducer(model, strategy):
    """Reduces per-replica step outputs the way Keras's train function does."""
    def reduce_fn(outputs):
        return keras_training.reduce_per_replica(outputs, strategy,
                                                 reduction=model.distribute_reduction_method)

    return reduce_fn


def _micro_batches(data, micro_batches, cluster):
    """A Keras batch `data` as a dict with keys x, y, w (with `cluster`, reordered by key-centric
    clustering by the integer features of x) and its (part, share) micro-batches: contiguous
    slices, so the parts concatenated are the returned batch."""
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
    batch = {k: v for k, v in (("x", x), ("y", y), ("w", sample_weight)) if v is not None}
    if cluster:
        keys = integer_leaves(x)
        if keys:
            batch = cluster_batch(batch, keys, micro_batches)
    return batch, split_batch(batch, micro_batches)


def _standard_compute_metrics(model):
    return type(model).compute_metrics is keras_training.Model.compute_metrics


def _update_then_minimize(model, loss, tape, x, y, y_pred, sample_weight):
    """The optimizer update of `loss` and the metrics' results, as tf_keras' standard train
    step gives them, with the compiled metrics updated *before* the update when the model keeps
    tf_keras' `compute_metrics`: their states are then final when the dense gradients are
    all-reduced, and ride on that all-reduce (`strategy.summed_reads`) instead of an all-reduce
    of their own. The metrics read only y and y_pred, so their values are the same."""
    if not _standard_compute_metrics(model):
        model.optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return model.compute_metrics(x, y, y_pred, sample_weight)
    model.compiled_metrics.update_state(y, y_pred, sample_weight)
    model.optimizer.minimize(loss, model.trainable_variables, tape=tape)
    return model.get_metrics_result()


def _metrics_first_train_step(model, data):
    """tf_keras' standard `Model.train_step`, its metrics updated before the optimizer update
    (`_update_then_minimize`)."""
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x, y, y_pred, sample_weight)
    tf_private.validate_target_and_loss(model, y, loss)
    return _update_then_minimize(model, loss, tape, x, y, y_pred, sample_weight)


def _frozen_window_train_step(model, data, micro_batches, cluster=False):
    """Keras's standard train step, over micro-batches of `data` in one frozen window.

    With tf_keras' own `compute_loss` the compiled loss runs once, on the whole batch (the
    micro-batches' predictions concatenated in their order), as one process computes it: one
    loss and loss-tracker update per batch instead of one per micro-batch. The model's own
    losses (`model.losses`: activity regularizers and `add_loss` of each call, and the weight
    regularizers) count each call's by its micro-batch's share of the batch. A model with its
    own `compute_loss` gets it per micro-batch, weighted by the share."""
    whole, parts = _micro_batches(data, micro_batches, cluster)
    own_loss = type(model).compute_loss is not keras_training.Model.compute_loss
    predictions, losses, regularization = [], [], []
    with tf.GradientTape() as tape, frozen_window():
        for part, share in parts:
            # A scalar update of a mean metric in call() counts the part's share of the step.
            with share_weighted_metrics(model, share):
                y_pred = model(part["x"], training=True)
            predictions.append(y_pred)
            if own_loss:
                # compute_loss averages over the micro-batch; `share` turns that into its part
                # of the batch mean.
                losses.append(model.compute_loss(part["x"], part.get("y"), y_pred,
                                                 part.get("w")) * share)
            elif model.losses:
                call_losses = tf.add_n([tf.cast(l, tf.float32) for l in model.losses])
                regularization.append(call_losses * share)
        # Metrics (and the loss) see the whole batch in micro-batch order (clustering's order).
        y_pred = tf.nest.map_structure(lambda *ps: tf.concat(ps, axis=0), *predictions)
        if own_loss:
            loss = tf.add_n(losses)
        else:
            loss = model.compiled_loss(
                whole.get("y"), y_pred, whole.get("w"),
                regularization_losses=[tf.add_n(regularization)] if regularization else None)
    return _update_then_minimize(model, loss, tape, whole["x"], whole.get("y"), y_pred,
                                 whole.get("w"))


def _check_standard_train_step(model, pipeline):
    """Micro-batching pipelines run tf_keras's standard train step; refuse overridden ones."""
    if not _standard_train_step(model):
        raise ValueError(
            "pipeline=%r runs tf_keras's standard train step over micro-batches, but %s "
            "overrides train_step. Split the batch yourself inside tnp.pipeline.frozen_window() "
            "(see tnp.pipeline.split_batch), or use pipeline='dbp'." % (pipeline, type(model).__name__))


def fit_epoch_steps(model):
    """The steps of an epoch of the `fit` that made `model`'s train function (what the
    progress bar counts), or None when unknown."""
    return getattr(model, "_nestpipe_epoch_steps", None)


def _fit(self, *args, **kwargs):
    """`Model.fit`, its epoch length recorded (`fit_epoch_steps`) from its callback list."""
    previous = getattr(_fit_state, "model", None)
    _fit_state.model = self
    try:
        return _ORIGINAL_FIT(self, *args, **kwargs)
    finally:
        _fit_state.model = previous


def _callback_list_init(self, callbacks=None, add_history=False, add_progbar=False, model=None,
                        **params):
    fitting = getattr(_fit_state, "model", None)
    if model is not None and model is fitting and "steps" in params:
        # fit's own list (the first made in it): its steps per epoch.
        model._nestpipe_epoch_steps = params["steps"]  # pylint: disable=protected-access
        _fit_state.model = None
    _ORIGINAL_CALLBACK_LIST_INIT(self, callbacks, add_history, add_progbar, model, **params)


def install():
    """Wraps tf_keras `Model.make_train_function`, and `Model.fit` to know its epoch length
    (idempotent)."""
    if getattr(keras_training.Model.make_train_function, _PATCHED_ATTR, False):
        return
    setattr(make_train_function, _PATCHED_ATTR, True)
    keras_training.Model.make_train_function = make_train_function
    keras_training.Model.fit = functools.wraps(_ORIGINAL_FIT)(_fit)
    tf_keras.callbacks.CallbackList.__init__ = _callback_list_init
