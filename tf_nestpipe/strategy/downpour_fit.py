"""tf_keras `fit` over a DOWNPOUR `tnp.ParameterServerStrategy(update_window=T)`.

Each `fit` step is one DOWNPOUR window (`DownpourTrainer`) scheduled on a worker: it reads T
batches, runs T local steps with the strategy's local optimizer on the worker's own copy of the
model, and pushes the summed gradient, which the compiled optimizer (the global optimizer)
applies on the ps tasks. So `steps_per_epoch` counts windows (T batches each), and `history`'s
`loss` is each epoch's last window's mean loss. The model must be a Sequential or functional
model (its worker copy is made by `tf_keras.models.clone_model`), compiled with one loss.
"""
import tensorflow as tf
import tf_keras

from tf_nestpipe import tf_private
from tf_nestpipe.strategy.downpour import DownpourTrainer


def _loss_fn(model):
    """The compiled loss as `loss_fn(labels, outputs)`: the mean of the per-sample losses."""
    loss = model.loss
    if isinstance(loss, (dict, list, tuple)) or loss is None:
        raise ValueError("fit with a DOWNPOUR tnp.ParameterServerStrategy needs a model compiled "
                         "with one loss; got loss=%r (use tnp.DownpourTrainer for other losses)"
                         % (loss,))
    loss = tf_keras.losses.get(loss)
    per_sample = loss.call if isinstance(loss, tf_keras.losses.Loss) else loss

    def loss_fn(labels, outputs):
        return tf.reduce_mean(per_sample(labels, outputs))

    return loss_fn


def _local_copy(model):
    """A function building the worker's copy of `model` (same architecture, own variables)."""
    if not (isinstance(model, tf_keras.Sequential) or tf_private.is_graph_network(model)):
        raise ValueError("fit with a DOWNPOUR tnp.ParameterServerStrategy copies the model to "
                         "every worker with tf_keras.models.clone_model: use a Sequential or "
                         "functional model, or tnp.DownpourTrainer(model_fn=...)")

    def model_fn():
        copy = tf_keras.models.clone_model(model)
        if not copy.built:
            copy.build(tf_private.build_input_shape(model))
        return copy

    return model_fn


def downpour_train_function(model):
    """The `train_function` of `model.fit` under a DOWNPOUR strategy: schedules one window per
    call on the model's cluster coordinator and returns its RemoteValue {"loss": ...}."""
    strategy = model.distribute_strategy
    coordinator = tf_private.keras_cluster_coordinator(model)
    if coordinator is None:
        raise ValueError("fit with a DOWNPOUR tnp.ParameterServerStrategy runs through a "
                         "ClusterCoordinator; pass the data as a "
                         "tf_keras.utils.experimental.DatasetCreator")
    trainer = DownpourTrainer(strategy, coordinator, _local_copy(model), _loss_fn(model),
                              model.optimizer, model=model)

    @tf.function
    def window(iterator):
        loss, _, _ = trainer._distributed_window_fn(iterator)  # pylint: disable=protected-access
        return {"loss": loss}

    def train_function(iterator):
        return coordinator.schedule(window, args=(iterator,))

    model._nestpipe_downpour = trainer  # pylint: disable=protected-access
    return train_function
