"""The socket mesh ops (ops/socket_ops.cc): a direct TCP connection between every pair of workers
that carries the embedding exchange's all-to-alls in tens of microseconds instead of the ~1-3 ms
of a TensorFlow CPU collective."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library


def socket_listen(host):
    """Binds this process's mesh socket on `host` (a free port) and returns the port (an int)."""
    return int(load_op_library().nestpipe_socket_listen(tf.constant(host, tf.string)).numpy())


def socket_connect(index, hosts, ports, nonce, timeout_seconds, stall_seconds):
    """Connects worker `index` to every worker of `hosts` / `ports` (its own entry included),
    all of them giving the same `nonce`; raises within `timeout_seconds` naming the workers it
    could not reach. A later exchange that waits on a peer silent (no heartbeat) for
    `stall_seconds` fails."""
    load_op_library().nestpipe_socket_connect(
        tf.constant(index, tf.int32), tf.constant(list(hosts), tf.string),
        tf.constant(list(ports), tf.int32), tf.constant(nonce, tf.int64),
        timeout_seconds=float(timeout_seconds), stall_seconds=float(stall_seconds))


def socket_all_to_all(tensor, send_counts, fill, key, ordering_token):
    """Sends the first `send_counts[j]` entries of `tensor[j]` to worker j; returns
    `(received, received_counts)`: `received[i]` holds worker i's entries, then `fill`. Calls are
    paired across workers by `key` and their order among the calls with that key, which
    `ordering_token` (the stream's token resource) keeps in program order."""
    tensor = tf.convert_to_tensor(tensor)
    return load_op_library().nestpipe_socket_all_to_all(
        tensor, tf.cast(send_counts, tf.int32), tf.cast(fill, tensor.dtype),
        tf.cast(key, tf.int64), ordering_token)
