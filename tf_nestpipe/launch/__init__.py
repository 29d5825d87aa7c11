"""Cluster description (TF_CONFIG) and the local multi-process launcher."""
from tf_nestpipe.tf_config import ClusterConfig, TFConfigError, parse_tf_config

__all__ = ["ClusterConfig", "TFConfigError", "parse_tf_config"]
