"""Per-stage costs of one NestPipe training step, for the scaling model (`python -m bench.scaling_model`).

    python bench/stage_costs.py single [--global-batch 512]                     # one process
    python -m tf_nestpipe.launch --workers W -- python bench/stage_costs.py cluster [--global-batch 512]

`single` (no TF_CONFIG) times, on the DLRM example's synthetic Zipf data:
- key routing: the fused dedup + bucket-by-owner op, the padded key layout and the owner-side
  dedup (`tf_nestpipe.ops`) for (samples, shards) pairs, collectives replaced by local copies;
- embedding retrieval: the owner's gather of its distinct rows, the slot-layout gather, the
  inverse-index rebuild, and their adjoints (segment sums) for the backward pass;
- the whole step of the DLRM example on one worker (tf_keras fit, NestPipeStrategy with one
  worker, as `bench/dlrm_worker.py --mode local`) at several batch sizes and with each pipeline.

`cluster` (every worker of a launched cluster) times the strategy's collectives (the transport
in use: `--collectives auto`, the default, is the socket mesh where it connects, `tf` is
TensorFlow's; the result says which as "transport") over a sweep of sizes:
the equal-split all-to-all (CollectiveAllToAllV2), the all-gather and the dense all-reduce
(the MultiWorkerMirrored path), each as a tf.function with one collective minus an empty
tf.function's call overhead; then every worker trains the DLRM example alone on its share of the
global batch at the same time (compute-only, the CPU contention of W processes on these cores).

Both print `RESULT {json}` (worker 0 for `cluster`), times in ms. Every measurement is taken in
interleaved rounds; `best` is the lowest per-round median (the round least disturbed by other
processes on the shared cores), `median` the median over all rounds.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dlrm  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe import ops  # noqa: E402
from tf_nestpipe.data import SyntheticClickLog, criteo_kaggle_table_sizes  # noqa: E402
from tf_nestpipe.collectives.communication import capacity_bucket  # noqa: E402
from tf_nestpipe.strategy.calibration import collective_probes  # noqa: E402


def timed(fns, rounds, calls=10, warmup=3):
    """Times each of `fns` (outputs fetched) interleaved: `rounds` rounds of `calls` calls of
    each, so a changing load from other processes hits all alike. Returns per fn the per-round
    medians in ms."""
    fetch = lambda fn: tf.nest.map_structure(lambda t: t.numpy(), fn())  # noqa: E731
    for fn in fns:
        for _ in range(warmup):
            fetch(fn)
    medians = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, medians):
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                fetch(fn)
                times.append(time.perf_counter() - start)
            out.append(1e3 * statistics.median(times))
    return medians


def fused_ids(log, table_sizes, samples, index=0):
    """The fused (offset) ids of `samples` samples of batch `index`, flattened: int64 [samples*F]."""
    offsets = np.concatenate([[0], np.cumsum(table_sizes)[:-1]]).astype(np.int64)
    sparse = log.batch(index, samples)[0]["sparse"]
    return (sparse + offsets[None, :]).reshape(-1)


def stage_functions(ids, shards, vocab, dim):
    """Routing and retrieval (forward + backward) of `ids` with `shards` owners as two
    tf.functions, the exchanges replaced by local copies; returns (route, retrieve, sizes)."""
    ids = tf.constant(ids)

    @tf.function
    def route():
        keys, splits, inverse = ops.route_keys(ids, shards, vocab)
        if shards == 1:
            return keys, tf.range(tf.size(keys)), inverse, tf.size(keys)
        bucket, capacity = capacity_bucket(tf.maximum(tf.reduce_max(splits), 1))
        padded = tf.RaggedTensor.from_row_lengths(keys, tf.cast(splits, tf.int64)).to_tensor(
            default_value=-1, shape=tf.stack([tf.constant(shards, tf.int64),
                                              tf.cast(capacity, tf.int64)]))
        # As owner 0, dedup every slot (what an owner receives from `shards` requesters): each
        # key is moved to shard 0's row of the same local index, so the volume is the real one.
        received = tf.where(padded >= 0, padded // shards * shards, -1)
        local_rows, slot_to_unique = ops.owner_rounds(received, tf.reshape(splits, [-1, 1]),
                                                      tf.reshape(capacity, [1]), shards, 0)
        local_rows, slot_to_unique = local_rows[0], slot_to_unique[0]
        slot = ops.bucket_slots(splits, capacity)
        return local_rows, slot_to_unique, tf.gather(slot, inverse), shards * capacity

    local_rows, slot_to_unique, rebuild, slots = route()
    table = tf.random.uniform([int(tf.reduce_max(local_rows)) + 1, dim])

    @tf.function
    def retrieve():
        with tf.GradientTape() as tape:
            tape.watch(table)
            owned = tf.gather(table, local_rows)
            outgoing = ops.gather_rows(owned, slot_to_unique)
            rows = ops.gather_rows(outgoing, rebuild)
            loss = tf.reduce_sum(rows)
        return tf.convert_to_tensor(tape.gradient(loss, table))[:1]

    sizes = {"ids": int(ids.shape[0]), "shards": shards,
             "unique": int(tf.size(tf.unique(ids)[0])), "slots": int(slots),
             "owner_rows": int(tf.size(local_rows))}
    return route, retrieve, sizes


def training_run(pipeline, batch, table_scale, dim, micro_batches, strategy=None):
    """(model, dataset) of the DLRM example on `batch` samples per step, trained by this process
    alone: NestPipeStrategy with one worker (`pipeline`), no strategy for pipeline "plain",
    or `strategy`."""
    table_sizes = criteo_kaggle_table_sizes(table_scale)
    log = SyntheticClickLog(table_sizes, seed=1)
    if pipeline == "plain":  # no strategy at all (the same model, tables unsharded)
        strategy = tf.distribute.get_strategy()
    elif strategy is None:
        strategy = tnp.NestPipeStrategy(
            pipeline=tnp.PipelineConfig(pipeline, micro_batches=micro_batches))
    model = dlrm.build_compiled_dlrm(strategy, "fused", table_sizes, dim)
    dataset = dlrm.make_dataset_fn(log, 0, 20, batch, repeat=True)(tf.distribute.InputContext())
    return model, dataset


def train_interleaved(runs, rounds, steps, warmup):
    """Trains every (model, dataset) of `runs` for `warmup` steps, then `rounds` times `steps`
    steps each, in turn; returns per run the per-round lists of step times in ms (the first
    step of each fit call, which re-primes a pipeline, left out)."""
    times = [[] for _ in runs]
    for model, dataset in runs:
        model.fit(dataset, epochs=1, steps_per_epoch=warmup, verbose=0)
    for _ in range(rounds):
        for (model, dataset), out in zip(runs, times):
            timer = dlrm.StepTimer()
            model.fit(dataset, epochs=1, steps_per_epoch=steps + 1, callbacks=[timer], verbose=0)
            out.append([1e3 * t for t in timer.times[1:]])
    return times


def summary(rounds):
    """`best_ms`: the lowest per-round median (the round least disturbed by other processes on
    the shared cores; what the costs use), `median_ms` over all, and the per-round medians."""
    medians = [float(np.median(r)) for r in rounds]
    flat = [t for r in rounds for t in r]
    return {"best_ms": min(medians), "median_ms": float(np.median(flat)),
            "round_medians_ms": medians, "count": len(flat)}


STAGE_POINTS = [(64, 1), (256, 1), (1024, 1), (64, 2), (256, 2), (1024, 2), (256, 16),
                (256, 128), (64, 1024)]


def single(args):
    """Routing/retrieval microbenchmarks and the one-worker DLRM step; prints RESULT."""
    load_before = os.getloadavg()[0]
    table_sizes = criteo_kaggle_table_sizes(args.table_scale)
    vocab = int(sum(table_sizes))
    log = SyntheticClickLog(table_sizes, seed=1)

    @tf.function
    def noop():
        return tf.ones([1])

    fns, stages = [noop], []
    for samples, shards in STAGE_POINTS:
        route, retrieve, sizes = stage_functions(fused_ids(log, table_sizes, samples), shards,
                                                 vocab, args.dim)
        fns += [route, retrieve]
        stages.append(dict(sizes, samples=samples))
    rounds = timed(fns, args.rounds)
    for i, stage in enumerate(stages):
        # Per round: the stage's median minus the empty function's, then the best round.
        for name, k in (("route_ms", 1 + 2 * i), ("retrieve_ms", 2 + 2 * i)):
            diffs = [a - b for a, b in zip(rounds[k], rounds[0])]
            stage[name] = max(min(diffs), 0.0)
            stage[name.replace("_ms", "_median_ms")] = max(statistics.median(diffs), 0.0)
        print("stage", stage, flush=True)
    configs = [("none", b) for b in (128, 256, 512)]
    configs += [(p, b) for p in ("dbp", "fwp", "nested") for b in (256, 512)]
    configs += [("plain", b) for b in (128, 256)]  # the reference of the contention factor
    runs = [training_run(p, b, args.table_scale, args.dim, args.micro_batches) for p, b in configs]
    times = train_interleaved(runs, args.rounds, args.steps, args.warmup)
    dense_params = int(sum(np.prod(v.shape) for v in runs[0][0].trainable_variables
                           if "embeddings" not in v.name))
    steps = [dict(summary(t), pipeline=p, batch=b, micro_batches=args.micro_batches)
             for (p, b), t in zip(configs, times)]
    for step in steps:
        print("step", step, flush=True)
    print("RESULT " + json.dumps({
        "stages": stages, "steps": steps, "table_scale": args.table_scale, "dim": args.dim,
        "fields": len(table_sizes), "vocab": vocab, "dense_params": dense_params,
        "call_overhead_ms": min(rounds[0]), "loadavg": [load_before, os.getloadavg()[0]]}),
        flush=True)


def cluster(args):
    """Collective sweeps on every worker, then concurrent compute-only training; prints RESULT."""
    load_before = os.getloadavg()[0]
    strategy = tnp.NestPipeStrategy(transport=args.collectives)
    collectives = strategy.extended.collectives
    workers = strategy.num_workers
    noop, probes = collective_probes(strategy, "plan")
    sweeps = [("all_to_all", probes["all_to_all"], [1 << 10, 32 << 10, 256 << 10, 1 << 20]),
              ("all_gather", probes["all_gather"], [8, 4 << 10, 64 << 10]),
              ("all_reduce", probes["all_reduce"], [4 << 10, 128 << 10, 1 << 20])]
    labels, fns = [], [noop]
    for name, make, sizes in sweeps:
        for size in sizes:
            nbytes, fn = make(size)
            labels.append((name, nbytes))
            fns.append(fn)
    rounds = timed(fns, args.rounds)  # the same call order on every worker
    result = {"workers": workers, "call_overhead_ms": min(rounds[0]),
              "collectives": {name: [] for name, _, _ in sweeps},
              "collectives_median": {name: [] for name, _, _ in sweeps}}
    for (name, nbytes), times in zip(labels, rounds[1:]):
        diffs = [a - b for a, b in zip(times, rounds[0])]
        result["collectives"][name].append([nbytes, max(min(diffs), 0.0)])
        result["collectives_median"][name].append([nbytes, max(statistics.median(diffs), 0.0)])
    result["transport"] = collectives.backend
    if args.collectives_only:
        if strategy.worker_index == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    # Compute-only: every worker trains alone on its share of the global batch, all at once.
    barrier = tf.function(lambda: collectives.all_gather(tf.ones([1]), "plan/barrier"))
    barrier().numpy()
    run = training_run("plain", args.global_batch // workers, args.table_scale, args.dim, 1)
    result["compute_only"] = dict(summary(train_interleaved([run], args.rounds, args.steps,
                                                            args.warmup)[0]),
                                  batch=args.global_batch // workers)
    result["global_batch"] = args.global_batch
    result["loadavg"] = [load_before, os.getloadavg()[0]]
    barrier().numpy()
    if strategy.worker_index == 0:
        print("RESULT " + json.dumps(result), flush=True)


def main():
    """Parses the flags and runs `single` or `cluster`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["single", "cluster"])
    parser.add_argument("--global-batch", type=int, default=512, help="cluster: split over workers")
    parser.add_argument("--steps", type=int, default=8, help="fit steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=8, help="fit steps before the first round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--collectives", default="auto", choices=["auto", "tf"],
                        help="cluster: the strategy's transport (auto: the socket mesh)")
    parser.add_argument("--collectives-only", action="store_true",
                        help="cluster: the collective sweeps only (no compute-only training)")
    args = parser.parse_args()
    single(args) if args.what == "single" else cluster(args)


if __name__ == "__main__":
    main()
