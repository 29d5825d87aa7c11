"""How the workers of a `NestPipeStrategy` talk to each other: `TransportConfig`.

Plain Python (no TensorFlow), so that the launcher can read the transport's settings; the engines
and the factory that turns a config into one are in `tf_nestpipe.collectives.transport`.
"""
import dataclasses
from typing import Optional

from tf_nestpipe import settings

# The names a user may pass; "auto" is the socket mesh on CPU (TensorFlow's collectives where
# the workers cannot reach each other's mesh ports) and TensorFlow's NCCL collectives on GPU.
TRANSPORT_NAMES = ("auto", "sockets", "tf", "horovod")

DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_CONNECT_TIMEOUT_SECONDS = 30.0
DEFAULT_HELLO_TIMEOUT_SECONDS = 5.0
DEFAULT_STALL_SECONDS = 20.0
DEFAULT_MAX_MESSAGE_BYTES = 1 << 32
DEFAULT_MAX_BUFFERED_BYTES = 1 << 30

SECRET_ENV = settings.TRANSPORT_SECRET.name
SECRET_FILE_ENV = settings.TRANSPORT_SECRET_FILE.name


class TransportError(RuntimeError):
    """The transport cannot be set up as configured (the message names the fix)."""


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """How the workers of a `NestPipeStrategy` talk to each other.

    Every field left at None is read from its environment variable (`TF_NESTPIPE_TRANSPORT_*`,
    listed in the docs' configuration table), else its default.

    Attributes:
      name: "auto" (default), "sockets" (the mesh or an error), "tf" (TensorFlow's
        collectives) or "horovod".
      timeout_seconds: how long a collective may wait for a peer that is alive but does not
        make the matching call (default 600 s, `TF_NESTPIPE_TRANSPORT_TIMEOUT`). Every worker
        then fails naming that peer and the call. Also TensorFlow's collective timeout.
      connect_timeout_seconds: how long start-up may take to open every connection (30 s).
      hello_timeout_seconds: how long one connection may take to authenticate (5 s); a silent
        or garbling stranger costs only this, never start-up as a whole.
      stall_seconds: how long a peer may send nothing at all, not even a heartbeat, before it
        counts as dead (20 s). Any byte counts: a long transfer on a slow link is progress.
      listen_host: the address the mesh listens on (default: this worker's `TF_CONFIG` host,
        never every interface unless this says "0.0.0.0").
      listen_port: the port the mesh listens on (default 0: any free port;
        `TF_NESTPIPE_TRANSPORT_PORT`). Fix it where a firewall or a Kubernetes NetworkPolicy
        admits only known ports.
      secret: the job's secret (bytes or str; default `TF_NESTPIPE_TRANSPORT_SECRET`, or the
        file named by `TF_NESTPIPE_TRANSPORT_SECRET_FILE`, e.g. a Kubernetes Secret). Peers
        prove they hold it before they may join. `python -m tf_nestpipe.launch` makes one.
      require_secret: refuse to open the mesh without a secret (default False: without one,
        worker 0 draws a secret and shares it over TensorFlow's own (unauthenticated) gRPC
        channel, and says so).
      max_message_bytes: the largest frame a peer may announce (4 GiB).
      max_buffered_bytes: bytes of frames that arrive before their call starts that a worker
        buffers in all (1 GiB).
      hierarchical: "auto" (default: from 64 workers on, where several share a host), "on" or
        "off": whether an all-to-all goes within each host first, then across hosts between
        workers of the same local rank (H-1 frames cross hosts per worker instead of W-L).
        Needs workers numbered host by host, the same number on every host.
      local_workers: workers per host (default: those whose `TF_CONFIG` hosts resolve to the
        same address).
    """

    name: str = "auto"
    timeout_seconds: Optional[float] = None
    connect_timeout_seconds: Optional[float] = None
    hello_timeout_seconds: Optional[float] = None
    stall_seconds: Optional[float] = None
    listen_host: Optional[str] = None
    listen_port: Optional[int] = None
    secret: Optional[bytes] = dataclasses.field(default=None, repr=False)
    require_secret: bool = False
    max_message_bytes: Optional[int] = None
    max_buffered_bytes: Optional[int] = None
    hierarchical: Optional[str] = None
    local_workers: Optional[int] = None

    def __post_init__(self):
        if self.name not in TRANSPORT_NAMES:
            raise ValueError("transport must be one of %s, got %r" % (TRANSPORT_NAMES, self.name))
        if self.hierarchical not in (None, "auto", "on", "off"):
            raise ValueError("TransportConfig.hierarchical must be 'auto', 'on' or 'off', got %r"
                             % (self.hierarchical,))
        for field in ("timeout_seconds", "connect_timeout_seconds", "hello_timeout_seconds",
                      "stall_seconds", "max_message_bytes", "max_buffered_bytes",
                      "local_workers"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError("TransportConfig.%s must be > 0, got %r" % (field, value))

    def resolved(self):
        """This config with every unset field filled from the environment or its default.

        Returns:
          A `TransportConfig` with no None numeric field.

        Raises:
          settings.SettingError: an environment variable holds a value it refuses.
        """
        def pick(value, setting):
            return setting.value() if value is None else value

        return dataclasses.replace(
            self,
            timeout_seconds=pick(self.timeout_seconds, settings.TRANSPORT_TIMEOUT),
            connect_timeout_seconds=pick(self.connect_timeout_seconds,
                                         settings.TRANSPORT_CONNECT_TIMEOUT),
            hello_timeout_seconds=pick(self.hello_timeout_seconds,
                                       settings.TRANSPORT_HELLO_TIMEOUT),
            stall_seconds=pick(self.stall_seconds, settings.TRANSPORT_STALL_SECONDS),
            max_message_bytes=pick(self.max_message_bytes, settings.TRANSPORT_MAX_MESSAGE_BYTES),
            max_buffered_bytes=pick(self.max_buffered_bytes,
                                    settings.TRANSPORT_MAX_BUFFERED_BYTES),
            listen_port=pick(self.listen_port, settings.TRANSPORT_PORT),
            listen_host=pick(self.listen_host, settings.TRANSPORT_LISTEN_HOST),
            hierarchical=pick(self.hierarchical, settings.TRANSPORT_HIERARCHICAL),
            local_workers=pick(self.local_workers, settings.TRANSPORT_LOCAL_WORKERS))

    @property
    def engine_owns_cluster(self):
        """Whether the engine, not `TF_CONFIG`, says who the workers are (Horovod's rank and
        size): the strategy then starts no TensorFlow server."""
        return self.name == "horovod"

    def job_secret(self):
        """The job's secret: `secret`, else `$TF_NESTPIPE_TRANSPORT_SECRET`, else the contents
        of `$TF_NESTPIPE_TRANSPORT_SECRET_FILE`.

        Returns:
          bytes, or None where none is configured.

        Raises:
          TransportError: the secret file cannot be read or is empty.
        """
        if self.secret:
            return self.secret.encode() if isinstance(self.secret, str) else bytes(self.secret)
        value = settings.TRANSPORT_SECRET.value()
        if value:
            return value.encode()
        path = settings.TRANSPORT_SECRET_FILE.value()
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read().strip()
        except OSError as error:
            raise TransportError("%s=%s cannot be read: %s; mount the job's secret there or "
                                 "unset the variable" % (SECRET_FILE_ENV, path, error)) from None
        if not data:
            raise TransportError("%s=%s is empty; put the job's secret in it" %
                                 (SECRET_FILE_ENV, path))
        return data


def as_transport_config(value):
    """A `TransportConfig` from a strategy argument: a config, or a transport name.

    Raises:
      ValueError: an unknown name or a value of another type.
    """
    if isinstance(value, TransportConfig):
        return value
    if isinstance(value, str):
        return TransportConfig(name=value)
    raise ValueError("transport must be a TransportConfig or one of %s, got %r"
                     % (TRANSPORT_NAMES, value))
