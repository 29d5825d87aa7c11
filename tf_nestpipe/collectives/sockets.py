"""The embedding exchange over a direct TCP mesh between the workers (`SocketCollectives`).

On CPU a TensorFlow collective costs ~1-3 ms whatever its size (bench/results/
collective_latency.md), and a step's exchange needs three or more of them in a row. The socket
mesh (ops/socket_ops.cc) sends each all-to-all as one message per peer on a connection opened
at start-up: tens of microseconds on loopback, and only the entries that hold data travel (the
real split sizes, like Horovod's backend). The dense all-reduce stays TensorFlow's.

`connect_socket_mesh` opens the mesh at start-up: every worker listens on its own `TF_CONFIG`
address, the addresses and a nonce are all-gathered with TensorFlow's collectives, and the
workers dial each other. Every worker learns whether every other one connected, so the cluster
agrees on the transport: where one cannot (a relay or NAT address, a firewall or a Kubernetes
NetworkPolicy that admits only TensorFlow's port), all fall back to TensorFlow's collectives and
worker 0 says why.
"""
import os
import socket
import sys

import numpy as np
import tensorflow as tf

from tf_nestpipe.collectives.communication import Collectives
from tf_nestpipe.ops.sockets import socket_all_to_all, socket_connect, socket_listen

# Seconds a worker waits for its peers' connections at start-up before the cluster falls back.
CONNECT_TIMEOUT_SECONDS = float(os.environ.get("NESTPIPE_SOCKET_CONNECT_TIMEOUT", "20"))
# Seconds an exchange waits on a peer that sends nothing, not even its heartbeat (every 0.5 s).
STALL_SECONDS = float(os.environ.get("NESTPIPE_SOCKET_STALL_SECONDS", "20"))


def _ipv4_as_int(host):
    """The IPv4 address `host` resolves to, as an int (-1 if it resolves to none)."""
    try:
        return int.from_bytes(socket.inet_aton(socket.gethostbyname(host)), "big")
    except OSError:
        return -1


def _local_address_towards(host):
    """The IPv4 address (an int) this machine sends from to reach `host`, or -1."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent
        return _ipv4_as_int(probe.getsockname()[0])
    except OSError:
        return -1
    finally:
        probe.close()


def _listen(worker_index, host):
    """Listens for the mesh on `host` (this worker's TF_CONFIG host) if it is an address of this
    machine, else (a relay, NAT or service address) on every interface, reached at the address
    this machine uses towards `host`. Returns `(address as int, port, reason)`, port -1 and a
    reason when it cannot."""
    address = _ipv4_as_int(host)
    if address < 0:
        return -1, -1, "worker %d's host %r has no IPv4 address" % (worker_index, host)
    try:
        return address, socket_listen(socket.inet_ntoa(address.to_bytes(4, "big"))), ""
    except tf.errors.OpError:
        pass
    address = _local_address_towards(host)
    try:
        if address >= 0:
            return address, socket_listen("0.0.0.0"), ""
    except tf.errors.OpError as error:
        return -1, -1, "worker %d cannot listen: %s" % (worker_index, error.message)
    return -1, -1, "worker %d has no address towards %s" % (worker_index, host)


def connect_socket_mesh(collectives, host):
    """Opens the socket mesh of the cluster whose TensorFlow `collectives` this worker uses, this
    worker listening on `host` (its `TF_CONFIG` host; see `_listen`). Returns `(True, "")` on
    every worker when every worker connected, else `(False, reason)` on every worker."""
    address, port, reason = _listen(collectives.worker_index, host)
    nonce = int.from_bytes(os.urandom(7), "big")
    table = collectives.all_gather(tf.constant([[address, port, nonce]], tf.int64),
                                   "nestpipe/sockets/addresses").numpy()
    connected = 0
    if (table[:, 1] >= 0).all():
        hosts = [socket.inet_ntoa(int(a).to_bytes(4, "big")) for a in table[:, 0]]
        try:
            socket_connect(collectives.worker_index, hosts, table[:, 1].tolist(),
                           int(table[0, 2]), CONNECT_TIMEOUT_SECONDS, STALL_SECONDS)
            connected = 1
        except tf.errors.OpError as error:
            reason = error.message
    elif not reason:
        reason = "worker %d could not listen" % int(np.argmax(table[:, 1] < 0))
    agreed = collectives.all_gather(tf.constant([connected], tf.int32),
                                    "nestpipe/sockets/connected").numpy()
    if agreed.all():
        return True, ""
    return False, reason or "worker %d could not connect" % int(np.argmin(agreed))


class SocketCollectives(Collectives):
    """`Collectives` whose all-to-alls and all-gathers travel on the socket mesh once `connect`
    has opened it on every worker (TensorFlow's collectives until then, and for good if the
    cluster could not connect), each as one message per peer carrying only the entries with
    data; streams, tags and instance keys as in `Collectives` (a key's calls pair in program
    order)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._mesh_open = False

    @property
    def backend(self):
        """"sockets" once the mesh is open, else "tf"."""
        return "sockets" if self._mesh_open else "tf"

    def connect(self, host):
        """Opens the mesh with this worker listening on `host` (see `connect_socket_mesh`);
        returns `(connected, reason)`, the same on every worker."""
        if self.num_workers == 1:
            return False, "one worker"
        connected, reason = connect_socket_mesh(self, host)
        self._mesh_open = connected
        return connected, reason

    def _socket_exchange(self, tensor, tag, bucket, send_counts, fill):
        tensor = tf.convert_to_tensor(tensor)
        if send_counts is None:
            send_counts = tf.fill([self.num_workers], tf.shape(tensor)[1])
        received = []

        def issue(key, token):
            if token is None:  # eager: `_chained` passes no token, the op still takes one
                token = self._ordering_token(self.current_stream()).handle
            out, counts = socket_all_to_all(tensor, send_counts, fill, key, token)
            received.append(counts)
            return out

        out = self._chained(tag, issue, bucket)
        out.set_shape(tensor.shape)
        return out, received[0]

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
        the mesh, an all-to-all of W copies."""
        tensor = tf.convert_to_tensor(tensor)
        if not self._mesh_open or tensor.shape.rank == 0:
            return super().all_gather(tensor, tag)
        copies = tf.repeat(tensor[tf.newaxis], self.num_workers, axis=0)
        out = self.all_to_all(copies, tag)
        gathered = tf.reshape(out, tf.concat([[-1], tf.shape(tensor)[1:]], 0))
        if tensor.shape[0] is not None:
            gathered.set_shape([tensor.shape[0] * self.num_workers] + tensor.shape[1:].as_list())
        return gathered


    def all_reduce_sum(self, tensors, tag):
        """Sums each dense tensor of `tensors` over all workers: one all-to-all per dtype of the
        tensors packed flat, each worker sending its vector to every peer and adding the W
        received vectors in worker order, so every worker computes bitwise the same sum. Runs
        on its own stream ("all_reduce"), not behind the step's embedding exchanges."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        if not self._mesh_open:
            raise ValueError("all_reduce_sum needs the socket mesh")
        out = [None] * len(tensors)
        by_dtype = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        with self.stream("all_reduce"):
            for dtype, indices in sorted(by_dtype.items(), key=lambda item: item[0].name):
                flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], 0)
                copies = tf.repeat(flat[tf.newaxis], self.num_workers, axis=0)
                rows = self.all_to_all(copies, "%s/%s" % (tag, dtype.name))
                total = rows[0]
                for j in range(1, self.num_workers):
                    total = total + rows[j]
                sizes = [tf.size(tensors[i]) for i in indices]
                for i, part in zip(indices, tf.split(total, tf.stack(sizes), num=len(indices))):
                    out[i] = tf.reshape(part, tf.shape(tensors[i]))
                    out[i].set_shape(tensors[i].shape)
        return out


def log_fallback(worker_index, reason):
    """Worker 0 says why the cluster runs the exchange on TensorFlow's collectives."""
    if worker_index == 0:
        print("tf_nestpipe: the embedding exchange uses TensorFlow's collectives (~1-3 ms each "
              "on CPU) instead of the socket mesh: %s. Open the workers' ports to each other "
              "(any port on their TF_CONFIG hosts) or pass collectives='tf' to skip the attempt."
              % reason, file=sys.stderr, flush=True)
