"""Sparse in-place updates of a variable's rows (the optimizers' `scatter_add` / `scatter_sub`
on a table's rows), bitwise what TensorFlow's own ops compute."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library

# The dtypes `scatter_rows` updates; others take TensorFlow's own ops.
DTYPES = (tf.float32, tf.float64)


def scatter_rows(handle, indices, updates, subtract=False):
    """Adds (`subtract`: subtracts) `updates[i]` to row `indices[i]` of the variable `handle`, in
    index order: what `ResourceScatterAdd` (`ResourceScatterSub`) computes on the CPU, bitwise,
    in a tight loop per row. Every index is checked before any row changes.

    Args:
      handle: The variable's resource handle (float32 or float64, rank >= 1, on the CPU).
      indices: int32 or int64 `[n]`, rows of the variable (repeats are applied in order).
      updates: `[n, ...]` of the variable's dtype and row shape.
      subtract: Whether to subtract rather than add.

    Returns:
      The op (it has no outputs).

    Raises:
      InvalidArgumentError: (when run) an index outside `[0, rows)` (nothing is updated), or
        `updates` not `[n]` + the variable's row shape.
    """
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in (tf.int32, tf.int64):
        indices = tf.cast(indices, tf.int64)
    return load_op_library().nestpipe_scatter_rows(handle, indices, updates, subtract=subtract)


tf.no_gradient("NestpipeScatterRows")
