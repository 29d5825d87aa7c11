"""The optimizers' sparse updates of a table's rows. tf_keras' optimizers apply an
`IndexedSlices` gradient with the variable's `scatter_add` / `scatter_sub` (Adagrad's
accumulator and rows, SGD's rows, ...); on a row shard they run `ops.scatter_rows`, one tight
loop per row instead of TensorFlow's tensor expression per row, with the same result bitwise."""
import tensorflow as tf

from tf_nestpipe import ops, tf_private


class RowShardUpdates:
    """Mixed into a row-shard variable's class (before the variable class): its `scatter_add`
    and `scatter_sub` run `ops.scatter_rows` for float32 / float64 variables off the GPU, and
    the variable class's own otherwise (which also raises the TypeError for a delta that is
    not an `IndexedSlices`); `use_locking` is ignored, as TensorFlow's resource variables
    ignore it (the update holds the variable's lock)."""

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        """`tf.Variable.scatter_add` (same arguments, result and errors)."""
        if not _takes_scatter_rows(self, sparse_delta):
            return super().scatter_add(sparse_delta, use_locking, name)
        return self._scatter_rows(sparse_delta, False, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        """`tf.Variable.scatter_sub` (same arguments, result and errors)."""
        if not _takes_scatter_rows(self, sparse_delta):
            return super().scatter_sub(sparse_delta, use_locking, name)
        return self._scatter_rows(sparse_delta, True, name)

    def _scatter_rows(self, sparse_delta, subtract, name):
        with tf.name_scope(name or ("scatter_sub" if subtract else "scatter_add")):
            op = ops.scatter_rows(self.handle, sparse_delta.indices,
                                  tf.convert_to_tensor(sparse_delta.values, self.dtype),
                                  subtract=subtract)
        return tf_private.lazy_read(self, op)


def _takes_scatter_rows(variable, sparse_delta):
    """Whether `ops.scatter_rows` updates `variable` by `sparse_delta` (else TensorFlow's op,
    which also raises the TypeError for a delta that is not an `IndexedSlices`)."""
    return (isinstance(sparse_delta, tf.IndexedSlices) and variable.dtype in ops.updates.DTYPES
            and "GPU" not in (variable.device or "").upper())
