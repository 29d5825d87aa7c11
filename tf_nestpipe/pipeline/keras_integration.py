"""tf_keras `fit` through the Dual-Buffer Pipeline.

`Model.make_train_function` is wrapped once (at `import tf_nestpipe`): for a model built under a
`NestPipeStrategy(pipeline="dbp")`, the train function becomes a `TrainPipeline` whose step is
the model's own `train_step` and whose route pass calls the model on the batch's inputs. Other
models, and `steps_per_execution > 1`, `run_eagerly` or a cluster coordinator, keep Keras's own
train function.
"""
import tensorflow as tf
import tf_keras
from tf_keras.src.engine import training as keras_training

from tf_nestpipe.pipeline.train_pipeline import TrainPipeline

_ORIGINAL = keras_training.Model.make_train_function
_PATCHED_ATTR = "_nestpipe_patched"


def _pipelined_strategy(model):
    from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy  # avoid an import cycle

    strategy = model.distribute_strategy
    if not isinstance(strategy, NestPipeStrategy) or strategy.pipeline == "none":
        return None
    if model.run_eagerly or model._cluster_coordinator:  # pylint: disable=protected-access
        return None
    steps = model._steps_per_execution  # pylint: disable=protected-access
    if steps is not None and int(steps.numpy()) != 1:
        return None
    return strategy


def make_train_function(self, force=False):
    """`Model.make_train_function`, pipelined under `NestPipeStrategy(pipeline="dbp")`."""
    strategy = _pipelined_strategy(self)
    if strategy is None:
        return _ORIGINAL(self, force)
    if self.train_function is not None and not force:
        return self.train_function
    model = self

    def step_fn(data):
        outputs = model.train_step(data)
        with tf.control_dependencies(keras_training._minimum_control_deps(outputs)):  # pylint: disable=protected-access
            model._train_counter.assign_add(1)  # pylint: disable=protected-access
        return outputs

    def route_fn(data):
        x, _, _ = tf_keras.utils.unpack_x_y_sample_weight(data)
        model(x, training=False)

    def reduce_fn(outputs):
        return keras_training.reduce_per_replica(outputs, strategy,
                                                 reduction=model.distribute_reduction_method)

    pipeline = TrainPipeline(strategy, step_fn, route_fn, optimizer=model.optimizer,
                             reduce_fn=reduce_fn,
                             skip_buffer_sync=strategy.unsafe_skip_buffer_sync)
    model._nestpipe_pipeline = pipeline  # pylint: disable=protected-access
    self.train_function = pipeline.progress
    return self.train_function


def install():
    """Wraps tf_keras `Model.make_train_function` (idempotent)."""
    if getattr(keras_training.Model.make_train_function, _PATCHED_ATTR, False):
        return
    setattr(make_train_function, _PATCHED_ATTR, True)
    keras_training.Model.make_train_function = make_train_function
