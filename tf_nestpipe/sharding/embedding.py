"""`ShardedEmbedding`: a tf_keras embedding layer whose table a NestPipeStrategy places over its
workers (row-sharded, whole on one worker, or replicated: the strategy's planner decides)."""
import contextlib
import weakref

import numpy as np
import tensorflow as tf
import tf_keras

from tf_nestpipe import ops
from tf_nestpipe.sharding import partitioners
from tf_nestpipe.sharding.fetch import current_fetcher
from tf_nestpipe.sharding.full_table import gather_full_rows
from tf_nestpipe.sharding.initializers import RowShardInitializer
from tf_nestpipe.sharding.layout import ShardLayout
from tf_nestpipe.sharding.lookup import sharded_lookup
from tf_nestpipe.sharding.row_shard import creating_row_shard, mark_replicated_table
from tf_nestpipe.sharding.tables import FusedTables
from tf_nestpipe import tf_private

COMBINERS = (None, "sum", "mean")


def embedding_exchange_of(strategy):
    """The `EmbeddingExchange` of a strategy that places row-wise tables (NestPipeStrategy),
    else None."""
    return getattr(getattr(strategy, "extended", None), "embedding_exchange", None)

INVALID_ID_POLICIES = ("error", "zero")
# The placement (chosen by the strategy's planner, tf_nestpipe.plan.placement) under which the
# table is an ordinary mirrored variable on every worker, looked up with a local gather.
DATA_PARALLEL = "data_parallel"
# The placement under which the whole table is one worker's row shard (`ShardLayout.owner_shard`),
# looked up through the same fused exchange as the row-wise tables.
TABLE_WISE = "table_wise"


# The multi-worker strategies of this process (see `register_multi_worker_strategy`).
_multi_worker_strategies = weakref.WeakSet()


def register_multi_worker_strategy(strategy):
    """Records `strategy`, a strategy of several workers whose tables this layer shards: a
    `ShardedEmbedding` built outside its scope (and outside any other strategy's) is refused,
    since each worker would silently train a model of its own."""
    _multi_worker_strategies.add(strategy)


def _check_not_outside_the_scope(layer):
    strategies = [s for s in _multi_worker_strategies if s.num_workers > 1]
    if strategies and not tf.distribute.has_strategy():
        raise ValueError(
            "ShardedEmbedding '%s' is built outside the scope of the %d-worker %s: each worker "
            "would train a model of its own and no table would be sharded. Create the model "
            "(and compile it) inside `with strategy.scope():`." % (
                layer.name, strategies[0].num_workers, type(strategies[0]).__name__))


def placement_of(strategy, layer):
    """The placement `strategy` gives `layer`'s table ("row_wise" for a strategy without a
    planner)."""
    place = getattr(getattr(strategy, "extended", None), "placement_of", None)
    return place(layer) if place is not None else "row_wise"


def table_owner_of(strategy, layer):
    """The worker `strategy`'s planner put `layer`'s table_wise table on."""
    return strategy.extended.table_owner(layer)


class ShardedTableLayer:
    """What a sharded embedding layer does, whichever Keras it is a layer of: placement at
    build, lookups through the installed fetcher, whole-table reads. A concrete layer mixes it
    into a Keras `Layer` class and defines the Keras-specific `_get_initializer`,
    `_serialize_initializer` and `_add_table_weight` (see `ShardedEmbedding`, and
    `tf_nestpipe.keras3.ShardedEmbedding` for Keras 3)."""

    def __init__(self, vocab_size, dim, combiner=None, embeddings_initializer="uniform",
                 invalid_id_policy="error", **kwargs):
        # As tf_keras' Embedding: under a mixed precision policy the table stays in its variable
        # dtype (every lookup path, local or exchanged, reads the same rows), and the output is
        # cast to the compute dtype.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if combiner not in COMBINERS:
            raise ValueError("combiner must be one of %s, got %r" % (COMBINERS, combiner))
        if invalid_id_policy not in INVALID_ID_POLICIES:
            raise ValueError("invalid_id_policy must be one of %s, got %r"
                             % (INVALID_ID_POLICIES, invalid_id_policy))
        if int(vocab_size) < 1 or int(dim) < 1:
            raise ValueError("vocab_size and dim must be positive, got %r and %r" % (vocab_size, dim))
        self.vocab_size = int(vocab_size)
        self.dim = int(dim)
        self.combiner = combiner
        self.invalid_id_policy = invalid_id_policy
        self.embeddings_initializer = self._get_initializer(embeddings_initializer)
        self.layout = None
        self.placement = None  # set when built under a NestPipeStrategy
        # The strategy whose scope the layer was created in; its variables are built there even
        # if the layer is first called outside the scope.
        current = tf.distribute.get_strategy()
        self._strategy = current if embedding_exchange_of(current) is not None else None
        announce = getattr(getattr(self._strategy, "extended", None), "announce_table", None)
        if announce is not None:
            announce(self)  # planned with the tables constructed with it (see placement_of)
        # Parameter-server mode: the table is a ShardedVariable on the ps tasks, its rows laid
        # out by the strategy's partitioner ("div": contiguous ranges, "mod": round-robin).
        self._ps_row_order = None
        if isinstance(current, tf.distribute.ParameterServerStrategy):
            self._ps_row_order = partitioners.row_order(
                tf_private.variable_partitioner(current.extended))

    def build(self, input_shape):
        if self._ps_row_order is not None:
            self.layout = ShardLayout(self.vocab_size, self.dim)
            # Created in the scope: the strategy shards it over the ps tasks.
            self.embeddings = self._add_table_weight((self.vocab_size, self.dim),
                                                     self.embeddings_initializer)
            super().build(input_shape)
            return
        if self._strategy is None and embedding_exchange_of(tf.distribute.get_strategy()):
            self._strategy = tf.distribute.get_strategy()
        if self._strategy is None:
            _check_not_outside_the_scope(self)
        scope = creation = contextlib.nullcontext()
        if self._strategy is not None:
            self.placement = placement_of(self._strategy, self)
            if self.placement == DATA_PARALLEL:
                # The whole table, mirrored on every worker like a dense weight.
                self.layout = ShardLayout(self.vocab_size, self.dim)
            else:
                owner = (table_owner_of(self._strategy, self) if self.placement == TABLE_WISE
                         else None)
                self.layout = ShardLayout(self.vocab_size, self.dim, self._strategy.num_workers,
                                          self._strategy.worker_index, owner_shard=owner)
                creation = creating_row_shard(self.layout)
            # Re-enter the scope only when called outside it (entering is illegal in a replica).
            if not tf.distribute.has_strategy():
                scope = self._strategy.scope()
        else:
            self.layout = ShardLayout(self.vocab_size, self.dim)
        with scope, creation:
            self.embeddings = self._add_table_weight(
                (self.layout.local_rows, self.dim),
                RowShardInitializer(self.embeddings_initializer, self.layout))
        if self.placement == DATA_PARALLEL:
            mark_replicated_table(self.embeddings, self.name)
        if self.exchanged:
            embedding_exchange_of(self._strategy).register(self)
        super().build(input_shape)

    @property
    def exchanged(self):
        """Whether lookups of this table go through an exchange between workers (a row-wise or
        table-wise table of a NestPipeStrategy with more than one worker)."""
        return (self._strategy is not None and self._ps_row_order is None
                and self.layout is not None and self.layout.num_shards > 1)

    def collectives(self):
        """The strategy's collectives (None outside a NestPipeStrategy)."""
        exchange = embedding_exchange_of(self._strategy)
        return exchange.collectives if exchange is not None else None

    @property
    def checked_vocab_size(self):
        """The vocabulary a lookup's ids are checked against (an error naming the table and the
        id), or 0: with invalid_id_policy="zero" they were already mapped into it."""
        return self.vocab_size if self.invalid_id_policy == "error" else 0

    def checked_ids(self, flat_ids):
        """`flat_ids` after checking they lie in the vocabulary (see `checked_vocab_size`).

        Args:
            flat_ids: `[n]` int ids.

        Returns:
            The ids (with `invalid_id_policy="zero"`, out-of-range ones mapped to a zero row).

        Raises:
            tf.errors.InvalidArgumentError: An id out of range under "error", naming the
                table and the id (when the step runs)."""
        if not self.checked_vocab_size:
            return flat_ids
        return ops.check_ids(flat_ids, self.vocab_size, self.name)

    def direct_lookup(self, flat_ids):
        """This table's own lookup, fused with no other: its exchange (row-wise, several
        workers), a local gather (one worker), or the gather from the ps shards.

        Args:
            flat_ids: `[n]` int ids, checked.

        Returns:
            `[n, dim]` rows."""
        if self._ps_row_order is not None:
            return self._parameter_server_lookup(flat_ids)
        if not self.exchanged:
            return sharded_lookup(FusedTables([self], 1, 0), flat_ids, None, self.name, None)
        exchange = embedding_exchange_of(self._strategy)
        tables = FusedTables([self], self.layout.num_shards, self.layout.shard_index)
        if self.layout.table_wise:
            # The route checks fused ids: a table-wise table's are not its own, so its ids are
            # checked (and named in the error) before they are fused.
            flat_ids = self.checked_ids(flat_ids)
        return sharded_lookup(tables, tables.fuse(self, flat_ids), exchange.collectives, self.name,
                              exchange.capacity_hint(self.name), exchange.wire)

    def _lookup(self, flat_ids):
        valid = None
        if self.invalid_id_policy == "zero":
            valid = tf.logical_and(flat_ids >= 0, flat_ids < self.vocab_size)
            flat_ids = tf.where(valid, flat_ids, tf.zeros_like(flat_ids))
        flat_ids = tf.reshape(flat_ids, [-1])
        # The installed fetcher answers: this table's own lookup unless a pipeline, a frozen
        # window, DOWNPOUR's route pass or an export installed another (sharding/fetch.py).
        rows = current_fetcher().lookup(self, flat_ids)
        if valid is not None:
            rows = rows * tf.cast(valid, rows.dtype)[:, None]
        return rows

    def _table_shards(self):
        """The table's shard variables in order (one if the partitioner did not split it)."""
        return list(getattr(self.embeddings, "variables", [self.embeddings]))

    def _parameter_server_lookup(self, flat_ids):
        """Rows of `flat_ids` from the ps shards (the gradient is an IndexedSlices per shard)."""
        return partitioners.gather_shard_rows(self._table_shards(), self.checked_ids(flat_ids),
                                              self._ps_row_order)

    def call(self, inputs):
        out = self._embed(inputs)
        if out.dtype != self.compute_dtype:
            out = tf.cast(out, self.compute_dtype)
        return out

    def _embed(self, inputs):
        if isinstance(inputs, tf.RaggedTensor):
            if self.combiner is None:
                raise ValueError("ShardedEmbedding '%s' got ragged ids; set combiner='sum' or "
                                 "'mean' to pool them" % self.name)
            if inputs.ragged_rank != 1:
                raise ValueError("ShardedEmbedding '%s' expects [batch, None] ragged ids, got "
                                 "ragged_rank %d" % (self.name, inputs.ragged_rank))
            ids = tf.cast(inputs.flat_values, tf.int64)
            rows = self._lookup(ids)
            segments = inputs.value_rowids()
            num = inputs.nrows()
            pooled = tf.math.unsorted_segment_sum(rows, segments, num)
            if self.combiner == "mean":
                counts = tf.cast(tf.maximum(inputs.row_lengths(), 1), pooled.dtype)
                pooled = pooled / counts[:, None]
            return pooled
        if isinstance(inputs, tf.SparseTensor):
            raise ValueError("ShardedEmbedding '%s' takes dense or ragged ids; convert the "
                             "SparseTensor with tf.RaggedTensor.from_sparse" % self.name)
        ids = tf.cast(inputs, tf.int64)
        rows = self._lookup(tf.reshape(ids, [-1]))
        out = tf.reshape(rows, tf.concat([tf.shape(ids), [self.dim]], axis=0))
        if self.combiner is None:
            return out
        if ids.shape.rank is not None and ids.shape.rank < 2:
            raise ValueError("ShardedEmbedding '%s' with combiner=%r needs ids of rank >= 2, "
                             "got shape %s" % (self.name, self.combiner, ids.shape))
        if self.combiner == "sum":
            return tf.reduce_sum(out, axis=-2)
        return tf.reduce_mean(out, axis=-2)

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if self.combiner is None:
            return input_shape.concatenate([self.dim])
        return input_shape[:-1].concatenate([self.dim])

    def full_table(self):
        """Returns the whole `[vocab_size, dim]` table as a NumPy array (under NestPipeStrategy a
        collective: call it on every worker at the same point; in parameter-server mode, read
        from the ps tasks by the chief)."""
        layout = self.layout
        if self._ps_row_order is not None:
            shards = [v.numpy() for v in self._table_shards()]
            if self._ps_row_order == partitioners.ROW_ORDER_MOD and len(shards) > 1:
                full = np.zeros((self.vocab_size, self.dim), shards[0].dtype)
                for k, shard in enumerate(shards):
                    full[k::len(shards)] = shard
                return full
            return np.concatenate(shards, axis=0)
        return gather_full_rows(self.embeddings, layout, self.collectives(),
                                self.name + "/full_table").numpy()

    def get_config(self):
        config = super().get_config()
        config.update({
            "vocab_size": self.vocab_size,
            "dim": self.dim,
            "combiner": self.combiner,
            "embeddings_initializer": self._serialize_initializer(self.embeddings_initializer),
            "invalid_id_policy": self.invalid_id_policy,
        })
        return config


# Registered: `.keras` / `.h5` model files and `from_config` find it with no `custom_objects`.
@tf_keras.utils.register_keras_serializable(package="tf_nestpipe")
class ShardedEmbedding(ShardedTableLayer, tf_keras.layers.Layer):
    """Embedding table placed over the workers of a `NestPipeStrategy` by its planner: row-sharded
    (owner = id mod W), whole on one worker, or replicated (see `self.placement`).

    Outside a NestPipeStrategy scope it is an ordinary embedding. Inputs: int ids `[batch]` or
    `[batch, k]`, or a `tf.RaggedTensor` `[batch, None]` of multi-hot ids. With `combiner=None`
    the output is `ids.shape + [dim]` (ragged inputs need a combiner); `"sum"` / `"mean"` pool
    the last id axis into `[batch, dim]`. Ids outside `[0, vocab_size)` raise an error naming the
    table and the id (`invalid_id_policy="error"`, default) or embed to zero vectors that get no
    gradient (`invalid_id_policy="zero"`). The strategy's planner places the table when it is
    built (`self.placement`): "row_wise" (row shards, the exchange), "table_wise" (the whole
    table on one worker, `self.layout.owner_shard`, looked up through the same exchange) or
    "data_parallel" (a mirrored whole table, local gathers; see
    `NestPipeStrategy(placement=...)`, "auto" by default: small tables replicated).

    Args:
        vocab_size: Rows of the table (ids in `[0, vocab_size)`).
        dim: The embedding dimension.
        combiner: None, "sum" or "mean" (pools the last id axis; needed for ragged ids).
        embeddings_initializer: A tf_keras initializer (name or object); the standard ones
            fill each worker's rows with exactly the values the whole table would hold.
        invalid_id_policy: "error" (default) or "zero".
        **kwargs: tf_keras `Layer` arguments (`name`, ...).

    Raises:
        ValueError: A bad argument, naming it; at call time, ids of the wrong shape or kind.
    """

    # tf_keras specifics of `ShardedTableLayer`.
    def _get_initializer(self, identifier):
        return tf_keras.initializers.get(identifier)

    def _serialize_initializer(self, initializer):
        return tf_keras.initializers.serialize(initializer)

    def _add_table_weight(self, shape, initializer):
        return self.add_weight(name="embeddings", shape=shape, initializer=initializer,
                               trainable=True, experimental_autocast=False)
