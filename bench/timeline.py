"""Communication exposure of the DLRM step on 2 workers, pipeline none vs dbp vs fwp vs nested,
from profiler traces.

    python bench/timeline.py [--latency-ms 0 3]

Writes bench/results/timeline.md and Chrome traces bench/results/timeline_{none,dbp,fwp,nested}.json
(open them in chrome://tracing or ui.perfetto.dev).
"""
import argparse
import os
import time

from runner import HERE, run_program, write_result

from emulated_latency import ENV as EMULATED_LATENCY_ENV


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 3.0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for latency in args.latency_ms:
        for pipeline in ("none", "dbp", "fwp", "nested"):
            trace = (os.path.join(HERE, "results", "timeline_%s.json" % pipeline)
                     if latency == args.latency_ms[0] else "")
            result = run_program([os.path.join(HERE, "dlrm_worker.py"), "--mode", "nestpipe",
                                  "--pipeline", pipeline, "--steps", "20", "--warmup", "5",
                                  "--profile-steps", str(args.steps), "--trace", trace],
                                 workers=2, env={EMULATED_LATENCY_ENV: str(latency)})
            rows.append((latency, result))
            print(latency, result, flush=True)
    lines = ["# Communication exposure per step (worker 0 of 2), from TensorFlow profiler traces", "",
             "Command: `python bench/timeline.py --latency-ms %s --steps %d`" % (
                 " ".join("%g" % l for l in args.latency_ms), args.steps), "",
             "DLRM example (fused tables), tf_keras fit's train function, after 23 warm-up steps; "
             "medians over %d profiled steps. Stage times are the union of their ops' intervals; "
             "exposure = time a collective runs while no other op runs / time collectives run. "
             "Emulated latency: a benchmark-only sleep before each embedding collective. The profiler "
             "itself slows steps down. Chrome traces of the first setting: "
             "`bench/results/timeline_{none,dbp,fwp,nested}.json` (fwp, nested: 4 micro-batches). Date: %s."
             % (args.steps, time.strftime("%Y-%m-%d")), "",
             "| latency | pipeline | step ms | communication ms | exposed ms | exposure | routing ms | retrieval ms | sync ms | compute ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for latency, r in rows:
        s = r["stage_ms"]
        lines.append("| %g ms | %s | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f | %.1f |" % (
            latency, r["pipeline"], r["profiled_step_ms"], r["communication_ms"], r["exposed_ms"],
            r["exposure_ratio"], s["routing"], s["retrieval"], s["sync"], s["compute"]))
    write_result("timeline.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
