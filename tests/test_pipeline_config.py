"""The pipeline's settings in one value (`tnp.PipelineConfig`), the strategy's former separate
arguments still accepted for one release with a DeprecationWarning."""
import warnings

import pytest

import tf_nestpipe as tnp
from tf_nestpipe.pipeline.config import LEGACY_ARGUMENTS, PipelineConfig, as_pipeline_config


def test_defaults_and_a_mode_name():
    config = as_pipeline_config("fwp")
    assert config == PipelineConfig("fwp") and config.micro_batches == 4
    assert config.auto_micro_batches == (2, 4)
    assert PipelineConfig(micro_batches=8).auto_micro_batches == (2, 8)


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fast"}, "pipeline must be one of"),
    ({"micro_batches": 0}, "micro_batches must be >= 1"),
    ({"auto_timed_steps": 0}, "auto_timed_steps >= 1"),
    ({"auto_micro_batches": ()}, "auto_micro_batches must be"),
])
def test_bad_fields_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kwargs)


def test_the_former_arguments_warn_and_set_the_config():
    with pytest.warns(DeprecationWarning, match=r"micro_batches=\.\.\..*PipelineConfig\('fwp', "
                                                r"cluster_samples=True, micro_batches=2\)"):
        config = as_pipeline_config("fwp", micro_batches=2, cluster_samples=True)
    assert config == PipelineConfig("fwp", micro_batches=2, cluster_samples=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling is silent
        assert as_pipeline_config(PipelineConfig("dbp")).mode == "dbp"
        assert as_pipeline_config("none", **{name: None for name in LEGACY_ARGUMENTS}).mode == "none"


def test_a_config_and_former_arguments_together_are_refused():
    with pytest.raises(ValueError, match="not also as micro_batches"):
        as_pipeline_config(PipelineConfig("fwp"), micro_batches=2)
    with pytest.raises(ValueError, match="a mode .* or a tnp.PipelineConfig"):
        as_pipeline_config(4)


def test_the_strategy_takes_a_config_and_the_old_spelling():
    strategy = tnp.NestPipeStrategy(pipeline=tnp.PipelineConfig("nested", micro_batches=2))
    assert (strategy.pipeline, strategy.micro_batches) == ("nested", 2)
    assert strategy.pipeline_config.auto_micro_batches == (2, 2)
    with pytest.warns(DeprecationWarning, match="NestPipeStrategy"):
        old = tnp.NestPipeStrategy(pipeline="fwp", micro_batches=3, auto_probe_rounds=2)
    assert old.pipeline_config == PipelineConfig("fwp", micro_batches=3, auto_probe_rounds=2)
    with pytest.raises(ValueError, match="pipeline must be one of"):
        tnp.NestPipeStrategy(pipeline="fast")


def test_communication_is_deprecated_and_never_silently_overridden():
    """MultiWorkerMirroredStrategy's spelling, `communication_options`, is the one; the old
    `communication` still works with a warning, and both together are refused (one of them
    would be ignored)."""
    ring = tf_distribute_options(tnp.CommunicationImplementation.RING)
    strategy = tnp.NestPipeStrategy(communication_options=ring)
    assert strategy.extended._communication_options.implementation == (
        tnp.CommunicationImplementation.RING)
    with pytest.warns(DeprecationWarning, match="communication_options=.*RING"):
        old = tnp.NestPipeStrategy(communication=tnp.CommunicationImplementation.RING)
    assert old.extended._communication_options.implementation == (
        tnp.CommunicationImplementation.RING)
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        tnp.NestPipeStrategy(communication=tnp.CommunicationImplementation.NCCL,
                             communication_options=ring)


def tf_distribute_options(implementation):
    import tensorflow as tf
    return tf.distribute.experimental.CommunicationOptions(implementation=implementation)
