"""Row gather with -1 padding and its adjoint, the deterministic sparse-gradient segment-sum."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library


def gather_rows(params, indices):
    """Returns `params[indices]` for a 2-D `params`, with a zero row wherever an index is -1."""
    return load_op_library().nestpipe_gather_rows(params, indices)


def segment_sum(data, segment_ids, num_segments):
    """Sums rows of `data` into `num_segments` rows by `segment_ids`, skipping ids of -1."""
    return load_op_library().nestpipe_segment_sum(data, segment_ids, tf.cast(num_segments, tf.int32))


def slice_rows(rows, start, end):
    """`rows[start:end]` (2-D `rows`, scalar bounds) whose gradient is an `IndexedSlices`: when a
    step takes many slices of one tensor (one per lookup of a buffer), their gradients are
    concatenated, not each padded to the whole tensor and summed densely."""
    return tf.gather(rows, tf.range(start, end))


@tf.RegisterGradient("NestpipeGatherRows")
def _gather_rows_grad(op, grad):
    params, indices = op.inputs
    num_rows = tf.shape(params, out_type=tf.int32)[0]
    if isinstance(grad, tf.IndexedSlices):
        # A sparse upstream gradient (e.g. of `slice_rows` pieces): each row of it goes straight
        # to the params row its output row was gathered from, never densified in between.
        return segment_sum(grad.values, tf.gather(indices, grad.indices), num_rows), None
    return segment_sum(grad, indices, num_rows), None


@tf.RegisterGradient("NestpipeSegmentSum")
def _segment_sum_grad(op, grad):
    return gather_rows(grad, op.inputs[1]), None, None
