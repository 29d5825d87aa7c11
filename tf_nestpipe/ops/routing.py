"""Key routing: requester-side dedup + bucket-by-owner and owner-side dedup."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library


def route_keys(ids, num_shards, vocab_size, table_name=""):
    """Dedups a vector of int64 ids and buckets the unique ids by owner (id mod num_shards).

    Returns `(bucketed_keys, split_sizes, inverse)`: unique ids grouped by owner, the count per
    owner, and for each input position the index of its id in `bucketed_keys`. Ids outside
    `[0, vocab_size)` raise `InvalidArgumentError` naming `table_name` and the id.
    """
    ids = tf.convert_to_tensor(ids, tf.int64)
    return load_op_library().nestpipe_route_keys(
        ids, num_shards=num_shards, vocab_size=vocab_size, table_name=table_name)


def check_ids(ids, vocab_size, table_name=""):
    """`ids` (int64), after checking that each lies in `[0, vocab_size)`: an out-of-range id
    raises `InvalidArgumentError` naming `table_name`, the id and its position."""
    return load_op_library().nestpipe_check_ids(tf.convert_to_tensor(ids, tf.int64),
                                                vocab_size=vocab_size, table_name=table_name)


def owner_dedup(received_keys, num_shards, shard_index):
    """Dedups the padded `[requesters, capacity]` keys an owner received (-1 is padding).

    Returns `(local_rows, slot_to_unique)`: the distinct local rows (key // num_shards) and, for
    each flattened slot, its index into `local_rows` (-1 for padding).
    """
    return load_op_library().nestpipe_owner_dedup(
        received_keys, num_shards=num_shards, shard_index=shard_index)


tf.no_gradient("NestpipeCheckIds")
tf.no_gradient("NestpipeRouteKeys")
tf.no_gradient("NestpipeOwnerDedup")
