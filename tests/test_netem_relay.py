"""The benchmark's emulated-network delay for direct connections: a connect() to an address in the
relayed subnet goes through bench/delay_relay.py's --dynamic port and is delayed both ways; other
connections are untouched. The (native) relay passes a large stream intact, in order, and its
end (half-close) on. Runs on loopback (127.0.0.0/8), no namespaces or root needed."""
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import REPO, run_command

sys.path.insert(0, os.path.join(REPO, "bench"))
import netem  # noqa: E402  pylint: disable=wrong-import-position

DELAY_MS = 25.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ECHO_CLIENT = textwrap.dedent("""
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(3):
        t0 = time.perf_counter(); c.sendall(b"ping"); data = c.recv(4)
        times.append((time.perf_counter() - t0) * 1e3)
        assert data == b"ping", data
    print("RTT", min(times))
""")


@pytest.fixture(scope="module")
def relayed_echo():
    """An echo server on 127.0.0.2 and the delay relay's dynamic port on 127.0.0.1."""
    server = socket.socket()
    server.bind(("127.0.0.2", 0))
    server.listen()
    echo_port = server.getsockname()[1]

    def echo():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while True:
                    data = conn.recv(64)
                    if not data:
                        break
                    conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    relay_port = _free_port()
    relay = subprocess.Popen([sys.executable, "-u", os.path.join(REPO, "bench", "delay_relay.py"),
                              "--delay-ms", str(DELAY_MS), "--dynamic", str(relay_port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "READY" in relay.stdout.readline()
    env = {"LD_PRELOAD": netem.relay_connect_library(), "NESTPIPE_RELAY_SUBNET": "127.0.0.",
           "NESTPIPE_RELAY_ADDRESS": "127.0.0.1", "NESTPIPE_RELAY_PORT": str(relay_port)}
    yield echo_port, env
    relay.kill()
    relay.wait()
    server.close()


def _round_trip_ms(port, env):
    result = run_command([sys.executable, "-c", ECHO_CLIENT, "127.0.0.2", str(port)], env=env,
                         timeout=60)
    assert result.returncode == 0, result.stdout
    return float(result.stdout.split("RTT")[-1])


def test_direct_connections_in_the_subnet_are_relayed_and_delayed(relayed_echo):
    port, env = relayed_echo
    assert _round_trip_ms(port, {}) < DELAY_MS  # loopback without the interposer
    # Through the relay: delayed once each way, the data intact.
    assert _round_trip_ms(port, env) >= 2 * DELAY_MS * 0.9


def test_connections_outside_the_subnet_or_excluded_are_not_relayed(relayed_echo):
    port, env = relayed_echo
    assert _round_trip_ms(port, dict(env, NESTPIPE_RELAY_SUBNET="10.")) < DELAY_MS
    assert _round_trip_ms(port, dict(env, NESTPIPE_RELAY_EXCLUDE="127.0.0.9,127.0.0.2")) < DELAY_MS


def test_a_mapped_port_relays_a_large_stream_intact_and_passes_its_end_on():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def echo():  # echoes until the client's end arrives, then ends its own side
        conn, _ = server.accept()
        with conn:
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    break
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    threading.Thread(target=echo, daemon=True).start()
    listen_port = _free_port()
    relay = subprocess.Popen([sys.executable, "-u", os.path.join(REPO, "bench", "delay_relay.py"),
                              "--delay-ms", "1", "%d:127.0.0.1:%d" % (listen_port,
                                                                   server.getsockname()[1])],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "READY" in relay.stdout.readline()
        payload = os.urandom(24 << 20)
        received = bytearray()
        client = socket.create_connection(("127.0.0.1", listen_port))
        client.settimeout(60)

        def read_all():
            while True:
                data = client.recv(1 << 20)
                if not data:  # the echo server's end, passed on by the relay
                    return
                received.extend(data)

        reader = threading.Thread(target=read_all)
        reader.start()
        client.sendall(payload)
        client.shutdown(socket.SHUT_WR)  # passed on: the echo server stops and ends its side
        reader.join(90)
        assert not reader.is_alive()
        assert len(received) == len(payload) and bytes(received) == payload
        client.close()
    finally:
        relay.kill()
        relay.wait()
        server.close()


def test_the_relay_refuses_a_negative_delay():
    result = run_command([sys.executable, os.path.join(REPO, "bench", "delay_relay.py"),
                          "--delay-ms", "-1", "--dynamic", str(_free_port())], timeout=60)
    assert result.returncode != 0 and "--delay-ms must be >= 0" in result.stdout, result.stdout
