"""The model-parallel embedding lookup of one table (DESIGN.md section 2).

Forward, per step: fused dedup + bucket-by-owner (custom op); an all-gather of the split sizes
(each worker learns what it will receive and the common padded capacity); an all-to-all of the
padded keys; owner-side dedup (custom op) and gather of the owned rows; an all-to-all of the rows
back; a gather through the inverse index. Backward is the adjoint of each step: segment-sum of
the per-sample gradients per unique key (custom op), the reverse all-to-all, and the owner's
segment-sum into an `IndexedSlices` gradient of its own rows only.
"""
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.sharding.layout import ShardLayout
from tf_nestpipe.strategy.communication import capacity_bucket


def sharded_lookup(table, ids, layout: ShardLayout, collectives, table_name=""):
    """Returns `table_full[ids]` (`[n, dim]`) for a vector of int64 `ids`, where `table` holds
    this worker's row shard of `table_full` as described by `layout`."""
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    num_shards = layout.num_shards
    keys, splits, inverse = ops.route_keys(ids, num_shards, layout.vocab_size, table_name)
    if num_shards == 1:
        unique_rows = tf.gather(table, keys)
        return ops.gather_rows(unique_rows, inverse)

    # 1. counts exchange: sent[i, j] = number of unique ids worker i requests from worker j.
    sent = tf.reshape(collectives.all_gather(splits, table_name + "/counts"), [num_shards, num_shards])
    bucket, capacity = capacity_bucket(tf.maximum(tf.reduce_max(sent), 1))
    # 2. keys all-to-all, padded with -1 to [num_shards, capacity].
    offsets = tf.cumsum(splits, exclusive=True)
    padded_keys = tf.RaggedTensor.from_row_lengths(keys, tf.cast(splits, tf.int64)).to_tensor(
        default_value=-1, shape=tf.stack([tf.constant(num_shards, tf.int64),
                                          tf.cast(capacity, tf.int64)]))
    received_keys = collectives.all_to_all(padded_keys, table_name + "/keys", bucket)
    # 3. owner: dedup across requesters, gather each owned row once.
    local_rows, slot_to_unique = ops.owner_dedup(received_keys, num_shards, layout.shard_index)
    owned = tf.gather(table, local_rows)  # IndexedSlices gradient on the owned rows only
    outgoing = tf.reshape(ops.gather_rows(owned, slot_to_unique),
                          [num_shards, capacity, layout.dim])
    # 4. rows all-to-all back; row slot (s, p) holds the p-th id this worker asked shard s for.
    incoming = tf.reshape(collectives.all_to_all_differentiable(
        outgoing, table_name + "/rows", bucket), [-1, layout.dim])
    owner_of_bucket_pos = tf.repeat(tf.range(num_shards, dtype=tf.int32), splits)
    slot_of_bucket_pos = (owner_of_bucket_pos * capacity + tf.range(tf.size(keys, tf.int32))
                          - tf.gather(offsets, owner_of_bucket_pos))
    # 5. inverse-index rebuild of the per-sample rows.
    return ops.gather_rows(incoming, tf.gather(slot_of_bucket_pos, inverse))
