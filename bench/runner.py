"""Runs one benchmark program, alone or on a local cluster, and returns the JSON it reports."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run_program(argv, workers=1, env=None, timeout=900, launcher_flags=()):
    """Runs `python argv...` (through the launcher when `workers > 1`) and returns the dict that
    worker 0 printed after `RESULT `; raises with the output's tail if there is none."""
    command = [sys.executable] + list(argv)
    if workers > 1:
        command = ([sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers)]
                   + list(launcher_flags) + ["--"] + command)
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    full_env.update(env or {})
    out = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=REPO, env=full_env, timeout=timeout)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    log = tempfile.NamedTemporaryFile("w", prefix="nestpipe_bench_", suffix=".log", delete=False)
    with log:
        log.write(out.stdout)
    errors = [line for line in out.stdout.splitlines() if "Error" in line or "error:" in line]
    raise RuntimeError("%s failed (rc=%d); full output in %s; errors:\n%s\n...\n%s" % (
        " ".join(argv), out.returncode, log.name, "\n".join(errors[-10:]), out.stdout[-2000:]))


def write_result(name, text):
    """Prints `text` and writes it to bench/results/NAME."""
    print(text)
    with open(os.path.join(HERE, "results", name), "w") as f:
        f.write(text)
