"""Step time of the DLRM example on 2 workers with pipeline="none", "dbp" and "fwp", side by side.

    python bench/pipeline.py [--steps 60] [--rounds 2] [--latency-ms 0 3]

Each latency setting adds a benchmark-only sleep before every embedding collective
(NESTPIPE_BENCH_EMULATED_LATENCY_MS) to emulate a slower network: `tc netem` is missing from this
kernel. Writes bench/results/pipeline.md.
"""
import argparse
import os
import statistics
import time

from runner import HERE, run_program, write_result

from tf_nestpipe.strategy.communication import EMULATED_LATENCY_ENV


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 3.0])
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    pipelines = ["none", "dbp", "fwp"]
    median = {}
    for latency in args.latency_ms:
        runs = {p: [] for p in pipelines}
        for _ in range(args.rounds):
            for pipeline in pipelines:
                result = run_program(
                    [os.path.join(HERE, "dlrm_worker.py"), "--mode", "nestpipe", "--pipeline", pipeline,
                     "--steps", str(args.steps), "--global-batch", str(args.global_batch),
                     "--table-scale", str(args.table_scale), "--micro-batches", str(args.micro_batches)],
                    workers=2, env={EMULATED_LATENCY_ENV: str(latency)})
                runs[pipeline].append(result["median_ms"])
                print(latency, pipeline, result, flush=True)
        for pipeline in pipelines:
            median[(latency, pipeline)] = statistics.median(runs[pipeline])
    lines = ["# NestPipe pipelines: step time, none vs dbp vs fwp (2 workers)", "",
             "Command: `python bench/pipeline.py --steps %d --rounds %d --global-batch %d "
             "--table-scale %g --latency-ms %s --micro-batches %d`" % (
                 args.steps, args.rounds, args.global_batch, args.table_scale,
                 " ".join("%g" % l for l in args.latency_ms), args.micro_batches),
             "",
             "DLRM example, one fused ShardedEmbeddingCollection (26 tables), tf_keras fit, "
             "Adagrad, synthetic Zipf data; both workers on the same 2 CPU cores. Emulated latency "
             "= a benchmark-only sleep before each embedding collective (no `tc netem` here); the "
             "dense all-reduce is not delayed. Median ms/step after 10 warm-up steps, median of "
             "%d interleaved rounds. Date: %s." % (args.rounds, time.strftime("%Y-%m-%d")), "",
             "| emulated latency per collective | none (ms/step) | dbp (ms/step) | fwp (ms/step) | dbp speedup | fwp speedup |",
             "|---|---|---|---|---|---|"]
    for latency in args.latency_ms:
        none, dbp, fwp = (median[(latency, p)] for p in pipelines)
        lines.append("| %g ms | %.1f | %.1f | %.1f | %.2fx | %.2fx |" % (
            latency, none, dbp, fwp, none / dbp, none / fwp))
    write_result("pipeline.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
