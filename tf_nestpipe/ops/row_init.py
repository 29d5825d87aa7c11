"""Per-row stateless random initialization (Philox counter offsets), matching TF's kernels."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library

DISTRIBUTIONS = ("uniform", "normal", "truncated_normal")


def stateless_row_init(seed, rows, dim, distribution):
    """Returns rows `rows` of the `[vocab, dim]` float32 tensor that
    `tf.random.stateless_{distribution}(shape=[vocab, dim], seed=seed)` would return (raw
    U[0,1) / N(0,1) / truncated N(0,1) samples), without materializing the other rows.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError("distribution must be one of %s, got %r" % (DISTRIBUTIONS, distribution))
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.cast(seed, tf.int64))
    return load_op_library().nestpipe_stateless_row_init(
        key, counter, tf.convert_to_tensor(rows, tf.int64), dim=int(dim), distribution=distribution)
