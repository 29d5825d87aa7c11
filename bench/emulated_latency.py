"""Benchmark-only network emulation on loopback: a host-side sleep before every embedding
collective of a strategy (bench/timeline.py sets `NESTPIPE_BENCH_EMULATED_LATENCY_MS` for its
workers; bench/dlrm_worker.py calls `install_from_env`). Production code has no such switch."""
import os
import time

import tensorflow as tf

ENV = "NESTPIPE_BENCH_EMULATED_LATENCY_MS"
# tf_nestpipe.pipeline.instrumentation classifies ops of this name as communication.
OP_NAME = "nestpipe_emulated_latency"


def delayed(seconds, tensor):
    """`tensor`, passed through a host-side sleep (the GIL is released). Declared stateless and
    fed by the data itself, so it is ordered by its data alone (not by every stateful op) and
    neither pruned nor merged with another delay."""
    def sleep_then_pass(value):
        time.sleep(seconds)
        return value

    out = tf.numpy_function(sleep_then_pass, [tensor], tensor.dtype, stateful=False,
                            name=OP_NAME)
    out.set_shape(tensor.shape)
    return out


def install(strategy, milliseconds):
    """Makes every traced all-gather and all-to-all of `strategy`'s collectives sleep
    `milliseconds` first (eager ones, e.g. full_table, are not delayed)."""
    collectives = strategy.extended.collectives
    seconds = float(milliseconds) / 1e3
    for name in ("all_gather", "all_to_all"):
        original = getattr(collectives, name)

        def with_delay(tensor, *args, _original=original, **kwargs):
            if seconds > 0 and not tf.executing_eagerly():
                tensor = delayed(seconds, tensor)
            return _original(tensor, *args, **kwargs)

        setattr(collectives, name, with_delay)


def install_from_env(strategy):
    """`install` with the latency of `NESTPIPE_BENCH_EMULATED_LATENCY_MS`, if set."""
    milliseconds = float(os.environ.get(ENV, "0") or 0)
    if milliseconds > 0:
        install(strategy, milliseconds)
