"""What Keras 3 models cannot do under tf_nestpipe, refused with what to use instead."""
import tensorflow as tf

from tf_nestpipe.pipeline.modes import MICRO_BATCHED


def refuse_parameter_server(strategy, what):
    """Raises for Keras 3 under a parameter-server strategy (Keras 3 has no
    parameter-server training: no `ClusterCoordinator` in its `fit`).

    Raises:
        ValueError: `strategy` is a `tf.distribute.ParameterServerStrategy`."""
    if isinstance(strategy, tf.distribute.ParameterServerStrategy):
        raise ValueError(
            "%s: Keras 3 has no parameter-server training (its fit runs no "
            "ClusterCoordinator), so tnp.ParameterServerStrategy and DOWNPOUR "
            "(update_window > 1, tnp.DownpourTrainer) need tf_keras: build the model with "
            "`import tf_keras` and tnp.ShardedEmbedding. With Keras 3 use "
            "tnp.NestPipeStrategy (synchronous, tables sharded over the workers)." % what)


def check_pipeline(strategy):
    """Raises for the pipeline modes Keras 3 models cannot run.

    Raises:
        ValueError: `strategy.pipeline` is "fwp" or "nested"."""
    if strategy.pipeline in MICRO_BATCHED:
        raise ValueError(
            "pipeline=%r splits each batch into micro-batches inside tf_keras's standard "
            "train step, which a Keras 3 model does not have. With Keras 3 use "
            "pipeline='none' (one fused exchange per step) or 'dbp' (the next batch's "
            "exchange overlapped with this step), or build the model with tf_keras for "
            "%r." % (strategy.pipeline, strategy.pipeline))
