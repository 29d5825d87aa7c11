"""tf_keras `fit` through the NestPipe pipelines.

`Model.make_train_function` is wrapped once (at `import tf_nestpipe`). For a model built under
`NestPipeStrategy(pipeline="dbp")` the train function becomes a `TrainPipeline` whose step is the
model's own `train_step` and whose route pass calls the model on the batch's inputs. Under
`pipeline="fwp"` each step runs the standard train step over `micro_batches` micro-batches in a
frozen window (one tape, one update). `pipeline="nested"` is both: a `TrainPipeline` whose route
pass prefetches the next batch micro-batch by micro-batch and whose step is the micro-batched
train step reading those buffers. With `cluster_samples=True` the micro-batches are formed by
key-centric clustering of the batch's integer features. Other models, and
`steps_per_execution > 1`, `run_eagerly` or a cluster coordinator, keep Keras's own train
function.
"""
import tensorflow as tf
import tf_keras
from tf_keras.src.engine import training as keras_training

from tf_nestpipe.pipeline.clustering import integer_leaves
from tf_nestpipe.pipeline.frozen_window import cluster_batch, frozen_window, split_batch
from tf_nestpipe.pipeline.train_pipeline import TrainPipeline

_ORIGINAL = keras_training.Model.make_train_function
_PATCHED_ATTR = "_nestpipe_patched"


def _pipelined_strategy(model):
    from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy  # avoid an import cycle

    strategy = model.distribute_strategy
    if getattr(strategy, "update_window", 1) > 1:
        raise ValueError(
            "tf_keras fit pushes every step's update to the ps, but this "
            "tnp.ParameterServerStrategy has update_window=%d: train with "
            "tnp.DownpourTrainer, or use update_window=1 with fit" % strategy.update_window)
    if not isinstance(strategy, NestPipeStrategy) or strategy.pipeline == "none":
        return None
    if model.run_eagerly or model._cluster_coordinator:  # pylint: disable=protected-access
        return None
    steps = model._steps_per_execution  # pylint: disable=protected-access
    if steps is not None and int(steps.numpy()) != 1:
        return None
    return strategy


def make_train_function(self, force=False):
    """`Model.make_train_function`, pipelined under `NestPipeStrategy(pipeline="dbp" | "fwp" |
    "nested")`."""
    strategy = _pipelined_strategy(self)
    if strategy is None:
        return _ORIGINAL(self, force)
    if self.train_function is not None and not force:
        return self.train_function
    if strategy.pipeline in ("fwp", "nested"):
        _check_standard_train_step(self, strategy.pipeline)
    if strategy.pipeline == "fwp":
        self.train_function = _frozen_window_train_function(self, strategy)
        return self.train_function
    model = self
    reduce_fn = _reducer(model, strategy)
    if strategy.pipeline == "nested":
        micro_batches, cluster = strategy.micro_batches, strategy.cluster_samples
        step_fn = _counting_step(
            model, lambda data: _frozen_window_train_step(model, data, micro_batches, cluster))

        def route_fn(data):
            with frozen_window():
                for part, _ in _micro_batches(data, micro_batches, cluster):
                    model(part["x"], training=False)
    else:
        step_fn = _counting_step(model, model.train_step)

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


def _micro_batches(data, micro_batches, cluster):
    """The (part, share) micro-batches of a Keras batch `data` as dicts with keys x, y, w; with
    `cluster`, after key-centric clustering by the integer features of x."""
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
    batch = {k: v for k, v in (("x", x), ("y", y), ("w", sample_weight)) if v is not None}
    if cluster:
        keys = integer_leaves(x)
        if keys:
            batch = cluster_batch(batch, keys, micro_batches)
    return split_batch(batch, micro_batches)


def _frozen_window_train_step(model, data, micro_batches, cluster=False):
    """Keras's standard train step, over micro-batches of `data` in one frozen window."""
    parts = _micro_batches(data, micro_batches, cluster)
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
    # Metrics see the whole batch in micro-batch order (the order clustering chose).
    whole = tf.nest.map_structure(lambda *ts: tf.concat(ts, axis=0), *[p for p, _ in parts])
    y_pred = tf.nest.map_structure(lambda *ps: tf.concat(ps, axis=0), *predictions)
    return model.compute_metrics(whole["x"], whole.get("y"), y_pred, whole.get("w"))


def _check_standard_train_step(model, pipeline):
    """Micro-batching pipelines run tf_keras's standard train step; refuse overridden ones."""
    if type(model).train_step is not keras_training.Model.train_step:
        raise ValueError(
            "pipeline=%r runs tf_keras's standard train step over micro-batches, but %s "
            "overrides train_step. Split the batch yourself inside tnp.pipeline.frozen_window() "
            "(see tnp.pipeline.split_batch), or use pipeline='dbp'." % (pipeline, type(model).__name__))


def _frozen_window_train_function(model, strategy):
    step_fn = _counting_step(
        model, lambda data: _frozen_window_train_step(model, data, strategy.micro_batches,
                                                      strategy.cluster_samples))
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
