"""Where each pipeline's step CPU goes, measured in the same worker processes.

    python bench/probe_profile.py --output NAME [--workers 2] [--frequency 1000] \\
        -- --model dlrm --data synthetic --tables per_table --synthetic-tables 8:100000 \\
           --global-batch 1024 --dim 16 --micro-batches 2 --auto-timed-steps 10 \\
           --auto-probe-rounds 40

Runs one auto row of bench/compare_worker.py (ours, pipeline="auto", the arguments after `--`
added) with its probe's steps logged (`AutoPipeline.probe_log`, `--probe-steps-out`) and worker
0 recorded by `perf record -k CLOCK_MONOTONIC` (every thread of the process: TensorFlow's pools,
the socket mesh's), then gives each sample to the probe step it fell in. Every candidate of the
probe ran interleaved with the others in the same processes (`auto.round_order`), so the
launch-to-launch spread of this machine (identical code measured 3.4-3.9 ms/step in separate
launches) is not in the differences. Per candidate it prints the timed steps, their mean wall
ms/step, the CPU ms per timed step (the samples' periods), the CPU per step by category
(TensorFlow kernels, the executor and framework, allocation, copies, Python, the OS kernel, our
ops, JIT code, ...) and the symbols whose CPU per step differs most from the first candidate's
(none). A symbol's difference below ~2 samples per step-count is sampling noise: with 400 timed
steps at 1000 Hz one sample is 2.5 us per step.

Needs `perf` (linux-tools) with permission to record another process (root, or
kernel.perf_event_paranoid <= 1). Writes bench/results/NAME.md and NAME.json.
"""
import argparse
import bisect
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from runner import HERE, write_result

RESULTS = os.path.join(HERE, "results")
WORKER = os.path.join(HERE, "compare_worker.py")

# (category, dso pattern, symbol pattern), first match wins; dso is the file name only.
CATEGORY_RULES = (
    ("allocation", r"", r"malloc|free\b|cfree|memalign|unlink_chunk|Allocat|operator new|"
                        r"operator delete|_int_free|malloc_consolidate"),
    ("copies (memcpy / memset)", r"^libc", r"mem(move|cpy|set)"),
    ("Python", r"^libpython", r""),
    ("OS kernel (scheduling, sockets)", r"^\[kernel", r""),
    ("our ops", r"^_nestpipe", r""),
    ("TensorFlow executor and framework", r"^libtensorflow_framework", r""),
    ("TensorFlow kernels", r"^libtensorflow_cc", r""),
    ("JIT code (oneDNN)", r"^perf-(\d+|PID)\.map$", r""),  # PID: bound_profile's
    ("libc, other", r"^libc", r""),
)
SAMPLE_LINE = re.compile(r"\s*([\d.]+):\s+(\d+)\s+[0-9a-f]+\s+(.*)\s+\((.*)\)\s*$")


def category(dso, symbol):
    """The category of a sample in `dso` (a file name) at `symbol` (see CATEGORY_RULES)."""
    for name, dso_pattern, symbol_pattern in CATEGORY_RULES:
        if re.search(dso_pattern, dso) and (not symbol_pattern or re.search(symbol_pattern, symbol)):
            return name
    return "other: " + dso


def parse_samples(text):
    """`perf script -F time,period,ip,sym,dso -G` output -> [(seconds, period ns, dso file
    name, symbol)]."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line)
        if match:
            seconds, period, symbol, dso = match.groups()
            samples.append((float(seconds), int(period), os.path.basename(dso), symbol))
    return samples


def attribute(samples, steps, key=lambda sample: (sample[2], sample[3])):
    """Gives each sample (`(seconds, period ns, ...)`) to the timed probe step (`{"candidate",
    "start", "end", "timed"}`) it fell in; samples outside every timed step are dropped.
    Returns {candidate: {key(sample): CPU seconds}}, by default keyed by (dso, symbol)."""
    timed = sorted((s["start"], s["end"], s["candidate"]) for s in steps if s["timed"])
    starts = [start for start, _, _ in timed]
    cpu = collections.defaultdict(collections.Counter)
    for sample in samples:
        seconds, period = sample[0], sample[1]
        i = bisect.bisect_right(starts, seconds) - 1
        if i >= 0 and seconds <= timed[i][1]:
            cpu[timed[i][2]][key(sample)] += period * 1e-9
    return cpu


def summarize(samples, steps, top=25):
    """{candidate: {"steps", "wall_ms", "cpu_ms", "categories_us": {name: us/step},
    "symbols_us": {"dso symbol": us/step}}} (per timed step) and, for each candidate after the
    first, its `top` symbols by CPU per step above the first's."""
    cpu = attribute(samples, steps)
    order = list(dict.fromkeys(s["candidate"] for s in steps))
    summary = {}
    for name in order:
        timed = [s for s in steps if s["timed"] and s["candidate"] == name]
        count = max(len(timed), 1)
        per_symbol = {"%s %s" % key: 1e6 * v / count for key, v in cpu[name].items()}
        per_category = collections.Counter()
        for (dso, symbol), seconds in cpu[name].items():
            per_category[category(dso, symbol)] += 1e6 * seconds / count
        summary[name] = {"steps": len(timed),
                         "wall_ms": 1e3 * sum(s["end"] - s["start"] for s in timed) / count,
                         "cpu_ms": 1e3 * sum(cpu[name].values()) / count,
                         "categories_us": dict(per_category), "symbols_us": per_symbol}
    base = summary[order[0]] if order else None
    for name in order[1:]:
        mine, theirs = summary[name]["symbols_us"], base["symbols_us"]
        more = sorted(set(mine) | set(theirs),
                      key=lambda k: -(mine.get(k, 0.0) - theirs.get(k, 0.0)))[:top]
        summary[name]["top_symbols_over_base"] = [
            (k, theirs.get(k, 0.0), mine.get(k, 0.0)) for k in more]
    return summary


def report_lines(summary, command):
    """The markdown report of `summarize`'s result."""
    names = list(summary)
    if not names:
        return ["No timed probe steps were recorded."]
    base = names[0]
    lines = ["# Same-process CPU per pipeline (auto's probe, worker 0)", "",
             "Command: `%s`" % command, "",
             "| candidate | timed steps | wall ms/step (mean) | CPU ms/step | vs %s (wall / CPU) |"
             % base, "|---|---|---|---|---|"]
    for name in names:
        s, b = summary[name], summary[base]
        lines.append("| %s | %d | %.3f | %.3f | %.3fx / %.3fx |" % (
            name, s["steps"], s["wall_ms"], s["cpu_ms"], s["wall_ms"] / max(b["wall_ms"], 1e-9),
            s["cpu_ms"] / max(b["cpu_ms"], 1e-9)))
    categories = sorted({c for s in summary.values() for c in s["categories_us"]},
                        key=lambda c: -summary[base]["categories_us"].get(c, 0.0))
    lines += ["", "CPU us per timed step by category:", "",
              "| category | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for c in categories:
        values = [summary[n]["categories_us"].get(c, 0.0) for n in names]
        lines.append("| %s | " % c + " | ".join(
            "%.0f" % v if n == base else "%.0f (%+.0f)" % (v, v - values[0])
            for n, v in zip(names, values)) + " |")
    for name in names[1:]:
        lines += ["", "%s: the symbols with the most CPU per step above %s's (us/step):" % (
            name, base), "", "| symbol | %s | %s | difference |" % (base, name), "|---|---|---|---|"]
        for symbol, theirs, mine in summary[name]["top_symbols_over_base"]:
            lines.append("| `%s` | %.1f | %.1f | %+.1f |" % (symbol[:110], theirs, mine,
                                                             mine - theirs))
    return lines


def _worker_zero_pid(timeout_s=120.0):
    """The pid of the local cluster's worker 0 (TF_CONFIG task index 0) running compare_worker."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for environ in glob.glob("/proc/[0-9]*/environ"):
            pid = environ.split("/")[2]
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as f:
                    if b"compare_worker.py" not in f.read():
                        continue
                with open(environ, "rb") as f:
                    variables = f.read().split(b"\0")
            except OSError:
                continue
            config = next((v[len(b"TF_CONFIG="):] for v in variables
                           if v.startswith(b"TF_CONFIG=")), None)
            if config and json.loads(config).get("task", {}).get("index") == 0:
                return int(pid)
        time.sleep(0.2)
    raise RuntimeError("worker 0 of the cluster did not start within %.0f s" % timeout_s)


def record_worker_zero(command, data, frequency, log_path, call_graph=False, write_s=60):
    """Runs `command` (a local cluster of compare_worker tasks, with TF_USE_LEGACY_KERAS=1) with
    its output in `log_path`, and records its worker 0 with `perf record -k CLOCK_MONOTONIC` at
    `frequency` Hz into `data` (with `call_graph`, call chains too: `-g`) until the cluster
    exits, giving perf `write_s` seconds after it to write its data. Returns the cluster's exit
    code."""
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    record = ["perf", "record"] + (["-g"] if call_graph else []) + [
        "-k", "CLOCK_MONOTONIC", "-F", str(frequency), "-o", data]
    with open(log_path, "w") as log:
        cluster = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            recorder = subprocess.Popen(record + ["-p", str(_worker_zero_pid())],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            code = cluster.wait()
            recorder.wait(timeout=write_s)
        finally:
            if cluster.poll() is None:
                cluster.kill()
    return code


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="bench/results/OUTPUT.md and .json")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--frequency", type=int, default=1000, help="perf samples per second")
    parser.add_argument("--top", type=int, default=25, help="symbols listed per candidate")
    parser.add_argument("worker_args", nargs=argparse.REMAINDER,
                        help="after --: bench/compare_worker.py arguments")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        sys.exit("probe_profile needs `perf` (install linux-tools for this kernel)")
    extra = [a for a in args.worker_args if a != "--"]
    folder = tempfile.mkdtemp(prefix="probe_profile_")
    steps_path = os.path.join(folder, "steps_{rank}.json")
    data = os.path.join(folder, "perf.data")
    command = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(args.workers),
               "--", sys.executable, "-u", WORKER, "--system", "nestpipe", "--pipeline", "auto",
               "--collectives", "sockets", "--profile-steps", "0",
               "--probe-steps-out", steps_path] + extra
    code = record_worker_zero(command, data, args.frequency,
                              os.path.join(folder, "cluster.log"))
    if code != 0 or not os.path.exists(steps_path.format(rank=0)):
        sys.exit("the auto row failed (exit %s); its output: %s"
                 % (code, os.path.join(folder, "cluster.log")))
    with open(steps_path.format(rank=0)) as f:
        steps = json.load(f)
    text = subprocess.run(["perf", "script", "-i", data, "-F", "time,period,ip,sym,dso", "-G"],
                          capture_output=True, text=True, check=True).stdout
    summary = summarize(parse_samples(text), steps, args.top)
    shown = "python bench/probe_profile.py " + " ".join(sys.argv[1:])
    write_result(args.output + ".md", "\n".join(report_lines(summary, shown)) + "\n")
    with open(os.path.join(RESULTS, args.output + ".json"), "w") as f:
        json.dump({"command": shown, "candidates": summary}, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
