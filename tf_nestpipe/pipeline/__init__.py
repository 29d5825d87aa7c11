"""NestPipe pipelines: the Dual-Buffer Pipeline (prefetch the next batch's rows while the current
batch computes, re-sync the rows the current update changed), the Frozen-Window Pipeline
(micro-batches whose all-to-alls overlap each other's dense compute), both nested, and key-centric
sample clustering."""
from tf_nestpipe.pipeline.auto import AutoPipeline
from tf_nestpipe.pipeline.config import PipelineConfig
from tf_nestpipe.pipeline.modes import AUTO_CANDIDATES, PIPELINES
from tf_nestpipe.pipeline.clustering import cluster_permutation, integer_leaves
from tf_nestpipe.pipeline.fused_exchange import BufferReader, RouteRecorder
from tf_nestpipe.pipeline.frozen_window import cluster_batch, frozen_window, split_batch
from tf_nestpipe.pipeline.instrumentation import StepProfile, Timeline, profile_steps
from tf_nestpipe.pipeline.train_pipeline import PipelineStats, TrainPipeline, updates_only_touched_rows

__all__ = ["AUTO_CANDIDATES", "AutoPipeline", "PIPELINES", "BufferReader", "PipelineConfig",
           "PipelineStats", "RouteRecorder", "StepProfile", "Timeline",
           "TrainPipeline", "cluster_batch", "cluster_permutation", "frozen_window",
           "integer_leaves", "profile_steps", "split_batch", "updates_only_touched_rows"]
