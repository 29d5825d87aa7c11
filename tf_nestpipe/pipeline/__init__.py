"""NestPipe pipelines: the Dual-Buffer Pipeline (prefetch the next batch's rows while the current
batch computes, re-sync the rows the current update changed), the Frozen-Window Pipeline
(micro-batches whose all-to-alls overlap each other's dense compute), both nested, and key-centric
sample clustering."""
from tf_nestpipe.pipeline.clustering import cluster_permutation, integer_leaves
from tf_nestpipe.pipeline.context import PipelineContext, current, pipeline_mode
from tf_nestpipe.pipeline.frozen_window import cluster_batch, frozen_window, split_batch
from tf_nestpipe.pipeline.instrumentation import StepProfile, Timeline, profile_steps
from tf_nestpipe.pipeline.train_pipeline import PipelineStats, TrainPipeline, updates_only_touched_rows

__all__ = ["PipelineContext", "PipelineStats", "StepProfile", "Timeline", "TrainPipeline",
           "cluster_batch", "cluster_permutation", "current", "frozen_window", "integer_leaves",
           "pipeline_mode", "profile_steps", "split_batch", "updates_only_touched_rows"]
