"""Opens the socket transport's connections at start-up: every pair of workers, authenticated.

Worker i dials every worker j < i and accepts every worker j > i. Each connection proves, in
both directions, that the other end holds the job's secret (an HMAC-SHA256 challenge-response
over fresh nonces: the secret itself never crosses the wire), and that it belongs to the same
cluster (its size and a fingerprint of the address table) and is the worker it claims to be.

Start-up cannot be held up from outside: every connection, ours or a stranger's, is handled on
its own by one event loop (`selectors`) with its own short deadline (`hello_timeout`), so a
silent, slow or garbling connection costs only itself; connects are non-blocking with the same
deadline; and a bounded number of unauthenticated connections are held at once (the
oldest dropped as new ones arrive). Strangers are refused and reported, never waited on.

Returns plain connected sockets (their file descriptors go to the C++ data plane,
`ops/socket_ops.cc`).
"""
import dataclasses
import errno
import hashlib
import hmac
import os
import selectors
import socket
import struct
import sys
import time

_MAGIC = b"NPMESH"
_VERSION = 2
# magic, protocol version, sender index, worker count, cluster fingerprint, nonce
_HELLO = struct.Struct("!6sHII8s16s")
_MAC_BYTES = 32
_ACK = b"\x01"
_RETRY_SECONDS = 0.05
# Unauthenticated connections held at once, beyond one per expected peer.
_SPARE_PENDING = 64
# Refusals printed as they happen (all of them are counted).
_REFUSALS_SHOWN = 10


class HandshakeError(RuntimeError):
    """The mesh could not be opened (a peer unreachable, or its authentication failed)."""


@dataclasses.dataclass
class Refusal:
    """A connection refused during start-up: who it came from and why."""
    address: str
    reason: str


def cluster_fingerprint(addresses):
    """8 bytes that differ between clusters: a digest of every worker's (host, port)."""
    text = ";".join("%s:%d" % (h, p) for h, p in addresses)
    return hashlib.sha256(text.encode()).digest()[:8]


def _mac(secret, role, first, second):
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


class _Conn:
    """One connection being opened: its socket, bytes in and out, state and deadline."""

    def __init__(self, sock, address, deadline, peer=None):
        self.sock = sock
        self.address = address
        self.deadline = deadline
        self.peer = peer          # the worker it should be (dials) or claims to be (accepts)
        self.state = None
        self.inbuf = b""
        self.outbuf = b""
        self.their_hello = b""
        self.my_hello = b""

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Handshake:
    """The start-up of worker `index`'s connections (see the module docstring).

    Args:
      index: this worker's index.
      addresses: `[(host, port)]` of every worker's listening socket (its own included).
      listener: this worker's listening socket (bound, listening).
      secret: the job's secret (bytes).
      timeout: seconds the whole start-up may take.
      hello_timeout: seconds one connection may take to prove itself.
    """

    def __init__(self, index, addresses, listener, secret, timeout, hello_timeout=5.0):
        if not secret:
            raise ValueError("the mesh handshake needs a non-empty secret")
        self.index = index
        self.addresses = list(addresses)
        self.num_workers = len(self.addresses)
        self.listener = listener
        self.secret = bytes(secret)
        self.timeout = float(timeout)
        self.hello_timeout = float(hello_timeout)
        self.fingerprint = cluster_fingerprint(self.addresses)
        self.peers = {}           # worker index -> connected socket
        self.refused = []         # Refusal of every stranger
        self._selector = selectors.DefaultSelector()
        self._pending_inbound = set()
        self._dials = {}          # worker index -> _Conn being dialed (or None: retry later)
        self._retry_at = {}

    def _hello(self):
        return _HELLO.pack(_MAGIC, _VERSION, self.index, self.num_workers, self.fingerprint,
                           os.urandom(16))

    def _parse_hello(self, data):
        """`(sender index, None)` for a hello of this cluster, else `(None, why not)`."""
        magic, version, sender, workers, fingerprint, _ = _HELLO.unpack(data)
        if magic != _MAGIC:
            return None, "it does not speak the tf_nestpipe mesh protocol"
        if version != _VERSION:
            return None, ("it speaks mesh protocol version %d, this worker %d (every worker "
                          "must run the same tf_nestpipe)" % (version, _VERSION))
        if workers != self.num_workers or fingerprint != self.fingerprint:
            return None, "it belongs to another cluster (another TF_CONFIG or job)"
        return sender, None

    # --- the event loop ---------------------------------------------------------------------

    def run(self):
        """Connects to every other worker.

        Returns:
          `{worker index: socket}` for every other worker, each authenticated.

        Raises:
          HandshakeError: a worker could not be reached or authenticated within `timeout`; the
            message names each missing worker and every refused stranger.
        """
        started = time.monotonic()
        deadline = started + self.timeout
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ, None)
        for j in range(self.index):
            self._retry_at[j] = started
        try:
            while len(self.peers) < self.num_workers - 1:
                now = time.monotonic()
                if now >= deadline:
                    raise HandshakeError(self._missing_message())
                for j, at in list(self._retry_at.items()):
                    if at <= now:
                        del self._retry_at[j]
                        self._dial(j, min(deadline, now + self.hello_timeout))
                wait = min([deadline] + list(self._retry_at.values())
                           + [c.deadline for c in self._all_conns()]) - now
                for key, events in self._selector.select(max(0.0, min(wait, 0.5))):
                    if key.data is None:
                        self._accept(deadline)
                    elif key.data.sock.fileno() >= 0:  # not dropped earlier in this round
                        self._step(key.data, events)
                self._expire(time.monotonic())
        finally:
            for conn in self._all_conns():
                self._drop(conn)
            self._selector.unregister(self.listener)
            self._selector.close()
        return dict(self.peers)

    def _all_conns(self):
        return list(self._pending_inbound) + [c for c in self._dials.values() if c is not None]

    def _missing_message(self):
        missing = [j for j in range(self.num_workers) if j != self.index and j not in self.peers]
        parts = ["nestpipe sockets: worker %d could not open its connections within %g s: no "
                 "authenticated connection with worker%s %s" % (
                     self.index, self.timeout, "s" if len(missing) > 1 else "",
                     ", ".join("%d (%s:%d)" % ((j,) + tuple(self.addresses[j]))
                               for j in missing))]
        if self.refused:
            shown = "; ".join("%s: %s" % (r.address, r.reason) for r in self.refused[:5])
            parts.append("refused %d connection%s (%s%s)" % (
                len(self.refused), "s" if len(self.refused) > 1 else "", shown,
                "; ..." if len(self.refused) > 5 else ""))
        parts.append("check that every worker runs with the same secret "
                     "(TF_NESTPIPE_TRANSPORT_SECRET or _SECRET_FILE) and that no firewall or "
                     "network policy blocks the workers' ports")
        return "; ".join(parts)

    def _refuse(self, conn, reason):
        self.refused.append(Refusal(conn.address, reason))
        if len(self.refused) <= _REFUSALS_SHOWN:  # a flood is summed up in the error instead
            print("tf_nestpipe: worker %d refused a connection from %s: %s"
                  % (self.index, conn.address, reason), file=sys.stderr, flush=True)
        self._drop(conn)

    def _drop(self, conn):
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._pending_inbound.discard(conn)
        if conn.peer is not None and self._dials.get(conn.peer) is conn:
            self._dials[conn.peer] = None
        conn.close()

    def _expire(self, now):
        for conn in self._all_conns():
            if conn.deadline <= now:
                if conn in self._pending_inbound:
                    self._refuse(conn, "it did not complete the handshake within %g s"
                                 % self.hello_timeout)
                else:
                    self._redial(conn, "no answer within %g s" % self.hello_timeout)

    # --- accepting --------------------------------------------------------------------------

    def _accept(self, deadline):
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            address = "%s:%d" % addr[:2]
            conn = _Conn(sock, address, min(deadline, time.monotonic() + self.hello_timeout))
            if len(self._pending_inbound) >= self.num_workers + _SPARE_PENDING:
                # Full: the oldest goes, so that strangers holding connections open cannot keep
                # a real peer (which proves itself in milliseconds) out until they time out.
                oldest = min(self._pending_inbound, key=lambda c: c.deadline)
                self._refuse(oldest, "too many unauthenticated connections at once (it was the "
                                     "oldest)")
            sock.setblocking(False)
            conn.state = "read_hello"
            self._pending_inbound.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)

    # --- dialing ----------------------------------------------------------------------------

    def _dial(self, j, conn_deadline):
        host, port = self.addresses[j]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        conn = _Conn(sock, "%s:%d" % (host, port), conn_deadline, peer=j)
        code = sock.connect_ex((host, port))
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            conn.close()
            self._dials[j] = None
            self._retry_at[j] = time.monotonic() + _RETRY_SECONDS
            return
        conn.state = "connecting"
        self._dials[j] = conn
        self._selector.register(sock, selectors.EVENT_WRITE, conn)

    def _redial(self, conn, why):
        del why  # a peer that is still starting refuses or stays silent: both are retried
        self._drop(conn)
        self._retry_at[conn.peer] = time.monotonic() + _RETRY_SECONDS

    # --- one connection's progress -----------------------------------------------------------

    def _step(self, conn, events):
        try:
            if events & selectors.EVENT_WRITE:
                self._write(conn)
            if events & selectors.EVENT_READ:
                self._read(conn)
        except OSError as error:
            if conn in self._pending_inbound:
                self._refuse(conn, "its connection broke: %s" % error)
            else:
                self._redial(conn, str(error))

    def _send(self, conn, data, next_state):
        conn.outbuf += data
        conn.state = next_state
        self._write(conn)

    def _write(self, conn):
        if conn.state == "connecting":
            code = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
            conn.my_hello = self._hello()
            conn.outbuf = conn.my_hello
            conn.state = "read_reply"
        if conn.outbuf:
            sent = conn.sock.send(conn.outbuf)
            conn.outbuf = conn.outbuf[sent:]
        self._selector.modify(conn.sock, selectors.EVENT_WRITE if conn.outbuf
                              else selectors.EVENT_READ, conn)
        if not conn.outbuf and conn.state == "done_inbound":
            self._finish(conn)

    def _read(self, conn):
        want = {"read_hello": _HELLO.size, "read_mac": _MAC_BYTES,
                "read_reply": _HELLO.size + _MAC_BYTES, "read_ack": 1}.get(conn.state)
        if want is None:
            return
        data = conn.sock.recv(want - len(conn.inbuf))
        if not data:
            raise OSError(errno.ECONNRESET, "closed before the handshake completed")
        conn.inbuf += data
        if len(conn.inbuf) < want:
            return
        data, conn.inbuf = conn.inbuf, b""
        getattr(self, "_on_" + conn.state)(conn, data)

    # Acceptor side.
    def _on_read_hello(self, conn, data):
        sender, wrong = self._parse_hello(data)
        if wrong is None and not (self.index < sender < self.num_workers):
            wrong = "it claims to be worker %d, which does not dial worker %d" % (sender,
                                                                                  self.index)
        if wrong is None and sender in self.peers:
            wrong = "worker %d is already connected" % sender
        if wrong is not None:
            self._refuse(conn, wrong)
            return
        conn.peer, conn.their_hello = sender, data
        conn.my_hello = self._hello()
        proof = _mac(self.secret, b"acceptor", conn.their_hello, conn.my_hello)
        self._send(conn, conn.my_hello + proof, "read_mac")

    def _on_read_mac(self, conn, data):
        expected = _mac(self.secret, b"dialer", conn.their_hello, conn.my_hello)
        if not hmac.compare_digest(data, expected):
            self._refuse(conn, "it claims to be worker %d but failed authentication (it does "
                               "not hold this job's secret)" % conn.peer)
            return
        self._send(conn, _ACK, "done_inbound")

    # Dialer side.
    def _on_read_reply(self, conn, data):
        hello, proof = data[:_HELLO.size], data[_HELLO.size:]
        sender, wrong = self._parse_hello(hello)
        if wrong is None and sender != conn.peer:
            wrong = "it answered as worker %d" % sender
        if wrong is None and not hmac.compare_digest(
                proof, _mac(self.secret, b"acceptor", conn.my_hello, hello)):
            wrong = "it failed authentication (it does not hold this job's secret)"
        if wrong is not None:
            self.refused.append(Refusal(conn.address, "as worker %d: %s" % (conn.peer, wrong)))
            self._redial(conn, wrong)
            return
        self._send(conn, _mac(self.secret, b"dialer", conn.my_hello, hello), "read_ack")

    def _on_read_ack(self, conn, data):
        if data != _ACK:
            self._redial(conn, "a bad acknowledgement")
            return
        self._finish(conn)

    def _finish(self, conn):
        self._selector.unregister(conn.sock)
        self._pending_inbound.discard(conn)
        if self._dials.get(conn.peer) is conn:
            del self._dials[conn.peer]
        conn.sock.setblocking(True)
        self.peers[conn.peer] = conn.sock
