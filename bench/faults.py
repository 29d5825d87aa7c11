"""Fault-injection benchmark: runs each fault N times on a local 2-worker cluster and prints a
table (fault, runs, recovered, exact, seconds to fail or resume).

    python bench/faults.py [--runs N] [--faults NAME,...] [--out bench/results/faults.md]

Faults (all traffic on 127.0.0.1):
- `worker-sigkill`: worker 1 SIGKILLs itself after step 6 of 12; `--restarts 1` restarts the
  cluster, which resumes from the ShardedCheckpoint of step 6. Recovered: exit 0; exact: the
  final table and dense weights equal an uninterrupted run's (max abs diff <= 1e-6); seconds:
  the whole faulted run.
- `launcher-sigterm`: SIGTERM to the launcher mid-run; it forwards SIGTERM, every worker saves
  (PreemptionCheckpointHandler) and exits 42; a second launch resumes to the end. Recovered:
  exit 42 then 0; exact as above; seconds: from the SIGTERM to the launcher's exit.
- `cluster-mismatch` (worker 0's TF_CONFIG lists 3 workers, worker 1's 2), `duplicate-index`
  (two processes as worker 1 of 3), `absent-leader` (worker 1 alone), `absent-worker` (worker 0
  alone): recovered means every process exited non-zero with a ClusterMismatchError naming the
  cause; seconds: until the last one exited (start-up timeout 10 s).
- `unequal-shares`: a fit whose second global batch splits 2 + 1 (tests/programs/
  unequal_shares.py): recovered means refused on both workers at that step, naming
  drop_remainder=True. `restore-other-size`: tests/programs/restore_sizes.py: every restore
  into another table size refused on both workers (recovered), into the saved size exact.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "fault_worker.py")
PROGRAMS = os.path.join(REPO, "tests", "programs")
STEPS = 12
STRATEGY = "import tf_nestpipe as tnp; tnp.NestPipeStrategy(); print('started', flush=True)"


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _launch(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2"] + args,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                          env=_env(), timeout=timeout)


def _same(a, b):
    if not (os.path.exists(a) and os.path.exists(b)):
        return False
    x, y = np.load(a), np.load(b)
    return all(np.abs(x[k] - y[k]).max() <= 1e-6 for k in x.files)


class Faults:
    """Each fault as a method returning (recovered, exact or None, seconds)."""

    def __init__(self, work):
        self.work = work
        self.reference = os.path.join(work, "reference.npz")
        self.counter = 0

    def _fresh(self, name):
        self.counter += 1
        path = os.path.join(self.work, "%s-%d" % (name, self.counter))
        os.makedirs(path)
        return path

    def ensure_reference(self):
        """An uninterrupted run's final parameters (once)."""
        if not os.path.exists(self.reference):
            result = _launch(["--", sys.executable, WORKER, self.reference,
                              os.path.join(self.work, "reference-ckpt"), str(STEPS)])
            if result.returncode != 0:
                raise RuntimeError("the reference run failed:\n" + result.stdout[-3000:])

    def worker_sigkill(self):
        self.ensure_reference()
        out = self._fresh("sigkill")
        start = time.time()
        result = _launch(["--restarts", "1", "--", sys.executable, WORKER,
                          os.path.join(out, "final.npz"), os.path.join(out, "ckpt"), str(STEPS),
                          "--die-at", "6"])
        took = time.time() - start
        recovered = result.returncode == 0 and "resumed at step 6" in result.stdout
        return recovered, _same(self.reference, os.path.join(out, "final.npz")), took

    def launcher_sigterm(self):
        self.ensure_reference()
        out = self._fresh("sigterm")
        ckpt, final = os.path.join(out, "ckpt"), os.path.join(out, "final.npz")
        process = subprocess.Popen(
            [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", "--grace-period",
             "20", "--", sys.executable, WORKER, final, ckpt, str(STEPS), "--step-seconds",
             "0.3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env=_env())
        for line in process.stdout:
            if "resumed at step" in line:
                break
        time.sleep(1.5)  # a few steps in
        start = time.time()
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)
        took = time.time() - start
        first = process.returncode
        second = _launch(["--", sys.executable, WORKER, final, ckpt, str(STEPS)])
        recovered = first == 42 and second.returncode == 0
        return recovered, _same(self.reference, final), took

    def _strategies(self, configs):
        start = time.time()
        processes = [subprocess.Popen([sys.executable, "-c", STRATEGY], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                      env=_env(TF_CONFIG=json.dumps(c),
                                               TF_NESTPIPE_STARTUP_TIMEOUT="10"))
                     for c in configs]
        outputs = [p.communicate(timeout=120)[0] for p in processes]
        took = time.time() - start
        refused = all(p.returncode != 0 and "ClusterMismatchError" in o
                      for p, o in zip(processes, outputs))
        return refused, None, took

    @staticmethod
    def _cluster(workers):
        from tf_nestpipe.launch.local_cluster import free_ports  # pylint: disable=import-outside-toplevel

        return {"worker": ["127.0.0.1:%d" % p for p in free_ports(workers)]}

    def cluster_mismatch(self):
        three = self._cluster(3)
        return self._strategies([{"cluster": three, "task": {"type": "worker", "index": 0}},
                                 {"cluster": {"worker": three["worker"][:2]},
                                  "task": {"type": "worker", "index": 1}}])

    def duplicate_index(self):
        three = self._cluster(3)
        return self._strategies([{"cluster": three, "task": {"type": "worker", "index": i}}
                                 for i in (0, 1, 1)])

    def absent_leader(self):
        return self._strategies([{"cluster": self._cluster(2),
                                  "task": {"type": "worker", "index": 1}}])

    def absent_worker(self):
        return self._strategies([{"cluster": self._cluster(2),
                                  "task": {"type": "worker", "index": 0}}])


    def unequal_shares(self):
        """fit whose second global batch splits 2 + 1: refused on both workers at that step."""
        out = self._fresh("shares")
        start = time.time()
        result = _launch(["--", sys.executable, os.path.join(PROGRAMS, "unequal_shares.py"), out,
                          "uneven"])
        took = time.time() - start
        refused = result.returncode == 0
        for rank in (0, 1):
            with open(os.path.join(out, "uneven-%d.json" % rank)) as f:
                case = json.load(f)
            refused = refused and case["steps"] == 1 and "drop_remainder=True" in (case["error"] or "")
        return refused, None, took

    def restore_other_size(self):
        """A 100-row table restored into 200 / 60 / 101 rows (whole and sharded checkpoints):
        refused on both workers; into 100 rows: exact."""
        out = self._fresh("sizes")
        start = time.time()
        result = _launch(["--", sys.executable, os.path.join(PROGRAMS, "restore_sizes.py"), out,
                          "save", "restore"])
        took = time.time() - start
        refused = exact = result.returncode == 0
        for rank in (0, 1):
            path = os.path.join(out, "results-2-%d.json" % rank)
            if not os.path.exists(path):
                return False, False, took
            with open(path) as f:
                cases = json.load(f)
            refused = refused and all(v.startswith("error: cannot restore") for k, v in
                                      cases.items() if not k.endswith("_into_100"))
            exact = exact and all(v == "ok" for k, v in cases.items() if k.endswith("_into_100"))
        return refused, exact, took


FAULTS = ["worker-sigkill", "launcher-sigterm", "cluster-mismatch", "duplicate-index",
          "absent-leader", "absent-worker", "unequal-shares", "restore-other-size"]


def main(argv=None):
    """Runs the faults and prints (and writes) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    names = [n for n in args.faults.split(",") if n]
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        parser.error("unknown faults %s; choose from %s" % (unknown, FAULTS))
    lines = ["| fault | runs | recovered | exact | seconds to fail or resume (median, max) |",
             "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="tf_nestpipe-faults-") as work:
        faults = Faults(work)
        for name in names:
            results = [getattr(faults, name.replace("-", "_"))() for _ in range(args.runs)]
            seconds = sorted(r[2] for r in results)
            exact = [r[1] for r in results if r[1] is not None]
            lines.append("| %s | %d | %d | %s | %.1f, %.1f |" % (
                name, len(results), sum(bool(r[0]) for r in results),
                "%d" % sum(exact) if exact else "n/a", seconds[len(seconds) // 2], seconds[-1]))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
