"""tf_keras `fit` through the NestPipe pipelines.

`Model.make_train_function` is wrapped once (at `import tf_nestpipe`). For a model built under
`NestPipeStrategy(pipeline="dbp")` the train function becomes a `TrainPipeline` whose step is the
model's own `train_step` and whose route pass calls the model on the batch's inputs. Under
`pipeline="fwp"` each step runs the standard train step over `micro_batches` micro-batches in a
frozen window (one tape, one update). Other models, and `steps_per_execution > 1`, `run_eagerly`
or a cluster coordinator, keep Keras's own train function.
"""
import tensorflow as tf
import tf_keras
from tf_keras.src.engine import training as keras_training

from tf_nestpipe.pipeline.frozen_window import frozen_window, split_batch
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
    if strategy.pipeline == "fwp":
        self.train_function = _frozen_window_train_function(self, strategy)
        return self.train_function
    model = self
    step_fn = _counting_step(model, model.train_step)
    reduce_fn = _reducer(model, strategy)

    def route_fn(data):
        x, _, _ = tf_keras.utils.unpack_x_y_sample_weight(data)
        model(x, training=False)

    pipeline = TrainPipeline(strategy, step_fn, route_fn, optimizer=model.optimizer,
                             reduce_fn=reduce_fn,
                             skip_buffer_sync=strategy.unsafe_skip_buffer_sync)
    model._nestpipe_pipeline = pipeline  # pylint: disable=protected-access
    self.train_function = pipeline.progress
    return self.train_function


def _counting_step(model, train_step):
    """`train_step` followed by the model's train-counter increment, as in Keras's own step."""
    def step_fn(data):
        outputs = train_step(data)
        with tf.control_dependencies(keras_training._minimum_control_deps(outputs)):  # pylint: disable=protected-access
            model._train_counter.assign_add(1)  # pylint: disable=protected-access
        return outputs

    return step_fn


def _reducer(model, strategy):
    """Reduces per-replica step outputs the way Keras's train function does."""
    def reduce_fn(outputs):
        return keras_training.reduce_per_replica(outputs, strategy,
                                                 reduction=model.distribute_reduction_method)

    return reduce_fn


def _frozen_window_train_step(model, data, micro_batches):
    """Keras's standard train step, over micro-batches of `data` in one frozen window."""
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
    parts = split_batch({k: v for k, v in (("x", x), ("y", y), ("w", sample_weight))
                         if v is not None}, micro_batches)
    predictions, losses = [], []
    with tf.GradientTape() as tape, frozen_window():
        for part, share in parts:
            y_pred = model(part["x"], training=True)
            # compute_loss averages over the micro-batch; `share` turns that into its part of
            # the batch mean (the loss tracker is updated per micro-batch, weighted by its size).
            losses.append(model.compute_loss(part["x"], part.get("y"), y_pred, part.get("w"))
                          * share)
            predictions.append(y_pred)
        loss = tf.add_n(losses)
    model.optimizer.minimize(loss, model.trainable_variables, tape=tape)
    y_pred = tf.nest.map_structure(lambda *ps: tf.concat(ps, axis=0), *predictions)
    return model.compute_metrics(x, y, y_pred, sample_weight)


def _frozen_window_train_function(model, strategy):
    if type(model).train_step is not keras_training.Model.train_step:
        raise ValueError(
            "pipeline='fwp' runs tf_keras's standard train step over micro-batches, but %s "
            "overrides train_step. Split the batch yourself inside tnp.pipeline.frozen_window() "
            "(see tnp.pipeline.split_batch), or use pipeline='dbp'." % type(model).__name__)

    step_fn = _counting_step(
        model, lambda data: _frozen_window_train_step(model, data, strategy.micro_batches))
    reduce_fn = _reducer(model, strategy)

    @tf.function(reduce_retracing=True)
    def train_function(iterator):
        return reduce_fn(strategy.run(step_fn, args=(next(iterator),)))

    return train_function


def install():
    """Wraps tf_keras `Model.make_train_function` (idempotent)."""
    if getattr(keras_training.Model.make_train_function, _PATCHED_ATTR, False):
        return
    setattr(make_train_function, _PATCHED_ATTR, True)
    keras_training.Model.make_train_function = make_train_function
