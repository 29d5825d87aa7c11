"""`tnp.check_exactness`: before trusting a pipeline setting, compare it with the reference.

Fits a fresh `model_fn()` twice on the same batches, once with the strategy's pipeline setting
(`pipeline`, `micro_batches`, `cluster_samples`) and once without a pipeline (the synchronous
reference every pipeline must equal, docs/design/design.md §2), and reports the largest
difference of any parameter (whole tables, dense weights). A collective: call it on every worker.
"""
import dataclasses

import numpy as np
import tensorflow as tf
import tf_keras

from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy, row_shard_layout
from tf_nestpipe.strategy.row_shard_saving import gather_full_rows


@dataclasses.dataclass
class ExactnessReport:
    """The result of `check_exactness`.

    Attributes:
        pipeline: The pipeline mode checked.
        steps: Training steps run each way.
        max_difference: The largest absolute difference of any parameter.
        differences: Per parameter (by position in `model.trainable_variables`, with its
            name), its largest absolute difference between the pipelined run and the
            reference.
    """

    pipeline: str
    steps: int
    max_difference: float
    differences: dict

    def __str__(self):
        worst = max(self.differences, key=self.differences.get) if self.differences else None
        return ("pipeline=%r vs the unpipelined reference after %d steps: largest parameter "
                "difference %.3g (%s)" % (self.pipeline, self.steps, self.max_difference, worst))


def _parameters(model, strategy):
    """Every trainable parameter as NumPy, row shards as whole tables (a collective)."""
    values = {}
    for i, variable in enumerate(model.trainable_variables):
        layout = row_shard_layout(variable)
        if layout is not None:
            value = gather_full_rows(variable, layout, strategy.extended.collectives,
                                     "nestpipe/check_exactness/%d" % i).numpy()
        else:
            value = variable.numpy()
        values["%d:%s" % (i, variable.name)] = value
    return values


def check_exactness(model_fn, dataset, steps, strategy=None, seed=0):
    """Fits `model_fn()` (builds and compiles a tf_keras model; called inside the strategy's
    scope) for `steps` steps of `dataset` (a distributed dataset, or a `dataset_fn(InputContext)`
    for `distribute_datasets_from_function`; each `fit` starts it from its beginning) with the
    strategy's pipeline and without one, from the same initial values (`seed`). A collective:
    call it on every worker.

    Args:
        model_fn: Builds and compiles a tf_keras model (called in the strategy's scope).
        dataset: A distributed dataset, or a `dataset_fn(InputContext)`.
        steps: Training steps each way.
        strategy: The `NestPipeStrategy` (default: the current one).
        seed: The initial values' seed, shared by both runs.

    Returns:
        An `ExactnessReport` (`print` it to see the worst parameter).

    Raises:
        ValueError: No `NestPipeStrategy`, or `model_fn` builds different models."""
    strategy = strategy or tf.distribute.get_strategy()
    if not isinstance(strategy, NestPipeStrategy):
        raise ValueError("check_exactness needs a tnp.NestPipeStrategy (pass strategy=, or call "
                         "it inside strategy.scope()); got %s" % type(strategy).__name__)
    if callable(dataset) and not hasattr(dataset, "__iter__"):
        dataset = strategy.distribute_datasets_from_function(dataset)
    pipeline = strategy.pipeline
    runs = {}
    try:
        for setting in ("none", pipeline):
            strategy.pipeline = setting  # read when the model's train function is made
            tf_keras.utils.set_random_seed(seed)
            with strategy.scope():
                model = model_fn()
            model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
            runs[setting] = _parameters(model, strategy)
    finally:
        strategy.pipeline = pipeline
    reference, candidate = runs["none"], runs[pipeline]
    if [k.split(":")[0] for k in reference] != [k.split(":")[0] for k in candidate]:
        raise ValueError("model_fn built models with different parameters")
    differences = {}
    for (name, ref), value in zip(reference.items(), candidate.values()):
        if ref.shape != value.shape:
            raise ValueError("model_fn built %s with shapes %s and %s" % (name, ref.shape,
                                                                          value.shape))
        differences[name.split(":", 1)[1]] = float(np.max(np.abs(ref - value))) if ref.size else 0.0
    return ExactnessReport(pipeline, int(steps), max(differences.values(), default=0.0),
                           differences)
