"""Input data for recommendation models: deterministic synthetic click logs."""
from tf_nestpipe.data.synthetic import SyntheticClickLog, criteo_kaggle_table_sizes

__all__ = ["SyntheticClickLog", "criteo_kaggle_table_sizes"]
