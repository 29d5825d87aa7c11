"""The socket transport (ops/socket_ops.cc, tf_nestpipe/collectives/sockets.py): its all-to-all,
all-gather, gradient and all-reduce equal NumPy on 3 workers; a peer that dies fails the
exchange at once, a stopped one after the stall timeout, a live one that skips a call within the
call timeout, each naming the worker (and the call); a cancelled exchange fails its step at once;
a cluster where one worker cannot take part agrees to fall back to TensorFlow's collectives."""
import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import PROGRAMS, launch, run_command
from tf_nestpipe.collectives import sockets as mesh
from tf_nestpipe.collectives.transport import TransportConfig, TransportError
from tf_nestpipe.ops.sockets import socket_all_to_all

PROGRAM = os.path.join(PROGRAMS, "socket_mesh.py")


@pytest.mark.cluster
def test_mesh_collectives_equal_numpy_on_three_workers():
    result = launch(3, [PROGRAM], timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("socket mesh ok 3 flat") == 3, result.stdout[-4000:]
    # Two I/O threads per process whatever the number of peers.
    assert result.stdout.count("'peers': 2, 'io_threads': 2}") == 3, result.stdout[-4000:]


@pytest.mark.cluster
def test_eight_workers_start_and_exchange_on_the_mesh():
    result = launch(8, [PROGRAM], timeout=400)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("socket mesh ok 8 flat") == 8, result.stdout[-4000:]
    assert result.stdout.count("'peers': 7, 'io_threads': 2}") == 8, result.stdout[-4000:]


@pytest.mark.cluster
def test_hierarchical_collectives_equal_numpy_on_two_hosts_of_two():
    """The same checks with every all-to-all in two hops (within a "host" of 2 workers, then
    across the 2 hosts), which must give exactly what the flat exchange gives."""
    result = launch(4, [PROGRAM], timeout=300,
                    env={"TF_NESTPIPE_TRANSPORT_HIERARCHICAL": "on",
                         "TF_NESTPIPE_TRANSPORT_LOCAL_WORKERS": "2"})
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("socket mesh ok 4 hosts (2, 2)") == 4, result.stdout[-4000:]


def _config(**fields):
    return TransportConfig(**fields).resolved()


def test_the_host_layout_of_the_hierarchical_all_to_all():
    two_by_two = [1, 1, 2, 2]
    assert mesh.host_layout(two_by_two, _config(hierarchical="on")) == (2, 2)
    assert mesh.host_layout(two_by_two, _config(hierarchical="off")) is None
    assert mesh.host_layout(two_by_two, _config(hierarchical="auto")) is None  # only 4 workers
    assert mesh.host_layout([1] * 32 + [2] * 32, _config(hierarchical="auto")) == (2, 32)
    assert mesh.host_layout([1, 2, 1, 2], _config(hierarchical="on")) is None  # interleaved
    assert mesh.host_layout([1, 1, 1, 2], _config(hierarchical="on")) is None  # uneven
    assert mesh.host_layout([1, 1, 1, 1], _config(hierarchical="on")) is None  # one host
    assert mesh.host_layout([1, 1, 1, 1], _config(hierarchical="on", local_workers=2)) == (2, 2)


@pytest.mark.cluster
@pytest.mark.parametrize("kind, errors, within", [
    ("die", ["worker 1 (127.0.0.1:"], 15),
    ("stop", ["has sent nothing, not even a heartbeat, for 3 s"], 30),
    # Every worker fails within the 4 s call timeout (+ 5 s), naming worker 1 and the call.
    ("skip", ["worker 0 failed after", "worker 1 failed after",
              "worker 1 (127.0.0.1:", "did not make call 'mesh/fault'"], 9),
])
def test_a_failed_peer_fails_the_exchange_naming_it(kind, errors, within):
    result = launch(2, [PROGRAM, kind], timeout=240,
                    env={"TF_NESTPIPE_TRANSPORT_STALL_SECONDS": "3",
                         "TF_NESTPIPE_TRANSPORT_TIMEOUT": "4"})
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    for error in errors:
        assert error in out, (error, out[-4000:])
    assert "nestpipe sockets:" in out and "worker 0" in out
    if kind == "skip":
        for worker in (0, 1):
            line = next(l for l in out.splitlines() if "worker %d failed after" % worker in l)
            assert float(line.split("after ")[1].split(" s")[0]) < within, line
        # Worker 1 learns worker 0's reason, not just that its connection closed.
        assert "worker 0 (127.0.0.1:" in out and "stopped the job" in out, out[-4000:]


@pytest.mark.cluster
def test_a_cancelled_exchange_fails_its_step_at_once_and_tells_the_peers():
    started = time.time()
    result = launch(2, [PROGRAM, "cancel"], timeout=240,
                    env={"TF_NESTPIPE_TRANSPORT_TIMEOUT": "120"})
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    line = next(l for l in out.splitlines() if "worker 0 step failed after" in l)
    assert float(line.split("after ")[1].split(" s")[0]) < 10, line  # not the 120 s timeout
    assert "worker 0 later call: CancelledError" in out, out[-4000:]
    assert "call 'mesh/cancel' was cancelled" in out, out[-4000:]
    assert time.time() - started < 120


def test_the_exchange_refuses_to_run_without_a_mesh():
    # pytest's own process never opens a mesh.
    with pytest.raises(tf.errors.FailedPreconditionError, match="mesh is not connected"):
        socket_all_to_all(tf.zeros([2, 3]), [3, 3], 0.0, 1, _token().handle)


class _FakeCollectives:
    """The all-gathers of `open_socket_mesh` answered from a script: worker 0's view of a
    2-worker cluster whose worker 1 reports `peer_port`, `peer_secret` and `peer_connected`."""

    worker_index = 0
    num_workers = 2

    def __init__(self, peer_port, peer_connected, peer_secret=0):
        self.peer_port, self.peer_connected, self.tags = peer_port, peer_connected, []
        self.peer_secret = peer_secret

    def all_gather(self, tensor, tag):
        self.tags.append(tag)
        mine = tensor.numpy()
        if tag.endswith("addresses"):
            peer = mine.copy()
            peer[0, 1] = self.peer_port
            peer[0, 2] = self.peer_secret
            return tf.constant(np.concatenate([mine, peer]))
        return tf.constant(np.concatenate([mine, [self.peer_connected]]))


CONFIG = TransportConfig(connect_timeout_seconds=1.0).resolved()


def test_the_cluster_falls_back_when_a_worker_cannot_listen():
    fake = _FakeCollectives(peer_port=-1, peer_connected=0)
    connected, reason, _ = mesh.open_socket_mesh(fake, "127.0.0.1", CONFIG)
    assert not connected and reason == "worker 1 could not listen"
    assert fake.tags == ["nestpipe/sockets/addresses", "nestpipe/sockets/connected"]


def test_the_cluster_falls_back_when_only_some_workers_have_a_secret(monkeypatch):
    monkeypatch.setenv("TF_NESTPIPE_TRANSPORT_SECRET", "s3cret")
    connected, reason, _ = mesh.open_socket_mesh(_FakeCollectives(4321, 0, peer_secret=0),
                                                 "127.0.0.1", CONFIG)
    assert not connected
    assert "workers [0] have a transport secret and workers [1] none" in reason


def test_the_cluster_falls_back_when_a_peer_did_not_connect(monkeypatch):
    # Positive control of the agreement: this worker "connects" but its peer reports failure.
    class Connected:
        def __init__(self, *args):
            pass

        def run(self):
            return {1: _Socket()}

    adopted = []
    monkeypatch.setattr(mesh, "Handshake", Connected)
    monkeypatch.setattr(mesh, "socket_adopt", lambda *args: adopted.append(args))
    connected, reason, _ = mesh.open_socket_mesh(_FakeCollectives(4321, 0), "127.0.0.1", CONFIG)
    assert not connected and reason == "worker 1 could not connect" and not adopted
    connected, reason, _ = mesh.open_socket_mesh(_FakeCollectives(4321, 1), "127.0.0.1", CONFIG)
    assert connected and reason == "" and adopted[0][1] == [-1, 99]


def test_a_required_secret_that_is_missing_is_refused_with_the_fix(monkeypatch):
    monkeypatch.delenv("TF_NESTPIPE_TRANSPORT_SECRET", raising=False)
    monkeypatch.delenv("TF_NESTPIPE_TRANSPORT_SECRET_FILE", raising=False)
    config = TransportConfig(require_secret=True).resolved()
    with pytest.raises(TransportError, match="TF_NESTPIPE_TRANSPORT_SECRET"):
        mesh.open_socket_mesh(_FakeCollectives(4321, 1), "127.0.0.1", config)


class _Socket:
    def detach(self):
        return 99

    def close(self):
        pass


def _token():
    from tensorflow.python.ops import resource_variable_ops  # pylint: disable=import-outside-toplevel
    return resource_variable_ops.ResourceVariable(0.0)


FRAMES = os.path.join(PROGRAMS, "socket_frames.py")


@pytest.mark.parametrize("case, error", [
    ("garbage", "DataLossError: .*worker 1 \\(peer:1\\) sent a frame without the tf_nestpipe magic"),
    ("bad_version", "DataLossError: .*a frame of protocol version 3 \\(this worker speaks 2\\)"),
    ("huge", "ResourceExhaustedError: .*announced a 1099511627776-byte frame, over this "
             "worker's limit .*TF_NESTPIPE_TRANSPORT_MAX_MESSAGE_BYTES"),
    ("flood", "ResourceExhaustedError: .*for exchanges worker 0 has not started, over its limit "
              "of 1048576 bytes \\(TF_NESTPIPE_TRANSPORT_MAX_BUFFERED_BYTES\\)"),
    ("oversized", "InternalError: .*sent 4 entries .* into call 'frames/9' of capacity 3"),
    ("cut", "UnavailableError: .*worker 1 \\(peer:1\\)"),
])
def test_the_data_plane_refuses_bad_frames_at_once_naming_the_sender(case, error):
    import re  # pylint: disable=import-outside-toplevel
    result = run_command([sys.executable, FRAMES, case], timeout=120)
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    line = next(l for l in out.splitlines() if l.startswith("%s failed after" % case))
    assert re.search(error, line), line
    assert float(line.split("after ")[1].split(" s")[0]) < 5, line
    growth = next(l for l in out.splitlines() if l.startswith("%s rss growth" % case))
    assert int(growth.split()[3]) < 16 * 1024, growth  # KiB: nothing sized by the sender


def test_the_data_plane_delivers_good_frames_whenever_they_arrive():
    # Positive control of the refusals above: the same program, well-formed frames.
    result = run_command([sys.executable, FRAMES, "good"], timeout=120)
    assert result.returncode == 0 and "good ok" in result.stdout, result.stdout[-3000:]


def _can_make_networks():
    import shutil  # pylint: disable=import-outside-toplevel
    return os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")


@pytest.mark.cluster
@pytest.mark.skipif(not _can_make_networks(), reason="needs root, ip and tc (network namespaces)")
def test_a_long_transfer_on_a_slow_link_is_progress_not_a_dead_peer():
    """10 MB each way at 10 Mbit/s takes ~8 s: longer than both the 3 s stall limit and the 4 s
    call timeout, which only silence (see the "stop" and "skip" cases) may trip."""
    sys.path.insert(0, os.path.join(os.path.dirname(PROGRAMS), "..", "bench"))
    from netem import EmulatedNetwork  # pylint: disable=import-outside-toplevel
    with EmulatedNetwork({"worker": 2}, rate="10mbit", prefix="npt") as net:
        argv = ([sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", "--no-pin-cpus"]
                + net.launcher_flags() + ["--", sys.executable, PROGRAM, "slow"])
        result = run_command(argv, timeout=240, fresh=True,  # forked tasks would share our netns
                             env={"TF_NESTPIPE_TRANSPORT_STALL_SECONDS": "3",
                                  "TF_NESTPIPE_TRANSPORT_TIMEOUT": "4"})
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    took = [float(l.split(" in ")[1].split(" s")[0]) for l in out.splitlines()
            if "slow exchange ok in" in l]
    assert len(took) == 2 and min(took) > 4, took  # it really outlasted both limits
