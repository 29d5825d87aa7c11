"""Watching the ps tasks while a `ClusterCoordinator` call blocks (DOWNPOUR).

When a ps task dies, `ClusterCoordinator` reports it as a ps failure only if the error it gets
names the ps task; otherwise (seen under load: "Socket closed" from the worker) it takes it for
a transient connectivity failure of the worker and retries the window forever, so `join()` (or
a `schedule()` whose queue is full) never returns. `call_watching_ps(fn, addresses)` runs
`fn()` in a helper thread and, while it blocks, probes every ps address with a TCP connect: a ps
whose address refuses (or does not answer) `failures_needed` probes in a row raises
`UnreachablePsError` naming it. A dead ps process's port refuses at once, so this is
deterministic; a slow but live ps still accepts connections (its gRPC server listens).
"""
import socket
import threading
import time
from typing import Callable, Dict, List, Optional


class UnreachablePsError(RuntimeError):
    """ps tasks stopped accepting connections while a coordinator call blocked."""

    def __init__(self, tasks: Dict[int, str], detail: str):
        self.tasks = dict(tasks)
        super().__init__("parameter server %s became unavailable: it stopped accepting "
                         "connections (%s)" % (
            ", ".join("/job:ps/task:%d at %s" % kv for kv in sorted(self.tasks.items())), detail))


def _accepts(address: str, timeout: float) -> Optional[str]:
    """None if `address` accepts a TCP connection, else why not."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        return None
    except OSError as error:
        return error.strerror or str(error)


def refusing_ps(addresses: List[str], probe_timeout: float = 2.0) -> Dict[int, str]:
    """{task: why} for each ps address in `addresses` that does not accept a TCP connection now
    (one probe each)."""
    reasons = {}
    for task, address in enumerate(addresses or []):
        reason = _accepts(address, probe_timeout)
        if reason:
            reasons[task] = reason
    return reasons


def call_watching_ps(fn: Callable, addresses: Optional[List[str]], interval: float = 1.0,
                     failures_needed: int = 3, probe_timeout: float = 2.0):
    """`fn()`, raising `UnreachablePsError` if some ps address stops accepting connections
    while it blocks (see module). Without `addresses`, just `fn()`."""
    if not addresses:
        return fn()
    done = threading.Event()
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as error:  # pylint: disable=broad-except
            box["error"] = error
        finally:
            done.set()

    thread = threading.Thread(target=run, name="nestpipe-ps-watched-call", daemon=True)
    thread.start()
    failures: Dict[int, int] = {}
    while not done.wait(interval):
        reasons = refusing_ps(addresses, probe_timeout)
        for task in range(len(addresses)):
            failures[task] = failures.get(task, 0) + 1 if task in reasons else 0
        down = {t: addresses[t] for t, n in failures.items() if n >= failures_needed}
        if down and not done.is_set():
            raise UnreachablePsError(down, "%d probes %.0f s apart: %s" % (
                failures_needed, interval, "; ".join(reasons.get(t, "") for t in sorted(down))))
    if "error" in box:
        raise box["error"]
    return box.get("value")
