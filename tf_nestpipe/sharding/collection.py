"""`ShardedEmbeddingCollection`: many single-hot tables served by one fused lookup per step.

The tables are stacked into one row-sharded table (table f's id k is fused row
`offset[f] + k`), so even a `strategy.run` loop (where each table has its own exchange) issues
one key all-to-all and one row all-to-all (plus one in backward) for all of them. Under `fit`
and `TrainPipeline` separate `ShardedEmbedding` layers of one dim share one exchange too.
"""
import numpy as np
import tensorflow as tf
import tf_keras

from tf_nestpipe.sharding.embedding import ShardedEmbedding


# Registered: `.keras` / `.h5` model files and `from_config` find it with no `custom_objects`.
@tf_keras.utils.register_keras_serializable(package="tf_nestpipe")
class ShardedEmbeddingCollection(tf_keras.layers.Layer):
    """Embeds `ids[:, f]` in table f (sizes `table_sizes`) for `[batch, F]` int ids -> `[batch, F, dim]`.

    The fused `[sum(table_sizes), dim]` table is initialized as one table by
    `embeddings_initializer`. Ids outside `[0, table_sizes[f])` raise an error naming the layer
    (with the offending values), or embed to zero with `invalid_id_policy="zero"`.

    Args:
        table_sizes: Rows of each feature's table.
        dim: The embedding dimension (shared).
        embeddings_initializer: A tf_keras initializer for the fused table.
        invalid_id_policy: "error" (default) or "zero".
        **kwargs: tf_keras `Layer` arguments (`name`, ...).

    Raises:
        ValueError: Empty or non-positive `table_sizes`; at call time, ids not `[batch, F]`.
    """

    def __init__(self, table_sizes, dim, embeddings_initializer="uniform", invalid_id_policy="error",
                 **kwargs):
        super().__init__(**kwargs)
        self.table_sizes = [int(s) for s in table_sizes]
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise ValueError("table_sizes must be a non-empty list of positive sizes, got %r"
                             % (table_sizes,))
        self.dim = int(dim)
        self.invalid_id_policy = invalid_id_policy
        self.offsets = np.concatenate([[0], np.cumsum(self.table_sizes)[:-1]]).astype(np.int64)
        self.fused = ShardedEmbedding(sum(self.table_sizes), dim,
                                      embeddings_initializer=embeddings_initializer,
                                      invalid_id_policy=invalid_id_policy,
                                      name=(self.name + "_fused"))

    def call(self, ids):
        return self._embed(ids)

    def _embed(self, ids):
        ids = tf.cast(ids, tf.int64)
        num_fields = len(self.table_sizes)
        if ids.shape.rank != 2 or (ids.shape[1] is not None and ids.shape[1] != num_fields):
            raise ValueError("ShardedEmbeddingCollection '%s' expects ids of shape [batch, %d], got %s"
                             % (self.name, num_fields, ids.shape))
        sizes = tf.constant(self.table_sizes, tf.int64)
        valid = tf.logical_and(ids >= 0, ids < sizes[None, :])
        if self.invalid_id_policy == "error":
            check = tf.debugging.Assert(
                tf.reduce_all(valid),
                ["ShardedEmbeddingCollection '%s': ids out of range of table sizes %s. Fix the "
                 "input pipeline or use invalid_id_policy='zero'. Offending (row, field) and ids:"
                 % (self.name, self.table_sizes), tf.where(tf.logical_not(valid)),
                 tf.boolean_mask(ids, tf.logical_not(valid))], summarize=20)
            with tf.control_dependencies([check]):
                fused_ids = ids + tf.constant(self.offsets)[None, :]
        else:
            fused_ids = tf.where(valid, ids + tf.constant(self.offsets)[None, :], -1)
        return self.fused(fused_ids)

    @property
    def embeddings(self):
        """The fused row-shard variable."""
        return self.fused.embeddings

    def tables(self):
        """The full tables as a list of NumPy arrays (a collective: call on every worker)."""
        full = self.fused.full_table()
        return [full[o:o + s] for o, s in zip(self.offsets, self.table_sizes)]

    def get_config(self):
        config = super().get_config()
        config.update({"table_sizes": self.table_sizes, "dim": self.dim,
                       "embeddings_initializer": tf_keras.initializers.serialize(
                           self.fused.embeddings_initializer),
                       "invalid_id_policy": self.invalid_id_policy})
        return config
