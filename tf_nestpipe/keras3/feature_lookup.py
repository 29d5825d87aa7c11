"""The lookups of keras-rs-style features (`FeatureConfig` -> `TableConfig`) in sharded tables:
the features of one table are looked up together (one lookup, so one share of the step's fused
exchange per table), then each is pooled by its table's combiner as `keras_rs.layers.EmbedReduce`
pools it. Used by `tf_nestpipe.keras3.DistributedEmbedding` and by keras-rs's own
`DistributedEmbedding` under a `NestPipeStrategy` (`tf_nestpipe.keras3.keras_rs_front`).
"""
from typing import NamedTuple, Optional

import tensorflow as tf

COMBINERS = ("mean", "sum", "sqrtn")


class FlatFeature(NamedTuple):
    """A feature's ids flattened: `ids` `[n]` int64, `weights` `[n]` or None, `segments` (the
    example of each id, None for one id per example) and `count` (the examples)."""

    ids: tf.Tensor
    weights: Optional[tf.Tensor]
    segments: Optional[tf.Tensor]
    count: Optional[tf.Tensor]


def check_combiner(table):
    """Raises for a table whose combiner is not one of `COMBINERS`.

    Raises:
        ValueError: naming the table and the combiners there are."""
    if table.combiner not in COMBINERS:
        raise ValueError("table %r: combiner %r is not supported; use one of %s"
                         % (table.name, table.combiner, COMBINERS))


def tables_by_name(features):
    """{table name: TableConfig} of `features` (FeatureConfigs), in first-use order.

    Tables are placed by name, so two features naming one table must share it: the same
    `TableConfig` object, or equal ones.

    Raises:
        ValueError: Two different tables of one name, or an unsupported combiner."""
    tables = {}
    for feature in features:
        table = feature.table
        check_combiner(table)
        known = tables.get(table.name)
        if known is None:
            tables[table.name] = table
        elif known is not table and known != table:
            raise ValueError(
                "two different tables are named %r (%s and %s): tables are placed and saved by "
                "name, give each its own name or share one TableConfig" % (table.name, known, table))
    return tables


def flatten_feature(ids, weights, name):
    """`ids` (`[batch]`, `[batch, k]`, a `[batch, None]` `tf.RaggedTensor` or a `[batch, k]`
    `tf.SparseTensor`) and their optional `weights` (the same structure) as a `FlatFeature`.

    Raises:
        ValueError: Ids of rank 3 or more, naming the feature."""
    if isinstance(ids, tf.RaggedTensor):
        flat_weights = None if weights is None else tf.reshape(weights.flat_values, [-1])
        return FlatFeature(tf.cast(ids.flat_values, tf.int64), flat_weights, ids.value_rowids(),
                           ids.nrows(out_type=tf.int64))
    if isinstance(ids, tf.SparseTensor):
        flat_weights = None if weights is None else weights.values
        return FlatFeature(tf.cast(ids.values, tf.int64), flat_weights, ids.indices[:, 0],
                           ids.dense_shape[0])
    ids = tf.cast(tf.convert_to_tensor(ids), tf.int64)
    flat_weights = None if weights is None else tf.reshape(weights, [-1])
    if ids.shape.rank == 1:
        return FlatFeature(ids, flat_weights, None, None)
    if ids.shape.rank != 2:
        raise ValueError("feature %r: ids of shape %s; a feature's ids are [batch] or "
                         "[batch, k] (or ragged / sparse [batch, None])" % (name, ids.shape))
    count = tf.shape(ids, out_type=tf.int64)[0]
    segments = tf.repeat(tf.range(count), tf.shape(ids, out_type=tf.int64)[1])
    return FlatFeature(tf.reshape(ids, [-1]), flat_weights, segments, count)


def pool(combiner, rows, flat):
    """The feature's embedding `[batch, dim]` from the rows of its ids, as `EmbedReduce`
    computes it: one id per example gives its row ("sum" scales it by its weight); several are
    summed with their weights, divided by the weights' sum ("mean") or the root of their
    squares' sum ("sqrtn"), zero for an example without ids."""
    if flat.segments is None:
        if flat.weights is not None and combiner == "sum":
            return rows * tf.cast(flat.weights, rows.dtype)[:, None]
        return rows
    weights = (tf.ones_like(rows[:, 0]) if flat.weights is None
               else tf.cast(flat.weights, rows.dtype))
    pooled = tf.math.unsorted_segment_sum(rows * weights[:, None], flat.segments, flat.count)
    if combiner == "mean":
        norm = tf.math.unsorted_segment_sum(weights, flat.segments, flat.count)
    elif combiner == "sqrtn":
        norm = tf.sqrt(tf.math.unsorted_segment_sum(tf.square(weights), flat.segments,
                                                    flat.count))
    else:
        return pooled
    return tf.math.divide_no_nan(pooled, norm[:, None])


def lookup_features(layers, features, inputs, weights=None):
    """Embeds every feature: one lookup per table (its features' ids concatenated), then each
    feature pooled by its table's combiner.

    Args:
        layers: {table name: embedding layer}; `layer(ids)` of `[n]` ids gives `[n, dim]` rows.
        features: The FeatureConfigs, in the order of `inputs`.
        inputs: Each feature's ids (see `flatten_feature`).
        weights: None, or each feature's weights (None for a feature without).

    Returns:
        Each feature's `[batch, dim]` embedding, in the order of `inputs`.
    """
    weights = [None] * len(inputs) if weights is None else list(weights)
    flats = [flatten_feature(ids, w, feature.name)
             for ids, w, feature in zip(inputs, weights, features)]
    outputs = [None] * len(flats)
    for name, layer in layers.items():
        mine = [i for i, feature in enumerate(features) if feature.table.name == name]
        if not mine:
            continue
        ids = [flats[i].ids for i in mine]
        rows = layer(ids[0] if len(ids) == 1 else tf.concat(ids, axis=0))
        parts = [rows] if len(ids) == 1 else tf.split(rows, [tf.size(x) for x in ids], axis=0)
        for i, part in zip(mine, parts):
            outputs[i] = pool(features[i].table.combiner, part, flats[i])
    return outputs
