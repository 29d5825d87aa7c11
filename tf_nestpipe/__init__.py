"""tf_nestpipe: a TensorFlow distribution strategy for recommendation models.

Embedding tables are placed per table by a planner (row-sharded across workers, model parallel,
or replicated where that is cheaper), dense weights mirrored (data parallel), with exact
synchronous semantics. Use with tf_keras (`TF_USE_LEGACY_KERAS=1`, set on import unless set) or
with Keras 3 (`import keras`; `from tf_nestpipe import keras3` for its layers, whose hooks the
strategy loads by itself for a Keras 3 model).
"""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# Entry points that never need TensorFlow: the launcher (`python -m tf_nestpipe.launch`, also its
# `--help`) and `python -m tf_nestpipe.launch.task`. Python imports this package first when they
# start, and importing TensorFlow there would cost seconds and print its start-up noise.
_NO_TENSORFLOW_ENTRY_POINTS = ("tf_nestpipe.launch", "tf_nestpipe.launch.task")


def _started_as_launcher(argv=None):
    """Whether this process is `python [options] -m tf_nestpipe.launch[.task] ...`."""
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    return any(flag == "-m" and module in _NO_TENSORFLOW_ENTRY_POINTS
               for flag, module in zip(argv, argv[1:]))


if not _started_as_launcher():
    from tf_nestpipe import tracing as _tracing  # noqa: E402

    _tracing.register_library()  # before any of our functions is traced

    from tf_nestpipe.tf_config import ClusterConfig, TFConfigError, parse_tf_config  # noqa: E402
    from tf_nestpipe.sharding import (DynamicEmbedding, ShardedEmbedding, ShardedEmbeddingCollection,  # noqa: E402
                                      ShardLayout)
    from tf_nestpipe.strategy import (CommunicationImplementation, DownpourTrainer,  # noqa: E402
                                      LocalAdagrad, LocalSGD, NestPipeStrategy,
                                      ParameterServerStrategy)
    from tf_nestpipe.strategy.checkpoint import ShardedCheckpoint  # noqa: E402
    from tf_nestpipe.collectives.transport import TransportConfig, TransportError  # noqa: E402
    from tf_nestpipe.strategy.keras_callbacks import BackupAndRestore, DynamicTableStats  # noqa: E402
    from tf_nestpipe.strategy.export import export_saved_model  # noqa: E402
    from tf_nestpipe.strategy.exactness_check import ExactnessReport, check_exactness  # noqa: E402
    from tf_nestpipe.strategy.global_candidates import global_in_batch_candidates  # noqa: E402
    from tf_nestpipe.strategy.preemption import PreemptionCheckpointHandler  # noqa: E402
    from tf_nestpipe.sharding.partitioners import (FixedShardsPartitioner,  # noqa: E402
                                                   MaxSizePartitioner, MinSizePartitioner,
                                                   ModShardsPartitioner)

    from tf_nestpipe.pipeline import PipelineConfig, TrainPipeline  # noqa: E402
    from tf_nestpipe.pipeline import keras_integration as _keras_integration  # noqa: E402

    _keras_integration.install()

    from tf_nestpipe import keras_hooks as _keras_hooks  # noqa: E402

    _keras_hooks.install()  # after keras_integration: wraps its make_train_function

    from tf_nestpipe.strategy import keras_checks as _keras_checks  # noqa: E402

    def _install_keras3_support():
        """Loads `tf_nestpipe.keras3` (Keras 3 and its hooks) and installs its hooks."""
        from tf_nestpipe import keras3  # pylint: disable=import-outside-toplevel

        keras3.install()

    # Loaded by the strategy where a Keras 3 model is built in its scope (see keras_checks).
    _keras_checks.set_keras3_support(_install_keras3_support)

__version__ = "0.1.0"

__all__ = [
    "BackupAndRestore",
    "ClusterConfig",
    "CommunicationImplementation",
    "DownpourTrainer",
    "DynamicEmbedding",
    "DynamicTableStats",
    "ExactnessReport",
    "FixedShardsPartitioner",
    "LocalAdagrad",
    "LocalSGD",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "ModShardsPartitioner",
    "NestPipeStrategy",
    "ParameterServerStrategy",
    "PipelineConfig",
    "PreemptionCheckpointHandler",
    "ShardLayout",
    "ShardedCheckpoint",
    "ShardedEmbedding",
    "ShardedEmbeddingCollection",
    "TFConfigError",
    "TrainPipeline",
    "TransportConfig",
    "TransportError",
    "check_exactness",
    "export_saved_model",
    "global_in_batch_candidates",
    "parse_tf_config",
]
