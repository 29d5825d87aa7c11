"""One benchmark run of the DLRM example: trains `--steps` steps with fit and prints, on worker
0, `RESULT {json}` with the per-step wall times (after warm-up).

Modes: single (one process, tf_keras Embedding, no strategy), nestpipe (NestPipeStrategy with one
fused ShardedEmbeddingCollection), nestpipe_per_table (one ShardedEmbedding per table), mwms
(MultiWorkerMirroredStrategy, RING, replicated tf_keras Embedding).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dlrm  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.data import SyntheticClickLog, criteo_kaggle_table_sizes  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True,
                        choices=["single", "nestpipe", "nestpipe_per_table", "mwms"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--pipeline", default="none", help="NestPipeStrategy pipeline (nestpipe modes)")
    parser.add_argument("--micro-batches", type=int, default=4, help="for pipeline=fwp")
    args = parser.parse_args()

    if args.mode == "single":
        strategy = tf.distribute.get_strategy()
        kind, rank = "keras", 0
    elif args.mode == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
        kind, rank = "keras", strategy.cluster_resolver.task_id
    else:
        strategy = tnp.NestPipeStrategy(pipeline=args.pipeline, micro_batches=args.micro_batches)
        kind = "fused" if args.mode == "nestpipe" else "per_table"
        rank = strategy.worker_index
    table_sizes = criteo_kaggle_table_sizes(args.table_scale)
    log = SyntheticClickLog(table_sizes, seed=1)
    model = dlrm.build_compiled_dlrm(strategy, kind, table_sizes, args.dim)
    dataset_fn = dlrm.make_dataset_fn(log, 0, args.steps, args.global_batch, repeat=True)
    if args.mode == "single":
        dataset = dataset_fn(tf.distribute.InputContext())
    else:
        dataset = strategy.distribute_datasets_from_function(dataset_fn)
    timer = dlrm.StepTimer()
    model.fit(dataset, epochs=1, steps_per_epoch=args.steps, callbacks=[timer], verbose=0)
    times = np.array(timer.times[args.warmup:]) * 1e3
    if rank == 0:
        print("RESULT " + json.dumps({
            "mode": args.mode, "pipeline": args.pipeline, "steps": len(times), "global_batch": args.global_batch,
            "median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "mean_ms": float(times.mean())}), flush=True)


if __name__ == "__main__":
    main()
