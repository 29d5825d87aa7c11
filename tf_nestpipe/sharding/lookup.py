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


def route(ids, layout: ShardLayout, collectives, table_name=""):
    """Stage 3 for a vector of int64 `ids` (more than one shard): dedup + bucket-by-owner, counts
    exchange, keys all-to-all and owner-side dedup. Returns a dict of tensors:

    - requester side: `splits` (unique ids per owner), `inverse` (input position -> bucketed
      unique index), `slot_of_bucket_pos` (bucketed unique index -> slot of the row exchange);
    - exchange shape: `bucket`, `capacity` (padded ids per owner/requester pair);
    - owner side: `local_rows` (distinct owned rows requested), `slot_to_unique` (slot ->
      index into `local_rows`, -1 for padding), `received` (ids received from each requester:
      the rows this owner sends back to each).

    The exchanges pass their real per-worker counts along: a collectives backend with variable
    splits (Horovod) sends only those entries, TensorFlow's all-to-all the padded blocks.
    """
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    num_shards = layout.num_shards
    keys, splits, inverse = ops.route_keys(ids, num_shards, layout.vocab_size, table_name)
    # Counts exchange: sent[i, j] = number of unique ids worker i requests from worker j.
    sent = tf.reshape(collectives.all_gather(splits, table_name + "/counts"), [num_shards, num_shards])
    bucket, capacity = capacity_bucket(tf.maximum(tf.reduce_max(sent), 1))
    padded_keys = tf.RaggedTensor.from_row_lengths(keys, tf.cast(splits, tf.int64)).to_tensor(
        default_value=-1, shape=tf.stack([tf.constant(num_shards, tf.int64),
                                          tf.cast(capacity, tf.int64)]))
    received_keys = collectives.all_to_all(padded_keys, table_name + "/keys", bucket,
                                           send_counts=splits, fill=-1)
    local_rows, slot_to_unique = ops.owner_dedup(received_keys, num_shards, layout.shard_index)
    offsets = tf.cumsum(splits, exclusive=True)
    owner_of_bucket_pos = tf.repeat(tf.range(num_shards, dtype=tf.int32), splits)
    slot_of_bucket_pos = (owner_of_bucket_pos * capacity + tf.range(tf.size(keys, tf.int32))
                          - tf.gather(offsets, owner_of_bucket_pos))
    return {"splits": splits, "inverse": inverse, "slot_of_bucket_pos": slot_of_bucket_pos,
            "bucket": bucket, "capacity": capacity, "local_rows": local_rows,
            "slot_to_unique": slot_to_unique, "received": sent[:, layout.shard_index]}


def exchange_rows(owned, routing, layout: ShardLayout, collectives, table_name="",
                  differentiable=True):
    """Stage 4: the owner's `owned` rows (one per `local_rows`) go back to the requesters.
    Returns the received rows in slot layout, `[num_shards * capacity, dim]`."""
    outgoing = tf.reshape(ops.gather_rows(owned, routing["slot_to_unique"]),
                          [layout.num_shards, routing["capacity"], layout.dim])
    exchange = collectives.all_to_all_differentiable if differentiable else collectives.all_to_all
    return tf.reshape(exchange(outgoing, table_name + "/rows", routing["bucket"],
                               send_counts=routing["received"]), [-1, layout.dim])


def sharded_lookup(table, ids, layout: ShardLayout, collectives, table_name=""):
    """Returns `table_full[ids]` (`[n, dim]`) for a vector of int64 `ids`, where `table` holds
    this worker's row shard of `table_full` as described by `layout`."""
    ids = tf.reshape(tf.cast(ids, tf.int64), [-1])
    if layout.num_shards == 1:
        keys, _, inverse = ops.route_keys(ids, 1, layout.vocab_size, table_name)
        return ops.gather_rows(tf.gather(table, keys), inverse)
    routing = route(ids, layout, collectives, table_name)
    owned = tf.gather(table, routing["local_rows"])  # IndexedSlices gradient on owned rows only
    incoming = exchange_rows(owned, routing, layout, collectives, table_name)
    # Stage 5: inverse-index rebuild of the per-sample rows.
    return ops.gather_rows(incoming, tf.gather(routing["slot_of_bucket_pos"], routing["inverse"]))
