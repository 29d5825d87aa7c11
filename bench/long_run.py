"""Repeated long runs of the main job: does every worker leave `fit` together? (issue 17's row
"dbp, 2 workers x 1,500 steps, 3 runs: once, worker 0 stayed in fit 8.7 s after worker 1
finished, until a heartbeat abort").

    python bench/long_run.py [--runs 3] [--workers 2] [--steps 1500] [--pipeline dbp]
                             [--out bench/results/long_run.md]

Each run is `python -m tf_nestpipe.launch --workers W -- python examples/dlrm.py --data
synthetic --steps S --pipeline P`; the table lists each run's exit code, every worker's exit time
as the launcher reports it (`[launch] worker:i: exit C after T s`), the largest gap between
workers, and the median step time the example prints. A run whose gap exceeds 2 s, or whose
exit code is not 0, is a reproduction.
"""
import argparse
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT = re.compile(r"\[launch\] (worker:\d+): exit (-?\d+) after ([\d.]+) s")
STEP = re.compile(r"([\d.]+) ms/step \(median\)")


def one_run(args, log_dir):
    """Runs the job once; returns (exit code, {task: seconds}, ms/step or None, seconds)."""
    argv = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(args.workers),
            "--log-dir", log_dir, "--", sys.executable, os.path.join(REPO, "examples", "dlrm.py"),
            "--data", "synthetic", "--steps", str(args.steps), "--pipeline", args.pipeline]
    start = time.time()
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=args.timeout, cwd=REPO)
    exits = {m.group(1): float(m.group(3)) for m in EXIT.finditer(result.stdout)}
    step = STEP.search(result.stdout)
    return result.returncode, exits, float(step.group(1)) if step else None, time.time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--pipeline", default="dbp")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = ["| run | exit code | workers' exit (s after start) | largest gap (s) | ms/step | "
            "reproduced |", "|---|---|---|---|---|---|"]
    for run in range(1, args.runs + 1):
        log_dir = os.path.join("/tmp", "nestpipe_long_run_%d_%d" % (os.getpid(), run))
        code, exits, step, _ = one_run(args, log_dir)
        gap = max(exits.values()) - min(exits.values()) if len(exits) == args.workers else None
        reproduced = code != 0 or gap is None or gap > 2.0
        rows.append("| %d | %d | %s | %s | %s | %s |" % (
            run, code, ", ".join("%s %.1f" % kv for kv in sorted(exits.items())),
            "%.1f" % gap if gap is not None else "-", "%.1f" % step if step else "-",
            "yes (logs: %s)" % log_dir if reproduced else "no"))
        print(rows[-1], flush=True)
    text = ("`python bench/long_run.py --runs %d --workers %d --steps %d --pipeline %s`\n\n"
            % (args.runs, args.workers, args.steps, args.pipeline)) + "\n".join(rows) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
