"""Partitioners for parameter-server mode: callables `(shape, dtype, axis=0) -> [num partitions
per axis]`, the signature `tf.distribute.ParameterServerStrategy` takes.

`FixedShardsPartitioner`, `MinSizePartitioner` and `MaxSizePartitioner` behave as TensorFlow's
(they are subclasses); `max_shards=None` in `MinSizePartitioner` means "one shard per ps task",
filled in by `tnp.ParameterServerStrategy`. `ModShardsPartitioner` shards rows round-robin
(id k on shard k mod K) instead of in contiguous ranges, so the hot small ids of a Zipf-distributed
feature spread over all ps tasks; `ShardedEmbedding` reads such tables with the "mod" layout.
"""
import tensorflow as tf

_partitioners = tf.distribute.experimental.partitioners

ROW_ORDER_DIV = "div"
ROW_ORDER_MOD = "mod"


def row_order(partitioner):
    """How a partitioner lays out the rows of a sharded table: "div" (contiguous ranges, TF's
    ShardedVariable default) or "mod" (round-robin)."""
    return getattr(partitioner, "row_order", ROW_ORDER_DIV)


class FixedShardsPartitioner(_partitioners.FixedShardsPartitioner):
    """Splits every variable into `num_shards` shards along axis 0 (fewer if it has fewer rows)."""

    row_order = ROW_ORDER_DIV


class MaxSizePartitioner(_partitioners.MaxSizePartitioner):
    """As many shards as needed so that none exceeds `max_shard_bytes` (at most `max_shards`)."""

    row_order = ROW_ORDER_DIV


class _ShardsFromPsCount:
    """Mixin for a partitioner whose shard limit (`_ps_count_attr`, the argument `_ps_count_arg`)
    may be left as None to mean "the number of ps tasks", bound by the strategy."""

    _ps_count_attr = _ps_count_arg = None
    _unbound = False

    def bind(self, num_ps):
        """Fills in the limit left to the strategy with `num_ps`."""
        if self._unbound:
            setattr(self, self._ps_count_attr, int(num_ps))
            self._unbound = False

    def __call__(self, shape, dtype, axis=0):
        if self._unbound:
            raise ValueError("%s(%s=None) takes its shard count from the number of ps tasks: "
                             "pass it to tnp.ParameterServerStrategy, or set %s"
                             % (type(self).__name__, self._ps_count_arg, self._ps_count_arg))
        return super().__call__(shape, dtype, axis)


class MinSizePartitioner(_ShardsFromPsCount, _partitioners.MinSizePartitioner):
    """As many shards as possible with each at least `min_shard_bytes`, up to `max_shards`.

    Args:
        min_shard_bytes: The least bytes of a shard.
        max_shards: The most shards (None: the number of ps tasks, set by the strategy).
        bytes_per_string: Bytes assumed per element of a string variable."""

    row_order = ROW_ORDER_DIV
    _ps_count_attr, _ps_count_arg = "_max_shards", "max_shards"

    def __init__(self, min_shard_bytes=256 << 10, max_shards=None, bytes_per_string=16):
        self._unbound = max_shards is None
        super().__init__(min_shard_bytes=min_shard_bytes, max_shards=max_shards or 1,
                         bytes_per_string=bytes_per_string)


class ModShardsPartitioner(_ShardsFromPsCount, _partitioners.FixedShardsPartitioner):
    """Shards holding rows round-robin: row k on shard k mod num_shards, at position
    k // num_shards. Balances Zipf-hot ids across the ps tasks.

    Args:
        num_shards: The shard count (None: one per ps task, set by the strategy)."""

    row_order = ROW_ORDER_MOD
    _ps_count_attr, _ps_count_arg = "_num_shards", "num_shards"

    def __init__(self, num_shards=None):
        self._unbound = num_shards is None
        super().__init__(num_shards or 1)


def gather_shard_rows(shards, ids, row_order):
    """Rows `ids` (natural order) of a table split into `shards` laid out by `row_order`
    ("div": contiguous ranges, "mod": round-robin), each gathered on the shard that owns it."""
    if len(shards) == 1:
        return tf.gather(shards[0], ids)
    if row_order == ROW_ORDER_MOD:
        return tf.compat.v1.nn.embedding_lookup(shards, ids, partition_strategy="mod")
    return tf.nn.embedding_lookup(shards, ids)
