"""Every task's TensorFlow server listens only on its TF_CONFIG address (TensorFlow alone binds
the port on every interface): for tasks of the launcher, and for a task started by another tool
through `python -m tf_nestpipe.launch.task`."""
import json
import os
import re
import sys

import pytest

from conftest import PROGRAMS, launch, run_command
from tf_nestpipe.launch import listen
from tf_nestpipe.launch.local_cluster import free_ports

PROGRAM = os.path.join(PROGRAMS, "listen_check.py")
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


def _listening(output):
    return [json.loads(m) for m in re.findall(r"LISTEN (\[.*\])", output)]


def _one_worker_env(host):
    """The environment of worker 0 of a one-worker TF_CONFIG cluster at `host` on a free port."""
    return dict(os.environ, TF_CONFIG=json.dumps(
        {"cluster": {"worker": ["%s:%d" % (host, free_ports(1)[0])]},
         "task": {"type": "worker", "index": 0}}))


@pytest.mark.cluster
def test_launched_servers_listen_only_on_their_tf_config_address():
    result = launch(1, [PROGRAM, "--server"])
    assert result.returncode == 0, result.stdout[-4000:]
    found = _listening(result.stdout)
    assert len(found) == 1, result.stdout[-4000:]
    assert found[0] and set(found[0]) <= LOOPBACK, found[0]


@pytest.mark.cluster
def test_a_task_started_by_another_tool_listens_only_on_its_address(tmp_path):
    env = _one_worker_env("localhost")
    narrowed = run_command([sys.executable, "-m", "tf_nestpipe.launch.task", "--",
                            sys.executable, PROGRAM, "--server"], env=env, timeout=120)
    assert narrowed.returncode == 0, narrowed.stdout[-3000:]
    assert set(_listening(narrowed.stdout)[0]) <= LOOPBACK
    plain = run_command([sys.executable, PROGRAM, "--server"], env=env, timeout=120)
    assert plain.returncode == 0, plain.stdout[-3000:]
    assert not set(_listening(plain.stdout)[0]) <= LOOPBACK  # TensorFlow alone: every interface


def test_listen_only_env_errors(monkeypatch):
    with pytest.raises(ValueError, match="not host:port"):
        listen.listen_only_env("localhost")
    env = listen.listen_only_env("localhost:2222", {"LD_PRELOAD": "/other.so"})
    assert env["TF_NESTPIPE_BIND_PORT"] == "2222" and env["TF_NESTPIPE_BIND_HOST"] in LOOPBACK | {"::1"}
    assert env["LD_PRELOAD"] == listen.SHIM + ":/other.so"
    monkeypatch.setattr(listen, "SHIM", "/nonexistent/_nestpipe_bind.so")
    with pytest.raises(listen.ShimMissingError, match="pip install"):
        listen.listen_only_env("localhost:2222")


@pytest.mark.cluster
def test_a_tf_config_host_of_another_machine_falls_back_with_a_warning():
    """A relay / NAT / service address is not local: the server still starts, on every
    interface, and says so (instead of failing to start)."""
    env = _one_worker_env("10.254.253.1")
    result = run_command([sys.executable, "-m", "tf_nestpipe.launch.task", "--",
                          sys.executable, PROGRAM, "--server"], env=env, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "10.254.253.1 is not an address of this machine" in result.stdout
    assert not set(_listening(result.stdout)[0]) <= LOOPBACK
