"""`ShardedEmbedding` for Keras 3 (`import keras`, TensorFlow backend): the same table as the
tf_keras layer (`tf_nestpipe.ShardedEmbedding`), placed and looked up by the same code
(`tf_nestpipe.sharding.embedding.ShardedTableLayer`), as a `keras.layers.Layer`."""
import keras
import numpy as np

import tensorflow as tf

from tf_nestpipe import tf_private
from tf_nestpipe.keras3 import feature_lookup
from tf_nestpipe.keras3.checks import refuse_parameter_server
from tf_nestpipe.sharding.embedding import ShardedTableLayer
from tf_nestpipe.sharding.row_shard import row_shard_layout


def own_rows_of(variable, value):
    """This worker's rows of `value` when `variable` (a Keras 3 variable) is a row shard and
    `value` is its whole table; else `value`.

    Raises:
        ValueError: `value` has neither this worker's row count nor the whole table's."""
    layout = row_shard_layout(getattr(variable, "value", variable))
    if layout is None or layout.num_shards == 1:
        return value
    value = np.asarray(value)
    if value.shape[:1] == (layout.local_rows,) and layout.local_rows != layout.vocab_size:
        return value  # already this worker's rows (a per-worker copy)
    if value.shape[:1] != (layout.vocab_size,):
        raise ValueError(
            "the value for %s has shape %s, but under NestPipeStrategy a row-sharded table's "
            "saved value is the whole table, %d rows (this worker holds %d of them)"
            % (variable.path if hasattr(variable, "path") else variable.name, value.shape,
               layout.vocab_size, layout.local_rows))
    return value[layout.global_ids()]


# Registered: `.keras` files and `from_config` find it with no `custom_objects`.
@keras.saving.register_keras_serializable(package="tf_nestpipe")
class ShardedEmbedding(ShardedTableLayer, keras.layers.Layer):
    """Keras 3 embedding table placed over the workers of a `NestPipeStrategy` by its planner:
    row-sharded (owner = id mod W), whole on one worker, or replicated (`self.placement`).

    The Keras 3 twin of `tf_nestpipe.ShardedEmbedding` (same arguments, placements, lookups and
    errors). Outside a NestPipeStrategy scope it is an ordinary embedding. Inputs: int ids
    `[batch]` or `[batch, k]` (`combiner=None` gives `ids.shape + [dim]`, `"sum"` / `"mean"`
    pool the last axis), or a `tf.RaggedTensor` `[batch, None]` with a combiner, called
    directly (Keras 3's functional inputs are dense). Its saved value (`model.save`,
    `save_weights`, `get_weights`) is the whole table on any worker count.

    Args:
        vocab_size: Rows of the table (ids in `[0, vocab_size)`).
        dim: The embedding dimension.
        combiner: None, "sum" or "mean".
        embeddings_initializer: A Keras 3 initializer (name or object); the standard ones
            fill each worker's rows with exactly the values the whole table would hold (give
            it a seed, or call `keras.utils.set_random_seed`, for the same table on every
            worker and in one process).
        invalid_id_policy: "error" (default) or "zero".
        **kwargs: Keras 3 `Layer` arguments (`name`, ...).

    Raises:
        ValueError: A bad argument, naming it; at call time, ids of the wrong shape or kind.
    """

    def __init__(self, vocab_size, dim, combiner=None, embeddings_initializer="uniform",
                 invalid_id_policy="error", **kwargs):
        refuse_parameter_server(tf.distribute.get_strategy(), "tnpk.ShardedEmbedding")
        super().__init__(vocab_size, dim, combiner=combiner,
                         embeddings_initializer=embeddings_initializer,
                         invalid_id_policy=invalid_id_policy, **kwargs)

    @property
    def embeddings(self):
        """The table's `tf.Variable` (this worker's rows under a row-wise placement); the Keras
        variable wrapping it is `self.embeddings_variable`."""
        variable = self.__dict__.get("embeddings_variable")
        return None if variable is None else variable.value

    @embeddings.setter
    def embeddings(self, variable):
        self.embeddings_variable = variable

    # Keras 3 specifics of `ShardedTableLayer`.
    def _get_initializer(self, identifier):
        return keras.initializers.get(identifier)

    def _serialize_initializer(self, initializer):
        return keras.initializers.serialize(initializer)

    def _add_table_weight(self, shape, initializer):
        # At once, even while Keras 3 builds the model symbolically (a subclassed model's first
        # fit): a deferred variable would be created after the row-shard context ended.
        with tf_private.keras3_eager_variable_creation():
            return self.add_weight(name="embeddings", shape=shape, initializer=initializer,
                                   trainable=True, autocast=False)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if self.combiner is None:
            return input_shape + (self.dim,)
        return input_shape[:-1] + (self.dim,)

    def compute_output_spec(self, inputs):
        # Keras 3 would otherwise trace `call` on symbolic inputs, and a lookup there would
        # join the strategy's exchange.
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=self.compute_dtype)

    def save_own_variables(self, store):
        """Saves the table: inside tf_nestpipe's Keras 3 saving (`model.save`, `save_weights`)
        the whole table (every worker calls it at the same point, as they all save)."""
        for i, variable in enumerate(self._trainable_variables + self._non_trainable_variables):
            store[str(i)] = variable.numpy()  # a row shard's numpy(): see row_shard_saving

    def load_own_variables(self, store):
        """Loads the table from `store` (the whole table, as saved on any worker count),
        keeping this worker's rows."""
        self._check_load_own_variables(store)
        for i, variable in enumerate(self._trainable_variables + self._non_trainable_variables):
            variable.assign(own_rows_of(variable, store[str(i)]))


# Registered: `.keras` files and `from_config` find it with no `custom_objects`. Its class name is
# keras-rs's: Keras files place a layer kept in a dict by its class name, so keras-rs's
# `DistributedEmbedding` keeps its tables at the same places with either class.
@keras.saving.register_keras_serializable(package="tf_nestpipe")
class EmbedReduce(ShardedEmbedding):
    """keras-rs's `keras_rs.layers.EmbedReduce` (an embedding pooled by a combiner) on a table
    placed over the workers of a `NestPipeStrategy`: the tables of keras-rs's
    `DistributedEmbedding` made in the strategy's scope.

    `[batch]` ids give their rows (with `weights` and "sum", scaled by them); `[batch, k]` ids
    (or a ragged `[batch, None]` / `tf.SparseTensor`) are pooled: summed with their `weights`
    (default 1), divided by the weights' sum ("mean") or the root of their squares' sum
    ("sqrtn").

    Args:
        input_dim: Rows of the table.
        output_dim: The embedding dimension.
        embeddings_initializer: A Keras 3 initializer (see `ShardedEmbedding`).
        combiner: "mean" (default), "sum" or "sqrtn".
        **kwargs: `ShardedEmbedding` / Keras `Layer` arguments (`name`, `invalid_id_policy`).

    Raises:
        ValueError: Another combiner.
    """

    def __init__(self, input_dim, output_dim, embeddings_initializer="uniform", combiner="mean",
                 **kwargs):
        if combiner not in feature_lookup.COMBINERS:
            raise ValueError("EmbedReduce: combiner must be one of %s, got %r"
                             % (feature_lookup.COMBINERS, combiner))
        super().__init__(input_dim, output_dim, combiner=None,
                         embeddings_initializer=embeddings_initializer, **kwargs)
        self.combiner = combiner  # the pooling's (the table's own lookups pool nothing)

    def call(self, inputs, weights=None):
        flat = feature_lookup.flatten_feature(inputs, weights, self.name)
        rows = self._lookup(flat.ids)
        if rows.dtype != self.compute_dtype:
            rows = tf.cast(rows, self.compute_dtype)
        return feature_lookup.pool(self.combiner, rows, flat)

    def compute_output_shape(self, input_shape, weights_shape=None):
        del weights_shape
        input_shape = tuple(input_shape)
        return input_shape + (self.dim,) if len(input_shape) <= 1 else (
            input_shape[:-1] + (self.dim,))

    def compute_output_spec(self, inputs, weights=None):
        del weights
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config["input_dim"], config["output_dim"] = config.pop("vocab_size"), config.pop("dim")
        return config
