"""The transport: how workers exchange tensors, behind one interface, chosen in one place.

`Transport` is what the layers above use (all-to-all, all-gather, all-reduce, streams, a
timeout, a name, and what the engine can do); each engine implements it:

- `SocketCollectives` ("sockets"): our TCP mesh, authenticated at start-up
  (`mesh_handshake`), its data plane in `ops/socket_ops.cc`. The CPU default.
- `Collectives` ("tf"): TensorFlow's collective ops (RING on CPU, NCCL on GPU).
- `HorovodCollectives` ("horovod"): Horovod's Gloo (or MPI) collectives.

`TransportConfig` says which one a strategy wants and how it behaves under faults;
`create_transport` (below) is the only place that turns a name into an engine.
"""
from tf_nestpipe.transport_config import (  # noqa: F401  (the names this module offers)
    SECRET_ENV, SECRET_FILE_ENV, TRANSPORT_NAMES, TransportConfig, TransportError,
    as_transport_config)


class Transport:
    """What every engine offers the layers above (see the engines' classes for the calls:
    `all_to_all`, `all_to_all_differentiable`, `all_gather`, `all_reduce_sum`, `stream`).

    Attributes:
      name: the engine in use ("sockets", "tf" or "horovod").
      timeout_seconds: the deadline of a collective (0: TensorFlow's none).
      sends_real_splits: an all-to-all sends only the entries with data, not its padding.
      reduces_dense: `all_reduce_sum` sums dense tensors (else TensorFlow's all-reduce does).
      reduces_sparse: `all_reduce_sum` also sums `IndexedSlices`.
      gathers: `all_gather` takes tensors whose first dimension differs between workers, and
        the strategy's cross-worker gathers go through it.
      broadcasts_initial_values: mirrored variables start from worker 0's value through
        `broadcast_initial_value` (TensorFlow's own path does it otherwise).
    """

    name = "abstract"
    sends_real_splits = False
    reduces_dense = False
    reduces_sparse = False
    gathers = False
    broadcasts_initial_values = False

    def open(self, host, config):
        """Connects this worker to its peers where the engine needs it (a no-op otherwise).

        Args:
          host: this worker's `TF_CONFIG` host.
          config: the resolved `TransportConfig`.

        Returns:
          `(opened, reason)`, the same on every worker.
        """
        del host, config
        return True, ""


def engine_for(config, device_type):
    """The engine class `config` asks for on a `device_type` ("CPU" or "GPU") worker, and
    whether it may fall back to TensorFlow's collectives when the mesh cannot open.

    Returns:
      `(engine class, may_fall_back)`.
    """
    # Imported here: the engines import TensorFlow; this module's config is plain Python.
    from tf_nestpipe.collectives.communication import Collectives  # pylint: disable=import-outside-toplevel
    from tf_nestpipe.collectives.horovod_collectives import HorovodCollectives  # pylint: disable=import-outside-toplevel
    from tf_nestpipe.collectives.sockets import SocketCollectives  # pylint: disable=import-outside-toplevel
    if config.name == "horovod":
        return HorovodCollectives, False
    if config.name == "tf" or (config.name == "auto" and device_type != "CPU"):
        return Collectives, False
    return SocketCollectives, config.name == "auto"


def create_transport(config, device_type, num_workers, worker_index, device, implementation,
                     hvd=None):
    """The engine `config` asks for, not yet opened (see `Transport.open`).

    Args:
      config: a resolved `TransportConfig`.
      device_type: "CPU" or "GPU", this worker's.
      num_workers: the number of workers.
      worker_index: this worker's index.
      device: this worker's device.
      implementation: TensorFlow's `CommunicationImplementation` for its collectives.
      hvd: the initialised `horovod.tensorflow` module, for "horovod".

    Returns:
      `(transport, may_fall_back)`: whether a mesh that cannot open falls back to TensorFlow's
      collectives ("auto") instead of failing ("sockets").
    """
    engine, may_fall_back = engine_for(config, device_type)
    if config.engine_owns_cluster:
        return engine(hvd, num_workers=num_workers, worker_index=worker_index, device=device,
                      timeout_seconds=config.timeout_seconds), False
    return engine(num_workers=num_workers, worker_index=worker_index, device=device,
                  implementation=implementation,
                  timeout_seconds=config.timeout_seconds), may_fall_back
