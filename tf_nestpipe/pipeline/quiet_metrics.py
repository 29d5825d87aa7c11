"""Metrics left untouched while a route pass is traced.

A route pass (see `fused_exchange.run_route_pass`) traces what a train step looks up by calling
the model (or a TFRS model's `compute_loss`) in a function of its own. Code on that path may
update metrics: a TFRS task's metrics, a layer's `self.add_metric(...)` or a metric object
updated in `call()`. In the route pass those updates would count every batch twice (every
stateful op of a function runs), and a metric's cross-replica `merge_call` cannot run in that
nested function at all. Within `untouched_metrics(model)` every tf_keras metric call and every
`update_state` of the model's metrics traces to nothing instead.

A micro-batching step calls the model once per micro-batch, so an update in `call()` runs once
per micro-batch. Updates with per-example values add up to the whole batch's, but a mean metric
updated with one scalar per call (`self.add_metric(tf.reduce_mean(x))`, `Mean.update_state(s)`)
would count each step M times, every micro-batch alike whatever its size. Within
`share_weighted_metrics(model, share)` such an update is weighted by the micro-batch's share of
the batch: the step counts once, and a batch mean is the whole batch's, as in one process. A
nonlinear statistic of the batch (its max, say) stays a statistic of the micro-batches, as it is
of each worker's batch with several workers.
"""
import contextlib
import threading

import tensorflow as tf
import tf_keras

_state = threading.local()
_original_call = tf_keras.metrics.Metric.__call__
_INSTALLED = "_nestpipe_quiet"


def _quiet():
    return getattr(_state, "depth", 0) > 0


def _weighted_scalar_update(metric, args, kwargs):
    """`(args, kwargs)` of an update of `metric`, a scalar update of a mean metric weighted by
    the current micro-batch's share (`share_weighted_metrics`); others unchanged."""
    share = getattr(_state, "share", None)
    if (share is None or not isinstance(metric, tf_keras.metrics.Mean) or len(args) != 1
            or kwargs.get("sample_weight") is not None or set(kwargs) - {"sample_weight"}):
        return args, kwargs
    value = args[0]
    if getattr(value, "shape", None) is None or value.shape.rank != 0:
        return args, kwargs
    return args, dict(kwargs, sample_weight=share)


def _metric_call(self, *args, **kwargs):
    if _quiet():
        return tf.constant(0.0, self.dtype or tf.float32)
    args, kwargs = _weighted_scalar_update(self, args, kwargs)
    return _original_call(self, *args, **kwargs)


def _no_update(*args, **kwargs):  # pylint: disable=unused-argument
    return tf.no_op()


def install():
    """Routes tf_keras `Metric.__call__` through the quiet check (idempotent)."""
    if getattr(tf_keras.metrics.Metric.__call__, _INSTALLED, False):
        return
    setattr(_metric_call, _INSTALLED, True)
    tf_keras.metrics.Metric.__call__ = _metric_call


def _model_metrics(model):
    metrics = list(getattr(model, "metrics", []))
    for metric in list(metrics):
        # A TFRS FactorizedTopK-style layer keeps its own metrics.
        metrics.extend(getattr(metric, "metrics", []) if not isinstance(
            metric, tf_keras.metrics.Metric) else [])
    return [m for m in metrics if isinstance(m, tf_keras.metrics.Metric)]


@contextlib.contextmanager
def untouched_metrics(model):
    """Within this context (this thread), metric calls and the `update_state` of `model`'s
    metrics trace to nothing (see the module docstring)."""
    install()
    metrics = _model_metrics(model)
    saved = [(metric, vars(metric).get("update_state")) for metric in metrics]
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        for metric, _ in saved:
            object.__setattr__(metric, "update_state", _no_update)
        yield
    finally:
        _state.depth -= 1
        for metric, update in saved:
            if update is None:
                object.__delattr__(metric, "update_state")
            else:
                object.__setattr__(metric, "update_state", update)


@contextlib.contextmanager
def share_weighted_metrics(model, share):
    """Within this context (this thread), an update of a mean metric with one scalar and no
    weight (through `Metric.__call__`, as `add_metric` does, or the `update_state` of one of
    `model`'s metrics) is weighted by `share`, a micro-batch's share of its batch (see the
    module docstring).

    Args:
        model: The model whose call runs on the micro-batch.
        share: The micro-batch's size over the batch's (a float32 scalar tensor).
    """
    install()
    metrics = [m for m in _model_metrics(model) if isinstance(m, tf_keras.metrics.Mean)]
    saved = [(metric, vars(metric).get("update_state")) for metric in metrics]
    previous = getattr(_state, "share", None)
    _state.share = share

    def weighted(metric, update):
        def update_state(*args, **kwargs):
            args, kwargs = _weighted_scalar_update(metric, args, kwargs)
            return update(*args, **kwargs)

        return update_state

    try:
        for metric, update in saved:
            object.__setattr__(metric, "update_state",
                               weighted(metric, update or metric.update_state))
        yield
    finally:
        _state.share = previous
        for metric, update in saved:
            if update is None:
                object.__delattr__(metric, "update_state")
            else:
                object.__setattr__(metric, "update_state", update)
