"""The socket mesh (ops/socket_ops.cc, tf_nestpipe/collectives/sockets.py): its all-to-all,
all-gather, gradient and all-reduce equal NumPy on 3 workers; a peer that dies fails the
exchange at once, a stopped one after the stall timeout, each naming the worker; connecting to
a peer that never answers fails within the timeout naming its address; a cluster where one
worker cannot take part agrees to fall back to TensorFlow's collectives."""
import os
import socket
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import PROGRAMS, launch
from tf_nestpipe.collectives import sockets as mesh
from tf_nestpipe.ops.sockets import socket_all_to_all, socket_connect, socket_listen

PROGRAM = os.path.join(PROGRAMS, "socket_mesh.py")


def _dead_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there any more
    return port


@pytest.mark.cluster
def test_mesh_collectives_equal_numpy_on_three_workers():
    result = launch(3, [PROGRAM], timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("socket mesh ok 3") == 3, result.stdout[-4000:]


@pytest.mark.cluster
@pytest.mark.parametrize("kind, error, within", [
    ("die", "worker 1 (127.0.0.1:", 15),
    ("stop", "has sent nothing, not even a heartbeat, for 3 s", 30),
])
def test_a_failed_peer_fails_the_exchange_naming_it(kind, error, within):
    started = time.time()
    result = launch(2, [PROGRAM, kind], timeout=240, env={"NESTPIPE_SOCKET_STALL_SECONDS": "3"})
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    assert "worker 1 %s" % ("dies" if kind == "die" else "stops") in out, out[-4000:]
    assert error in out, out[-4000:]
    assert "nestpipe sockets:" in out and "worker 0" in out
    assert time.time() - started < 120


def test_the_exchange_refuses_to_run_without_a_mesh():
    # pytest's own process never opens a mesh.
    with pytest.raises(tf.errors.FailedPreconditionError, match="mesh is not connected"):
        socket_all_to_all(tf.zeros([2, 3]), [3, 3], 0.0, 1, _token().handle)


def test_connecting_to_a_peer_nobody_answers_fails_naming_it():
    port = socket_listen("127.0.0.1")
    dead = _dead_port()
    started = time.time()
    # As worker 1, dialing worker 0 at an address where nobody listens.
    with pytest.raises(tf.errors.DeadlineExceededError,
                       match=r"could not reach worker 0 at 127\.0\.0\.1:%d within 1" % dead):
        socket_connect(1, ["127.0.0.1", "127.0.0.1"], [dead, port], 5, 1.0, 20.0)
    # As worker 0, waiting for a worker 1 that never dials.
    with pytest.raises(tf.errors.DeadlineExceededError,
                       match=r"heard nothing within 1 s from workers 1 \(127\.0\.0\.1:%d\)"
                       % dead):
        socket_connect(0, ["127.0.0.1", "127.0.0.1"], [port, dead], 5, 1.0, 20.0)
    assert time.time() - started < 10


def test_connect_refuses_malformed_cluster_lists():
    with pytest.raises(tf.errors.InvalidArgumentError, match="two equal lists"):
        socket_connect(0, ["127.0.0.1", "127.0.0.1"], [1], 5, 1.0, 20.0)


class _FakeCollectives:
    """The all-gathers of `connect_socket_mesh` answered from a script: worker 0's view of a
    2-worker cluster whose worker 1 reports `peer_port` and `peer_connected`."""

    worker_index = 0
    num_workers = 2

    def __init__(self, peer_port, peer_connected):
        self.peer_port, self.peer_connected, self.tags = peer_port, peer_connected, []

    def all_gather(self, tensor, tag):
        self.tags.append(tag)
        mine = tensor.numpy()
        if tag.endswith("addresses"):
            peer = mine.copy()
            peer[0, 1] = self.peer_port
            return tf.constant(np.concatenate([mine, peer]))
        return tf.constant(np.concatenate([mine, [self.peer_connected]]))


def test_the_cluster_falls_back_when_a_worker_cannot_listen():
    fake = _FakeCollectives(peer_port=-1, peer_connected=0)
    connected, reason = mesh.connect_socket_mesh(fake, "127.0.0.1")
    assert not connected and reason == "worker 1 could not listen"
    assert fake.tags == ["nestpipe/sockets/addresses", "nestpipe/sockets/connected"]


def test_the_cluster_falls_back_when_a_peer_did_not_connect(monkeypatch):
    # Positive control of the agreement: this worker "connects" but its peer reports failure.
    monkeypatch.setattr(mesh, "socket_connect", lambda *args: None)
    connected, reason = mesh.connect_socket_mesh(_FakeCollectives(4321, 0), "127.0.0.1")
    assert not connected and reason == "worker 1 could not connect"
    connected, reason = mesh.connect_socket_mesh(_FakeCollectives(4321, 1), "127.0.0.1")
    assert connected and reason == ""


def _token():
    from tensorflow.python.ops import resource_variable_ops  # pylint: disable=import-outside-toplevel
    return resource_variable_ops.ResourceVariable(0.0)
