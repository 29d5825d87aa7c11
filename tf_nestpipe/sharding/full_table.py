"""The whole table from every worker's row shard (one all-gather), in id order."""
import tensorflow as tf


def gather_full_rows(local, layout, collectives, tag):
    """The whole `[vocab_size, ...]` value from every worker's row shard `local` (a collective)."""
    if layout.num_shards == 1:
        return tf.convert_to_tensor(local)
    local = tf.convert_to_tensor(local)
    pad = layout.max_local_rows - layout.local_rows
    padded = tf.pad(local, [[0, pad]] + [[0, 0]] * (local.shape.rank - 1))
    gathered = collectives.all_gather(padded, tag)  # [num_shards * max_local_rows, ...]
    ids = tf.range(layout.vocab_size, dtype=tf.int64)
    index = layout.owner(ids) * layout.max_local_rows + layout.local_row(ids)
    return tf.gather(gathered, index)
