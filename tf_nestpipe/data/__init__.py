"""Input data for recommendation models: synthetic click logs, Criteo and MovieLens converters,
TFRecord shards of a `Schema` and an efficient tf.data reader (`make_dataset`)."""
from tf_nestpipe.data.autotune import without_autotuning
from tf_nestpipe.data.criteo import (convert_criteo, criteo_schema, format_criteo_tsv,
                                     read_criteo_tsv, write_criteo_tsv)
from tf_nestpipe.data.movielens import (cache_dir, convert_movielens, fetch_movielens,
                                        load_or_prepare_movielens, movielens_schema,
                                        prepare_movielens)
from tf_nestpipe.data.position import InputPosition
from tf_nestpipe.data.schema import RaggedIds, Schema, SparseFeature
from tf_nestpipe.data.synthetic import (CriteoRows, SyntheticClickLog, criteo_kaggle_table_sizes,
                                        fold_ids, power_law_ids, write_synthetic_tfrecords)
from tf_nestpipe.data.tfrecord import (ShardWriter, encode_examples, load_metadata, make_dataset,
                                       parse_batch, schema_from_metadata, split_files)

__all__ = [
    "CriteoRows",
    "InputPosition",
    "RaggedIds",
    "Schema",
    "ShardWriter",
    "SparseFeature",
    "SyntheticClickLog",
    "cache_dir",
    "convert_criteo",
    "convert_movielens",
    "criteo_kaggle_table_sizes",
    "criteo_schema",
    "encode_examples",
    "fetch_movielens",
    "fold_ids",
    "load_or_prepare_movielens",
    "format_criteo_tsv",
    "load_metadata",
    "make_dataset",
    "movielens_schema",
    "parse_batch",
    "power_law_ids",
    "prepare_movielens",
    "read_criteo_tsv",
    "schema_from_metadata",
    "split_files",
    "without_autotuning",
    "write_criteo_tsv",
    "write_synthetic_tfrecords",
]
