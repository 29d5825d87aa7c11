"""DLRM ms/step on 2 workers: NestPipeStrategy with TF collectives vs Horovod collectives.

Same model, data, global batch and pipeline; the two backends alternate in interleaved rounds
(so load from other jobs hits both alike). Prints the table and writes
bench/results/horovod_step_time.md.

    python bench/horovod_step_time.py [--steps 60] [--rounds 2] [--pipelines none,dbp]
"""
import argparse
import os
import statistics
import time

from runner import HERE, run_program, write_result

BACKENDS = ("tf", "horovod")


def run_backend(backend, pipeline, args):
    """One 2-worker run of bench/dlrm_worker.py; returns its RESULT dict."""
    argv = [os.path.join(HERE, "dlrm_worker.py"), "--mode", "nestpipe", "--collectives", backend,
            "--pipeline", pipeline, "--steps", str(args.steps),
            "--global-batch", str(args.global_batch), "--table-scale", str(args.table_scale)]
    flags = ("--horovod",) if backend == "horovod" else ()
    return run_program(argv, workers=2, launcher_flags=flags)


def main():
    """Runs the interleaved rounds and writes bench/results/horovod_step_time.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--pipelines", default="none,dbp")
    args = parser.parse_args()
    pipelines = args.pipelines.split(",")
    results = {(b, p): [] for p in pipelines for b in BACKENDS}
    for _ in range(args.rounds):
        for pipeline in pipelines:
            for backend in BACKENDS:
                results[(backend, pipeline)].append(run_backend(backend, pipeline, args))
                print(backend, pipeline, results[(backend, pipeline)][-1], flush=True)
    lines = [
        "# DLRM step time: TF collectives vs Horovod collectives (NestPipeStrategy, 2 workers)",
        "",
        "Command: `python bench/horovod_step_time.py --steps %d --rounds %d --global-batch %d "
        "--table-scale %g --pipelines %s`" % (args.steps, args.rounds, args.global_batch,
                                             args.table_scale, args.pipelines),
        "",
        "DLRM example (26 Criteo-Kaggle-shaped tables scaled by %g, one fused "
        "ShardedEmbeddingCollection, dim 16), synthetic Zipf data, global batch %d, tf_keras fit, "
        "Adagrad; both workers on the same 2 CPU cores, which other jobs shared during the run; "
        "median over steps after 10 warm-up steps, median over %d interleaved rounds. Horovod "
        "0.28.1 (Gloo, default 1 ms cycle time), launched with `python -m tf_nestpipe.launch "
        "--workers 2 --horovod`. Date: %s."
        % (args.table_scale, args.global_batch, args.rounds, time.strftime("%Y-%m-%d")),
        "",
        "| pipeline | collectives | ms/step (median) | ms/step (p90) | samples/s | vs tf | "
        "median of each round |",
        "|---|---|---|---|---|---|---|",
    ]
    for pipeline in pipelines:
        base = statistics.median(r["median_ms"] for r in results[("tf", pipeline)])
        for backend in BACKENDS:
            runs = results[(backend, pipeline)]
            median = statistics.median(r["median_ms"] for r in runs)
            p90 = statistics.median(r["p90_ms"] for r in runs)
            lines.append("| %s | %s | %.1f | %.1f | %.0f | %.2fx | %s |" % (
                pipeline, backend, median, p90, args.global_batch / median * 1e3, base / median,
                ", ".join("%.1f" % r["median_ms"] for r in runs)))
    write_result("horovod_step_time.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
