"""The socket transport's start-up handshake (tf_nestpipe/collectives/mesh_handshake.py), in one
process: two workers connect and authenticate each other; a peer without the job's secret is
refused on both sides; strangers on the listening port (silence, random bytes, huge streams,
another cluster's hello, a forged proof, hundreds of held connections) neither delay start-up
nor grow memory, and are named; a worker that never comes is named within the timeout."""
import os
import resource
import socket
import threading
import time

import pytest

from tf_nestpipe.collectives.mesh_handshake import (Handshake, HandshakeError, _HELLO, _MAGIC,
                                                    _VERSION, cluster_fingerprint)


def _listener():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


def _start(handshake):
    """Runs `handshake` in a thread; returns a dict that gets "peers" or "error", and "took"."""
    result = {}

    def run():
        started = time.monotonic()
        try:
            result["peers"] = handshake.run()
        except HandshakeError as error:
            result["error"] = str(error)
        result["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return result


def _cluster(secrets=(b"job-secret", b"job-secret"), timeout=10.0, hello_timeout=5.0):
    listeners = [_listener() for _ in secrets]
    addresses = [l.getsockname() for l in listeners]
    return [Handshake(i, addresses, listeners[i], secret, timeout, hello_timeout)
            for i, secret in enumerate(secrets)], addresses


def test_two_workers_connect_and_authenticate_each_other():
    (h0, h1), _ = _cluster()
    r0, r1 = _start(h0), _start(h1)
    for r in (r0, r1):
        r["thread"].join(15)
    assert set(r0["peers"]) == {1} and set(r1["peers"]) == {0}
    r1["peers"][0].sendall(b"rows")
    assert r0["peers"][1].recv(4) == b"rows"
    assert not h0.refused and not h1.refused


def test_a_peer_without_the_jobs_secret_is_refused_on_both_sides():
    (h0, h1), _ = _cluster(secrets=(b"job-secret", b"a guess"), timeout=3.0)
    r0, r1 = _start(h0), _start(h1)
    for r in (r0, r1):
        r["thread"].join(15)
    assert "error" in r0 and "error" in r1
    assert "no authenticated connection with worker 1 (127.0.0.1:" in r0["error"]
    assert "failed authentication" in r0["error"] or "failed authentication" in r1["error"]
    assert "TF_NESTPIPE_TRANSPORT_SECRET" in r0["error"]
    assert "no authenticated connection with worker 0" in r1["error"]
    assert r0["took"] < 6 and r1["took"] < 6


def test_a_worker_that_never_comes_is_named_within_the_timeout():
    (h0, _), addresses = _cluster(timeout=1.0)
    r0 = _start(h0)
    r0["thread"].join(10)
    assert "worker 1 (%s:%d)" % addresses[1] in r0["error"] and r0["took"] < 2.5


def _rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _attack(address, fingerprint):
    """Connections a stranger makes to a listening worker; returns them (held open)."""
    held = []

    def connect():
        sock = socket.create_connection(address, timeout=5)
        held.append(sock)
        return sock

    for _ in range(20):                   # silence
        connect()
    for _ in range(10):                   # random bytes
        connect().sendall(os.urandom(4096))
    for _ in range(3):                    # another cluster's hello
        connect().sendall(_HELLO.pack(_MAGIC, _VERSION, 1, 2, b"x" * 8, os.urandom(16)))
    for _ in range(3):                    # an older protocol
        connect().sendall(_HELLO.pack(_MAGIC, _VERSION - 1, 1, 2, fingerprint, os.urandom(16)))
    forged = connect()                    # this cluster's hello, then a forged proof
    forged.sendall(_HELLO.pack(_MAGIC, _VERSION, 1, 2, fingerprint, os.urandom(16)))
    forged.recv(_HELLO.size + 32)
    forged.sendall(os.urandom(32))
    flood = connect()                     # a huge stream
    try:
        flood.sendall(b"\0" * (1 << 20))
    except OSError:
        pass  # refused and closed before it all went
    for _ in range(300):                  # many connections, held
        try:
            connect()
        except OSError:
            break
    return held


def test_strangers_on_the_port_neither_delay_start_up_nor_grow_memory():
    (h0, h1), addresses = _cluster(timeout=30.0, hello_timeout=5.0)
    before = _rss_kib()
    r0 = _start(h0)
    held = _attack(addresses[0], cluster_fingerprint(addresses))
    started = time.monotonic()
    r1 = _start(h1)  # the real worker 1 comes after the strangers
    for r in (r0, r1):
        r["thread"].join(40)
    took = time.monotonic() - started
    for sock in held:
        sock.close()
    assert set(r0["peers"]) == {1} and set(r1["peers"]) == {0}, (r0.get("error"),
                                                                   r1.get("error"))
    assert took < 3.0, took  # not the strangers' 5 s hello timeout, nor the 30 s start-up one
    reasons = " | ".join(r.reason for r in h0.refused)
    assert "does not speak the tf_nestpipe mesh protocol" in reasons
    assert "belongs to another cluster" in reasons
    assert "mesh protocol version %d" % (_VERSION - 1) in reasons
    assert "failed authentication" in reasons
    assert "too many unauthenticated connections at once" in reasons
    assert _rss_kib() - before < 32 * 1024  # KiB: bounded whatever the strangers send


def test_the_handshake_needs_a_secret():
    with pytest.raises(ValueError, match="secret"):
        Handshake(0, [("127.0.0.1", 1), ("127.0.0.1", 2)], _listener(), b"", 1.0)
