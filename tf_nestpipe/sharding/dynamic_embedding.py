"""`DynamicEmbedding`: an embedding table of raw int64 (or string) ids with no fixed vocabulary.

Each worker owns the ids `ops.dynamic_owner` maps to it (splitmix64 of the id's bits, mod W) and
keeps them in a hash table (`ops.DynamicTable`, a C++ resource) from id to a slot of its row
variable `[capacity_per_worker, dim]`, an ordinary trainable variable whose optimizer slots sit
beside it. Semantics (the same on any worker count, see ops/dynamic_table_ops.cc):

- A *training* lookup (`training=True`) is one step of the table: each owner admits the distinct
  ids it owns that the global batch looks up. An id is admitted in the `admission`-th step it
  appears in (1: at first sight); its row starts at `initial_rows(initializer, id)`, a function of
  (seed, id). When the owner's capacity is full, `eviction` ("lru" / "lfu") frees the slot of an
  id not seen in this step; `ttl_steps` > 0 removes ids not seen for that many steps. A reused
  slot restarts from the new id's initial row and fresh optimizer state.
- Ids not admitted (pending, or refused when every slot is taken by this step's ids) embed to a
  zero row and get no update; inference lookups (`training` False / None) never admit: unknown
  ids embed to zero rows there too.
- Call the layer once per training step (concatenate features that share the table): each call
  is a step of the table.
- Strings are hashed to int64 ids with `tf.strings.to_hash_bucket_fast(s, 2**63 - 1)` (FarmHash
  Fingerprint64 mod 2^63 - 1).

The counters (admitted, evicted, expired, refused, pending) are `table_stats()`.
"""
import contextlib

import numpy as np
import tensorflow as tf
import tf_keras

from tf_nestpipe.ops.dynamic_table import STAT_NAMES, DynamicTable
from tf_nestpipe.sharding.dynamic_init import check_dynamic_initializer, initial_rows
from tf_nestpipe.sharding.dynamic_lookup import dynamic_lookup
from tf_nestpipe.sharding.dynamic_state import DynamicTableSaveable, all_gather_ragged
from tf_nestpipe.sharding.dynamic_slots import FreshSlots, mark_dynamic_rows
from tf_nestpipe.sharding.embedding import COMBINERS, embedding_exchange_of
from tf_nestpipe.sharding.fetch import current_fetcher
from tf_nestpipe.sharding.layout import ShardLayout
from tf_nestpipe.sharding.row_shard import creating_row_shard

STRING_HASH_BUCKETS = 2 ** 63 - 1


def string_ids(strings):
    """The int64 ids of string keys (see module)."""
    return tf.strings.to_hash_bucket_fast(strings, STRING_HASH_BUCKETS)


# Registered: `.keras` / `.h5` model files and `from_config` find it with no `custom_objects`.
@tf_keras.utils.register_keras_serializable(package="tf_nestpipe")
class DynamicEmbedding(tf_keras.layers.Layer):
    """Embedding of raw int64 / string ids with admission and eviction (see module).

    Inputs: ids `[batch]` / `[batch, k]` or ragged `[batch, None]` (needs a combiner). With
    `combiner=None` the output is `ids.shape + [dim]`; "sum" / "mean" pool the last id axis.
    Create it under `NestPipeStrategy.scope()` (one worker works too).

    Args:
        dim: The embedding dimension.
        combiner: None, "sum" or "mean" (pools the last id axis; needed for ragged ids).
        embeddings_initializer: A tf_keras initializer; an admitted id's first row depends only
            on (its seed, the id), at any worker count.
        capacity_per_worker: Rows each worker's hash table holds.
        admission: An id is admitted the `admission`-th step it is seen in (1: at once).
        eviction: "lru" or "lfu": which id a full table evicts for a new one.
        ttl_steps: Ids unseen for this many steps are removed (0: never).
        counter_capacity: Ids pending admission that are counted (default: the capacity).
        **kwargs: tf_keras `Layer` arguments (`name`, ...).

    Raises:
        ValueError: A bad argument, naming it; or the layer is built outside a
            `NestPipeStrategy` scope.
    """

    def __init__(self, dim, combiner=None, embeddings_initializer=None, capacity_per_worker=65536,
                 admission=1, eviction="lru", ttl_steps=0, counter_capacity=None, **kwargs):
        super().__init__(**kwargs)
        if combiner not in COMBINERS:
            raise ValueError("combiner must be one of %s, got %r" % (COMBINERS, combiner))
        if int(dim) < 1:
            raise ValueError("dim must be positive, got %r" % (dim,))
        self.dim = int(dim)
        self.combiner = combiner
        self.embeddings_initializer = check_dynamic_initializer(
            embeddings_initializer or tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=0),
            self.name)
        strategy = tf.distribute.get_strategy()
        exchange = embedding_exchange_of(strategy)
        if exchange is None:
            raise ValueError(
                "DynamicEmbedding '%s' must be created under tnp.NestPipeStrategy().scope() "
                "(one worker works too): the strategy resets the optimizer state of reused "
                "slots and routes ids to their owners." % self.name)
        self._strategy = strategy
        self.num_workers = strategy.num_workers
        self.worker_index = strategy.worker_index
        self.capacity_per_worker = int(capacity_per_worker)
        self.admission, self.eviction, self.ttl_steps = int(admission), eviction, int(ttl_steps)
        self.counter_capacity = counter_capacity
        # Held by a plain object, untracked: a SavedModel of the Keras model must not need the
        # custom op (tnp.export_saved_model serves the table with core ops).
        self._table_holder = _Holder(DynamicTable(
            self.capacity_per_worker, admit_after=self.admission, policy=eviction,
            ttl=self.ttl_steps, counter_capacity=counter_capacity, name=self.name))
        # Every worker's slots as one "table" of capacity * W rows (slot s of worker i is row
        # s * W + i): the row variable is a row shard of it, never all-reduced.
        self.layout = ShardLayout(self.capacity_per_worker * self.num_workers, self.dim,
                                  self.num_workers, self.worker_index)
        self._fresh = FreshSlots(exchange.collectives.device, self.name, layer=self)
        self.table_state = DynamicTableSaveable(self)  # checkpointed beside the rows
        self._training_graphs = []

    @property
    def table(self):
        """This worker's `ops.DynamicTable` (kept out of Keras tracking: see `checkpointed`)."""
        return self._table_holder.table

    def build(self, input_shape):
        scope = self._strategy.scope() if not tf.distribute.has_strategy() else contextlib.nullcontext()
        with scope, creating_row_shard(self.layout):
            self.rows = self.add_weight(name="rows", shape=(self.capacity_per_worker, self.dim),
                                        initializer="zeros", trainable=True)
        mark_dynamic_rows(self.rows, self._fresh)
        super().build(input_shape)

    def collectives(self):
        """The strategy's collectives."""
        return embedding_exchange_of(self._strategy).collectives

    # --- lookup --------------------------------------------------------------------------------
    def owner_rows(self, ids, training):
        """This worker's rows of the distinct ids it owns: the hash-table step (training) or a
        find, fresh slots initialized, zero rows where not admitted.

        Args:
            ids: `[u]` int64 distinct ids this worker owns.
            training: Whether this is the step of the table (admission, eviction, counters).

        Returns:
            `[u, dim]` rows."""
        if training:
            slots, fresh = self.table.admit(ids)
            fresh_slots = tf.boolean_mask(slots, fresh)
            init = self.rows.scatter_update(tf.IndexedSlices(
                initial_rows(self.embeddings_initializer, tf.boolean_mask(ids, fresh), self.dim),
                fresh_slots))
            deps = [init, self._fresh.record(fresh_slots)]
        else:
            slots, deps = self.table.find(ids), []
        with tf.control_dependencies(deps):
            valid = slots >= 0
            gathered = tf.gather(self.rows, tf.boolean_mask(slots, valid))
            positions = tf.where(valid)
            return tf.scatter_nd(positions, gathered,
                                 tf.stack([tf.size(ids, out_type=tf.int64), self.dim]))

    def direct_lookup(self, flat_ids, training=False):
        """The lookup itself: route to the owners, their table step, rows back.

        Args:
            flat_ids: `[n]` int64 (or string) ids.
            training: Whether this is the step of the table.

        Returns:
            `[n, dim]` rows (zero where an id is not admitted)."""
        return dynamic_lookup(lambda ids: self.owner_rows(ids, training), flat_ids, self.dim,
                              self.num_workers, self.worker_index, self.collectives(),
                              "nestpipe/dynamic/" + self.name)

    def _check_once_per_step(self):
        if tf.executing_eagerly():
            return
        graph = tf.compat.v1.get_default_graph()
        if any(g is graph for g in self._training_graphs):
            raise ValueError(
                "DynamicEmbedding '%s' is looked up twice in one training step: each training "
                "lookup is a step of the table (admission, eviction). Concatenate the ids of the "
                "features sharing the table into one call." % self.name)
        self._training_graphs.append(graph)

    def _lookup(self, flat_ids, training):
        # The installed fetcher decides: the lookup itself (no pipeline, the step of a DBP
        # pipeline; in fit's frozen window one lookup of all the micro-batches' ids), zeros (a
        # route pass: dynamic tables are not prefetched), a core-op gather (export) or a refusal
        # naming the fix (sharding/fetch.py).
        return current_fetcher().lookup_dynamic(_LookupView(self, training), flat_ids)

    def call(self, inputs, training=None):
        return self._embed(inputs, bool(training))

    def _embed(self, inputs, training):
        ragged = isinstance(inputs, tf.RaggedTensor)
        if isinstance(inputs, tf.SparseTensor):
            raise ValueError("DynamicEmbedding '%s' takes dense or ragged ids; convert the "
                             "SparseTensor with tf.RaggedTensor.from_sparse" % self.name)
        values = inputs.flat_values if ragged else inputs
        if values.dtype == tf.string:
            ids = string_ids(values)
        elif values.dtype.is_integer:
            ids = tf.cast(values, tf.int64)
        else:
            raise ValueError("DynamicEmbedding '%s' takes integer or string ids, got %s"
                             % (self.name, values.dtype.name))
        rows = self._lookup(tf.reshape(ids, [-1]), training)
        if ragged:
            if self.combiner is None or inputs.ragged_rank != 1:
                raise ValueError("DynamicEmbedding '%s' got ragged ids: set combiner='sum' or "
                                 "'mean' and pass [batch, None] ids" % self.name)
            pooled = tf.math.unsorted_segment_sum(rows, inputs.value_rowids(), inputs.nrows())
            if self.combiner == "mean":
                counts = tf.cast(tf.maximum(inputs.row_lengths(), 1), pooled.dtype)
                pooled = pooled / counts[:, None]
            return pooled
        out = tf.reshape(rows, tf.concat([tf.shape(ids), [self.dim]], axis=0))
        if self.combiner is None:
            return out
        if ids.shape.rank is not None and ids.shape.rank < 2:
            raise ValueError("DynamicEmbedding '%s' with combiner=%r needs ids of rank >= 2, got "
                             "shape %s" % (self.name, self.combiner, ids.shape))
        return tf.reduce_sum(out, -2) if self.combiner == "sum" else tf.reduce_mean(out, -2)

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if self.combiner is None:
            return input_shape.concatenate([self.dim])
        return input_shape[:-1].concatenate([self.dim])

    # --- state ---------------------------------------------------------------------------------
    def table_stats(self):
        """This worker's counters (dict of `STAT_NAMES`), eager."""
        return self.table.stats_dict()

    def global_table_stats(self):
        """The counters summed over the workers (a collective: every worker calls it); "step"
        is the table's step count."""
        local = self.table.stats()
        total = tf.reduce_sum(self.collectives().all_gather(
            local[None, :], "nestpipe/dynamic_stats/" + self.name), axis=0).numpy()
        stats = dict(zip(STAT_NAMES, (int(v) for v in total)))
        stats["step"] = int(local.numpy()[STAT_NAMES.index("step")])
        return stats

    def full_table(self):
        """`(ids, rows)`: every admitted id (ascending) and its row, from all workers (a
        collective: every worker calls it at the same point). NumPy arrays."""
        state = self.table.export()
        rows = tf.gather(self.rows, state.entries[:, 0])
        (ids, rows), _ = all_gather_ragged([state.ids, rows], self.collectives(),
                                           self.num_workers, "nestpipe/dynamic_full/" + self.name)
        order = np.argsort(ids, kind="stable")
        return ids[order], rows[order]

    def get_config(self):
        config = super().get_config()
        config.update({"dim": self.dim, "combiner": self.combiner,
                       "embeddings_initializer": tf_keras.initializers.serialize(
                           self.embeddings_initializer),
                       "capacity_per_worker": self.capacity_per_worker,
                       "admission": self.admission, "eviction": self.eviction,
                       "ttl_steps": self.ttl_steps, "counter_capacity": self.counter_capacity})
        return config


class _Holder:
    """Keeps the table resource out of Keras / checkpoint tracking."""

    def __init__(self, table):
        self.table = table


class _LookupView:
    """The layer as a fetcher sees it for one lookup: `direct_lookup` admits when training."""

    def __init__(self, layer, training):
        self.layer = layer
        self.training = training
        self.name = layer.name
        self.dim = layer.dim
        self.rows = layer.rows

    def direct_lookup(self, flat_ids):
        if not self.training:
            return self.layer.direct_lookup(flat_ids, training=False)
        self.layer._check_once_per_step()  # pylint: disable=protected-access
        return self.layer.direct_lookup(flat_ids, training=True)
