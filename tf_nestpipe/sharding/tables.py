"""The row source of one exchange: the row-wise and table-wise tables of one dim and dtype in
one id space.

Each table reserves, in the local row space of every worker s, a span of rows: a row-wise table
`ceil(vocab / W)` rows on every worker, a table-wise one all its rows on its owner
and none elsewhere; spans follow each other in registration order, so table t starts at local
row `starts[t][s]` on worker s. Table t's id k (owned by `layout.owner(k)` at
`layout.local_row(k)`, the table's `ShardLayout`) is fused id
`W * (starts[t][owner] + local_row) + owner`: the ownership rule of a `ShardLayout` of the fused
space (owner = fused mod W, local row = fused // W) then names the same worker and that worker's
fused local row. For a group of row-wise tables only, `starts[t]` is the same on every worker
and the fused id is `W * starts[t] + k` (docs/design/design.md §10). One exchange then routes,
fetches and sends back the rows of all the tables together.
"""
import numpy as np
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.sharding.layout import ShardLayout


def _span(layout, shard):
    """Local rows a table with `layout` reserves on `shard` in a fused row space."""
    if layout.table_wise:
        return layout.rows_of_shard(shard)
    return layout.max_local_rows


class FusedTables:
    """`layers` (`ShardedEmbedding`s of one dim and dtype, row-wise or table-wise over
    `num_shards` workers) as one table with layout `layout` whose rows this worker gathers with
    `gather`."""

    def __init__(self, layers, num_shards, shard_index):
        if not layers:
            raise ValueError("FusedTables needs at least one table")
        dims = {(layer.dim, layer.embeddings.dtype) for layer in layers}
        if len(dims) != 1:
            raise ValueError("tables of one exchange must share dim and dtype, got %s" % dims)
        self.layers = tuple(layers)
        self.num_shards = num_shards
        layouts = [self._layout_of(layer, num_shards, shard_index) for layer in self.layers]
        spans = np.asarray([[_span(layout, s) for s in range(num_shards)] for layout in layouts],
                           np.int64).reshape(len(layouts), num_shards)
        starts = np.cumsum(spans, axis=0) - spans  # [tables, shards]
        self._layouts = {id(layer): layout for layer, layout in zip(self.layers, layouts)}
        self._starts = {id(layer): row for layer, row in zip(self.layers, starts)}
        self._row_offsets = starts[:, shard_index]  # this worker's table starts
        # The fused space ends after the largest fused id of any table's last row on any
        # worker (a single table's ids above its vocabulary then fail the route's range check).
        last = max(num_shards * (int(starts[t, s]) + layout.rows_of_shard(s) - 1) + s
                   for t, layout in enumerate(layouts) for s in range(num_shards)
                   if layout.rows_of_shard(s))
        self.layout = ShardLayout(last + 1, self.layers[0].dim, num_shards, shard_index)
        self.dtype = self.layers[0].embeddings.dtype

    @property
    def row_offsets(self):
        """This worker's first fused local row of each table (int64 NumPy `[tables]`, ascending
        from 0)."""
        return self._row_offsets

    @staticmethod
    def _layout_of(layer, num_shards, shard_index):
        layout = getattr(layer, "layout", None)
        if layout is not None and layout.num_shards == num_shards:
            return layout
        # A table that is not split (one shard): row-wise over `num_shards` is the same rule.
        return ShardLayout(layer.vocab_size, layer.dim, num_shards, shard_index)

    def _single_offset(self, layer):
        """`layer`'s fused id of its id 0 when every id k fuses to it + k (a row-wise table
        starting on the same local row of every worker: W * start + k), else None."""
        starts = self._starts[id(layer)]
        if self._layouts[id(layer)].table_wise or (starts != starts[0]).any():
            return None
        return int(starts[0]) * self.num_shards

    def offset(self, layer):
        """The fused id of `layer`'s id 0 (a row-wise table of a group whose tables start on
        the same local row of every worker, e.g. row-wise tables only)."""
        offset = self._single_offset(layer)
        if offset is None:
            raise ValueError("table %r has no single fused offset: use FusedTables.fuse"
                             % layer.name)
        return offset

    def fuse(self, layer, flat_ids):
        """`layer`'s int64 ids as fused ids (see the module docstring)."""
        offset = self._single_offset(layer)
        if offset is not None:
            return flat_ids + tf.constant(offset, tf.int64) if offset else flat_ids
        layout, starts = self._layouts[id(layer)], self._starts[id(layer)]
        width = self.num_shards
        owner = layout.owner(flat_ids)
        if (starts == starts[0]).all():
            start = tf.constant(int(starts[0]), tf.int64)
        else:
            start = tf.gather(tf.constant(starts), owner)
        return width * (start + layout.local_row(flat_ids)) + owner

    def fuse_lookups(self, lookups, segment_ends=None):
        """`lookups` (`(layer, its unchecked int64 flat ids)`, one per lookup) checked (each
        table's `checked_vocab_size`) and fused, one after another, in one op: returns
        `(fused ids, each lookup's size, segment_sizes)` (`ops.fuse_ids`: the lookups cut into
        segments, e.g. a frozen window's rounds, ending after lookup `segment_ends[s] - 1`;
        default one)."""
        ids, vocab_sizes, offsets = [], [], []
        for layer, flat_ids in lookups:
            offset = self._single_offset(layer)
            if offset is not None:
                ids.append(flat_ids)  # offset + k, checked in the op
                vocab_sizes.append(layer.checked_vocab_size)
                offsets.append(offset)
            else:
                # Fused by ownership: checked first (the route checks fused ids only).
                ids.append(self.fuse(layer, layer.checked_ids(flat_ids)))
                vocab_sizes.append(0)
                offsets.append(0)
        return ops.fuse_ids(ids, vocab_sizes, offsets, [layer.name for layer, _ in lookups],
                            segment_ends)

    def read_rows(self, local_rows):
        """`gather(local_rows)`'s values, not differentiable: for a group of tables one op
        (`ops.read_table_rows`) instead of a partition, a gather per table and a stitch."""
        if len(self.layers) == 1:
            return tf.stop_gradient(tf.gather(self.layers[0].embeddings, local_rows))
        # Called in a replica context (the pipelines' steps), where a distributed variable's
        # handle is this worker's.
        handles = [layer.embeddings.handle for layer in self.layers]
        return ops.read_table_rows(handles, local_rows, self._row_offsets, self.dtype,
                                   self.layers[0].dim)

    def gradient_carrier(self, local_rows, distinct_rows=False, table_sizes=None):
        """Zeros `[r, dim]` for fused local rows `local_rows` (int64 `[r]`) whose gradient is
        `gather(local_rows)`'s (an `IndexedSlices` of each table's own rows, the same values and
        indices in the same order), reading no row (`ops.gradient_carrier`): for a lookup whose
        values come from a prefetch buffer. Called in a replica context, as `read_rows`. With
        `distinct_rows` (no row of `local_rows` repeats) the gradients say so
        (`ops.has_distinct_indices`); `table_sizes` (int32 `[tables]`) says `local_rows` are
        grouped by table (a `RoutingRecord`'s), so the gradient is cut by a split, not a
        partition."""
        return ops.gradient_carrier([layer.embeddings for layer in self.layers], local_rows,
                                    self._row_offsets, self.dtype, self.layers[0].dim,
                                    distinct_rows=distinct_rows, table_sizes=table_sizes)

    def gather(self, local_rows):
        """This worker's rows at fused local rows `local_rows` (int64 `[r]`), read from each
        table's shard; the gradient is an `IndexedSlices` of each table's own rows."""
        if len(self.layers) == 1:
            return tf.gather(self.layers[0].embeddings, local_rows)
        num_tables = len(self.layers)
        table, rows_in_table = ops.tables_of_rows(local_rows, self._row_offsets, num_tables)
        positions = tf.dynamic_partition(tf.range(tf.size(local_rows)), table, num_tables)
        return tf.dynamic_stitch(positions, [tf.gather(layer.embeddings, rows) for layer, rows
                                             in zip(self.layers, rows_in_table)])
