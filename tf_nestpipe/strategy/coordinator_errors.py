"""A ps failure under a plain `ClusterCoordinator` is a `ParameterServerUnavailableError`.

`tnp.DownpourTrainer` explains a dead ps task (`downpour.explaining_ps_failures`, and the ps
watch of `ps_watch` where TensorFlow takes it for a transient failure and would retry forever).
A script that drives `tf.distribute.experimental.coordinator.ClusterCoordinator` itself over a
`tnp.ParameterServerStrategy` (or tf_keras `fit`, which makes one) got TensorFlow's raw
`UnavailableError` instead, or a `join()` that never returned. `install()` wraps the
coordinator's `schedule` and `join` so that, for a coordinator of a `tnp.ParameterServerStrategy`,
they report a ps failure the same way (`join` watching the ps addresses while it waits).
"""
import functools

import tensorflow as tf

from tf_nestpipe.strategy.downpour import explaining_ps_failures
from tf_nestpipe.strategy.ps_watch import call_watching_ps

_HOOKED = "_nestpipe_ps_errors"


def _ps_addresses(coordinator):
    """The ps addresses of `coordinator`'s strategy if it is a `tnp.ParameterServerStrategy`."""
    from tf_nestpipe.strategy.parameter_server import ParameterServerStrategy

    strategy = getattr(coordinator, "strategy", None)
    return strategy.ps_addresses if isinstance(strategy, ParameterServerStrategy) else None


def explained(method, watch):
    """`method` (a coordinator's `join` / `schedule`) with ps failures explained; with `watch`
    the ps addresses are probed while it blocks."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        addresses = _ps_addresses(self)
        if addresses is None:
            return method(self, *args, **kwargs)
        with explaining_ps_failures(addresses):
            if watch:
                return call_watching_ps(lambda: method(self, *args, **kwargs), addresses)
            return method(self, *args, **kwargs)

    setattr(wrapped, _HOOKED, True)
    return wrapped


def install():
    """Wraps `ClusterCoordinator.join` and `schedule` (idempotent)."""
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator
    if getattr(coordinator.join, _HOOKED, False):
        return
    coordinator.join = explained(coordinator.join, watch=True)
    coordinator.schedule = explained(coordinator.schedule, watch=False)
