"""`DistributedEmbedding`: keras-rs's `keras_rs.layers.DistributedEmbedding` interface (its
`TableConfig` / `FeatureConfig`, feature structures in, embedding structures out), its tables
placed and sharded over the workers of a `NestPipeStrategy` by the strategy's planner.

keras-rs shards tables only on TPU SparseCore; on CPU and GPU it keeps one plain embedding per
table. Here every table is a `tf_nestpipe.keras3.ShardedEmbedding` (row-wise, table-wise or
replicated, as the strategy places it), looked up through the fused exchange with the model's
other tables. keras-rs is not needed to use it: a config is any object with the fields of
keras-rs's (`FeatureConfig.name / table / input_shape / output_shape`, `TableConfig.name /
vocabulary_size / embedding_dim / initializer / combiner`).
"""
import keras
import tensorflow as tf

from tf_nestpipe.keras3.layers import ShardedEmbedding

COMBINERS = ("mean", "sum")


def _check_table(table):
    if table.combiner not in COMBINERS:
        raise ValueError(
            "table %r: combiner %r is not supported by tf_nestpipe's DistributedEmbedding; use "
            "one of %s" % (table.name, table.combiner, COMBINERS))


class DistributedEmbedding(keras.layers.Layer):
    """Embeds and pools a (nested) structure of features with tables sharded by the
    `NestPipeStrategy` whose scope it is created in; the interface of
    `keras_rs.layers.DistributedEmbedding`.

    Each `FeatureConfig` names its `TableConfig`; features sharing a `TableConfig` share its
    table. A feature's ids are `[batch]` (one id: its row) or `[batch, k]` / a `[batch, None]`
    `tf.RaggedTensor` (pooled by the table's combiner, "mean" or "sum", optionally weighted).
    The output has the inputs' structure, each entry `[batch, embedding_dim]`.

    `TableConfig.optimizer` is not used: the tables train with the optimizer passed to
    `model.compile` (as keras-rs does off SparseCore). `TableConfig.placement` ("auto",
    "sparsecore", "default_device") is keras-rs's device choice; here the strategy's planner
    places every table (`NestPipeStrategy(placement=...)`).

    Args:
        feature_configs: A nested structure (dict, list, ...) of `keras_rs.layers.FeatureConfig`.
        table_stacking: Accepted for keras-rs compatibility; tables of one embedding dim
            travel in one fused exchange per step anyway.
        update_stats: Accepted for keras-rs compatibility (SparseCore statistics); unused.
        **kwargs: Keras `Layer` arguments.

    Raises:
        ValueError: A table with a combiner other than "mean" or "sum", or two tables of one
            name with different configs.
    """

    def __init__(self, feature_configs, *, table_stacking="auto", update_stats=False, **kwargs):
        super().__init__(**kwargs)
        self._feature_configs_structure = feature_configs
        paths = keras.tree.flatten_with_path(feature_configs)
        self._paths = [".".join(str(p) for p in path) for path, _ in paths]
        self._features = [config for _, config in paths]
        self.tables = {}
        for config in self._features:
            table = config.table
            _check_table(table)
            existing = self.tables.get(table.name)
            if existing is not None:
                if (existing.vocab_size, existing.dim) != (table.vocabulary_size,
                                                           table.embedding_dim):
                    raise ValueError("two tables are named %r with different sizes" % table.name)
                continue
            self.tables[table.name] = ShardedEmbedding(
                table.vocabulary_size, table.embedding_dim, combiner=None,
                embeddings_initializer=table.initializer, name=table.name)
        self.table_stacking = table_stacking
        self.update_stats = update_stats

    def build(self, input_shapes=None):
        for table in self.tables.values():
            if not table.built:
                table.build((None,))
        super().build(input_shapes)

    def preprocess(self, inputs, weights=None, training=False):
        """keras-rs's SparseCore preprocessing: nothing to do here; returns `inputs`."""
        del weights, training
        return inputs

    def _flat(self, ids, weights):
        """A feature's ids as `(flat ids, flat weights or None, segments, count)`; segments is
        None for one id per example (`[batch]` ids)."""
        if isinstance(ids, tf.RaggedTensor):
            w = None if weights is None else tf.reshape(weights.flat_values, [-1])
            return (tf.cast(ids.flat_values, tf.int64), w, ids.value_rowids(),
                    ids.nrows(out_type=tf.int64))
        ids = tf.cast(tf.convert_to_tensor(ids), tf.int64)
        w = None if weights is None else tf.reshape(weights, [-1])
        if ids.shape.rank == 1:
            return ids, w, None, None
        count = tf.shape(ids, out_type=tf.int64)[0]
        segments = tf.repeat(tf.range(count), tf.shape(ids, out_type=tf.int64)[1])
        return tf.reshape(ids, [-1]), w, segments, count

    def _pool(self, combiner, rows, flat):
        _, w, segments, count = flat
        if segments is None:  # one id per example: its row ("sum": times its weight)
            if w is not None and combiner == "sum":
                return rows * tf.cast(w, rows.dtype)[:, None]
            return rows
        w = tf.ones_like(rows[:, 0]) if w is None else tf.cast(w, rows.dtype)
        pooled = tf.math.unsorted_segment_sum(rows * w[:, None], segments, count)
        if combiner == "mean":
            pooled = tf.math.divide_no_nan(
                pooled, tf.math.unsorted_segment_sum(w, segments, count)[:, None])
        return pooled

    def call(self, inputs, weights=None, training=False):
        """Embeds `inputs` (the feature configs' structure of ids; optional `weights` of the
        same structure) into the same structure of `[batch, embedding_dim]` embeddings. The
        features of one table are looked up together (one lookup per table)."""
        del training
        flat_inputs = keras.tree.flatten(inputs)
        flat_weights = ([None] * len(flat_inputs) if weights is None
                        else keras.tree.flatten(weights))
        if len(flat_inputs) != len(self._features):
            raise ValueError("DistributedEmbedding got %d features, its configs name %d (%s)" % (
                len(flat_inputs), len(self._features), self._paths))
        flats = [self._flat(ids, w) for ids, w in zip(flat_inputs, flat_weights)]
        outputs = [None] * len(flats)
        for name, layer in self.tables.items():
            mine = [i for i, c in enumerate(self._features) if c.table.name == name]
            if not mine:
                continue
            rows = layer(tf.concat([flats[i][0] for i in mine], axis=0))
            parts = tf.split(rows, [tf.size(flats[i][0]) for i in mine], axis=0)
            for i, part in zip(mine, parts):
                outputs[i] = self._pool(self._features[i].table.combiner, part, flats[i])
        return keras.tree.pack_sequence_as(self._feature_configs_structure, outputs)

    def compute_output_spec(self, inputs, weights=None, training=False):
        del weights, training
        specs = [keras.KerasTensor((ids.shape[0], config.table.embedding_dim),
                                   dtype=self.compute_dtype)
                 for config, ids in zip(self._features, keras.tree.flatten(inputs))]
        return keras.tree.pack_sequence_as(self._feature_configs_structure, specs)

    def get_embedding_tables(self):
        """{table name: the whole table} (a collective under several workers: call it on every
        worker at the same point)."""
        return {name: tf.constant(layer.full_table()) for name, layer in self.tables.items()}

    def get_config(self):
        raise NotImplementedError(
            "tf_nestpipe's DistributedEmbedding is not serializable to a .keras config yet: "
            "save its weights (model.save_weights), or tnp.export_saved_model for serving")
