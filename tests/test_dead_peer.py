"""A cluster started without our launcher (plain TF_CONFIG processes): when a worker stops
answering mid-run, the surviving worker fails within 60 s with an error naming the silent task
(TensorFlow's coordination-service heartbeats abort the pending collectives), never hangs.
The heartbeat timeout is NestPipe's (TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS, strategy/coordination.py):
the survivor's verdict comes no sooner than it, so a machine stalled for less is survived."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import PROGRAMS, REPO, through_forkserver


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


HEARTBEAT_SECONDS = 15


@pytest.mark.cluster
def test_a_silent_worker_fails_the_survivor_fast_naming_it(tmp_path):
    cluster = {"worker": ["localhost:%d" % p for p in _free_ports(2)]}
    procs, logs = [], []
    for index in range(2):
        env = dict(os.environ, TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS=str(HEARTBEAT_SECONDS),
                   TF_CONFIG=json.dumps({"cluster": cluster,
                                         "task": {"type": "worker", "index": index}}))
        logs.append(tmp_path / ("worker%d.log" % index))
        procs.append(subprocess.Popen(through_forkserver([sys.executable,
                                                          os.path.join(PROGRAMS, "dead_peer.py")]),
                                      cwd=REPO, env=env, stdout=open(logs[-1], "w"),
                                      stderr=subprocess.STDOUT))
    try:
        deadline = time.time() + 240
        while "worker 1 stops answering" not in logs[1].read_text():
            assert time.time() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        stopped = time.time()
        code = procs[0].wait(timeout=90)
        elapsed = time.time() - stopped
        output = logs[0].read_text()
        assert code != 0
        assert elapsed < 60, elapsed
        # The service ran with our timeout: configured, and no verdict before it had passed.
        assert "heartbeat timeout %.1f s" % HEARTBEAT_SECONDS in output, output[-3000:]
        assert elapsed >= HEARTBEAT_SECONDS - 1, elapsed
        # The coordination service's heartbeat verdict, naming the silent task on its own line.
        assert ("The following tasks are unhealthy (stopped sending heartbeats):\n"
                "/job:worker/replica:0/task:1\n") in output, output[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()


def test_heartbeat_timeout_from_the_environment(monkeypatch):
    from tf_nestpipe.strategy import coordination

    monkeypatch.delenv("TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS", raising=False)
    assert coordination.heartbeat_timeout_from_env() == 30.0
    monkeypatch.setenv("TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS", "12.5")
    assert coordination.heartbeat_timeout_from_env() == 12.5
    for bad in ("soon", "0", "0.5", "-3", "nan"):
        monkeypatch.setenv("TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS", bad)
        with pytest.raises(ValueError, match="TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS must be"):
            coordination.heartbeat_timeout_from_env()


def test_no_coordination_service_for_tasks_tensorflow_does_not_coordinate():
    import tensorflow as tf
    from tf_nestpipe.strategy import coordination

    def resolver(task_type):
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}),
            task_type=task_type, task_id=0)

    # A parameter server, and a process with no cluster: nothing is configured.
    assert not coordination.configure_coordination_service(resolver("ps"), 30)
    assert not coordination.configure_coordination_service(
        tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({})), 30)
    assert coordination.configured_heartbeat_timeout_seconds() is None
