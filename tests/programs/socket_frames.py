"""The socket transport's data plane fed frames by hand: this process is worker 0 of a 2-worker
mesh whose worker 1 is the other end of a socketpair, written by this program.

usage: socket_frames.py CASE
  good:    worker 1's frames (one before the exchange starts, one after) arrive intact;
  garbage: random bytes; bad_version: a frame of another protocol version; huge: a frame that
  announces 2^40 bytes; flood: frames for exchanges not started, beyond the buffer limit;
  oversized: a frame larger than its exchange's row; cut: the connection closes mid-frame.
Prints "CASE ok ..." or "CASE failed after S s: ErrorType: message" and the RSS growth.
"""
import os
import socket
import struct
import sys
import threading
import time

import numpy as np
import tensorflow as tf

from tf_nestpipe.ops.sockets import socket_adopt, socket_all_to_all
from tf_nestpipe.tf_private import resource_variable_ops

HEADER = struct.Struct("<IHHqqqq")
MAGIC, VERSION, DATA = 0x3253504E, 2, 1


def frame(key, seq, count, payload, version=VERSION, magic=MAGIC, nbytes=None):
    return HEADER.pack(magic, version, DATA, key, seq, count,
                       len(payload) if nbytes is None else nbytes) + payload


def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def main(case):
    mine, theirs = socket.socketpair()
    socket_adopt(0, [-1, mine.detach()], ["self", "peer:1"], call_timeout_seconds=30,
                 stall_seconds=30, max_message_bytes=1 << 30, max_buffered_bytes=1 << 20)
    token = resource_variable_ops.ResourceVariable(0.0)
    values = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    theirs_row = (np.arange(6, dtype=np.float32) + 100).reshape(3, 2)
    before = rss_kib()
    result = {}

    def exchange(key):
        try:
            out, counts = socket_all_to_all(tf.constant(values), [3, 2], -1.0, key, token.handle,
                                            label="frames/%d" % key)
            result[key] = (out.numpy(), counts.numpy())
        except tf.errors.OpError as error:
            result[key] = error

    started = time.time()
    if case == "good":
        theirs.sendall(frame(5, 0, 3, theirs_row.tobytes()))  # before its exchange starts
        exchange(5)
        thread = threading.Thread(target=exchange, args=(6,))
        thread.start()
        time.sleep(0.2)
        theirs.sendall(frame(6, 0, 1, theirs_row[:1].tobytes()))  # after
        thread.join(10)
        for key, count in ((5, 3), (6, 1)):
            out, counts = result[key]
            want = np.full((3, 2), -1.0, np.float32)
            want[:count] = theirs_row[:count]
            np.testing.assert_array_equal(out[1], want)
            np.testing.assert_array_equal(out[0], values[0])
            assert counts.tolist() == [3, count], counts
        # What worker 0 sent worker 1: its row 1, 2 entries (the send count), after a header.
        header = HEADER.unpack(theirs.recv(HEADER.size, socket.MSG_WAITALL))
        assert header[:7] == (MAGIC, VERSION, DATA, 5, 0, 2, 16), header
        got = np.frombuffer(theirs.recv(16, socket.MSG_WAITALL), np.float32).reshape(2, 2)
        np.testing.assert_array_equal(got, values[1][:2])
        print("good ok", flush=True)
        return
    thread = threading.Thread(target=exchange, args=(9,))
    thread.start()
    time.sleep(0.2)
    if case == "garbage":
        theirs.sendall(os.urandom(1 << 16))
    elif case == "bad_version":
        theirs.sendall(frame(9, 0, 3, theirs_row.tobytes(), version=VERSION + 1))
    elif case == "huge":
        theirs.sendall(frame(12, 0, 1, b"", nbytes=1 << 40))
    elif case == "flood":
        try:
            for key in range(100, 140):
                theirs.sendall(frame(key, 0, 1, b"\0" * (64 << 10)))
        except OSError:
            pass  # worker 0 closed the connection once over its limit
    elif case == "oversized":
        theirs.sendall(frame(9, 0, 4, b"\0" * 32))
    elif case == "cut":
        theirs.sendall(frame(9, 0, 3, theirs_row.tobytes())[:30])
        theirs.close()
    thread.join(20)
    error = result.get(9)
    assert isinstance(error, tf.errors.OpError), error
    print("%s failed after %.1f s: %s: %s" % (case, time.time() - started, type(error).__name__,
                                                error.message), flush=True)
    print("%s rss growth %d KiB" % (case, rss_kib() - before), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
