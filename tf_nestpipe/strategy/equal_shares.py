"""Refuses steps whose per-worker shares of the global batch differ in size.

Every worker averages its loss over its own share and the dense all-reduce sums the workers'
gradients divided by the number of workers: that is the global-batch mean only when every share
has the same size. The last batch of a dataset whose length is not a multiple of the global
batch (without `drop_remainder=True`) splits unevenly, e.g. 3 samples as 2 + 1 on 2 workers,
and would silently train another model than one process does. So before such a step every
worker all-gathers its share's size (one tiny collective per training step, only when the
batch dimension is not static) and the step fails on every worker, naming the sizes and the
fix, before its gradients are aggregated, i.e. before any variable is updated. Only training
steps are checked (`strategy.run` calls whose function aggregates gradients into trainable
variables): evaluate and predict reduce sums and counts, exact for any shares.
In multi-worker mode TensorFlow relaxes the batch dimension of finite datasets (its partial-batch
handling), so in practice every step of a finite dataset is checked; a repeated (infinite)
dataset batched with drop_remainder=True keeps static shapes and pays nothing. Eager
`strategy.run` calls are always checked. Not caught: per-worker datasets whose batch sizes are
static but different on each worker (each traces its own static shape).
"""
import tensorflow as tf

from tf_nestpipe.tf_private import distribute_values as _dist_values

TAG = "nestpipe/equal_shares"


class UnequalSharesError(ValueError):
    """Workers got shares of different sizes of one global batch (see the module docstring)."""


_OPT_OUT = ("Pass check_equal_shares=False to NestPipeStrategy (or set "
            "strategy.check_equal_shares = False) to train anyway.")


def _message(sizes):
    return ("the workers' shares of this global batch differ in size (%s): each worker "
            "averages over its own share, so the update would differ from one process on the "
            "global batch. If this is the dataset's last, partial batch, batch the dataset with "
            "drop_remainder=True (e.g. dataset.batch(global_batch, drop_remainder=True), or "
            "input_context.get_per_replica_batch_size(...) with drop_remainder=True in a "
            "dataset_fn) so that every step's global batch is full. If every batch splits so, "
            "the global batch is not divisible by the number of workers: use one that is. %s"
            % (sizes, _OPT_OUT))


def static_batch_size(dataset):
    """The batch size every element of `dataset` has statically (the first dimension of all
    its tensors), else None."""
    sizes = set()
    for spec in tf.nest.flatten(getattr(dataset, "element_spec", None)):
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None or shape.rank == 0 or shape[0] is None:
            return None
        sizes.add(int(shape[0]))
    return sizes.pop() if len(sizes) == 1 else None


def check_global_batch(dataset, num_workers):
    """Refuses, before any step, a dataset of global batches whose static size does not split
    evenly over `num_workers` (e.g. `batch(63, drop_remainder=True)` on 2 workers: every step
    32 + 31 samples), naming the sizes to use."""
    size = static_batch_size(dataset)
    if size is None or size % num_workers == 0:
        return
    lower, upper = size - size % num_workers, size + num_workers - size % num_workers
    raise UnequalSharesError(
        "the dataset's global batch of %d samples does not split evenly over %d workers: "
        "every step's shares would differ in size (%s samples), and each worker averages over "
        "its own share, so the updates would differ from one process's. Use a global batch "
        "divisible by %d (e.g. %s%d). %s" % (
            size, num_workers, " + ".join(
                str(size // num_workers + (k < size % num_workers)) for k in range(num_workers)),
            num_workers, "%d or " % lower if lower else "", upper, _OPT_OUT))


def leading_size(args):
    """The batch size of the first batched tensor of `args` (the step's first argument, e.g.
    the features) as a scalar tensor; None when there is none, or when the size is static in a
    traced function (the same on every worker: the same program traced the same dataset).
    Eagerly every tensor's shape is known but may differ between workers: always checked."""
    eager = tf.executing_eagerly()
    for value in tf.nest.flatten(args, expand_composites=False):
        if isinstance(value, tf.RaggedTensor):
            size = value.nrows()
        elif isinstance(value, tf.SparseTensor):
            size = value.dense_shape[0]
        elif isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank:
            size = tf.shape(value, out_type=tf.int64)[0]
        else:
            continue  # a scalar or a Python value: not a batch
        if value.shape[0] is not None and not eager:
            return None
        return tf.cast(size, tf.int32)
    return None


def check_equal_shares(size, collectives):
    """All-gathers every worker's share `size`; raises (eagerly) or returns an op that fails
    (in a function) with `UnequalSharesError`'s message when they differ."""
    return check_shares(collectives.all_gather(tf.reshape(size, [1]), TAG))


def check_shares(sizes):
    """Every worker's share size `sizes` (`[W]`, e.g. as the keys exchange carried them):
    raises (eagerly) or returns an op that fails (in a function) with `UnequalSharesError`'s
    message when they differ."""
    if tf.executing_eagerly():
        values = sizes.numpy().tolist()
        if len(set(values)) > 1:
            raise UnequalSharesError(_message(" + ".join(str(v) for v in values) + " samples"))
        return None

    return tf.debugging.Assert(
        tf.reduce_all(tf.equal(sizes, sizes[0])),
        [_message("samples per worker at the end of this message"), sizes], name="nestpipe_equal_shares")


def graph_tensors(values):
    """The graph tensors of `values` (tensors, IndexedSlices, per-replica values), for control
    dependencies; none when executing eagerly."""
    if tf.executing_eagerly():
        return []
    flat = []
    for value in tf.nest.flatten(values, expand_composites=False):
        parts = value.values if isinstance(value, _dist_values.DistributedValues) else (value,)
        for part in parts:
            flat.extend(t for t in tf.nest.flatten(part, expand_composites=True)
                        if isinstance(t, tf.Tensor) and hasattr(t, "graph"))
    return flat


def after(check, value):
    """`value` (tensors, IndexedSlices, per-replica values), computed only after `check`."""
    if check is None:
        return value
    with tf.control_dependencies([check]):
        return tf.nest.map_structure(tf.identity, value, expand_composites=True)
