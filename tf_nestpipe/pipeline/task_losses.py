"""Losses a model's own train step calls (TFRS tasks), reduced over the global batch as
`compile` reduces its loss.

tf_keras reduces a compiled loss for a distribution strategy itself: the mean over this replica's
batch, divided by the number of replicas (`SUM_OVER_BATCH_SIZE` / `AUTO` reduction), and the
regularization losses divided by the replicas too, so the gradients summed over the workers are
one process's. A loss object called by the model's own code (a TFRS `Ranking` task's loss) gets
none of this: tf_keras refuses its `AUTO` reduction under any strategy, and TFRS's
`train_step` adds `model.losses` unscaled on every worker.

`reduce_like_compile(model)` (under a `NestPipeStrategy`, before its train / test function is
made) gives them the same reduction: every `SUM_OVER_BATCH_SIZE` / `AUTO` loss object a layer of
the model holds (not the compiled loss, which tf_keras reduces) is divided by the replicas in
sync, and a model that keeps TFRS's own `train_step` / `test_step` gets those steps with its
regularization losses divided by the replicas in sync. Losses with `SUM` or `NONE` reduction
(the reduction a TFRS user writes for MultiWorkerMirroredStrategy, scaled by the global batch
by hand) are left as written.
"""
import tensorflow as tf
import tf_keras

from tf_nestpipe import tf_private

_GLOBAL_BATCH_REDUCTIONS = (tf_keras.losses.Reduction.AUTO,
                            tf_keras.losses.Reduction.SUM_OVER_BATCH_SIZE)
_classes = {}
_TFRS_BASE = "tensorflow_recommenders.models.base"


def _replicas_in_sync():
    return tf.distribute.get_strategy().num_replicas_in_sync


class _GlobalBatchLoss:
    """Mixed into a loss object's class: under a strategy, a `SUM_OVER_BATCH_SIZE` / `AUTO`
    reduction is this replica's mean divided by the replicas in sync, as compile gives it."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        global_batch = self.reduction in _GLOBAL_BATCH_REDUCTIONS
        # tf_keras allows these reductions under a strategy only where it scales the result
        # itself (compile); here the scaling below does.
        self._allow_sum_over_batch_size = global_batch or self._allow_sum_over_batch_size
        value = super().__call__(y_true, y_pred, sample_weight=sample_weight)
        replicas = _replicas_in_sync()
        if global_batch and replicas > 1:
            value = value * (1.0 / replicas)
        return value


def _adapt_loss(loss):
    base = type(loss)
    if isinstance(loss, _GlobalBatchLoss):
        return
    if base not in _classes:
        _classes[base] = type(base.__name__, (_GlobalBatchLoss, base),
                              {"__module__": base.__module__})
    loss.__class__ = _classes[base]


def _held_losses(model):
    """The loss objects the model's layers hold as attributes (a TFRS task's `_loss`), other
    than the compiled loss."""
    compiled = {id(loss) for loss in tf.nest.flatten(getattr(model, "loss", None))}
    found = {}
    for layer in [model] + list(tf_private.flatten_layers(model)):
        for value in vars(layer).values():
            if isinstance(value, tf_keras.losses.Loss) and id(value) not in compiled:
                found[id(value)] = value
    return list(found.values())


def tfrs_base_step(model, name):
    """Whether `model`'s `name` ("train_step" / "test_step") is TFRS's `tfrs.Model` one (the
    step that calls `compute_loss(inputs, training)` and adds `model.losses`)."""
    step = getattr(type(model), name, None)
    return (getattr(step, "__module__", None) == _TFRS_BASE
            and getattr(step, "__qualname__", None) == "Model." + name)


def _regularization_loss(model):
    """`model.losses` summed, divided by the replicas in sync (as compile does)."""
    total = tf.reduce_sum([tf.reduce_sum(loss) for loss in model.losses])
    replicas = _replicas_in_sync()
    return total * (1.0 / replicas) if replicas > 1 else total


def _step_outputs(model, loss, regularization_loss):
    outputs = {metric.name: metric.result() for metric in model.metrics}
    outputs.update(loss=loss, regularization_loss=regularization_loss,
                   total_loss=loss + regularization_loss)
    return outputs


def _tfrs_train_step(model, inputs):
    """TFRS's `train_step`, its regularization losses reduced as compile reduces them."""
    with tf.GradientTape() as tape:
        loss = model.compute_loss(inputs, training=True)
        regularization_loss = _regularization_loss(model)
        total_loss = loss + regularization_loss
    gradients = tape.gradient(total_loss, model.trainable_variables)
    model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return _step_outputs(model, loss, regularization_loss)


def _tfrs_test_step(model, inputs):
    """TFRS's `test_step`, its regularization losses reduced as compile reduces them."""
    loss = model.compute_loss(inputs, training=False)
    return _step_outputs(model, loss, _regularization_loss(model))


def reduce_like_compile(model):
    """Gives the losses `model`'s own steps call the reduction compile gives its loss (see the
    module docstring). Idempotent; call under the model's strategy before its train or test
    function is made."""
    for loss in _held_losses(model):
        if loss.reduction in _GLOBAL_BATCH_REDUCTIONS:
            _adapt_loss(loss)
    # Instance attributes: tf_keras' train / test functions call `self.train_step`.
    for name, step in (("train_step", _tfrs_train_step), ("test_step", _tfrs_test_step)):
        if tfrs_base_step(model, name) and name not in vars(model):
            object.__setattr__(model, name, lambda inputs, _step=step: _step(model, inputs))
