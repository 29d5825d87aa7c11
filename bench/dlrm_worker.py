"""One benchmark run of the DLRM example: trains `--steps` steps with fit and prints, on worker
0, `RESULT {json}` with the per-step wall times (after warm-up).

Modes: single (one process, tf_keras Embedding, no strategy), nestpipe (NestPipeStrategy with one
fused ShardedEmbeddingCollection), nestpipe_per_table (one ShardedEmbedding per table), mwms
(MultiWorkerMirroredStrategy, RING, replicated tf_keras Embedding), local (every task of the
cluster trains the nestpipe model alone on its share of the global batch, no communication at
all: the compute-only bound of a cluster run on the same cores).

`--profile-steps K` then profiles K more steps and adds the communication time, the exposed
communication and the exposure ratio (medians) to the result; `--trace PATH` writes worker 0's
Chrome trace of them.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dlrm  # noqa: E402
import emulated_latency  # noqa: E402
import step_stages  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.data import SyntheticClickLog, criteo_kaggle_table_sizes  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True,
                        choices=["single", "nestpipe", "nestpipe_per_table", "mwms", "local"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--pipeline", default="none", help="NestPipeStrategy pipeline (nestpipe modes)")
    parser.add_argument("--micro-batches", type=int, default=4, help="for pipeline=fwp/nested")
    parser.add_argument("--cluster-samples", action="store_true", help="key-centric clustering")
    parser.add_argument("--collectives", default="tf", choices=["tf", "horovod"],
                        help="NestPipeStrategy collectives backend (nestpipe modes; horovod needs "
                             "`python -m tf_nestpipe.launch --horovod` or horovodrun)")
    parser.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--trace", default="", help="Chrome trace of the profiled steps (worker 0)")
    args = parser.parse_args()
    global_batch, rank = args.global_batch, 0
    if args.mode == "local":
        tasks = json.loads(os.environ.pop("TF_CONFIG", "{}"))
        workers = len(tasks.get("cluster", {}).get("worker", [])) or 1
        rank = tasks.get("task", {}).get("index", 0)
        global_batch = args.global_batch // workers

    if args.mode == "single":
        strategy = tf.distribute.get_strategy()
        kind, rank = "keras", 0
    elif args.mode == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
        kind, rank = "keras", strategy.cluster_resolver.task_id
    else:
        # row_wise: the pipelines' benchmarks time the tables' exchange ("auto", the default,
        # may replicate the small tables).
        strategy = tnp.NestPipeStrategy(
            pipeline=tnp.PipelineConfig(args.pipeline, micro_batches=args.micro_batches,
                                        cluster_samples=args.cluster_samples),
            transport=args.collectives, placement="row_wise")
        emulated_latency.install_from_env(strategy)
        kind = "per_table" if args.mode == "nestpipe_per_table" else "fused"
        rank = max(rank, strategy.worker_index)
    table_sizes = criteo_kaggle_table_sizes(args.table_scale)
    log = SyntheticClickLog(table_sizes, seed=1)
    model = dlrm.build_compiled_dlrm(strategy, kind, table_sizes, args.dim)
    dataset_fn = dlrm.make_dataset_fn(log, 0, args.steps, global_batch, repeat=True)
    if args.mode in ("single", "local"):
        dataset = dataset_fn(tf.distribute.InputContext())
    else:
        dataset = strategy.distribute_datasets_from_function(dataset_fn)
    timer = dlrm.StepTimer()
    model.fit(dataset, epochs=1, steps_per_epoch=args.steps, callbacks=[timer], verbose=0)
    times = np.array(timer.times[args.warmup:]) * 1e3
    result = {"mode": args.mode, "pipeline": args.pipeline, "collectives": args.collectives,
              "steps": len(times),
              "global_batch": args.global_batch, "median_ms": float(np.median(times)),
              "p90_ms": float(np.percentile(times, 90)), "mean_ms": float(times.mean())}
    if args.profile_steps:
        result.update(profile(model, dataset, args.profile_steps, args.trace, enabled=rank == 0))
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def profile(model, dataset, steps, trace, enabled=True):
    """Runs `steps` more training steps, profiled when `enabled`, and returns their median
    communication and exposure ({} when not enabled). Every worker must call it (the steps
    exchange data); profile one worker only: TF 2.21's profiler can abort a process when it stops
    (see tf_nestpipe.pipeline.profile_steps), so each profiled worker adds a chance of that."""
    iterator = iter(dataset)
    train_function = model.make_train_function()
    for _ in range(3):  # the new iterator re-primes a pipeline
        train_function(iterator)
    if not enabled:
        for _ in range(steps):
            train_function(iterator)
        return {}
    timeline = tnp.pipeline.profile_steps(lambda: train_function(iterator), steps,
                                          tempfile.mkdtemp(prefix="nestpipe_profile_"))
    profiles = timeline.profiles()
    if trace:
        timeline.to_chrome_trace(trace)
    median = statistics.median
    return {"profiled_step_ms": median([p.step_ms for p in profiles]),
            "communication_ms": median([p.communication_ms for p in profiles]),
            "exposed_ms": median([p.exposed_communication_ms for p in profiles]),
            "exposure_ratio": median([p.exposure_ratio for p in profiles]),
            "ops_per_step": median([p.ops for p in profiles]),
            "stage_ms": {s: median([p.stage_ms[s] for p in profiles]) for s in profiles[0].stage_ms},
            "stages": step_stages.breakdown(timeline)}


if __name__ == "__main__":
    main()
