"""Per-step time of NestPipeStrategy on 2 workers vs one process vs MultiWorkerMirroredStrategy.

Same DLRM model, same synthetic Criteo-shaped data, same global batch, run one after another in
one invocation; prints the ratios and writes bench/results/step_time.md.

    python bench/step_time.py [--steps 60] [--rounds 2]
"""
import argparse
import os
import statistics
import time

from runner import HERE, run_program, write_result
MODES = [("single", 1), ("nestpipe", 2), ("nestpipe_per_table", 2), ("mwms", 2)]
# Collectives issued per training step by the embedding path (26 tables).
EMBEDDING_COLLECTIVES = {
    "single": "0",
    "nestpipe": "4 (1 counts all-gather, 2 all-to-alls fwd, 1 bwd) for all 26 tables",
    "nestpipe_per_table": "104 (4 per table)",
    "mwms": "52 all-gathers (shapes + values of 26 IndexedSlices gradients)",
}


def run_mode(mode, workers, args):
    return run_program([os.path.join(HERE, "dlrm_worker.py"), "--mode", mode, "--steps", str(args.steps),
                        "--global-batch", str(args.global_batch), "--table-scale", str(args.table_scale)],
                       workers=workers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of all modes")
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--table-scale", type=float, default=0.002)
    args = parser.parse_args()
    results = {mode: [] for mode, _ in MODES}
    for _ in range(args.rounds):
        for mode, workers in MODES:
            results[mode].append(run_mode(mode, workers, args))
            print(mode, results[mode][-1], flush=True)
    median = {m: statistics.median(r["median_ms"] for r in runs) for m, runs in results.items()}
    p90 = {m: statistics.median(r["p90_ms"] for r in runs) for m, runs in results.items()}
    lines = [
        "# Step time: NestPipeStrategy vs one process vs MultiWorkerMirroredStrategy",
        "",
        "Command: `python bench/step_time.py --steps %d --rounds %d --global-batch %d --table-scale %g`"
        % (args.steps, args.rounds, args.global_batch, args.table_scale),
        "",
        "DLRM example (26 Criteo-Kaggle-shaped tables scaled by %g, dim 16), synthetic Zipf data, "
        "global batch %d, tf_keras fit, Adagrad; all workers on the same 2 CPU cores; median over "
        "steps after 10 warm-up steps, median over %d interleaved rounds. Date: %s."
        % (args.table_scale, args.global_batch, args.rounds, time.strftime("%Y-%m-%d")),
        "",
        "| mode | workers | ms/step (median) | ms/step (p90) | samples/s | vs single | embedding collectives/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, workers in MODES:
        lines.append("| %s | %d | %.1f | %.1f | %.0f | %.2fx | %s |" % (
            mode, workers, median[mode], p90[mode], args.global_batch / median[mode] * 1e3,
            median["single"] / median[mode], EMBEDDING_COLLECTIVES[mode]))
    lines += [
        "",
        "Ratios: NestPipe (fused) is **%.2fx** faster per step than MWMS; per-table NestPipe is "
        "%.2fx faster than MWMS; fusing the tables' lookups gives %.2fx. Distribution efficiency on the "
        "same cores E = single / cluster = %.2f." % (
            median["mwms"] / median["nestpipe"], median["mwms"] / median["nestpipe_per_table"],
            median["nestpipe_per_table"] / median["nestpipe"], median["single"] / median["nestpipe"]),
    ]
    write_result("step_time.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
