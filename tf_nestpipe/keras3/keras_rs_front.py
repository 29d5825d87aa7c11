"""keras-rs's own `keras_rs.layers.DistributedEmbedding` under a `NestPipeStrategy`.

Created in a NestPipeStrategy scope, the layer's tables (its features placed "auto" or
"default_device": every table off TPU SparseCore) are `tf_nestpipe.keras3.EmbedReduce`s
(keras-rs's `EmbedReduce` on a `ShardedEmbedding` table),
placed and sharded by the strategy's planner and looked up one lookup per table through the
step's fused exchange (`feature_lookup`, as `tf_nestpipe.keras3.DistributedEmbedding` does);
`get_embedding_tables()` returns whole tables. keras-rs's own code does the rest (configs,
structures, preprocessing, output shapes, `get_config`). Created anywhere else the layer is
keras-rs's, untouched.

The table layers sit where keras-rs puts its `EmbedReduce` layers, one per table, with its
class name, so Keras files of a model load both ways: written by keras-rs's plain layer and
loaded under the strategy (the tables then sharded), or written under the strategy (whole
tables) and loaded without it.

Tables a `TableConfig(placement="sparsecore")` asks for TPU SparseCore (which shards them) are
sharded by the strategy alike, with a `SparseCorePlacementWarning`: they train with the
optimizer given to `model.compile`, not with `TableConfig.optimizer` as on SparseCore. So
keras-rs's TPU examples run with their strategy line changed. Features configured with
`tf.tpu.experimental.embedding.FeatureConfig` are refused under the strategy, naming the fix.
Installed by `tf_nestpipe.keras3.install()` once keras-rs is imported (the keras-rs internals
come from `tf_private`).
"""
import warnings

import keras
import tensorflow as tf

from tf_nestpipe import tf_private
from tf_nestpipe.keras3 import feature_lookup
from tf_nestpipe.keras3.layers import EmbedReduce
from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy


def _in_nestpipe_scope():
    return isinstance(tf.distribute.get_strategy(), NestPipeStrategy)


class _Tables:
    """A keras-rs layer's sharded tables ({table name: layer}) and features ({path:
    FeatureConfig}); kept out of Keras' tracking (the layers are tracked where keras-rs keeps
    its own, see `tf_private.set_keras_rs_tables`)."""

    def __init__(self, layers, features):
        self.layers = layers
        self.features = features


def _tables_of(layer):
    return layer.__dict__.get("_nestpipe_tables")


def _init_tables(original):
    def init_tables(self, feature_configs, table_stacking):
        if not _in_nestpipe_scope():
            return original(self, feature_configs, table_stacking)
        del table_stacking  # the fused exchange groups the tables of one dim anyway
        tables = feature_lookup.tables_by_name(feature_configs.values())
        layers = {name: EmbedReduce(table.vocabulary_size, table.embedding_dim,
                                    embeddings_initializer=table.initializer,
                                    combiner=table.combiner, name=name)
                  for name, table in tables.items()}
        tf_private.set_keras_rs_tables(self, {path: layers[feature.table.name]
                                              for path, feature in feature_configs.items()})
        self.__dict__["_nestpipe_tables"] = _Tables(layers, dict(feature_configs))
        return None

    return tf_private.mark_hooked(init_tables)


def _call_tables(original):
    def call_tables(self, inputs, weights=None, training=False):
        tables = _tables_of(self)
        if tables is None:
            return original(self, inputs, weights=weights, training=training)
        paths = list(inputs)
        outputs = feature_lookup.lookup_features(
            tables.layers, [tables.features[path] for path in paths],
            [inputs[path] for path in paths],
            None if weights is None else [weights.get(path) for path in paths])
        return dict(zip(paths, outputs))

    return tf_private.mark_hooked(call_tables)


def _read_tables(original):
    def read_tables(self):
        tables = _tables_of(self)
        if tables is None:
            return original(self)
        # Whole tables: a collective under several workers (every worker calls it).
        return {name: keras.ops.convert_to_tensor(layer.full_table())
                for name, layer in tables.layers.items()}

    return tf_private.mark_hooked(read_tables)


class SparseCorePlacementWarning(UserWarning):
    """keras-rs tables asked for TPU SparseCore are sharded by the NestPipeStrategy instead."""


def _place_features(original):
    def place_features(self, feature_configs):
        original(self, feature_configs)
        if not _in_nestpipe_scope():
            return
        import keras_rs  # pylint: disable=import-outside-toplevel
        moved = tf_private.keras_rs_move_to_default_device(
            self, lambda feature: isinstance(feature, keras_rs.layers.FeatureConfig))
        if moved:
            tables = sorted({feature.table.name for feature in moved.values()})
            warnings.warn(
                "keras_rs DistributedEmbedding: tables %s ask for placement='sparsecore' (TPU "
                "SparseCore, which shards them); under NestPipeStrategy its planner places and "
                "shards them over the workers instead, and they train with the optimizer given "
                "to model.compile: TableConfig.optimizer is SparseCore's and is not used"
                % tables, SparseCorePlacementWarning, stacklevel=4)

    return tf_private.mark_hooked(place_features)


def _init_sparsecore(original):
    def init_sparsecore(self, feature_configs, table_stacking):
        if _in_nestpipe_scope():
            raise ValueError(
                "keras_rs DistributedEmbedding: features %s are configured with "
                "tf.tpu.experimental.embedding's FeatureConfig (TPU SparseCore only); under "
                "tf_nestpipe's NestPipeStrategy configure them with keras_rs.layers.TableConfig "
                "/ FeatureConfig (their tables are then sharded by the strategy's planner: "
                "choose row_wise / table_wise / data_parallel with "
                "NestPipeStrategy(placement=...))" % sorted(feature_configs))
        return original(self, feature_configs, table_stacking)

    return tf_private.mark_hooked(init_sparsecore)


def install():
    """Hooks keras-rs's `DistributedEmbedding` (idempotent; keras-rs must be importable)."""
    tf_private.wrap_keras_rs_distributed_embedding({
        "place_features": _place_features, "init_tables": _init_tables,
        "call_tables": _call_tables, "read_tables": _read_tables,
        "init_sparsecore": _init_sparsecore})
