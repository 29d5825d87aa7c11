"""Parameter-server mode side by side: DOWNPOUR with update windows T=1/3/10
(`tnp.ParameterServerStrategy` + `tnp.DownpourTrainer`) vs TensorFlow's own
`tf.distribute.ParameterServerStrategy` with `tf_keras.layers.Embedding`, on the same
chief + 2 workers + 2 ps cluster, the same model, MovieLens-1M data and samples; plus the
synchronous `tnp.NestPipeStrategy` (2 workers, tf_keras fit) as the convergence reference.

    python bench/ps.py [--steps 1740] [--warmup 30] [--batch 512] [--windows 1 3 10]

Every run trains for the same `--steps` batches of `--batch` samples (warm-up included) and is
a separate launcher invocation (bench/ps_worker.py describes the model and what is measured):
samples/s after warm-up, gradient bytes pushed to the ps per sample (float32 values x 4,
indices not counted), parameter bytes pulled per sample, and the exact held-out AUC on
MovieLens-1M's test split scored on the chief. It checks the issue's convergence target:
DOWNPOUR T=3 within 0.01 AUC of the synchronous run after the same number of samples.
Writes bench/results/ps.md.
"""
import argparse
import os
import time

from runner import HERE, run_program, write_result

PS_CLUSTER = ["--ps", "2", "--chief"]
AUC_TOLERANCE = 0.01


def run_mode(args, mode, window=None):
    """Runs bench/ps_worker.py in `mode` on its cluster; returns its result dict plus the
    1-minute load average seen just before the run and the run's wall time (launch included)."""
    argv = [os.path.join(HERE, "ps_worker.py"), "--mode", mode, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch", str(args.batch), "--dim", str(args.dim),
            "--learning-rate", str(args.learning_rate), "--local-lr", str(args.local_lr),
            "--min-shard-bytes", str(args.min_shard_bytes)]
    if window is not None:
        argv += ["--window", str(window)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    flags = [] if mode == "sync" else PS_CLUSTER
    result = run_program(argv, workers=2, launcher_flags=flags, timeout=args.timeout)
    result["load_before"] = load
    result["run_seconds"] = time.perf_counter() - start
    print(mode, window, {k: v for k, v in result.items() if k != "shards"}, flush=True)
    return result


def table(results, baseline):
    """Markdown table rows of the runs (ratios against the tf_pss run `baseline`)."""
    sync = results.get("sync")
    lines = ["| run | cluster | T | samples/s | vs tf_pss | pushed B/sample | pulled B/sample | "
             "train loss (last 5%) | held-out AUC | AUC - sync | load before | run s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        cluster = "2 workers" if r["mode"] == "sync" else "chief + 2 workers + 2 ps"
        pushed = "-"
        if "pushed_bytes_per_sample" in r:
            pushed = "%.1f" % r["pushed_bytes_per_sample"]
            if "pushed_distinct_bytes_per_sample" in r:
                pushed += " (%.1f distinct rows)" % r["pushed_distinct_bytes_per_sample"]
        pulled = "%.1f" % r["pulled_bytes_per_sample"] if "pulled_bytes_per_sample" in r else "-"
        ratio = "%.2fx" % (r["samples_per_s"] / baseline["samples_per_s"]) if baseline else "-"
        delta = "%+.4f" % (r["auc"] - sync["auc"]) if sync else "-"
        lines.append("| %s | %s | %s | {:,.0f} | %s | %s | %s | %.4f | %.4f | %s | %.1f | %.0f |".format(
            r["samples_per_s"]) % (name, cluster, r["window"] or "-", ratio, pushed, pulled,
            r["final_train_loss"], r["auc"], delta, r["load_before"], r["run_seconds"]))
    return lines


def shard_text(results):
    """The ps shards of each table in the PS runs (one list when they all agree)."""
    layouts = {name: ", ".join("%s %d" % item for item in sorted(r["shards"].items()))
               for name, r in results.items() if "shards" in r}
    counts = {tuple(sorted(r["shards"].values())) for r in results.values() if "shards" in r}
    if len(counts) == 1:
        return "%s (the same counts in every PS run)" % layouts["tf_pss"]
    return "; ".join("%s: %s" % item for item in layouts.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1740,
                        help="batches per run, warm-up included (a multiple of every T)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed first batches")
    parser.add_argument("--batch", type=int, default=512, help="samples per step")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 3, 10])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=0.3, help="(global) Adagrad")
    parser.add_argument("--local-lr", type=float, default=0.1, help="DOWNPOUR local SGD")
    parser.add_argument("--min-shard-bytes", type=int, default=64 << 10)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    args = parser.parse_args()
    for window in args.windows:
        if args.steps % window or args.warmup % window:
            raise SystemExit("--steps and --warmup must be multiples of every window (T=%d)"
                             % window)
    started = time.perf_counter()
    results = {"tf_pss": run_mode(args, "tf_pss")}
    for window in args.windows:
        results["downpour T=%d" % window] = run_mode(args, "downpour", window)
    results["sync"] = run_mode(args, "sync")
    total = time.perf_counter() - started

    baseline, sync = results["tf_pss"], results["sync"]
    samples = args.steps * args.batch
    first = next(iter(results.values()))
    lines = [
        "# Parameter-server mode: DOWNPOUR T=%s vs tf.distribute.ParameterServerStrategy"
        % "/".join(str(w) for w in args.windows), "",
        "Command: `python bench/ps.py --steps %d --warmup %d --batch %d --windows %s --dim %d "
        "--learning-rate %g --local-lr %g --min-shard-bytes %d` (total %.0f s, %s)." % (
            args.steps, args.warmup, args.batch, " ".join(str(w) for w in args.windows),
            args.dim, args.learning_rate, args.local_lr, args.min_shard_bytes, total,
            time.strftime("%Y-%m-%d")), "",
        "## Setup", "",
        "- Data: MovieLens-1M (`tf_nestpipe.data`, label rating >= 4), train split ({:,} "
        "ratings, time-ordered first 90%%); every run trains on {:,} steps x {:,} = {:,} samples "
        "(%.2f epochs), the first %d steps untimed warm-up. Held-out AUC: exact ROC AUC over the "
        "whole test split ({:,} latest ratings), scored on the chief (sync: worker 0) with a plain "
        "copy of the trained global parameters.".format(
            first["train_rows"], args.steps, args.batch, samples, first["test_rows"]) % (
            samples / first["train_rows"], args.warmup),
        "- Model (all runs): one embedding table (dim %d) per single-hot feature (user, item, age, "
        "gender, occupation, zip, year) + mean-pooled genres, concat, ReLU MLP 64-32-1, "
        "binary cross-entropy on the logit; {:,} parameters. Global optimizer tf_keras Adagrad "
        "%g everywhere.".format(first["parameters"]) % (args.dim, args.learning_rate),
        "- tf_pss: `tf.distribute.ParameterServerStrategy` + `ClusterCoordinator`, "
        "`MinSizePartitioner(min_shard_bytes=%d, max_shards=2)`, `tf_keras.layers.Embedding` "
        "per feature; a scheduled custom step (forward, backward, Adagrad `apply_gradients` on "
        "the ps variables): every step pushes its gradient. Shards per table: %s." % (
            args.min_shard_bytes, shard_text(results)),
        "- downpour T: `tnp.ParameterServerStrategy(variable_partitioner=tnp.MinSizePartitioner("
        "%d), update_window=T, local_optimizer=tnp.LocalSGD(%g))` + `tnp.DownpourTrainer` with "
        "`tnp.ShardedEmbedding` per feature; one scheduled window = pull the dense "
        "parameters and the table rows its batches read, T local steps of one batch each, push the summed (deduplicated) gradient; %d / T "
        "windows." % (args.min_shard_bytes, args.local_lr, args.steps),
        "- PS runs: `python -m tf_nestpipe.launch --workers 2 --ps 2 --chief`; each worker "
        "reads the whole train split in its own random order (per-worker dataset, shuffled "
        "with an unseeded shuffle, repeated), as in TF's parameter-server guide; steps are "
        "scheduled, then joined.",
        "- sync: `tnp.NestPipeStrategy` on `--workers 2` (no ps, no chief: a different cluster "
        "type), tf_keras `fit` on global batches of %d (AutoShard FILE, %d per worker), same "
        "model, Adagrad and number of samples (one pass, seeded shuffle)." % (
            args.batch, args.batch // 2),
        "- samples/s: samples of the steps after warm-up / wall time from the join after "
        "warm-up to the join after the last step (sync: end of the warm-up step to the end of "
        "the last step). One run each; 5 (PS) or 2 (sync) processes share 2 CPU cores, and "
        "other jobs may be running (the 1-minute load average before each run is listed).",
        "- pushed B/sample: gradient values sent to the ps x 4 bytes / samples trained (all "
        "steps). downpour: the trainer's count of the pushed, deduplicated window sums. "
        "tf_pss: counted in its step: dense gradient sizes + the embedding gradients' "
        "`IndexedSlices` values (one row per looked-up id, duplicates included, as TF sends "
        "them); in parentheses the same with each distinct row once (what a deduplicating push "
        "would send). sync pushes nothing (all-to-all / all-reduce between workers).",
        "- pulled B/sample: parameter values read from the ps x 4 / samples. downpour: the "
        "trainer's count: the dense parameters whole plus each table row the window's batches "
        "read, once per window (rows are pulled step by step, each step's new rows while the "
        "previous step computes). tf_pss: the dense parameters plus one embedding row per "
        "looked-up id, per step.", "",
        "## Results", ""]
    lines += table(results, baseline)
    lines.append("")
    for window in args.windows:
        r = results["downpour T=%d" % window]
        lines.append("- DOWNPOUR T=%d: %.2fx tf_pss's samples/s, pushes %.1f B/sample (tf_pss "
                     "%.1f, %.2fx)." % (
                         window, r["samples_per_s"] / baseline["samples_per_s"],
                         r["pushed_bytes_per_sample"], baseline["pushed_bytes_per_sample"],
                         r["pushed_bytes_per_sample"] / baseline["pushed_bytes_per_sample"]))
    if "downpour T=3" in results:
        t3 = results["downpour T=3"]
        gap = t3["auc"] - sync["auc"]
        met = gap >= -AUC_TOLERANCE  # a T=3 AUC above the synchronous one also reaches it
        lines += ["", "**Convergence target (DOWNPOUR T=3 reaches a held-out AUC within %.2f of "
                  "the synchronous run after the same {:,} samples): %s** — T=3 held-out AUC %.4f, sync %.4f "
                  "(difference %+.4f).".format(samples) % (
                      AUC_TOLERANCE, "met" if met else "NOT met", t3["auc"], sync["auc"], gap)]
    write_result("ps.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
