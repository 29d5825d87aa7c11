"""Row gather with -1 padding and its adjoint, the deterministic sparse-gradient segment-sum."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library


def gather_rows(params, indices):
    """Returns `params[indices]` for a 2-D `params`, with a zero row wherever an index is -1."""
    return load_op_library().nestpipe_gather_rows(params, indices)


def read_table_rows(handles, local_rows, row_offsets, dtype, dim):
    """Rows of the tables (variable `handles`, in order) at fused local rows `local_rows`: table t
    holds local rows from `row_offsets[t]` (the last table starting at or before a row holds it).
    One op, not differentiable."""
    return load_op_library().nestpipe_read_table_rows(
        handles, tf.cast(local_rows, tf.int64), tf.cast(row_offsets, tf.int64), dtype=dtype,
        dim=dim)


def segment_sum(data, segment_ids, num_segments):
    """Sums rows of `data` into `num_segments` rows by `segment_ids`, skipping ids of -1."""
    return load_op_library().nestpipe_segment_sum(data, segment_ids, tf.cast(num_segments, tf.int32))


tf.no_gradient("NestpipeReadTableRows")


@tf.RegisterGradient("NestpipeGatherRows")
def _gather_rows_grad(op, grad):
    params, indices = op.inputs
    num_rows = tf.shape(params, out_type=tf.int32)[0]
    if isinstance(grad, tf.IndexedSlices):
        # A sparse upstream gradient (e.g. a tf.gather of the rows): each row of it goes straight
        # to the params row its output row was gathered from, never densified in between.
        return segment_sum(grad.values, tf.gather(indices, grad.indices), num_rows), None
    return segment_sum(grad, indices, num_rows), None


@tf.RegisterGradient("NestpipeSegmentSum")
def _segment_sum_grad(op, grad):
    return gather_rows(grad, op.inputs[1]), None, None
