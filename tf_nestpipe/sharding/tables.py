"""The row source of one exchange: the row-wise tables of one dim and dtype in one id space.

Table t's id k is fused id `offsets[t] + k`, with every offset a multiple of the number of
workers W, so the ownership rule of `ShardLayout` applied to the fused id gives the same owner
as applied to k (`k mod W`) and the fused local row is `offsets[t] / W + k // W`. One exchange
then routes, fetches and sends back the rows of all the tables together (DESIGN.md section 10).
"""
import numpy as np
import tensorflow as tf

from tf_nestpipe.sharding.layout import ShardLayout


class FusedTables:
    """`layers` (row-wise `ShardedEmbedding`s of one dim and dtype, sharded over `num_shards`
    workers) as one table with layout `layout` whose rows this worker gathers with `gather`."""

    def __init__(self, layers, num_shards, shard_index):
        if not layers:
            raise ValueError("FusedTables needs at least one table")
        dims = {(layer.dim, layer.embeddings.dtype) for layer in layers}
        if len(dims) != 1:
            raise ValueError("tables of one exchange must share dim and dtype, got %s" % dims)
        self.layers = tuple(layers)
        self.num_shards = num_shards
        offsets, total = [], 0
        for layer in self.layers:
            offsets.append(total)
            total += -(-layer.vocab_size // num_shards) * num_shards  # rounded up to W
        self._offsets = {id(layer): offset for layer, offset in zip(self.layers, offsets)}
        self._row_offsets = np.asarray(offsets, np.int64) // num_shards
        self.layout = ShardLayout(offsets[-1] + self.layers[-1].vocab_size, self.layers[0].dim,
                                  num_shards, shard_index)
        self.dtype = self.layers[0].embeddings.dtype

    def offset(self, layer):
        """The fused id of `layer`'s id 0."""
        return self._offsets[id(layer)]

    def fuse(self, layer, flat_ids):
        """`layer`'s int64 ids as fused ids."""
        offset = self.offset(layer)
        return flat_ids + tf.constant(offset, tf.int64) if offset else flat_ids

    def gather(self, local_rows):
        """This worker's rows at fused local rows `local_rows` (int64 `[r]`), read from each
        table's shard; the gradient is an `IndexedSlices` of each table's own rows."""
        if len(self.layers) == 1:
            return tf.gather(self.layers[0].embeddings, local_rows)
        num_tables = len(self.layers)
        row_offsets = tf.constant(self._row_offsets)
        table = tf.cast(tf.searchsorted(row_offsets, local_rows, side="right"), tf.int32) - 1
        rows_in_table = tf.dynamic_partition(local_rows - tf.gather(row_offsets, table), table,
                                             num_tables)
        positions = tf.dynamic_partition(tf.range(tf.size(local_rows)), table, num_tables)
        return tf.dynamic_stitch(positions, [tf.gather(layer.embeddings, rows) for layer, rows
                                             in zip(self.layers, rows_in_table)])
