"""How the socket transport scales with the number of workers, measured where this machine
allows (W local workers of a tiny model) and extended on paper to 128 and 1,536 workers.

    python bench/transport_scale.py [--workers 2 4 8 16] [--steps 20]

Per W it launches `bench/transport_scale_worker.py` on W local workers (unpinned: 16 workers on
a 2-core machine) and records, per worker: start-up seconds (launch to strategy ready), bytes
and frames the transport sent per training step (the mesh's own counters), the dense gradient's
bytes n, threads and sockets of the process. The dense all-reduce (reduce-scatter + all-gather)
sends 2n(W-1)/W per worker; the earlier all-reduce sent every peer the whole vector, (W-1)n.
Writes bench/results/transport_scale.md and .json (overwritten).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "transport_scale")
PAPER_WORKERS = (128, 1536)
WORKERS_PER_HOST = 8  # for the paper rows: 8 workers (GPUs or socket pairs) per host


def run(workers, steps):
    """Launches one cluster of `workers`; returns its workers' records."""
    argv = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers),
            "--no-pin-cpus", "--", sys.executable, os.path.join(HERE,
                                                                "transport_scale_worker.py"),
            "--launched", repr(time.time()), "--steps", str(steps)]
    env = dict(os.environ, TF_NESTPIPE_LAUNCH_OUTPUT="all", TF_NESTPIPE_TRANSPORT_CONNECT_TIMEOUT="120",
               TF_NESTPIPE_STARTUP_TIMEOUT="300")
    result = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=1800)
    records = [json.loads(line.split("SCALE ", 1)[1]) for line in result.stdout.splitlines()
               if "SCALE {" in line]
    if result.returncode != 0 or len(records) != workers:
        raise RuntimeError("W=%d failed (rc %d):\n%s" % (workers, result.returncode,
                                                         result.stdout[-3000:]))
    return records


def summarize(workers, records):
    n = records[0]["dense_gradient_bytes"]
    sent = statistics.mean(r["bytes_sent_per_step"] for r in records)
    return {
        "workers": workers,
        "startup_s_median": statistics.median(r["startup_s"] for r in records),
        "startup_s_max": max(r["startup_s"] for r in records),
        "step_ms_median": statistics.median(r["step_ms"] for r in records),
        "dense_gradient_bytes": n,
        "bytes_sent_per_step": round(sent),
        "allreduce_bytes_now": round(2 * n * (workers - 1) / workers),
        "allreduce_bytes_before": n * (workers - 1),
        "frames_sent_per_step": statistics.mean(r["frames_sent_per_step"] for r in records),
        "mesh_io_threads": max(r["mesh_io_threads"] for r in records),
        "mesh_threads_before": 2 * (workers - 1) + 1,
        "process_threads_max": max(r["threads"] for r in records),
        "sockets_max": max(r["sockets"] for r in records),
        "mesh_peers": records[0]["mesh_peers"],
    }


def paper(workers, n, embedding_bytes):
    """The transport's cost model at `workers` (no measurement): per worker and step."""
    hosts = max(1, workers // WORKERS_PER_HOST)
    return {
        "workers": workers,
        "allreduce_bytes_now": round(2 * n * (workers - 1) / workers),
        "allreduce_bytes_before": n * (workers - 1),
        "embedding_bytes": embedding_bytes,
        "frames_per_all_to_all_flat": workers - 1,
        "frames_per_all_to_all_hierarchical": (WORKERS_PER_HOST - 1) + (hosts - 1),
        "mesh_io_threads": 2,
        "mesh_threads_before": 2 * (workers - 1) + 1,
        "mesh_sockets": workers - 1,
    }


def markdown(command, rows, paper_rows, load):
    lines = ["# Socket transport: scaling with the number of workers", "",
             "Command: `%s` (load average before the run: %s; 2 cores, so the "
             "8- and 16-worker step times and start-up are CPU-bound, not network-bound)."
             % (command, load), "",
             "## Measured (local workers, tiny model: one row-sharded table, 2x256 dense tower)",
             "", "| W | start-up s (median / max) | step ms | dense gradient n (bytes) | "
             "bytes sent / worker / step | all-reduce share now 2n(W-1)/W | before (W-1)n | "
             "frames / step | mesh I/O threads (before: 2(W-1)+1) | threads / process | "
             "sockets / process |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %d | %.1f / %.1f | %.1f | %d | %d | %d | %d | %.0f | %d (%d) | %d | %d |" % (
            r["workers"], r["startup_s_median"], r["startup_s_max"], r["step_ms_median"],
            r["dense_gradient_bytes"], r["bytes_sent_per_step"], r["allreduce_bytes_now"],
            r["allreduce_bytes_before"], r["frames_sent_per_step"], r["mesh_io_threads"],
            r["mesh_threads_before"], r["process_threads_max"], r["sockets_max"]))
    lines += ["", "Bytes sent per worker per step stay near 2n whatever W (the dense all-reduce "
              "is a reduce-scatter and an all-gather on the mesh; the embedding exchange adds "
              "the rows and gradients of this worker's lookups). Threads per process are "
              "TensorFlow's own pools plus the mesh's 2; sockets grow by two per peer (one of the mesh, "
              "one of TensorFlow's gRPC channel).", "",
              "## On paper (the same model at W workers, %d workers per host)" % WORKERS_PER_HOST,
              "", "| W | all-reduce bytes / worker now | before | frames per all-to-all flat | "
              "hierarchical (host, then across hosts) | mesh I/O threads (before) | mesh sockets "
              "/ process |", "|---|---|---|---|---|---|---|"]
    for r in paper_rows:
        lines.append("| %d | %d | %d | %d | %d | %d (%d) | %d |" % (
            r["workers"], r["allreduce_bytes_now"], r["allreduce_bytes_before"],
            r["frames_per_all_to_all_flat"], r["frames_per_all_to_all_hierarchical"],
            r["mesh_io_threads"], r["mesh_threads_before"], r["mesh_sockets"]))
    lines += ["", "What bounds it at 1,536 workers: a full mesh holds W-1 sockets per process "
              "(1,535, within a raised `ulimit -n`) and W(W-1)/2 connections in the cluster "
              "(about 1.2 million), each opened and authenticated at start-up. The hierarchical "
              "all-to-all (`TransportConfig(hierarchical=...)`, on by default from 64 workers "
              "sharing hosts) cuts the frames a worker sends across hosts per all-to-all to H-1; "
              "it then only uses same-host and same-rank connections, so opening only those "
              "(not built) is what would bound the connections too.", ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the .md from the .json of the last run")
    args = parser.parse_args()
    if args.report_only:
        with open(RESULTS + ".json") as f:
            saved = json.load(f)
        with open(RESULTS + ".md", "w") as f:
            f.write(markdown(saved["command"], saved["measured"], saved["paper"], saved["load"]))
        return
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    rows = []
    for workers in args.workers:
        records = run(workers, args.steps)
        rows.append(summarize(workers, records))
        print(json.dumps(rows[-1]), flush=True)
    n = rows[-1]["dense_gradient_bytes"]
    embedding = max(0, rows[-1]["bytes_sent_per_step"] - rows[-1]["allreduce_bytes_now"])
    paper_rows = [paper(w, n, embedding) for w in PAPER_WORKERS]
    command = "python bench/transport_scale.py --workers %s --steps %d" % (
        " ".join(map(str, args.workers)), args.steps)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS + ".json", "w") as f:
        json.dump({"command": command, "load": load, "measured": rows, "paper": paper_rows}, f,
                  indent=1)
    with open(RESULTS + ".md", "w") as f:
        f.write(markdown(command, rows, paper_rows, load))
    print(markdown(command, rows, paper_rows, load))


if __name__ == "__main__":
    main()
