"""Prints `LISTEN [addresses]`: where this task's TensorFlow server listens (from /proc/net).

usage: listen_check.py [--server]
  Starts the server of the TF_CONFIG task (through a 2+-worker NestPipeStrategy, or a plain
  tf.distribute.Server with --server) and lists the local addresses bound to its port.
"""
import json
import os
import socket
import struct
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402


def listening(port):
    """Textual local addresses of the listening TCP sockets on `port`."""
    found = []
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(name).read().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A = LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0])
                           for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return sorted(found)


def main():
    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    address = config["cluster"][task["type"]][task["index"]]
    if "--server" in sys.argv:
        server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]),
                                      job_name=task["type"], task_index=task["index"])
        print("serving", server.target, flush=True)
    else:
        strategy = tnp.NestPipeStrategy()
        assert strategy.num_workers > 1
    print("LISTEN", json.dumps(listening(int(address.rsplit(":", 1)[1]))), flush=True)


if __name__ == "__main__":
    main()
