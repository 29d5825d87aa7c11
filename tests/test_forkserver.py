"""The test fork server (tests/forkserver.py): a command it forks behaves as a fresh interpreter
would (exit status, signals, streams, environment, exit duties), and a command it cannot run so
runs the interpreter itself. A server of its own here, preloading only numpy (fast)."""
import os
import signal
import subprocess
import sys
import time

import pytest

import forkserver

FORKSERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")
# A fresh interpreter does not import numpy; a child of this server starts with it imported.
FORKED_PROBE = "import sys; print('forked' if 'numpy' in sys.modules else 'fresh', flush=True)"


def test_parse_command_takes_scripts_modules_code_and_unbuffered_only():
    assert forkserver.parse_command(["prog.py", "a", "-m"]) == (
        "path", "prog.py", ["prog.py", "a", "-m"], False)
    assert forkserver.parse_command(["-u", "-m", "pkg.mod", "x"]) == (
        "module", "pkg.mod", ["pkg.mod", "x"], True)
    assert forkserver.parse_command(["-c", "print(1)", "y"]) == (
        "code", "print(1)", ["-c", "y"], False)
    for unsupported in (["-X", "importtime", "p.py"], ["-O", "p.py"], [], ["-"], ["-m"],
                        ["-u"]):
        assert forkserver.parse_command(unsupported) is None, unsupported


def test_env_mismatch_names_an_import_time_variable_and_allows_runtime_ones():
    server = {"TF_CPP_MIN_LOG_LEVEL": "2", "LD_PRELOAD": "/a.so:/b.so"}
    assert forkserver.env_mismatch(server, dict(server, TF_CONFIG="{}",
                                                TF_NESTPIPE_X="1")) is None
    assert forkserver.env_mismatch(server, dict(server, TF_CPP_MIN_LOG_LEVEL="0")) == (
        "TF_CPP_MIN_LOG_LEVEL")
    assert forkserver.env_mismatch(server, dict(server, NEW="1")) == "NEW"
    assert forkserver.env_mismatch(server, {"TF_CPP_MIN_LOG_LEVEL": "2"}) is None  # no preload
    assert forkserver.env_mismatch(server, dict(server, LD_PRELOAD="/b.so")) is None
    assert forkserver.env_mismatch(server, dict(server, LD_PRELOAD="/c.so")) == "LD_PRELOAD"
    # A variable the imports set: the client may carry the value they set (its parent imported
    # them too), not another.
    assert forkserver.env_mismatch(server, dict(server, TF2_BEHAVIOR="1"),
                                   {"TF2_BEHAVIOR": "1"}) is None
    assert forkserver.env_mismatch(server, dict(server, TF2_BEHAVIOR="0"),
                                   {"TF2_BEHAVIOR": "1"}) == "TF2_BEHAVIOR"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A fork server preloading numpy, its client, and the environment that reaches it."""
    folder = tmp_path_factory.mktemp("forkserver")
    address = str(folder / "socket")
    env = dict(os.environ, **{forkserver.SOCKET_ENV: address,
                              forkserver.LOG_ENV: str(folder / "exec.log")})
    process = subprocess.Popen([sys.executable, FORKSERVER, address, "numpy"], env=env,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while not os.path.exists(address) and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(address), "the fork server did not start"
    shim = forkserver.python_shim(str(folder), sys.executable, os.path.dirname(FORKSERVER))
    yield {"shim": shim, "env": env, "log": folder / "exec.log", "folder": folder}
    process.kill()
    process.wait()


def run(server, code, *args, env=None, **kwargs):
    """Runs `shim -c code args` with the server's environment."""
    return subprocess.run([server["shim"], "-c", code] + list(args), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=dict(server["env"], **(env or {})), timeout=60, **kwargs)


def test_a_command_is_forked_and_sees_its_own_argv_cwd_streams_and_environment(server, tmp_path):
    code = FORKED_PROBE + ("; import os; print(sys.argv, os.getcwd(), "
                           "os.environ['NESTPIPE_TEST_MINE'], "
                           "sys.executable == os.environ['NESTPIPE_TEST_SHIM'], input())")
    result = run(server, code, "a", "b", env={"TF_CONFIG": "{}", "NESTPIPE_TEST_MINE": "x",
                                              "NESTPIPE_TEST_SHIM": server["shim"]},
                 cwd=str(tmp_path), input="typed\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "forked", "['-c', 'a', 'b'] %s x True typed" % tmp_path], result.stdout
    script = tmp_path / "prog.py"
    script.write_text("import sys\nprint(sys.argv, sys.path[0], __name__)\n")
    result = subprocess.run([server["shim"], "-u", str(script), "z"], env=server["env"],
                            text=True, stdout=subprocess.PIPE, timeout=60, check=True)
    assert result.stdout == "[%r, 'z'] %s __main__\n" % (str(script), tmp_path)


def test_exit_statuses_are_the_interpreters(server):
    assert run(server, "import sys; sys.exit(3)").returncode == 3
    message = run(server, "import sys; sys.exit('bye')")
    assert (message.returncode, message.stderr) == (1, "bye\n")
    error = run(server, "def f():\n    raise ValueError('boom')\nf()")
    assert error.returncode == 1
    assert error.stderr.startswith("Traceback (most recent call last):\n  File \"<string>\"")
    assert "forkserver" not in error.stderr and error.stderr.endswith("ValueError: boom\n")
    killed = run(server, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -signal.SIGKILL
    interrupted = run(server, "raise KeyboardInterrupt")
    assert interrupted.returncode == -signal.SIGINT


def test_exit_duties_run_threads_atexit_and_unclosed_files(server, tmp_path):
    target = tmp_path / "unclosed.txt"
    code = ("import atexit, threading, time\n"
            "kept = open(%r, 'w'); kept.write('written')\n"
            "atexit.register(lambda: print('atexit', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
            % str(target))
    result = run(server, code)
    assert (result.returncode, result.stdout) == (0, "thread\natexit\n"), result.stderr
    assert target.read_text() == "written"


def test_signals_reach_the_child_and_its_client_dies_the_same_way(server):
    process = subprocess.Popen(
        [server["shim"], "-c", FORKED_PROBE + "; import time; time.sleep(60)"],
        env=server["env"], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "forked\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM


def test_a_killed_client_takes_its_child_with_it(server):
    process = subprocess.Popen(
        [server["shim"], "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
        env=server["env"], stdout=subprocess.PIPE, text=True)
    child = int(process.stdout.readline())
    process.kill()
    process.wait()
    assert _ends_within(child, 10)


def _ends_within(pid, seconds):
    """Whether process `pid` is gone (or a zombie) within `seconds`."""
    deadline = time.time() + seconds
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        # Gone before the open, or reaped between the open and the read (ESRCH).
        return False


def test_ignored_signals_stay_ignored(server):
    result = run(server, FORKED_PROBE + "; import os, signal; os.kill(os.getpid(), "
                 "signal.SIGINT); print('survived')",
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert (result.returncode, result.stdout) == (0, "forked\nsurvived\n"), result.stderr


def test_each_child_gets_its_own_numpy_seed(server):
    code = FORKED_PROBE + "; import numpy; print(numpy.random.randint(1 << 30))"
    first, second = run(server, code).stdout, run(server, code).stdout
    assert first.startswith("forked\n") and first != second


def test_what_the_server_cannot_run_as_fresh_runs_the_interpreter(server):
    """Positive control of the probe: an import-time variable that differs, an interpreter
    option, no server: fresh processes (logged why)."""
    assert run(server, FORKED_PROBE).stdout == "forked\n"
    assert run(server, FORKED_PROBE, env={"TF_CPP_MIN_LOG_LEVEL": "9"}).stdout == "fresh\n"
    result = subprocess.run([server["shim"], "-B", "-c", FORKED_PROBE], env=server["env"],
                            text=True, stdout=subprocess.PIPE, timeout=60)
    assert result.stdout == "fresh\n"
    assert run(server, FORKED_PROBE, env={forkserver.SOCKET_ENV: str(
        server["folder"] / "nothing")}).stdout == "fresh\n"
    log = server["log"].read_text()
    assert "exec TF_CPP_MIN_LOG_LEVEL differs from the server's" in log
    assert "exec options: -B" in log and "exec server unreachable" in log


def test_the_server_ends_with_the_session_that_started_it(tmp_path):
    """A session killed without stopping its server (SIGKILL) leaves no server behind."""
    starter = ("import subprocess, sys\n"
               "server = subprocess.Popen([sys.executable, %r, %r, 'json'],\n"
               "                          stdin=subprocess.DEVNULL, start_new_session=True)\n"
               "print(server.pid, flush=True)\n"
               "sys.stdin.read()\n" % (FORKSERVER, str(tmp_path / "socket")))
    session = subprocess.Popen([sys.executable, "-c", starter], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    server = int(session.stdout.readline())
    deadline = time.time() + 30
    while not (tmp_path / "socket").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert _alive(server)  # positive control: it serves while its session lives
    session.kill()
    session.wait()
    assert _ends_within(server, 10)
