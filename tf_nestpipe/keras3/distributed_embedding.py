"""`DistributedEmbedding`: keras-rs's `keras_rs.layers.DistributedEmbedding` interface (its
`TableConfig` / `FeatureConfig`, feature structures in, embedding structures out), its tables
placed and sharded over the workers of a `NestPipeStrategy` by the strategy's planner.

keras-rs shards tables only on TPU SparseCore; on CPU and GPU it keeps one plain embedding per
table. Here every table is a `tf_nestpipe.keras3.ShardedEmbedding` (row-wise, table-wise or
replicated, as the strategy places it), looked up through the fused exchange with the model's
other tables. keras-rs's own `DistributedEmbedding` created in a NestPipeStrategy scope gets the
same tables and lookups (`tf_nestpipe.keras3.keras_rs_front`); this layer serves the same
configs without keras-rs's class. A config is any object with the fields of keras-rs's
(`FeatureConfig.name / table / input_shape / output_shape`, `TableConfig.name / vocabulary_size /
embedding_dim / initializer / combiner`); a `.keras` file needs keras-rs's config classes.
"""
import keras

from tf_nestpipe.keras3 import feature_lookup
from tf_nestpipe.keras3.layers import ShardedEmbedding


class _Untracked:
    """Holds the user's config structure as it is (Keras and TensorFlow would wrap a dict
    assigned to a layer attribute, which `keras.tree` then packs differently)."""

    def __init__(self, value):
        self.value = value


def _keras_rs_configs():
    try:
        import keras_rs  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise ImportError("loading a tf_nestpipe DistributedEmbedding from its config needs "
                          "keras-rs (`pip install keras-rs`): the config holds keras-rs's "
                          "FeatureConfig / TableConfig") from error
    return keras_rs.layers.FeatureConfig, keras_rs.layers.TableConfig


def serialize_feature_configs(structure):
    """`(feature configs, tables)`: `structure` with each FeatureConfig's `get_config()` in
    place, its "table" replaced by an index into `tables` (each TableConfig's `get_config()`,
    once: shared tables stay shared). keras-rs's own `DistributedEmbedding.get_config` format.

    Raises:
        TypeError: A config without `get_config` (not keras-rs's)."""
    tables, index_of = [], {}

    def serialize(feature):
        if not callable(getattr(feature, "get_config", None)):
            raise TypeError(
                "feature %r: a .keras config of DistributedEmbedding needs keras-rs's "
                "keras_rs.layers.FeatureConfig / TableConfig (got %s); or save the weights "
                "only (model.save_weights)" % (getattr(feature, "name", feature),
                                               type(feature).__name__))
        config = feature.get_config()
        if id(feature.table) not in index_of:
            index_of[id(feature.table)] = len(tables)
            tables.append(config["table"])
        config["table"] = index_of[id(feature.table)]
        return config

    return keras.tree.map_structure(serialize, structure), tables


def deserialize_feature_configs(structure, tables):
    """The inverse of `serialize_feature_configs`, with keras-rs's config classes (a table
    shared by several features is one `TableConfig` again)."""
    feature_class, table_class = _keras_rs_configs()
    made = [None] * len(tables)

    def deserialize(node):
        if not (isinstance(node, dict) and isinstance(node.get("name"), str)
                and isinstance(node.get("table"), int)):
            return None  # not a feature: keras.tree.traverse recurses into it
        index = node["table"]
        if made[index] is None:
            made[index] = table_class.from_config(tables[index])
        config = dict(node, table=made[index])
        for key in ("input_shape", "output_shape"):  # JSON turned the tuples into lists
            if isinstance(config.get(key), list):
                config[key] = tuple(config[key])
        return feature_class(**config)

    return keras.tree.traverse(deserialize, structure)


# Registered: `.keras` files and `from_config` find it with no `custom_objects`.
@keras.saving.register_keras_serializable(package="tf_nestpipe")
class DistributedEmbedding(keras.layers.Layer):
    """Embeds and pools a (nested) structure of features with tables sharded by the
    `NestPipeStrategy` whose scope it is created in; the interface of
    `keras_rs.layers.DistributedEmbedding`.

    Each `FeatureConfig` names its `TableConfig`; features sharing a `TableConfig` share its
    table. A feature's ids are `[batch]` (one id: its row) or `[batch, k]` / a `[batch, None]`
    `tf.RaggedTensor` / a `tf.SparseTensor` (pooled by the table's combiner: "mean", "sum" or
    "sqrtn", optionally weighted, as `keras_rs.layers.EmbedReduce` pools). The output has the
    inputs' structure, each entry `[batch, embedding_dim]`.

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
        ValueError: A table whose combiner is not "mean", "sum" or "sqrtn", or two different
            tables of one name.
    """

    def __init__(self, feature_configs, *, table_stacking="auto", update_stats=False, **kwargs):
        super().__init__(**kwargs)
        self._structure = _Untracked(feature_configs)
        paths = keras.tree.flatten_with_path(feature_configs)
        self._paths = [".".join(str(p) for p in path) for path, _ in paths]
        self._features = [config for _, config in paths]
        self.tables = {
            name: ShardedEmbedding(table.vocabulary_size, table.embedding_dim, combiner=None,
                                   embeddings_initializer=table.initializer, name=name)
            for name, table in feature_lookup.tables_by_name(self._features).items()}
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

    def call(self, inputs, weights=None, training=False):
        """Embeds `inputs` (the feature configs' structure of ids; optional `weights` of the
        same structure) into the same structure of `[batch, embedding_dim]` embeddings. The
        features of one table are looked up together (one lookup per table)."""
        del training
        flat_inputs = keras.tree.flatten(inputs)
        if len(flat_inputs) != len(self._features):
            raise ValueError("DistributedEmbedding got %d features, its configs name %d (%s)" % (
                len(flat_inputs), len(self._features), self._paths))
        flat_weights = None if weights is None else keras.tree.flatten(weights)
        outputs = feature_lookup.lookup_features(self.tables, self._features, flat_inputs,
                                                 flat_weights)
        return keras.tree.pack_sequence_as(self._structure.value, outputs)

    def compute_output_spec(self, inputs, weights=None, training=False):
        del weights, training
        specs = [keras.KerasTensor((ids.shape[0], config.table.embedding_dim),
                                   dtype=self.compute_dtype)
                 for config, ids in zip(self._features, keras.tree.flatten(inputs))]
        return keras.tree.pack_sequence_as(self._structure.value, specs)

    def get_embedding_tables(self):
        """{table name: the whole table} (a collective under several workers: call it on every
        worker at the same point)."""
        return {name: keras.ops.convert_to_tensor(layer.full_table())
                for name, layer in self.tables.items()}

    def get_config(self):
        """The layer's config in keras-rs's `DistributedEmbedding` format: "feature_configs"
        (each FeatureConfig's config, its table an index into "tables"), "tables", and
        "table_stacking" / "update_stats".

        Raises:
            TypeError: The configs are not keras-rs's (they have no `get_config`)."""
        config = super().get_config()
        config["feature_configs"], config["tables"] = serialize_feature_configs(
            self._structure.value)
        config.update(table_stacking=self.table_stacking, update_stats=self.update_stats)
        return config

    @classmethod
    def from_config(cls, config):
        """The layer of `get_config`'s config (needs keras-rs for its config classes)."""
        config = dict(config)
        tables = config.pop("tables")
        config["feature_configs"] = deserialize_feature_configs(config["feature_configs"],
                                                                tables)
        return cls(**config)
