"""Frozen-Window Pipeline (docs/design/design.md §4): micro-batches inside one synchronous step.

Between a batch's first lookup and its sparse update the tables do not change: every row is
*frozen* for the window. So the batch is split into M micro-batches, each looked up on its own:
the all-to-all of micro-batch j+1 depends only on the routing of the earlier ones, not on their
dense compute, and runs while micro-batch j computes. A window cache makes each micro-batch fetch
only the ids no earlier micro-batch fetched (total traffic = the whole batch's dedup); a cached
row's gradient flows back through the exchange that fetched it (under the fused exchange all
micro-batches' row gradients go back in one reverse exchange per window). Gradients of all micro-batches
are summed on one tape, so there is one dense all-reduce and one sparse update per batch. Under
the fused exchange (`fit`, `TrainPipeline`) the exchange keeps the window itself, once per batch
and table group (`fused_exchange`); `WindowFetcher` keeps it per table for `strategy.run` loops.

Custom loops:

    with tf.GradientTape() as tape, tnp.pipeline.frozen_window():
        loss = tf.add_n([loss_fn(mb) * share for mb, share in tnp.pipeline.split_batch(batch, M)])
"""
import contextlib

import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.pipeline import clustering
from tf_nestpipe.sharding.fetch import RowFetcher, current_fetcher, installed


class WindowCache:
    """Ids fetched so far in this window and their rows, per table."""

    def __init__(self):
        self.keys = {}
        self.rows = {}


class WindowFetcher(RowFetcher):
    """Within a frozen window: each lookup of a row-wise table asks the fetcher it wraps only
    for the ids no earlier lookup of that table in the window fetched."""

    def __init__(self, inner):
        self.inner = inner
        self.cache = WindowCache()

    def lookup(self, layer, flat_ids):
        if not layer.exchanged:
            return self.inner.lookup(layer, flat_ids)
        return windowed_lookup(self.cache, layer.name, flat_ids,
                               lambda ids: self.inner.lookup(layer, ids), layer.dim,
                               layer.embeddings.dtype)


@contextlib.contextmanager
def frozen_window():
    """Within this context, sharded lookups of the same table share a frozen window: each id is
    fetched once, by the first lookup that reads it. Use it around the micro-batches of one
    batch, before the batch's update. Under the fused exchange (a `TrainPipeline` pass) the
    exchange keeps the window itself, once per batch; otherwise (`strategy.run` loops) each
    table keeps a window cache (`WindowFetcher`)."""
    fetcher = current_fetcher()
    if hasattr(fetcher, "window"):
        with fetcher.window():
            yield None
        return
    with installed(WindowFetcher(fetcher)) as window_fetcher:
        yield window_fetcher.cache


def windowed_lookup(cache, name, ids, lookup, dim, dtype):
    """Rows for `ids` where `lookup(new_ids)` fetches only the ids not yet in `cache[name]`."""
    unique, inverse = tf.unique(ids, out_idx=tf.int32)
    cached_keys = cache.keys.get(name, tf.zeros([0], ids.dtype))
    cached_rows = cache.rows.get(name, tf.zeros([0, dim], dtype))
    new_keys, _ = tf.raw_ops.ListDiff(x=unique, y=cached_keys, out_idx=tf.int32)
    new_rows = lookup(new_keys)
    keys = tf.concat([cached_keys, new_keys], axis=0)
    rows = tf.concat([cached_rows, new_rows], axis=0)
    cache.keys[name], cache.rows[name] = keys, rows
    order = tf.argsort(keys)
    position = tf.gather(order, tf.searchsorted(tf.gather(keys, order), unique))
    # gather_rows: a dense segment-sum gradient (tf.gather's IndexedSlices would be densified
    # again by every earlier lookup's gradient).
    return ops.gather_rows(rows, tf.gather(position, inverse))


def batch_size_of(batch):
    """The number of samples (dimension 0) of a nested batch, as an int64 scalar."""
    first = tf.nest.flatten(batch, expand_composites=False)[0]
    if isinstance(first, tf.RaggedTensor):
        return first.nrows(out_type=tf.int64)
    return tf.shape(first, out_type=tf.int64)[0]


def cluster_batch(batch, cluster_keys, micro_batches):
    """`batch` with its samples reordered by key-centric clustering of `cluster_keys` (see
    `tf_nestpipe.pipeline.clustering`)."""
    permutation = clustering.cluster_permutation(cluster_keys, batch_size_of(batch), micro_batches)
    return tf.nest.map_structure(lambda t: tf.gather(t, permutation), batch)


def split_batch(batch, micro_batches, cluster_keys=None):
    """Splits every tensor (or ragged tensor) of `batch` along axis 0 into `micro_batches`
    contiguous parts; returns a list of (part, share) with share = part size / batch size.

    With `cluster_keys` (a list of the batch's id tensors, e.g. `clustering.integer_leaves(x)`)
    the samples are first reordered by key-centric clustering, so micro-batches share keys and
    the one with the fewest keys comes first."""
    if cluster_keys is not None:
        batch = cluster_batch(batch, cluster_keys, micro_batches)
    size = batch_size_of(batch)
    bounds = [size * j // micro_batches for j in range(micro_batches + 1)]
    sizes = tf.stack([bounds[j + 1] - bounds[j] for j in range(micro_batches)])
    shares = tf.unstack(tf.cast(sizes, tf.float32) / tf.cast(tf.maximum(size, 1), tf.float32),
                        num=micro_batches)

    def pieces(t):
        # A tensor is cut by one op (SplitV); a ragged one by a slice per part.
        if isinstance(t, tf.RaggedTensor):
            return [t[bounds[j]:bounds[j + 1]] for j in range(micro_batches)]
        return tf.split(t, sizes, num=micro_batches)

    flat = [pieces(t) for t in tf.nest.flatten(batch)]
    return [(tf.nest.pack_sequence_as(batch, [p[j] for p in flat]), shares[j])
            for j in range(micro_batches)]
