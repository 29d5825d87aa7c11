"""The socket transport (`SocketCollectives`): all-to-alls, all-gathers and dense all-reduces on
a TCP mesh between the workers.

A TensorFlow CPU collective costs a gRPC round trip through the collective executor whatever
its size; a frame on an open connection a system call or two, and only the entries that hold
data travel (the real split sizes). See docs/transport.md for the design and its measurements.

`open_socket_mesh` opens the mesh at start-up: every worker listens on its own `TF_CONFIG`
host, the addresses are all-gathered with TensorFlow's collectives, and the workers connect and
authenticate each other with the job's secret (`mesh_handshake`). Every worker learns whether
every other one connected, so the cluster agrees on the transport: where one cannot (a relay or
NAT address, a firewall or a Kubernetes NetworkPolicy that admits only TensorFlow's port), all
fall back to TensorFlow's collectives (transport "auto") or fail (transport "sockets").
"""
import atexit
import os
import socket
import sys

import numpy as np
import tensorflow as tf

from tf_nestpipe.collectives.communication import Collectives
from tf_nestpipe.collectives.mesh_handshake import Handshake, HandshakeError
from tf_nestpipe.collectives.transport import TransportError
from tf_nestpipe.ops.sockets import socket_adopt, socket_all_to_all, socket_finish

_SECRET_WORDS = 4  # a drawn secret travels as 4 int64 words (32 bytes)
# Below this many workers a flat all-to-all's W-1 frames cost less than a second hop.
_HIERARCHICAL_FROM_WORKERS = 64
# A dense sum whose W-1 whole copies take at most this many bytes goes in one round (every
# worker sends its vector to every peer) instead of two (reduce-scatter + all-gather): a round
# trip costs more than the extra bytes. With 2 workers both send the same bytes.
_DIRECT_SUM_BYTES = 256 << 10
# The name scope of the ops of a dense sum (`all_reduce_sum`) that read what the peers sent: in a
# profile, the first of them to run is where a step waited for its peers' dense gradients.
ALL_REDUCE_SCOPE = "nestpipe_all_reduce"


def host_layout(addresses, config):
    """`(hosts, workers per host)` for the hierarchical all-to-all, or None for the flat one.

    Args:
      addresses: each worker's mesh address (workers with the same one share a host).
      config: the resolved `TransportConfig` (`hierarchical`, `local_workers`).

    Returns:
      `(H, L)` where worker `h * L + l` is the l-th worker of host h, or None: turned off, too
      few workers ("auto"), one host or one worker per host, or hosts that are not numbered
      host by host with the same number of workers each (then "on" says why on stderr).
    """
    addresses = [int(a) for a in addresses]
    workers = len(addresses)
    if config.hierarchical == "off" or (config.hierarchical == "auto"
                                        and workers < _HIERARCHICAL_FROM_WORKERS):
        return None
    local = config.local_workers
    if local is None:
        local = 1
        while local < workers and addresses[local] == addresses[0]:
            local += 1
    def host_by_host():
        """Each run of `local` consecutive workers shares one address, and runs differ."""
        return all(addresses[w] == addresses[w - w % local]
                   and (w % local != 0 or w == 0 or addresses[w] != addresses[w - 1])
                   for w in range(workers))

    regular = workers % local == 0 and (config.local_workers is not None or host_by_host())
    if not regular or local < 2 or workers // local < 2:
        if config.hierarchical == "on":
            print("tf_nestpipe: the hierarchical all-to-all needs workers numbered host by host, "
                  "the same number (>= 2) on each of >= 2 hosts (TF_NESTPIPE_TRANSPORT_LOCAL_"
                  "WORKERS sets it); using the flat one", file=sys.stderr, flush=True)
        return None
    return workers // local, local


def _ipv4_as_int(host):
    """The IPv4 address `host` resolves to, as an int (-1 if it resolves to none)."""
    try:
        return int.from_bytes(socket.inet_aton(socket.gethostbyname(host)), "big")
    except OSError:
        return -1


def _int_as_ipv4(address):
    return socket.inet_ntoa(int(address).to_bytes(4, "big"))


def _listen(worker_index, host, listen_host, listen_port=0):
    """Listens for the mesh on `listen_host` if given, else on `host` (this worker's TF_CONFIG
    host), at `listen_port` (0: any free port). Returns `(socket or None, address as int, port, reason)`: the address peers dial
    (the TF_CONFIG host's), and a reason when it cannot listen."""
    address = _ipv4_as_int(host)
    if address < 0:
        return None, -1, -1, "worker %d's host %r has no IPv4 address" % (worker_index, host)
    bind_host = listen_host or _int_as_ipv4(address)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_host, listen_port))
        listener.listen(1024)
    except OSError as error:
        listener.close()
        hint = ("" if listen_host else "; where the TF_CONFIG host is a relay, NAT or service "
                "address, set TF_NESTPIPE_TRANSPORT_LISTEN_HOST (or TransportConfig.listen_host) "
                "to an address of this machine")
        return None, -1, -1, "worker %d cannot listen on %s:%d: %s%s" % (
            worker_index, bind_host, listen_port, error.strerror or error, hint)
    return listener, address, listener.getsockname()[1], ""


def _secret_words(secret):
    return np.frombuffer(secret[:8 * _SECRET_WORDS].ljust(8 * _SECRET_WORDS, b"\0"),
                         dtype=">i8").astype(np.int64)


def open_socket_mesh(collectives, host, config):
    """Opens the mesh of the cluster whose TensorFlow `collectives` this worker uses.

    Args:
      collectives: the TensorFlow collectives the addresses are all-gathered with.
      host: this worker's `TF_CONFIG` host.
      config: the resolved `TransportConfig`.

    Returns:
      `(connected, reason, addresses)`: `(True, "", ...)` on every worker when every worker
      connected, else `(False, reason, ...)` on every worker; `addresses` the workers' mesh
      addresses (ints, -1 where unknown).

    Raises:
      TransportError: `config.require_secret` and no secret is configured.
    """
    me, workers = collectives.worker_index, collectives.num_workers
    secret = config.job_secret()
    if secret is None and config.require_secret:
        raise TransportError(
            "worker %d has no transport secret and TransportConfig(require_secret=True): set "
            "TF_NESTPIPE_TRANSPORT_SECRET or TF_NESTPIPE_TRANSPORT_SECRET_FILE on every worker "
            "(python -m tf_nestpipe.launch sets one; on Kubernetes mount a Secret)" % me)
    listener, address, port, reason = _listen(me, host, config.listen_host, config.listen_port)
    drawn = os.urandom(8 * _SECRET_WORDS)
    row = np.concatenate([[address, port, int(secret is not None)], _secret_words(drawn)])
    table = collectives.all_gather(tf.constant(row[np.newaxis], tf.int64),
                                   "nestpipe/sockets/addresses").numpy()
    with_secret = table[:, 2].astype(bool)
    if secret is None:
        secret = table[0, 3:].astype(">i8").tobytes()
        if me == 0:
            print("tf_nestpipe: the socket transport has no job secret (TF_NESTPIPE_TRANSPORT_"
                  "SECRET / _SECRET_FILE), so worker 0 drew one and shared it over TensorFlow's "
                  "unauthenticated gRPC channel: anyone who can read that traffic could join the "
                  "mesh. Set a secret on every worker (python -m tf_nestpipe.launch does).",
                  file=sys.stderr, flush=True)
    peers, addresses = {}, []
    if (table[:, 1] < 0).any():
        reason = reason or "worker %d could not listen" % int(np.argmax(table[:, 1] < 0))
    elif with_secret.any() and not with_secret.all():
        reason = ("workers %s have a transport secret and workers %s none: set the same "
                  "TF_NESTPIPE_TRANSPORT_SECRET (or _SECRET_FILE) on every worker" % (
                      np.flatnonzero(with_secret).tolist(),
                      np.flatnonzero(~with_secret).tolist()))
    else:
        addresses = [(_int_as_ipv4(a), int(p)) for a, p in table[:, :2]]
        try:
            peers = Handshake(me, addresses, listener, secret, config.connect_timeout_seconds,
                              config.hello_timeout_seconds).run()
        except HandshakeError as error:
            reason = str(error)
    if listener is not None:
        listener.close()  # the mesh accepts nobody after start-up
    connected = int(len(peers) == workers - 1)
    agreed = collectives.all_gather(tf.constant([connected], tf.int32),
                                    "nestpipe/sockets/connected").numpy()
    if not agreed.all():
        for sock in peers.values():
            sock.close()
        return (False, reason or "worker %d could not connect" % int(np.argmin(agreed)),
                table[:, 0].tolist())
    fds = [peers[j].detach() if j != me else -1 for j in range(workers)]
    socket_adopt(me, fds, ["%s:%d" % a for a in addresses], config.timeout_seconds,
                 config.stall_seconds, config.max_message_bytes, config.max_buffered_bytes)
    # At the program's end the frames still queued (e.g. of the last step's exchange, which a
    # slower peer still waits for) go out before the process exits, then a goodbye.
    atexit.register(socket_finish, config.stall_seconds)
    return True, "", table[:, 0].tolist()


class SocketCollectives(Collectives):
    """The socket transport: `Collectives` whose all-to-alls, all-gathers and dense all-reduces
    travel on the mesh once `connect` has opened it on every worker (TensorFlow's collectives
    until then, and for good if the cluster could not connect). Each all-to-all is one frame per
    peer carrying only the entries with data; streams, tags and instance keys as in
    `Collectives` (a key's calls pair in program order)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._mesh_open = False
        self.hosts = None  # (hosts, workers per host) when all-to-alls go hierarchical

    @property
    def name(self):
        """"sockets" once the mesh is open, else "tf"."""
        return "sockets" if self._mesh_open else "tf"

    @property
    def sends_real_splits(self):
        return self._mesh_open

    @property
    def reduces_dense(self):
        return self._mesh_open

    def open(self, host, config):
        """Opens the mesh with this worker listening on `host` (see `open_socket_mesh`).

        Returns:
          `(connected, reason)`, the same on every worker.
        """
        if self.num_workers == 1:
            return False, "one worker"
        connected, reason, addresses = open_socket_mesh(self, host, config)
        self._mesh_open = connected
        if connected:
            self.hosts = host_layout(addresses, config)
        return connected, reason

    def _socket_exchange(self, tensor, tag, bucket, send_counts, fill):
        tensor = tf.convert_to_tensor(tensor)
        if send_counts is None:
            send_counts = tf.fill([self.num_workers], tf.shape(tensor)[1])
        if self.hosts is not None:
            return self._hierarchical_exchange(tensor, tag, bucket, send_counts, fill)
        return self._group_exchange(tensor, tag, bucket, send_counts, fill)

    def _group_exchange(self, tensor, tag, bucket, send_counts, fill, group=()):
        """One all-to-all among `group` (every worker when empty); `(out, received counts)`."""
        received = []

        def issue(key, token):
            if token is None:  # eager: `_chained` passes no token, the op still takes one
                token = self._ordering_token(self.current_stream()).handle
            out, counts = socket_all_to_all(tensor, send_counts, fill, key, token, label=tag,
                                            group=group)
            received.append(counts)
            return out

        out = self._chained(tag, issue, bucket)
        out.set_shape(tensor.shape)
        return out, received[0]

    def _hierarchical_exchange(self, tensor, tag, bucket, send_counts, fill):
        """The all-to-all in two hops: within this host, each worker hands every local peer
        the blocks bound for that peer's local rank on every host; then across hosts, between
        workers of the same local rank, only the entries with data (packed). Returns what the
        flat exchange returns: `(out [W, C, ...], received counts [W])`."""
        hosts, local = self.hosts
        me = self.worker_index
        my_host, my_rank = divmod(me, local)
        capacity = tf.shape(tensor)[1]
        entry = tf.shape(tensor)[2:]
        counts = tf.reshape(tf.cast(send_counts, tf.int32), [hosts, local])
        # Hop 1, within the host: local peer r gets [host, C, ...] blocks bound for (host, r).
        by_rank = tf.transpose(tf.reshape(tensor, tf.concat([[hosts, local, capacity], entry], 0)),
                               tf.concat([[1, 0], tf.range(2, tf.rank(tensor) + 1)], 0))
        same_host = [my_host * local + r for r in range(local)]
        first = tf.reshape(by_rank, tf.concat([[local, hosts * capacity], entry], 0))
        got, _ = self._group_exchange(first, tag + "/host", bucket,
                                      tf.fill([local], hosts * capacity), fill, same_host)
        got_counts, _ = self._group_exchange(tf.transpose(counts)[:, :, tf.newaxis],
                                             tag + "/host_counts", None, tf.fill([local], hosts),
                                             0, same_host)
        # got[s, h]: from local source s, bound for (h, my_rank); got_counts[s, h]: its count.
        got = tf.reshape(got, tf.concat([[local, hosts, capacity], entry], 0))
        got_counts = tf.reshape(got_counts, [local, hosts])
        # Hop 2, across hosts: to (h, my_rank) the entries with data of every local source.
        outgoing = tf.transpose(got, tf.concat([[1, 0], tf.range(2, tf.rank(tensor) + 1)], 0))
        outgoing_counts = tf.transpose(got_counts)  # [hosts, local]
        valid = tf.sequence_mask(outgoing_counts, capacity)  # [hosts, local, C]
        packed_counts = tf.reduce_sum(outgoing_counts, axis=1)  # [hosts]
        positions = tf.cast(tf.where(valid), tf.int32)
        entries = tf.gather_nd(outgoing, positions)  # in (host, source, entry) order
        slot = tf.sequence_mask(packed_counts, local * capacity)
        packed = tf.scatter_nd(tf.cast(tf.where(slot), tf.int32), entries,
                               tf.concat([[hosts, local * capacity], entry], 0))
        same_rank = [h * local + my_rank for h in range(hosts)]
        arrived, _ = self._group_exchange(packed, tag + "/across", bucket, packed_counts, fill,
                                          same_rank)
        arrived_counts, _ = self._group_exchange(outgoing_counts[:, :, tf.newaxis],
                                                 tag + "/across_counts", None,
                                                 tf.fill([hosts], local), 0, same_rank)
        # arrived[h]: the packed entries of host h's sources s in order; counts [hosts, local].
        arrived_counts = tf.reshape(arrived_counts, [hosts * local])
        arrived_slot = tf.sequence_mask(tf.reduce_sum(tf.reshape(arrived_counts,
                                                                 [hosts, local]), 1),
                                        local * capacity)
        values = tf.gather_nd(arrived, tf.cast(tf.where(arrived_slot), tf.int32))
        out = tf.fill(tf.concat([[hosts * local, capacity], entry], 0),
                      tf.cast(fill, tensor.dtype))
        out = tf.tensor_scatter_nd_update(
            out, tf.cast(tf.where(tf.sequence_mask(arrived_counts, capacity)), tf.int32), values)
        out.set_shape(tensor.shape)
        return out, arrived_counts

    def all_to_all(self, tensor, tag, bucket=None, send_counts=None, fill=0):
        """Sends the first `send_counts[j]` entries of `tensor[j]` (all of them without
        `send_counts`) to worker j; the received padding is `fill`."""
        if not self._mesh_open:
            return super().all_to_all(tensor, tag, bucket, send_counts, fill)
        return self._socket_exchange(tensor, tag, bucket, send_counts, fill)[0]

    def all_to_all_differentiable(self, tensor, tag, bucket=None, send_counts=None):
        """All-to-all whose gradient is the reverse all-to-all, each direction carrying only the
        entries that hold data."""
        if not self._mesh_open:
            return super().all_to_all_differentiable(tensor, tag, bucket, send_counts)

        @tf.custom_gradient
        def exchange(x):
            out, received = self._socket_exchange(x, tag, bucket, send_counts, 0)

            def grad(dy):
                back, _ = self._socket_exchange(dy, tag + "/grad", bucket, received, 0)
                return back

            return out, grad

        return exchange(tensor)

    def all_gather(self, tensor, tag):
        """Concatenates `tensor` (same shape on every worker) from all workers along axis 0: on
        the mesh, one frame of it to each peer."""
        tensor = tf.convert_to_tensor(tensor)
        if not self._mesh_open or tensor.shape.rank == 0:
            return super().all_gather(tensor, tag)
        copies = tf.repeat(tensor[tf.newaxis], self.num_workers, axis=0)
        out = self.all_to_all(copies, tag)
        gathered = tf.reshape(out, tf.concat([[-1], tf.shape(tensor)[1:]], 0))
        if tensor.shape[0] is not None:
            gathered.set_shape([tensor.shape[0] * self.num_workers] + tensor.shape[1:].as_list())
        return gathered

    def _sums_directly(self, flat):
        """Whether the dense sum of `flat` goes in one round (see `all_reduce_sum`)."""
        if self.num_workers == 2:
            return True
        elements = flat.shape.num_elements()
        return (elements is not None
                and (self.num_workers - 1) * elements * flat.dtype.size <= _DIRECT_SUM_BYTES)

    def _reduce_scatter_gather(self, flat, tag):
        """The sum of `flat` over the workers in two rounds (see `all_reduce_sum`)."""
        workers = self.num_workers
        size = tf.size(flat)
        chunk = (size + workers - 1) // workers
        chunks = tf.reshape(tf.pad(flat, [[0, chunk * workers - size]]), [workers, chunk])
        mine = self.all_to_all(chunks, tag + "/scatter")
        with tf.name_scope(ALL_REDUCE_SCOPE):
            total = _sum_in_worker_order(mine, workers)
            return tf.reshape(self.all_gather(total[tf.newaxis], tag + "/gather"), [-1])[:size]

    def all_reduce_sum(self, tensors, tag):
        """Sums each dense tensor of `tensors` over all workers.

        Per dtype, the tensors are packed flat and cut into W chunks: a reduce-scatter (worker j
        receives every worker's chunk j and adds them in worker order) then an all-gather of the
        summed chunks, two all-to-alls that send 2(W-1)/W of the vector per worker, whatever W.
        Each chunk is summed once, so every worker holds bitwise the same sums. A small vector
        (or any, with 2 workers) goes in one round instead: every worker sends it whole to every
        peer and adds the W vectors in worker order, the same arithmetic. Runs on its own stream
        ("all_reduce"), not behind the step's embedding exchanges.

        Args:
          tensors: dense tensors (this worker's values).
          tag: the collectives' tag.

        Returns:
          The sums, in the order and shapes of `tensors`.

        Raises:
          ValueError: the mesh is not open.
        """
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        if not self._mesh_open:
            raise ValueError("all_reduce_sum needs the socket mesh")
        out = [None] * len(tensors)
        by_dtype = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        workers = self.num_workers
        with self.stream("all_reduce"):
            for dtype, indices in sorted(by_dtype.items(), key=lambda item: item[0].name):
                flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], 0)
                if self._sums_directly(flat):
                    rows = self.all_to_all(tf.repeat(flat[tf.newaxis], workers, axis=0),
                                           "%s/%s" % (tag, dtype.name))
                    with tf.name_scope(ALL_REDUCE_SCOPE):
                        summed = _sum_in_worker_order(rows, workers)
                else:
                    summed = self._reduce_scatter_gather(flat, "%s/%s" % (tag, dtype.name))
                sizes = [tf.size(tensors[i]) for i in indices]
                for i, part in zip(indices, tf.split(summed, tf.stack(sizes), num=len(indices))):
                    out[i] = tf.reshape(part, tf.shape(tensors[i]))
                    out[i].set_shape(tensors[i].shape)
        return out


def _sum_in_worker_order(received, workers):
    """The sum of `received` (`[workers, ...]`, row j from worker j) added in worker order, so
    every worker that sums the same rows holds bitwise the same result."""
    total = received[0]
    for j in range(1, workers):
        total = total + received[j]
    return total


def log_fallback(worker_index, reason):
    """Worker 0 says why the cluster runs the exchange on TensorFlow's collectives."""
    if worker_index == 0:
        print("tf_nestpipe: the embedding exchange uses TensorFlow's collectives (~1-3 ms each "
              "on CPU) instead of the socket mesh: %s. Open the workers' ports to each other "
              "(any port on their TF_CONFIG hosts) or pass transport='tf' to skip the attempt."
              % reason, file=sys.stderr, flush=True)
