"""Profiles a few DLRM training steps on this worker and reports per-stage times, exposure ratio
and a Chrome trace (worker 0 prints `RESULT {json}`)."""
import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


import dlrm  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.data import SyntheticClickLog, criteo_kaggle_table_sizes  # noqa: E402
from tf_nestpipe.pipeline import profile_steps  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", default="none")
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trace", default="", help="write worker 0's Chrome trace here")
    args = parser.parse_args()
    strategy = tnp.NestPipeStrategy(pipeline=args.pipeline)
    sizes = criteo_kaggle_table_sizes(0.002)
    log = SyntheticClickLog(sizes, seed=1)
    model = dlrm.build_compiled_dlrm(strategy, "fused", sizes)
    iterator = iter(strategy.distribute_datasets_from_function(
        dlrm.make_dataset_fn(log, 0, 60, 512, repeat=True)))
    train_function = model.make_train_function()
    for _ in range(args.warmup):
        train_function(iterator)
    logdir = tempfile.mkdtemp(prefix="nestpipe_profile_")
    timeline = profile_steps(lambda: train_function(iterator), args.steps, logdir)
    profiles = timeline.profiles()
    if strategy.worker_index == 0:
        if args.trace:
            timeline.to_chrome_trace(args.trace)
        median = lambda xs: statistics.median(xs)  # noqa: E731
        print("RESULT " + json.dumps({
            "pipeline": args.pipeline,
            "step_ms": median([p.step_ms for p in profiles]),
            "communication_ms": median([p.communication_ms for p in profiles]),
            "exposed_ms": median([p.exposed_communication_ms for p in profiles]),
            "exposure_ratio": median([p.exposure_ratio for p in profiles]),
            "stage_ms": {s: median([p.stage_ms[s] for p in profiles]) for s in profiles[0].stage_ms},
        }), flush=True)


if __name__ == "__main__":
    main()
