"""Runs one benchmark program, alone or on a local cluster, and returns the JSON it reports."""
import json
import os
import subprocess
import sys

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
    raise RuntimeError("%s failed (rc=%d):\n%s" % (" ".join(argv), out.returncode, out.stdout[-3000:]))


def write_result(name, text):
    """Prints `text` and writes it to bench/results/NAME."""
    print(text)
    with open(os.path.join(HERE, "results", name), "w") as f:
        f.write(text)
