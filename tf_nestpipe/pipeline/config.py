"""`PipelineConfig`: how a `NestPipeStrategy` pipelines the embedding exchange, in one value
(the modes are described in docs/concepts/pipelines.md)."""
import dataclasses
import warnings
from typing import Optional, Tuple

from tf_nestpipe.pipeline.modes import PIPELINES as MODES
# The strategy's former separate arguments, now fields of PipelineConfig.
LEGACY_ARGUMENTS = ("micro_batches", "cluster_samples", "unsafe_skip_buffer_sync",
                    "auto_warmup_steps", "auto_timed_steps", "auto_probe_rounds",
                    "auto_micro_batches")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How training steps are pipelined. Every mode trains exactly what `"none"` trains.

    Args:
        mode: "auto" (default: the first steps of `fit` try none, fwp, dbp and nested and keep
            the fastest on the slowest worker), "none", "dbp" (the next batch's rows are
            fetched while the current batch computes), "fwp" (each step as `micro_batches`
            micro-batches in a frozen window) or "nested" (both).
        micro_batches: Micro-batches per step under "fwp" and "nested" (>= 1; default 4).
        cluster_samples: Form the micro-batches by key-centric sample clustering (fewer ids
            fetched; same result).
        auto_warmup_steps: "auto": untimed steps per candidate in the probe's first round.
        auto_timed_steps: "auto": timed steps per candidate and round (>= 1).
        auto_probe_rounds: "auto": interleaved probe rounds (>= 1).
        auto_micro_batches: "auto": the micro-batch counts tried with fwp and nested (default:
            2 and `micro_batches`).
        unsafe_skip_buffer_sync: Testing only: skip the dual buffer's re-sync, which makes
            training stale (what `tnp.check_exactness` must catch).

    Raises:
        ValueError: An unknown mode or a count out of range, naming the field.
    """

    mode: str = "auto"
    micro_batches: int = 4
    cluster_samples: bool = False
    auto_warmup_steps: int = 1
    auto_timed_steps: int = 4
    auto_probe_rounds: int = 6
    auto_micro_batches: Optional[Tuple[int, ...]] = None
    unsafe_skip_buffer_sync: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError("pipeline must be one of %s, got %r" % (MODES, self.mode))
        if int(self.micro_batches) < 1:
            raise ValueError("micro_batches must be >= 1, got %r" % (self.micro_batches,))
        if (int(self.auto_warmup_steps) < 0 or int(self.auto_timed_steps) < 1
                or int(self.auto_probe_rounds) < 1):
            raise ValueError("auto_warmup_steps must be >= 0, auto_timed_steps >= 1 and "
                             "auto_probe_rounds >= 1, got %r, %r and %r"
                             % (self.auto_warmup_steps, self.auto_timed_steps,
                                self.auto_probe_rounds))
        counts = self.auto_micro_batches
        if counts is not None and (not counts or any(int(m) < 1 for m in counts)):
            raise ValueError("auto_micro_batches must be micro-batch counts >= 1 (those >= 2 "
                             "are tried with fwp and nested), got %r" % (counts,))
        object.__setattr__(self, "micro_batches", int(self.micro_batches))
        object.__setattr__(self, "cluster_samples", bool(self.cluster_samples))
        object.__setattr__(self, "auto_warmup_steps", int(self.auto_warmup_steps))
        object.__setattr__(self, "auto_timed_steps", int(self.auto_timed_steps))
        object.__setattr__(self, "auto_probe_rounds", int(self.auto_probe_rounds))
        object.__setattr__(self, "auto_micro_batches",
                           (2, self.micro_batches) if counts is None
                           else tuple(int(m) for m in counts))
        object.__setattr__(self, "unsafe_skip_buffer_sync", bool(self.unsafe_skip_buffer_sync))


def as_pipeline_config(pipeline, **legacy) -> PipelineConfig:
    """The strategy's `PipelineConfig` from its `pipeline` argument and the former separate
    arguments (`LEGACY_ARGUMENTS`, None where not passed).

    Args:
        pipeline: A `PipelineConfig`, or a mode name ("auto", "none", "dbp", "fwp", "nested").
        **legacy: The former arguments; each one passed warns (DeprecationWarning) and sets
            the field of the same name.

    Returns:
        The config.

    Raises:
        ValueError: A bad mode or field, an unknown argument, or a `PipelineConfig` together
            with former arguments (which would silently lose one of them).
    """
    unknown = set(legacy) - set(LEGACY_ARGUMENTS)
    if unknown:
        raise ValueError("unknown pipeline arguments %s" % sorted(unknown))
    given = {name: value for name, value in legacy.items() if value is not None}
    if isinstance(pipeline, PipelineConfig):
        if given:
            raise ValueError("pass the pipeline's settings in pipeline=tnp.PipelineConfig(...) "
                             "only, not also as %s" % ", ".join(sorted(given)))
        return pipeline
    if not isinstance(pipeline, str):
        raise ValueError("pipeline must be a mode (one of %s) or a tnp.PipelineConfig, got %r"
                         % (MODES, pipeline))
    if given:
        warnings.warn("NestPipeStrategy(%s) is deprecated and will be removed in the next "
                      "release: pass pipeline=tnp.PipelineConfig(%r, %s)"
                      % (", ".join("%s=..." % name for name in sorted(given)), pipeline,
                         ", ".join("%s=%r" % kv for kv in sorted(given.items()))),
                      DeprecationWarning, stacklevel=3)
    return PipelineConfig(pipeline, **given)
