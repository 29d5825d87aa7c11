"""Where ours' step CPU goes beyond the compute-only bound's, op kernel by op kernel.

    python bench/bound_profile.py --output NAME [--workers 2] [--modes none dbp] [--rounds 2] \\
        [--frequency 500] -- --model dlrm --data synthetic --tables per_table \\
           --synthetic-tables 8:200000 --zipf 1.2 --dim 64 --global-batch 4096 --steps 200 \\
           --warmup 20

The bandwidth family's cells name "its own CPU" as what bounds ours where the network is fast
(bench/results/bandwidth_family.md): ours' worker keeps its core busy with more CPU per step
than a compute-only process on the same share of the batch. This script says where that CPU
goes. Each round launches the compute-only bound (`compare_worker.py --system compute_only`:
W plain tf_keras processes at once, each on its share, no communication) and then ours in each
mode (`--system nestpipe --collectives sockets`), all on loopback, with the arguments after
`--`, and records worker 0 of each launch with `perf record -g -k CLOCK_MONOTONIC` (every
thread: TensorFlow's pools, the socket mesh's). Each sample goes to the timed step it fell in
(`compare_worker.py --steps-out`); the rounds' samples are pooled per system. Per system it
prints the timed steps' mean wall and CPU ms per step, the CPU per step by category of the
sampled function (as bench/probe_profile.py), by the op kernel the sample ran under (the
kernel's own code and what it called: its copies, allocations, ...; samples under no kernel:
"no op kernel: <category>"), and the functions whose CPU per step differs most from the
bound's. Loopback only: the kernel's cost of a real or emulated link (veth, qdisc) is not in it.

Needs `perf` with permission to record another process (root, or
kernel.perf_event_paranoid <= 1). Writes bench/results/NAME.md and NAME.json.
"""
import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import probe_profile
from runner import HERE, write_result

RESULTS = os.path.join(HERE, "results")
WORKER = os.path.join(HERE, "compare_worker.py")
BOUND = "compute_only"

_HEADER = re.compile(r"^\s*(\S.*?)\s+([\d.]+):\s+(\d+)\s*$")
_FRAME = re.compile(r"^\s+[0-9a-f]+\s+(.*)\s+\((.*)\)\s*$")
_KERNEL_METHOD = re.compile(r"::(Compute|ComputeAsync)$")
# Our ops' library exports few symbols: a sample in a kernel's inlined code may be named after
# another method of the kernel's class (e.g. its destructor).
_OUR_KERNEL = re.compile(r"(nestpipe::\w+Op)::")
_JIT_MAP = re.compile(r"^perf-\d+\.map$")


def parse_stacks(text):
    """`perf script -F comm,time,period,ip,sym,dso` output of a `perf record -g` profile ->
    [(seconds, period ns, [(dso file name, symbol), ...] leaf first, thread name)]. A JIT
    map's name (`perf-PID.map`) loses its pid, so that launches compare."""
    samples, current = [], None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = (float(header.group(2)), int(header.group(3)), [], header.group(1))
            samples.append(current)
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            symbol, dso = frame.groups()
            dso = os.path.basename(dso)
            current[2].append(("perf-PID.map" if _JIT_MAP.match(dso) else dso, symbol))
    return samples


def _plain_name(symbol):
    """A C++ symbol without its template arguments (which may hold parentheses), argument
    list and `tensorflow::`."""
    symbol = symbol.replace("(anonymous namespace)", "{anonymous}")
    while True:
        shorter = re.sub(r"<[^<>]*>", "", symbol)
        if shorter == symbol:
            break
        symbol = shorter
    return symbol.split("(")[0].replace("tensorflow::", "")


def op_kernel(frames, thread):
    """The op kernel a sample ran under: the innermost frame that is a kernel's `Compute` /
    `ComputeAsync` (e.g. "ConcatBaseOp", "nestpipe::SegmentSumOp"; not a device's dispatch)
    or any method of one of our kernels, else "no op kernel: <the leaf's category> [<thread
    name>]" (the socket mesh's threads are `nestpipe_recv` / `nestpipe_send`). perf walks call
    chains by frame pointers, which optimized libraries omit: a sample whose chain stops early
    (often a copy inside a kernel) counts under "no op kernel"."""
    for dso, symbol in frames:
        name = _plain_name(symbol)
        if _KERNEL_METHOD.search(name) and not name.endswith("Device::Compute"):
            return _KERNEL_METHOD.sub("", name)
        ours = _OUR_KERNEL.search(name) if dso.startswith("_nestpipe_ops") else None
        if ours:
            return ours.group(1)
    leaf = probe_profile.category(*frames[0]) if frames else "(no frames)"
    return "no op kernel: %s [%s]" % (leaf, thread)


def op_cpu(samples, steps):
    """{candidate: {op kernel: CPU us per timed step}} of `parse_stacks` samples, each given to
    the timed step (`{"candidate", "start", "end", "timed"}`) it fell in."""
    by_op = probe_profile.attribute(samples, steps,
                                    key=lambda sample: op_kernel(sample[2], sample[3]))
    counts = collections.Counter(s["candidate"] for s in steps if s["timed"])
    return {candidate: {op: 1e6 * seconds / counts[candidate] for op, seconds in cpu.items()}
            for candidate, cpu in by_op.items()}


def op_lines(ops, order, top):
    """Markdown lines: the `top` op kernels by CPU per step above the bound's (first of
    `order`), and the largest below it."""
    base = order[0]
    names = sorted({op for name in order for op in ops.get(name, {})},
                   key=lambda op: -max(ops.get(n, {}).get(op, 0.0) - ops[base].get(op, 0.0)
                                       for n in order[1:]))
    shown = names[:top] + [n for n in names[-3:] if n not in names[:top]]
    lines = ["", "CPU us per timed step by the op kernel it ran under (its own code and what it "
             "called), the largest differences from %s's first:" % base, "",
             "| op kernel | " + " | ".join(order) + " |", "|---" * (len(order) + 1) + "|"]
    for op in shown:
        values = [ops.get(n, {}).get(op, 0.0) for n in order]
        lines.append("| `%s` | " % op[:80] + " | ".join(
            "%.0f" % v if n == base else "%.0f (%+.0f)" % (v, v - values[0])
            for n, v in zip(order, values)) + " |")
    return lines


def _launch(system_args, extra, workers, frequency, folder, label):
    """One launch of compare_worker with worker 0 recorded; returns (its parsed samples, its
    steps labelled `label`, its RESULT json)."""
    steps_path = os.path.join(folder, "%s-steps.json" % label)
    data = os.path.join(folder, "%s-perf.data" % label)
    log_path = os.path.join(folder, "%s.log" % label)
    command = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers), "--",
               sys.executable, "-u", WORKER] + system_args + [
                   "--profile-steps", "0", "--steps-out", steps_path] + extra
    code = probe_profile.record_worker_zero(command, data, frequency, log_path,
                                            call_graph=True, write_s=120)
    if code != 0 or not os.path.exists(steps_path):
        sys.exit("the %s launch failed (exit %s); its output: %s" % (label, code, log_path))
    with open(steps_path) as f:
        steps = [dict(step, candidate=label) for step in json.load(f)]
    text = subprocess.run(["perf", "script", "-i", data, "-F", "comm,time,period,ip,sym,dso"],
                          capture_output=True, text=True, check=True).stdout
    with open(log_path) as f:
        results = [line.split("RESULT", 1)[1] for line in f
                   if "RESULT" in line and line.startswith("[worker:0]")]
    return parse_stacks(text), steps, json.loads(results[-1]) if results else {}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="bench/results/OUTPUT.md and .json")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["none"],
                        help="ours' pipelines to profile (none, dbp, fwp, nested)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="launches of each system, interleaved, samples pooled")
    parser.add_argument("--frequency", type=int, default=500, help="perf samples per second")
    parser.add_argument("--top", type=int, default=20, help="op kernels and symbols listed")
    parser.add_argument("worker_args", nargs=argparse.REMAINDER,
                        help="after --: bench/compare_worker.py arguments (model, data, batch)")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        sys.exit("bound_profile needs `perf` (install linux-tools for this kernel)")
    if "auto" in args.modes:
        sys.exit("--modes: profile a fixed pipeline (auto's probe steps are not its mode's; "
                 "bench/probe_profile.py profiles the probe)")
    extra = [a for a in args.worker_args if a != "--"]
    systems = [(BOUND, ["--system", BOUND])] + [
        (mode, ["--system", "nestpipe", "--pipeline", mode, "--collectives", "sockets"])
        for mode in args.modes]
    folder = tempfile.mkdtemp(prefix="bound_profile_")
    samples, steps, rows = [], [], collections.defaultdict(list)
    for round_index in range(args.rounds):
        for label, system_args in systems:
            got, marked, result = _launch(system_args, extra, args.workers, args.frequency,
                                          folder, label + "-%d" % round_index)
            samples += got
            steps += [dict(step, candidate=label) for step in marked]
            rows[label].append({k: result.get(k) for k in ("ms_median", "cpu_ms_per_step",
                                                           "cpu_busy")})
    leaf = [(seconds, period, frames[0][0] if frames else "[unknown]",
             frames[0][1] if frames else "[unknown]") for seconds, period, frames, _ in samples]
    summary = probe_profile.summarize(leaf, steps, args.top)
    ops = op_cpu(samples, steps)
    order = [label for label, _ in systems]
    shown = "python bench/bound_profile.py " + " ".join(sys.argv[1:])
    lines = probe_profile.report_lines(summary, shown)
    lines[0] = "# Ours' step CPU against the compute-only bound's (worker 0, loopback)"
    lines += op_lines(ops, order, args.top)
    lines += ["", "Per launch (compare_worker's own timers, every timed step): median ms/step, "
              "process CPU ms/step, cores busy:", ""]
    for label in order:
        lines.append("- %s: %s" % (label, "; ".join(
            "%.1f / %.1f / %.2f" % (r["ms_median"] or 0, r["cpu_ms_per_step"] or 0,
                                    r["cpu_busy"] or 0) for r in rows[label])))
    write_result(args.output + ".md", "\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, args.output + ".json"), "w") as f:
        json.dump({"command": shown, "systems": summary, "op_kernels_us": ops,
                   "launches": rows}, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
