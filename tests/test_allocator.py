"""The allocator setting that keeps freed memory in a worker (tf_nestpipe.launch.allocator): what
it calls, when the user's choice wins, what it refuses, and that the strategy and the launcher
apply it."""
import json
import os
import platform
import select
import subprocess
import sys

import pytest

from tf_nestpipe.launch import allocator
from tf_nestpipe.launch.allocator import (DEFAULT_TOP_PAD_BYTES, DISABLED, SET, TOP_PAD_ENV,
                                          UNAVAILABLE, USER_SET, allocator_env, check_top_pad,
                                          keep_freed_memory)
from tf_nestpipe.launch.local_cluster import free_ports

from conftest import REPO, through_forkserver

GLIBC = platform.libc_ver()[0] == "glibc"


class FakeLibc:
    """Records mallopt calls; returns `result` (glibc: 1 on success, 0 on failure)."""

    def __init__(self, result=1):
        self.calls = []
        self.result = result

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.result


def test_sets_the_top_pad_through_mallopt():
    libc = FakeLibc()
    assert keep_freed_memory(env={}, libc=libc) == SET
    assert libc.calls == [(-2, DEFAULT_TOP_PAD_BYTES)]  # M_TOP_PAD
    assert keep_freed_memory(1 << 20, env={}, libc=libc) == SET
    assert libc.calls[-1] == (-2, 1 << 20)


def test_the_users_variable_wins_and_zero_leaves_the_allocator_alone():
    libc = FakeLibc()
    assert keep_freed_memory(env={TOP_PAD_ENV: "1000"}, libc=libc) == USER_SET
    assert keep_freed_memory(0, env={}, libc=libc) == DISABLED
    assert libc.calls == []


def test_a_refused_mallopt_is_reported():
    assert keep_freed_memory(env={}, libc=FakeLibc(result=0)) == UNAVAILABLE


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64", None, 1 << 31])
def test_bad_pads_are_refused(bad):
    with pytest.raises(ValueError, match="malloc_top_pad_bytes"):
        check_top_pad(bad)
    with pytest.raises(ValueError, match="malloc_top_pad_bytes"):
        keep_freed_memory(bad, env={}, libc=FakeLibc())
    with pytest.raises(ValueError, match="malloc_top_pad_bytes"):
        allocator_env({}, bad)


def test_launcher_environment():
    assert allocator_env({}) == {TOP_PAD_ENV: str(DEFAULT_TOP_PAD_BYTES)}
    assert allocator_env({TOP_PAD_ENV: "5"}) == {}  # the user's value stays
    assert allocator_env({}, 0) == {}


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_real_glibc_takes_it():
    """This process's glibc accepts the call (a fresh interpreter without the variable; the
    module alone, loaded from its file: stdlib only, no TensorFlow to import)."""
    env = {k: v for k, v in os.environ.items() if k != TOP_PAD_ENV}
    code = ("import importlib.util as u; s = u.spec_from_file_location('allocator', %r); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.keep_freed_memory())"
            % allocator.__file__)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                         capture_output=True, check=True).stdout.split()
    assert out[-1] == SET


def test_the_strategy_applies_it_and_refuses_a_bad_pad(monkeypatch):
    import tf_nestpipe as tnp

    asked = []
    monkeypatch.setattr(allocator, "keep_freed_memory",
                        lambda top_pad: asked.append(top_pad) or "recorded")
    strategy = tnp.NestPipeStrategy(pipeline="none", malloc_top_pad_bytes=1 << 20)
    assert asked == [1 << 20] and strategy.malloc_top_pad == "recorded"
    with pytest.raises(ValueError, match="malloc_top_pad_bytes"):
        tnp.NestPipeStrategy(malloc_top_pad_bytes=-1)
    assert asked == [1 << 20]  # refused before anything was applied


def test_the_parameter_server_strategy_applies_it_and_refuses_a_bad_pad(monkeypatch):
    import tf_nestpipe as tnp

    asked = []
    monkeypatch.setattr(allocator, "keep_freed_memory",
                        lambda top_pad: asked.append(top_pad) or "recorded")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="malloc_top_pad_bytes"):
        tnp.ParameterServerStrategy(malloc_top_pad_bytes=1.5)
    assert asked == []  # refused before anything was applied
    with pytest.raises(ValueError, match="--ps K --chief"):  # no cluster here
        tnp.ParameterServerStrategy(malloc_top_pad_bytes=1 << 20)
    assert asked == [1 << 20]  # applied first, as the chief's process starts


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
@pytest.mark.parametrize("user_value,said", [(None, SET), ("4096", USER_SET)])
def test_a_serving_task_applies_it(user_value, said):
    """`python -m tf_nestpipe.server` (ps tasks, parameter-server workers) keeps freed memory
    too, and says so on its serving line; the user's variable wins."""
    env = {k: v for k, v in os.environ.items() if k != TOP_PAD_ENV}
    if user_value is not None:
        env[TOP_PAD_ENV] = user_value
    env["TF_CONFIG"] = json.dumps({"cluster": {"ps": ["127.0.0.1:%d" % free_ports(1)[0]]},
                                   "task": {"type": "ps", "index": 0}})
    # Forked from the suite's fork server (tests/forkserver.py), which applies the variable as a
    # fresh interpreter's glibc would.
    server = subprocess.Popen(through_forkserver([sys.executable, "-m", "tf_nestpipe.server"]),
                              cwd=REPO, env=env,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        # The serving line (it then serves until killed); a task that never prints fails here.
        ready, _, _ = select.select([server.stdout], [], [], 120)
        line = server.stdout.readline() if ready else "no serving line within 120 s"
    finally:
        server.kill()
        server.wait()
    assert "ps:0 serving at" in line and line.rstrip().endswith("(malloc top pad: %s)" % said), line


def test_launched_tasks_get_it_unless_the_user_set_it(tmp_path):
    script = tmp_path / "pad.py"
    script.write_text("import os\nprint('pad', os.environ.get(%r, '-'))\n" % TOP_PAD_ENV)
    env = {k: v for k, v in os.environ.items() if k != TOP_PAD_ENV}

    def launch(*flags):
        return subprocess.run(through_forkserver(
            [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", "--output", "all"]
            + list(flags) + ["--", sys.executable, str(script)]),
                              cwd=REPO, env=env, text=True, capture_output=True, timeout=120)

    result = launch()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[worker:1] pad %d" % DEFAULT_TOP_PAD_BYTES in result.stdout, result.stdout
    result = launch("--env", TOP_PAD_ENV + "=4096")
    assert "[worker:1] pad 4096" in result.stdout, result.stdout
