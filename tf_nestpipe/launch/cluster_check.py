"""Start-up check that every task of a synchronous cluster was given the same cluster.

Before TensorFlow starts its gRPC server (whose start-up waits without bound for peers, ignoring
SIGTERM), every chief / worker task reports to the *leader* (the chief, else worker 0) over a
plain TCP connection to the leader's own TF_CONFIG address: its role, index and the cluster its
TF_CONFIG describes. The leader binds that address itself for the check (and releases it before
TensorFlow binds it), waits for every task of its cluster and answers each one: ok, or the
problem. Within `timeout` seconds every task either passes or fails with a
`ClusterMismatchError` naming the cause:

- the first field in which a task's cluster differs from the leader's (e.g. `cluster.worker`:
  3 addresses on worker:0, 2 on worker:1), on every task that reached the leader;
- two processes claiming the same role and index (or the leader's address already taken);
- a task that never reported (named with its address), or a leader nobody listens at (named
  with its address).

Where the job has a secret (`TF_NESTPIPE_TRANSPORT_SECRET`, which the launcher sets), every
report is signed with it (HMAC-SHA256) and the leader ignores reports that are not: a stranger
on the leader's port can neither fail nor delay the check (each connection has its own
5-second deadline, handled by one event loop).

In parameter-server mode the ps tasks report too (`roles=PS_MODE_ROLES`): the chief leads
(`tnp.ParameterServerStrategy`, before it connects to the cluster) and `python -m
tf_nestpipe.server` reports while it serves (`report_while_serving`: a PS-mode server's start
does not wait for peers, and a chief that leads no check, e.g. TensorFlow's own
`ParameterServerStrategy`, must not stop it); a worker server the launcher restarts skips it.

This module imports no TensorFlow; `tf_nestpipe.strategy` calls `agree_on_cluster` once per
process before starting TensorFlow's server (under Horovod, after `hvd.init()`).
"""
import hashlib
import hmac
import json
import os
import selectors
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

from tf_nestpipe import settings
from tf_nestpipe.transport_config import TransportConfig, TransportError

STARTUP_TIMEOUT_ENV = settings.STARTUP_TIMEOUT.name
DEFAULT_STARTUP_TIMEOUT = settings.STARTUP_TIMEOUT.default
TRAINING_ROLES = ("chief", "worker")
PS_MODE_ROLES = ("chief", "worker", "ps")  # parameter-server mode: every task reports
# Set by the launcher for a worker server it restarted: the cluster was checked when it started.
RESTARTED_ENV = settings.RESTARTED_TASK.name
_LINGER_SECONDS = 3.0  # the leader keeps answering late tasks with its error this long
_VERDICT_GRACE = 10.0  # a task waits this much longer than its timeout for the leader's verdict
_MAX_MESSAGE = 1 << 20
_REPORT_SECONDS = 5.0  # one connection's time to deliver its report
_SPARE_PENDING = 64  # connections without a complete report held at once, beyond the tasks
_SERVER_REPORT_TIMEOUT = 7 * 24 * 3600.0  # a serving task waits for the chief's check this long


class ClusterMismatchError(RuntimeError):
    """The tasks of a cluster disagree about it, or one of them cannot be reached; the message
    names the field or the address and what to fix."""


def startup_timeout(value: Optional[float] = None) -> float:
    """The start-up timeout: `value`, else `$TF_NESTPIPE_STARTUP_TIMEOUT`, else 30 s.

    Args:
        value: Seconds, or None to read the environment.

    Returns:
        Seconds, > 0.

    Raises:
        tf_nestpipe.settings.SettingError: The variable is not a number > 0.
        ClusterMismatchError: `value` is <= 0.
    """
    if value is None:
        value = settings.STARTUP_TIMEOUT.value()
    if value <= 0:
        raise ClusterMismatchError("the start-up timeout must be > 0 seconds, got %r" % (value,))
    return float(value)


def fingerprint(cluster: Dict[str, List[str]]) -> str:
    """A short hash of `cluster` (roles and their addresses in order)."""
    text = json.dumps({role: list(cluster[role]) for role in sorted(cluster)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def leader_of(cluster: Dict[str, List[str]]) -> Tuple[str, int]:
    """The task every other one reports to: the chief, else worker 0."""
    return ("chief", 0) if cluster.get("chief") else ("worker", 0)


def training_tasks(cluster: Dict[str, List[str]],
                   roles: Tuple[str, ...] = TRAINING_ROLES) -> List[Tuple[str, int]]:
    """Every task of `cluster` in `roles` (default: every chief and worker task)."""
    return [(role, i) for role in roles for i in range(len(cluster.get(role, [])))]


def describe_difference(mine: Dict[str, List[str]], mine_name: str,
                        theirs: Dict[str, List[str]], their_name: str) -> Optional[str]:
    """The first field in which two cluster descriptions differ, in words (None if equal)."""
    for role in sorted(set(mine) | set(theirs)):
        a, b = mine.get(role), theirs.get(role)
        if a == b:
            continue
        if a is None or b is None:
            has, lacks = (mine_name, their_name) if b is None else (their_name, mine_name)
            listed = a if b is None else b
            return ("cluster.%s: %s lists %d %s task(s) %s, %s lists none"
                    % (role, has, len(listed), role, listed, lacks))
        if len(a) != len(b):
            return ("cluster.%s: %s lists %d address(es) %s, %s lists %d %s"
                    % (role, mine_name, len(a), a, their_name, len(b), b))
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return "cluster.%s[%d]: %s has %r, %s has %r" % (role, i, mine_name, x,
                                                                 their_name, y)
    return None


def _name(task: Tuple[str, int]) -> str:
    return "%s:%d" % task


def _split_address(address: str) -> Tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _send(conn: socket.socket, message: dict):
    conn.sendall((json.dumps(message) + "\n").encode())


_TIMED_OUT = {"timed_out": True}


def _receive(conn: socket.socket, deadline: float) -> Optional[dict]:
    """One JSON line from `conn` before `deadline`; None if the peer closed or sent no JSON,
    `_TIMED_OUT` if nothing complete arrived in time."""
    data = b""
    while b"\n" not in data and len(data) < _MAX_MESSAGE:
        conn.settimeout(max(0.05, deadline - time.time()))
        try:
            chunk = conn.recv(65536)
        except socket.timeout:
            return _TIMED_OUT
        except OSError:
            return None
        if not chunk:
            break
        data += chunk
    try:
        message = json.loads(data.split(b"\n", 1)[0].decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return message if isinstance(message, dict) else None


def _listen(address: str, task: Tuple[str, int]) -> socket.socket:
    host, port = _split_address(address)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise ClusterMismatchError("cannot resolve the host of %s's address %s (%s); fix "
                                   "TF_CONFIG's cluster" % (_name(task), address, error)) from None
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            server.bind((host, port))
        except OSError as error:
            if error.errno != 99:  # EADDRNOTAVAIL: a service / NAT address; bind the port only
                raise
            server.bind(("", port))
    except OSError as error:
        server.close()
        raise ClusterMismatchError(
            "%s cannot listen at its address %s (%s): another process holds it, e.g. two "
            "processes were started as %s (same task index), or the port is taken. Give every "
            "task its own index and a free port." % (_name(task), address, error.strerror,
                                                     _name(task))) from None
    server.listen(64)
    return server


class _Pending:
    """A connection to the leader whose report has not fully arrived."""

    def __init__(self, conn, address, deadline):
        self.conn, self.address, self.deadline, self.data = conn, address, deadline, b""


def _report_mac(secret: bytes, hello: dict) -> str:
    """The proof that a report comes from a task holding the job's secret."""
    body = json.dumps({k: v for k, v in hello.items() if k != "mac"}, sort_keys=True)
    return hmac.new(secret, b"nestpipe-cluster-check" + body.encode(), hashlib.sha256).hexdigest()


def _job_secret() -> Optional[bytes]:
    try:
        return TransportConfig().job_secret()
    except TransportError as error:
        raise ClusterMismatchError(str(error)) from None


class _Collector:
    """The leader's reception of reports: one event loop, every connection with its own short
    deadline, so that silent, slow or garbling connections (a port scanner, a stranger) cost
    only themselves; a bounded number of them held at once, the oldest dropped first."""

    def __init__(self, server, secret, max_pending):
        self.server, self.secret, self.max_pending = server, secret, max_pending
        self.selector = selectors.DefaultSelector()
        server.setblocking(False)
        self.selector.register(server, selectors.EVENT_READ, None)
        self.pending = {}
        self.refused = 0

    def close(self):
        for item in list(self.pending.values()):
            self._drop(item)
        self.selector.close()

    def _drop(self, item):
        self.selector.unregister(item.conn)
        del self.pending[item.conn]
        item.conn.close()

    def reports(self, deadline):
        """Yields `(conn, hello)` for each complete, authentic report until `deadline`."""
        while time.time() < deadline:
            now = time.time()
            nearest = min([deadline] + [p.deadline for p in self.pending.values()])
            for key, _ in self.selector.select(max(0.0, min(nearest - now, 0.5))):
                if key.data is None:
                    self._accept()
                    continue
                item = key.data
                if self.pending.get(item.conn) is not item:
                    continue  # dropped by an accept earlier in this round
                try:
                    chunk = item.conn.recv(65536)
                except OSError:
                    chunk = b""
                item.data += chunk
                if not chunk or len(item.data) >= _MAX_MESSAGE:
                    self._drop(item)
                    continue
                if b"\n" not in item.data:
                    continue
                hello = _parse(item.data)
                conn = item.conn
                self.selector.unregister(conn)
                del self.pending[conn]
                if hello is None:
                    conn.close()
                    continue
                if self.secret is not None and not hmac.compare_digest(
                        str(hello.get("mac", "")), _report_mac(self.secret, hello)):
                    self.refused += 1
                    try:  # a task without the secret learns why; a stranger learns nothing new
                        conn.setblocking(True)
                        conn.settimeout(1.0)
                        _send(conn, {"ok": False, "error": (
                            "the leader refused this report: it is not signed with the job's "
                            "secret; set the same TF_NESTPIPE_TRANSPORT_SECRET (or _SECRET_FILE) "
                            "on every task")})
                    except OSError:
                        pass
                    conn.close()
                    continue
                conn.setblocking(True)
                yield conn, hello
            for item in [p for p in self.pending.values() if p.deadline <= time.time()]:
                self._drop(item)

    def _accept(self):
        while True:
            try:
                conn, addr = self.server.accept()
            except (BlockingIOError, InterruptedError, OSError):
                return
            if len(self.pending) >= self.max_pending:
                self._drop(min(self.pending.values(), key=lambda p: p.deadline))
            conn.setblocking(False)
            item = _Pending(conn, addr, time.time() + _REPORT_SECONDS)
            self.pending[conn] = item
            self.selector.register(conn, selectors.EVENT_READ, item)


def _parse(data: bytes) -> Optional[dict]:
    try:
        message = json.loads(data.split(b"\n", 1)[0].decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return message if isinstance(message, dict) else None


def _lead(cluster, me, timeout, roles):
    """The leader's side: collect every task's report, answer them, raise on a problem."""
    server = _listen(cluster[me[0]][me[1]], me)
    deadline = time.time() + timeout
    expected = [t for t in training_tasks(cluster, roles) if t != me]
    reported: Dict[Tuple[str, int], Tuple[socket.socket, dict]] = {}
    others: List[socket.socket] = []
    problem = None
    collector = _Collector(server, _job_secret(), len(expected) + _SPARE_PENDING)
    try:
        for conn, hello in collector.reports(deadline):
            try:
                task = (str(hello.get("role")), int(hello.get("index", -1)))
            except (TypeError, ValueError):
                conn.close()
                continue
            theirs = hello.get("cluster") or {}
            difference = describe_difference(cluster, "%s (the leader)" % _name(me), theirs,
                                             _name(task))
            if difference is not None:
                problem = ("the tasks were given different clusters: %s. Give every task the "
                           "same TF_CONFIG cluster (only task differs)." % difference)
            elif task not in expected:
                problem = ("a process reported as %s, which is not a task of the cluster (or is "
                           "the leader itself): two processes with the same task?" % _name(task))
            elif task in reported:
                problem = ("two processes were started as %s (pids %s and %s): give every task "
                           "its own task index." % (_name(task), reported[task][1].get("pid"),
                                                    hello.get("pid")))
            if problem is None:
                reported[task] = (conn, hello)
            else:
                others.append(conn)  # it gets the verdict too
            if problem is not None or len(reported) == len(expected):
                break
        if problem is None and len(reported) < len(expected):
            missing = [t for t in expected if t not in reported]
            problem = ("timed out after %.0f s waiting at %s for %s to report: %s. Start "
                       "every task of the cluster, check that each one's TF_CONFIG names "
                       "the leader %s at %s, or raise $%s." % (
                           timeout, cluster[me[0]][me[1]],
                           ", ".join(_name(t) for t in missing),
                           ", ".join("%s at %s" % (_name(t), cluster[t[0]][t[1]])
                                     for t in missing),
                           _name(me), cluster[me[0]][me[1]], STARTUP_TIMEOUT_ENV))
            if collector.refused:
                problem += (" (%d reports were refused: not signed with the job's secret)"
                            % collector.refused)
        verdict = {"ok": problem is None, "error": problem}
        connections = [conn for conn, _ in reported.values()] + others
        for conn in connections:
            try:
                _send(conn, verdict)
            except OSError:
                pass
        # Let the tasks close first (no TIME_WAIT left on the port TensorFlow binds next).
        for conn in connections:
            _receive(conn, time.time() + 2.0)
            conn.close()
        collector.close()
        server.setblocking(True)
        if problem is not None:
            _linger(server, problem)
            raise ClusterMismatchError(problem)
    finally:
        server.close()


def _linger(server, problem):
    """Answers tasks that report shortly after the leader found a problem with that problem."""
    end = time.time() + _LINGER_SECONDS
    while time.time() < end:
        server.settimeout(max(0.05, end - time.time()))
        try:
            conn, _ = server.accept()
        except (socket.timeout, OSError):
            continue
        if _receive(conn, time.time() + 1.0) not in (None, _TIMED_OUT):
            try:
                _send(conn, {"ok": False, "error": problem})
            except OSError:
                pass
        conn.close()


def _not_a_leader(me, leader, address):
    """The error for an address whose process takes reports and never answers them."""
    return ClusterMismatchError(
        "%s: the process at the leader %s's address %s did not answer the start-up "
        "check: it is not a tf_nestpipe task starting up (it started already, so this "
        "process may duplicate a running task, or another program holds the port)."
        % (_name(me), _name(leader), address))


def _report(cluster, me, timeout):
    """A non-leader's side: report to the leader until it answers or the timeout passes."""
    leader = leader_of(cluster)
    address = cluster[leader[0]][leader[1]]
    host, port = _split_address(address)
    deadline = time.time() + timeout
    hello = {"role": me[0], "index": me[1], "cluster": cluster, "pid": os.getpid(),
             "fingerprint": fingerprint(cluster)}
    secret = _job_secret()
    if secret is not None:
        hello["mac"] = _report_mac(secret, hello)
    last_error = None
    closed_unanswered = False  # something at the address took a report and closed, no answer
    while True:
        remaining = deadline - time.time()
        if remaining <= 0 and closed_unanswered:
            raise _not_a_leader(me, leader, address)
        if remaining <= 0:
            raise ClusterMismatchError(
                "%s timed out after %.0f s joining the cluster: nobody answered at the leader "
                "%s's address %s (%s). Start the leader, fix that address in TF_CONFIG, or raise "
                "$%s." % (_name(me), timeout, _name(leader), address, last_error,
                          STARTUP_TIMEOUT_ENV))
        try:
            conn = socket.create_connection((host, port), timeout=min(2.0, remaining))
        except OSError as error:
            last_error = error.strerror or str(error)
            time.sleep(0.2)
            continue
        try:
            _send(conn, hello)
            # The leader answers once every task reported (or it timed out itself).
            answer = _receive(conn, deadline + _VERDICT_GRACE)
        except OSError as error:
            answer, last_error = None, str(error)
        finally:
            conn.close()
        if answer is None:
            # A relay or proxy in front of a leader that does not listen yet accepts and closes:
            # retry until the deadline; only then is it a process that is not ours.
            closed_unanswered, last_error = True, "closed without an answer"
            time.sleep(0.2)
            continue
        if answer is _TIMED_OUT and closed_unanswered:
            raise _not_a_leader(me, leader, address)
        if answer is _TIMED_OUT:
            raise ClusterMismatchError(
                "%s: the leader %s at %s took the report but gave no verdict within %.0f s (it "
                "is still waiting for other tasks, or it started much later than this task). "
                "Start every task, or raise $%s." % (_name(me), _name(leader), address,
                                                   timeout + _VERDICT_GRACE,
                                                   STARTUP_TIMEOUT_ENV))
        if not answer.get("ok"):
            error = ClusterMismatchError("%s: %s" % (_name(me), answer.get("error")))
            error.leader_verdict = True  # the leader answered: the cluster is wrong
            raise error
        return


def agree_on_cluster(cluster: Dict[str, List[str]], task_type: str, task_index: int,
                     timeout: Optional[float] = None, roles: Tuple[str, ...] = TRAINING_ROLES):
    """Checks with every other task of `roles` (default chief / worker; `PS_MODE_ROLES` in
    parameter-server mode, where the chief leads) that all were given `cluster` (see the
    module docstring); returns when they agree, raises `ClusterMismatchError` otherwise. A
    no-op for a cluster of one such task, and for a task the launcher restarted
    (`$TF_NESTPIPE_RESTARTED_TASK`: the cluster was checked when it first started)."""
    me = (task_type, int(task_index))
    tasks = training_tasks(cluster, roles)
    if len(tasks) < 2 or me not in tasks or settings.RESTARTED_TASK.value():
        return
    timeout = startup_timeout(timeout)
    if me == leader_of(cluster):
        _lead(cluster, me, timeout, roles)
    else:
        _report(cluster, me, timeout)


def report_while_serving(cluster: Dict[str, List[str]], task_type: str, task_index: int,
                         on_mismatch, timeout: Optional[float] = None) -> threading.Thread:
    """Parameter-server mode, a worker or ps server: reports to the chief in a background
    thread (PS_MODE_ROLES). If the chief answers that the cluster is wrong, calls
    `on_mismatch(message)` (the server exits); if no chief leads a check (not started, not
    tnp.ParameterServerStrategy, or a restarted task), it logs one line and the server goes
    on serving, as before. Waiting costs nothing here, so by default it waits for the chief
    (which may run much user code before building its strategy) for `_SERVER_REPORT_TIMEOUT`;
    the chief's own timeout bounds the check. Returns the (daemon) thread."""

    def check():
        try:
            agree_on_cluster(cluster, task_type, task_index,
                             timeout=_SERVER_REPORT_TIMEOUT if timeout is None else timeout,
                             roles=PS_MODE_ROLES)
        except ClusterMismatchError as error:
            if getattr(error, "leader_verdict", False):
                on_mismatch(str(error))
                return
            print("tf_nestpipe.server: no start-up cluster check (%s)" % error, flush=True)

    thread = threading.Thread(target=check, name="nestpipe-cluster-check", daemon=True)
    thread.start()
    return thread
