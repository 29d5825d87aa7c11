"""Servers that listen only on their `TF_CONFIG` address.

TensorFlow's gRPC server binds its port on every interface; the host in `TF_CONFIG` only chooses
the port. `listen_only_env(address)` returns the environment that preloads our small bind()
interposer (`_nestpipe_bind.so`, built by setup.py from native/bind_tf_config.c), which narrows
that one wildcard bind to the task's own host. The launcher sets it for every task it starts;
`python -m tf_nestpipe.launch.task -- COMMAND` does the same for tasks started by other tools.
"""
import os
import socket

from tf_nestpipe import settings

SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "_nestpipe_bind.so")


class ShimMissingError(FileNotFoundError):
    """The bind() interposer was not built."""


def numeric_host(host):
    """`host` as a numeric IP address (names such as localhost are resolved)."""
    host = host.strip("[]")
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    if not infos:
        raise ValueError("cannot resolve the TF_CONFIG host %r" % host)
    return infos[0][4][0]


def listen_only_env(address, environ=None):
    """Environment variables that make the task at `address` ("host:port") listen only there."""
    if not os.path.exists(SHIM):
        raise ShimMissingError(
            "%s is missing, so servers would listen on every interface; build it with "
            "`pip install --no-build-isolation -e .`" % SHIM)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError("TF_CONFIG address %r is not host:port" % address)
    preload = (environ or os.environ).get("LD_PRELOAD", "")
    return {settings.BIND_HOST.name: numeric_host(host), settings.BIND_PORT.name: port,
            "LD_PRELOAD": SHIM + (":" + preload if preload else "")}
