"""Horovod's Gloo rendezvous for the local launcher (`python -m tf_nestpipe.launch --horovod`).

`horovodrun --gloo` starts an HTTP rendezvous server in the launching process and gives every
worker the `HOROVOD_*` variables that `hvd.init()` reads (rank, size, local and cross rank/size,
hostname, the rendezvous address and port, the Gloo controller and CPU operations). This module
does the same with Horovod's own `RendezvousServer` and host assignment, so a launched cluster
gets both a `TF_CONFIG` and a Horovod environment per worker, with Horovod rank = the task's
position among the synchronous workers (chief first), which `NestPipeStrategy(collectives=
"horovod")` checks.
"""
from typing import Dict, List, Optional

from tf_nestpipe.collectives.horovod_collectives import INSTALL_HINT

LOOPBACK_ADDRESS = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"


class HorovodRendezvous:
    """A running Gloo rendezvous server for `num_workers` local processes; `env(rank)` is the
    environment a worker needs to join it at `address` (an address of this machine) with Gloo on
    `interface` (default loopback). Stop it with `stop()`."""

    def __init__(self, num_workers: int, verbose: int = 0, address: Optional[str] = None,
                 interface: Optional[str] = None):
        try:
            # pylint: disable=import-outside-toplevel
            from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
            from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
            from horovod.runner.http.http_server import RendezvousServer
        except ImportError as e:
            raise RuntimeError("--horovod: %s (import horovod.runner failed: %s)"
                               % (INSTALL_HINT, e)) from e
        if num_workers < 1:
            raise ValueError("--horovod needs at least one worker")
        self.num_workers = num_workers
        self._slots = get_host_assignments(parse_hosts("localhost:%d" % num_workers), num_workers)
        self._server = RendezvousServer(verbose)
        self.port = self._server.start()
        self._server.init(self._slots)
        self._common = {k: str(v) for k, v in create_run_env_vars(
            address or LOOPBACK_ADDRESS, [interface or LOOPBACK_INTERFACE], self.port).items()}
        self._per_rank: List[Dict[str, str]] = [
            {k: str(v) for k, v in create_slot_env_vars(slot).items()} for slot in self._slots]

    def env(self, rank: int) -> Dict[str, str]:
        """The `HOROVOD_*` variables of worker `rank` (0 .. num_workers - 1)."""
        out = dict(self._common)
        out.update(self._per_rank[rank])
        return out

    def stop(self):
        """Shuts the rendezvous server down."""
        if self._server is not None:
            self._server.stop()
            self._server = None
