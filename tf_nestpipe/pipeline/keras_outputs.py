"""What tf_keras `fit` / `evaluate` / `predict` report under `NestPipeStrategy`: global values.

Keras metrics are already global (their `result()` reads variables synchronized over the
workers). A *raw* value a custom `train_step` / `test_step` returns (TFRS's `loss`,
`regularization_loss`, `total_loss`) is this worker's: about 1/W of the global value, and
different on every worker, so callbacks watching it (EarlyStopping, ReduceLROnPlateau) would
decide differently per worker. `reduce_step_outputs` sums every raw float value over the workers
(one packed all-reduce per step for all of them; none when a step returns metrics only), the rule
MultiWorkerMirroredStrategy applies to everything a step returns: the sum of the per-worker losses
is the loss whose gradient training applies (gradients are summed over workers), i.e. one
process's loss on the global batch when each worker's loss is its share of a global-batch sum
(TFRS tasks' SUM reduction, or `tf.nn.compute_average_loss` with the global batch size).
A raw float tensor of any fully known static shape is summed element-wise, as
MultiWorkerMirroredStrategy sums it; one whose shape is known only at run time (e.g. per-example
values of a batch) cannot be packed alike on every worker and stays this worker's.

`concat_predictions` gives `predict` every worker's rows, in input order, on every worker (as
MultiWorkerMirroredStrategy does): per step, the workers' slices concatenated in worker order.

This module needs only a strategy object with `num_workers`, `reduce` and `gather`; the tf_keras
hooks that call it live in `tf_nestpipe.keras_hooks`.
"""
import tensorflow as tf

_SUMMED = ("auto", "sum")


def _is_raw_float(value):
    """A float tensor whose static shape is fully known (the same packing on every worker)."""
    return (isinstance(value, tf.Tensor) and value.dtype.is_floating
            and value.shape.is_fully_defined())


def raw_output_keys(model, outputs):
    """The top-level keys of the step output dict `outputs` that are raw per-worker values
    (float tensors of fully known shape not named after one of `model.metrics`), sorted."""
    if not isinstance(outputs, dict):
        return []
    metric_names = {metric.name for metric in model.metrics}
    return sorted(key for key, value in outputs.items()
                  if key not in metric_names and _is_raw_float(value))


def reduce_step_outputs(model, strategy, outputs, reduction="auto"):
    """`outputs` (a step's dict of this worker's values) with every raw float value (scalar or
    of fully known shape) replaced by its element-wise sum over all workers, in one packed
    all-reduce (a collective: every worker's step calls
    it). Metric results pass unchanged; `reduction` other than "auto" / "sum" (e.g. "first")
    leaves everything as it is."""
    if getattr(strategy, "num_workers", 1) == 1 or reduction not in _SUMMED:
        return outputs
    keys = raw_output_keys(model, outputs)
    if not keys:
        return outputs
    sizes = [outputs[key].shape.num_elements() for key in keys]
    packed = tf.concat([tf.reshape(tf.cast(outputs[key], tf.float64), [-1]) for key in keys], 0)
    summed = tf.split(strategy.reduce(tf.distribute.ReduceOp.SUM, packed, axis=None), sizes)
    result = dict(outputs)
    for key, value in zip(keys, summed):
        result[key] = tf.cast(tf.reshape(value, outputs[key].shape), outputs[key].dtype)
    return result


def concat_predictions(strategy, value):
    """This step's predictions of every worker, concatenated along axis 0 in worker order (a
    collective: every worker's predict step calls it; the workers' row counts may differ)."""
    if getattr(strategy, "num_workers", 1) == 1:
        return value
    if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
        raise ValueError("predict under NestPipeStrategy gathers dense predictions only; got a "
                         "%s: return a dense tensor from the model" % type(value).__name__)
    value = tf.convert_to_tensor(value)
    if value.shape.rank == 0:
        value = tf.reshape(value, [1])
    elif value.shape.rank is None:
        # Rank known only when it runs: a scalar becomes one row, a batch stays as it is.
        value = tf.reshape(value, tf.concat([[-1], tf.shape(value)[1:]], axis=0))
    rows = tf.shape(value)[0]
    counts = strategy.gather(tf.reshape(rows, [1]), axis=0)
    capacity = tf.reduce_max(counts)
    pad = tf.concat([[[0, capacity - rows]], tf.zeros([tf.rank(value) - 1, 2], tf.int32)],
                    axis=0)
    gathered = strategy.gather(tf.pad(value, pad), axis=0)  # [W * capacity, ...]
    # Keep each worker's first counts[w] rows, in worker order.
    index = tf.reshape(tf.range(capacity)[None, :] < counts[:, None], [-1])
    return tf.boolean_mask(gathered, index)
