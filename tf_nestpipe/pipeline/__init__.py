"""NestPipe pipelines: the Dual-Buffer Pipeline (prefetch the next batch's rows while the current
batch computes, re-sync the rows the current update changed) and the Frozen-Window Pipeline
(micro-batches whose all-to-alls overlap each other's dense compute)."""
from tf_nestpipe.pipeline.context import PipelineContext, current, pipeline_mode
from tf_nestpipe.pipeline.frozen_window import frozen_window, split_batch
from tf_nestpipe.pipeline.instrumentation import StepProfile, Timeline, profile_steps
from tf_nestpipe.pipeline.train_pipeline import PipelineStats, TrainPipeline, updates_only_touched_rows

__all__ = ["frozen_window", "split_batch", "PipelineContext", "PipelineStats", "StepProfile", "Timeline", "profile_steps", "TrainPipeline", "current", "pipeline_mode",
           "updates_only_touched_rows"]
