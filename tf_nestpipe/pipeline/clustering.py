"""Key-centric sample clustering (docs/design/design.md §4): reorders the samples of a batch so
that its micro-batches share keys, and puts the micro-batch with the fewest keys first.

The gradient sum of a batch does not depend on the order of its samples, so the training result
is unchanged (up to float summation order). Each sample is assigned its *anchor* key: among its
ids, the one shared by the most samples of the batch, counting only keys that occur in at least
2 and at most ceil(batch / micro_batches) samples (a key hotter than that lands in several
micro-batches whatever the order; a key seen once is shared by nobody). Samples are sorted by
(anchor count descending, anchor), so the samples of one anchor are contiguous and fall into as
few micro-batches as possible. The contiguous micro-batches are then ordered by their number of
distinct keys, fewest first: the first micro-batch's fetch is the one nothing overlaps.
"""
import tensorflow as tf


def _occurrences(keys):
    """Flattens a list of int id tensors ([B], [B, k] or ragged [B, None]) into (field-tagged
    key, sample row) pairs."""
    values, rows = [], []
    num_fields = len(keys)
    for field, ids in enumerate(keys):
        if isinstance(ids, tf.RaggedTensor):
            flat, row = ids.flat_values, ids.value_rowids()
        else:
            ids = tf.convert_to_tensor(ids)
            if ids.shape.rank == 1:
                ids = ids[:, None]
            elif ids.shape.rank != 2:
                raise ValueError("cluster keys must be [batch], [batch, k] or ragged [batch, None] "
                                 "int tensors, got shape %s" % ids.shape)
            flat = tf.reshape(ids, [-1])
            row = tf.repeat(tf.range(tf.shape(ids, out_type=tf.int64)[0]), tf.shape(ids)[1])
        # Tag by field so equal ids of different tables are different keys.
        values.append(tf.cast(flat, tf.int64) * num_fields + field)
        rows.append(tf.cast(row, tf.int64))
    return tf.concat(values, 0), tf.concat(rows, 0)


def _chunk_bounds(size, micro_batches):
    return [size * j // micro_batches for j in range(micro_batches + 1)]


def cluster_permutation(keys, batch_size, micro_batches):
    """Returns an int64 permutation `[batch_size]` of the samples (see the module docstring).

    `keys` is a list of int id tensors whose first dimension is the batch (dense `[B]`, `[B, k]`
    or ragged `[B, None]`): typically every id feature of the batch."""
    if not keys:
        raise ValueError("cluster_permutation needs at least one id tensor to cluster by")
    batch_size = tf.cast(batch_size, tf.int64)
    values, rows = _occurrences(keys)
    unique, key_index, counts = tf.unique_with_counts(values, out_idx=tf.int64)
    count = tf.gather(counts, key_index)
    cap = (batch_size + micro_batches - 1) // micro_batches
    score = tf.where(tf.logical_and(count >= 2, count <= cap), count, 0)
    best = tf.math.unsorted_segment_max(score, rows, batch_size)
    best = tf.maximum(best, 0)  # samples without ids get 0 (segment max of nothing is -inf-like)
    is_anchor = tf.logical_and(score > 0, tf.equal(score, tf.gather(best, rows)))
    sentinel = tf.size(unique, out_type=tf.int64)
    anchor = tf.math.unsorted_segment_min(tf.where(is_anchor, key_index, sentinel), rows,
                                          batch_size)
    anchor = tf.minimum(anchor, sentinel)
    # Stable sorts, least significant key first: anchor ascending, then count descending.
    order = tf.argsort(anchor, stable=True)
    order = tf.gather(order, tf.argsort(-tf.gather(best, order), stable=True))
    order = tf.cast(order, tf.int64)

    # Order the contiguous micro-batches by their number of distinct keys, fewest first.
    position = tf.math.invert_permutation(order)  # sample -> its place in `order`
    bounds = tf.stack(_chunk_bounds(batch_size, micro_batches))
    chunk_of_place = tf.searchsorted(bounds[1:], tf.range(batch_size), side="right",
                                     out_type=tf.int64)
    chunk = tf.gather(chunk_of_place, tf.gather(position, rows))
    pairs, _ = tf.unique(chunk * (sentinel + 1) + key_index)
    distinct = tf.math.unsorted_segment_sum(tf.ones_like(pairs), pairs // (sentinel + 1),
                                            micro_batches)
    chunk_order = tf.argsort(distinct, stable=True)
    places = tf.ragged.range(tf.gather(bounds[:-1], chunk_order),
                             tf.gather(bounds[1:], chunk_order)).flat_values
    return tf.gather(order, places)


def integer_leaves(structure):
    """The integer tensors (dense or ragged) of a nested structure: the id features to cluster by."""
    return [t for t in tf.nest.flatten(structure, expand_composites=False)
            if isinstance(t, (tf.Tensor, tf.RaggedTensor, tf.Variable)) and t.dtype.is_integer]
