"""The exchange of a dynamic table's lookup (DynamicEmbedding): route raw int64 ids to their
owners, the owner's hash-table step, the rows back.

Owner of id k: `ops.dynamic_owner` (splitmix64 finalizer of k's bits, mod W). Stages:
- route: dedup (tf.unique), bucket by owner, one all-gather of the `[W]` counts (every worker
  learns the whole count matrix), one keys all-to-all padded to the largest count's capacity
  bucket (validity from the counts, since every int64 is a valid id: no sentinel).
- owner: dedup of the ids received from all requesters, the hash-table step
  (`DynamicEmbedding.owner_rows`: admit / find and gather), rows in slot layout.
- output: the rows all-to-all back (its gradient the reverse all-to-all), un-bucketed.
"""
import tensorflow as tf

from tf_nestpipe.collectives.communication import capacity_bucket
from tf_nestpipe.ops.dynamic_table import dynamic_owner


def dynamic_lookup(owner_rows, ids, dim, num_shards, shard_index, collectives, tag):
    """Rows `[n, dim]` of int64 `ids`, where `owner_rows(unique_ids)` gives this worker's rows
    of the distinct ids it owns (`[u, dim]`, differentiable into its row variable)."""
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    unique, inverse = tf.unique(ids, out_idx=tf.int32)
    if num_shards == 1:
        return tf.gather(owner_rows(unique), inverse)
    owner = dynamic_owner(unique, num_shards)
    order = tf.argsort(owner, stable=True)
    by_owner = tf.gather(unique, order)
    counts = tf.math.bincount(owner, minlength=num_shards, maxlength=num_shards, dtype=tf.int32)
    # matrix[i, j]: distinct ids worker i asks of worker j (the same on every worker).
    matrix = collectives.all_gather(counts[None, :], tag + "/counts")
    bucket, capacity = capacity_bucket(tf.maximum(tf.reduce_max(matrix), 1))
    offsets = tf.cumsum(counts, exclusive=True)
    owner_sorted = tf.gather(owner, order)
    slot = owner_sorted * capacity + tf.range(tf.size(unique)) - tf.gather(offsets, owner_sorted)
    keys_out = tf.scatter_nd(slot[:, None], by_owner, [num_shards * capacity])
    keys_in = collectives.all_to_all(tf.reshape(keys_out, [num_shards, capacity]),
                                     tag + "/keys", bucket)
    received = matrix[:, shard_index]
    valid = tf.reshape(tf.range(capacity)[None, :] < received[:, None], [-1])
    positions = tf.cast(tf.where(valid)[:, 0], tf.int32)
    owned, owned_inverse = tf.unique(tf.boolean_mask(tf.reshape(keys_in, [-1]), valid),
                                     out_idx=tf.int32)
    rows = owner_rows(owned)
    outgoing = tf.scatter_nd(positions[:, None], tf.gather(rows, owned_inverse),
                             [num_shards * capacity, dim])
    incoming = collectives.all_to_all_differentiable(
        tf.reshape(outgoing, [num_shards, capacity, dim]), tag + "/rows", bucket)
    rows_sorted = tf.gather(tf.reshape(incoming, [-1, dim]), slot)
    rows_unique = tf.gather(rows_sorted, tf.argsort(order))
    return tf.gather(rows_unique, inverse)
