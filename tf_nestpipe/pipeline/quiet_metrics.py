"""Metrics left untouched while a route pass is traced.

A route pass (see `fused_exchange.run_route_pass`) traces what a train step looks up by calling
the model (or a TFRS model's `compute_loss`) in a function of its own. Code on that path may
update metrics: a TFRS task's metrics, a layer's `self.add_metric(...)` or a metric object
updated in `call()`. In the route pass those updates would count every batch twice (every
stateful op of a function runs), and a metric's cross-replica `merge_call` cannot run in that
nested function at all. Within `untouched_metrics(model)` every tf_keras metric call and every
`update_state` of the model's metrics traces to nothing instead.
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


def _metric_call(self, *args, **kwargs):
    if _quiet():
        return tf.constant(0.0, self.dtype or tf.float32)
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
