"""The socket transport's data-plane ops (ops/socket_ops.cc): all-to-alls on the connections the
mesh handshake opened (`tf_nestpipe.collectives.mesh_handshake`)."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library

# The fields of `socket_stats`, in order.
SOCKET_STATS = ("bytes_sent", "bytes_received", "frames_sent", "frames_received", "peers",
                "io_threads")


def socket_adopt(index, fds, addresses, call_timeout_seconds, stall_seconds,
                 max_message_bytes, max_buffered_bytes):
    """Hands worker `index`'s connected, authenticated sockets to the data plane.

    Args:
      index: this worker's index.
      fds: the file descriptor of the connection to each worker, -1 for this worker's own.
      addresses: each worker's "host:port", for errors.
      call_timeout_seconds: how long an exchange waits for a live peer that does not make it.
      stall_seconds: how long a peer may send nothing at all before it counts as dead.
      max_message_bytes: the largest frame a peer may announce.
      max_buffered_bytes: bytes of frames buffered before their exchange starts, in all.

    Raises:
      tf.errors.InvalidArgumentError: malformed lists.
      tf.errors.FailedPreconditionError: the process already belongs to another cluster.
    """
    load_op_library().nestpipe_socket_adopt(
        tf.constant(index, tf.int32), tf.constant(list(fds), tf.int32),
        tf.constant(list(addresses), tf.string),
        call_timeout_seconds=float(call_timeout_seconds), stall_seconds=float(stall_seconds),
        max_message_bytes=int(max_message_bytes), max_buffered_bytes=int(max_buffered_bytes))


def socket_all_to_all(tensor, send_counts, fill, key, ordering_token, label="", group=()):
    """Sends the first `send_counts[j]` entries of `tensor[j]` to the j-th member of `group`.

    Args:
      tensor: `[G, n, ...]`, one block per member.
      send_counts: `[G]` int32, how many leading entries of each block carry data.
      fill: the value of the received padding.
      key: int64 scalar; calls pair across workers by key and their order among its calls.
      ordering_token: the stream's token resource (keeps a stream's calls in program order).
      label: the call's name in errors (e.g. "user_table/keys").
      group: the worker indices taking part, this one's among them (empty: every worker).

    Returns:
      `(received, received_counts)`: `received[i]` holds member i's entries, then `fill`.
    """
    tensor = tf.convert_to_tensor(tensor)
    return load_op_library().nestpipe_socket_all_to_all(
        tensor, tf.cast(send_counts, tf.int32), tf.cast(fill, tensor.dtype),
        tf.cast(key, tf.int64), ordering_token, label=label, group=list(group))


def socket_finish(stall_seconds):
    """Ends this process's part of the mesh: a goodbye to every peer after everything still
    queued, and waits until the peers have it all (or `stall_seconds` pass without progress).

    Returns:
      Whether everything was delivered (False also when no mesh is open).
    """
    return bool(load_op_library().nestpipe_socket_finish(
        stall_seconds=float(stall_seconds)).numpy())


def socket_stats():
    """This process's mesh counters since it opened.

    Returns:
      A dict with the `SOCKET_STATS` fields (Python ints).
    """
    values = load_op_library().nestpipe_socket_stats().numpy().tolist()
    return dict(zip(SOCKET_STATS, values))
