"""Starts a cluster of local processes, one `TF_CONFIG` each, and supervises it.

Every task's output is prefixed with its role and index, and every task's TensorFlow server
listens only on its own address (see `listen`). The cluster fails fast: when one task
exits non-zero, every other task is killed and the launcher exits non-zero. Children run in their
own process groups and die with the launcher (PR_SET_PDEATHSIG), so no orphan survives. With
`horovod=True` the launcher also runs Horovod's Gloo rendezvous and gives every training task its
`HOROVOD_*` environment (see `horovod_rendezvous`).
"""
import ctypes
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from tf_nestpipe.launch.listen import ShimMissingError, listen_only_env

_PR_SET_PDEATHSIG = 1


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """Returns `count` distinct TCP ports that are free on `host` right now."""
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind((host, 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def make_cluster(num_workers: int, num_ps: int = 0, chief: bool = False,
                 host: str = "127.0.0.1") -> Dict[str, List[str]]:
    """Builds a `cluster` dict with free localhost ports for each role."""
    if num_workers < 0 or num_ps < 0 or num_workers + num_ps + int(chief) == 0:
        raise ValueError("a cluster needs at least one task (got workers=%d ps=%d chief=%s)"
                         % (num_workers, num_ps, chief))
    ports = iter(free_ports(num_workers + num_ps + int(chief), host))
    cluster = {}
    if chief:
        cluster["chief"] = ["%s:%d" % (host, next(ports))]
    if num_workers:
        cluster["worker"] = ["%s:%d" % (host, next(ports)) for _ in range(num_workers)]
    if num_ps:
        cluster["ps"] = ["%s:%d" % (host, next(ports)) for _ in range(num_ps)]
    return cluster


def _die_with_parent():
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


@dataclasses.dataclass
class _Task:
    role: str
    process: subprocess.Popen
    runs_command: bool
    pump: Optional[threading.Thread] = None


class LocalCluster:
    """Runs `command` on every training task of a localhost cluster; ps tasks (and, in
    parameter-server mode, workers) run the `tf_nestpipe.server` entry point instead. In
    parameter-server mode a worker server that dies is restarted (up to 3 times)."""

    def __init__(self, command: Sequence[str], num_workers: int, num_ps: int = 0,
                 chief: bool = False, env: Optional[Dict[str, str]] = None,
                 output=None, cluster: Optional[Dict[str, List[str]]] = None,
                 task_prefix: str = "", horovod: bool = False,
                 horovod_address: Optional[str] = None, horovod_interface: Optional[str] = None):
        """`cluster` overrides the generated localhost addresses (e.g. hosts inside network
        namespaces); `task_prefix` is a command template put before each task's command, with
        `{role}` and `{index}` filled in (e.g. `ip netns exec ns_{role}{index}`). `horovod`
        starts a Gloo rendezvous and sets each chief / worker task's `HOROVOD_*` variables
        (rank = position among chief + workers, chief first); the tasks reach the rendezvous at
        `horovod_address` and Gloo uses `horovod_interface` (default: loopback), which tasks
        with their own `cluster` addresses or `task_prefix` (namespaces) must name."""
        if not command:
            raise ValueError("no command given: use `-- python script.py ARGS`")
        if horovod and num_ps:
            raise ValueError("--horovod trains synchronously; it cannot be combined with --ps")
        if horovod and (cluster is not None or task_prefix) and not (horovod_address
                                                                     and horovod_interface):
            raise ValueError("--horovod with --cluster-spec or --task-prefix needs "
                             "--horovod-address (where the tasks reach this machine) and "
                             "--horovod-interface (the interface Gloo uses in the tasks)")
        if (horovod_address or horovod_interface) and not horovod:
            raise ValueError("--horovod-address / --horovod-interface need --horovod")
        self.horovod = horovod
        self.horovod_address, self.horovod_interface = horovod_address, horovod_interface
        self._rendezvous = None
        self.command = list(command)
        self._generated_addresses = cluster is None
        self._num_workers, self._num_ps, self._chief = num_workers, num_ps, chief
        if cluster is None:
            cluster = make_cluster(num_workers, num_ps, chief)
        elif not cluster.get("worker") and not cluster.get("chief"):
            raise ValueError("the cluster spec needs a 'worker' or 'chief' list, got %r" % (cluster,))
        self.cluster = {role: list(addresses) for role, addresses in cluster.items()}
        self.parameter_server_mode = bool(self.cluster.get("ps"))
        self.task_prefix = task_prefix
        self.max_worker_restarts = 3  # per worker server, parameter-server mode only
        self._restarts: Dict[str, int] = {}
        self.env = dict(env or {})
        self.output = output or sys.stdout
        self._lock = threading.Lock()
        self.tasks: List[_Task] = []
        self._warned_listen_all = False

    def _task_command(self, role: str) -> (List[str], bool):
        if role == "ps" or (self.parameter_server_mode and role == "worker"):
            return [sys.executable, "-u", "-m", "tf_nestpipe.server"], False
        return self.command, True

    def _pump(self, task: _Task):
        prefix = "[%s] " % task.role
        for line in task.process.stdout:
            with self._lock:
                self.output.write(prefix + line)
                self.output.flush()

    def _spawn(self, role: str, index: int) -> _Task:
        env = dict(os.environ)
        env.update(self.env)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": self.cluster, "task": {"type": role, "index": index}})
        if self._rendezvous is not None:
            rank = index + (len(self.cluster.get("chief", [])) if role == "worker" else 0)
            env.update(self._rendezvous.env(rank))
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:  # its server listens only on its TF_CONFIG address, not on every interface
            env.update(listen_only_env(self.cluster[role][index], env))
        except ShimMissingError as error:
            if not self._warned_listen_all:
                self._warned_listen_all = True
                with self._lock:
                    self.output.write("[launch] warning: %s\n" % error)
        argv, runs_command = self._task_command(role)
        if self.task_prefix:
            argv = shlex.split(self.task_prefix.format(role=role, index=index)) + argv
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   errors="replace", preexec_fn=_die_with_parent)
        task = _Task("%s:%d" % (role, index), process, runs_command)
        task.pump = threading.Thread(target=self._pump, args=(task,), daemon=True)
        task.pump.start()
        return task

    def start(self):
        """Starts one process per task (after a fresh Horovod rendezvous with `horovod`)."""
        if self.horovod:
            from tf_nestpipe.launch.horovod_rendezvous import (  # pylint: disable=import-outside-toplevel
                HorovodRendezvous)

            self._stop_rendezvous()
            self._rendezvous = HorovodRendezvous(
                len(self.cluster.get("chief", [])) + len(self.cluster.get("worker", [])),
                address=self.horovod_address, interface=self.horovod_interface)
        for role, addresses in self.cluster.items():
            for index in range(len(addresses)):
                self.tasks.append(self._spawn(role, index))

    def _restart_if_worker_server(self, position: int, code: int) -> bool:
        """Parameter-server mode: a worker server that died is started again on its address
        (the coordinator re-schedules its functions and the worker rejoins). Returns whether
        it was restarted."""
        task = self.tasks[position]
        role, index = task.role.split(":")
        if not (self.parameter_server_mode and role == "worker" and not task.runs_command):
            return False
        restarts = self._restarts.get(task.role, 0)
        if restarts >= self.max_worker_restarts:
            return False
        self._restarts[task.role] = restarts + 1
        with self._lock:
            self.output.write("[launch] %s exited (%s); restarting it (%d of %d)\n"
                              % (task.role, code, restarts + 1, self.max_worker_restarts))
            self.output.flush()
        if task.pump is not None:
            task.pump.join(timeout=5)
        self.tasks[position] = self._spawn(role, int(index))
        return True

    def _stop_rendezvous(self):
        if self._rendezvous is not None:
            self._rendezvous.stop()
            self._rendezvous = None

    def kill_all(self):
        """Kills every task's process group and reaps it (and stops the Horovod rendezvous)."""
        for task in self.tasks:
            if task.process.poll() is None:
                try:
                    os.killpg(task.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for task in self.tasks:
            task.process.wait()
            if task.pump is not None:
                task.pump.join(timeout=5)
        self._stop_rendezvous()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits until every command task succeeded (0) or one failed / timed out (non-zero)."""
        deadline = None if timeout is None else time.time() + timeout
        failed = None
        try:
            while True:
                pending = False
                for position, task in enumerate(self.tasks):
                    code = task.process.poll()
                    if code is None:
                        pending = pending or task.runs_command
                    elif code != 0 and not self._restart_if_worker_server(position, code):
                        failed = (task.role, code)
                        break
                if failed or not pending:
                    break
                if deadline is not None and time.time() > deadline:
                    failed = ("launcher", "timeout after %.0fs" % timeout)
                    break
                time.sleep(0.1)
        finally:
            self.kill_all()
        if failed:
            with self._lock:
                self.output.write("[launch] task %s failed (%s); the cluster was torn down\n" % failed)
                self.output.flush()
            return 1
        return 0

    def run(self, timeout: Optional[float] = None, restarts: int = 0) -> int:
        """Starts the cluster and waits for it; returns the launcher's exit code. After a failed
        attempt the whole cluster is started again, up to `restarts` times (with fresh ports
        unless the addresses were given): a training script that resumes from its latest
        checkpoint then continues where the failed attempt saved last."""
        previous = {}

        def _terminate(signum, _frame):
            self.kill_all()
            sys.exit(128 + signum)

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, _terminate)
        try:
            for attempt in range(int(restarts) + 1):
                if attempt:
                    with self._lock:
                        self.output.write("[launch] restarting the cluster (restart %d of %d)\n"
                                          % (attempt, restarts))
                        self.output.flush()
                    self.tasks = []
                    self._restarts = {}
                    if self._generated_addresses:
                        self.cluster = make_cluster(self._num_workers, self._num_ps, self._chief)
                self.start()
                code = self.wait(timeout)
                if code == 0:
                    return 0
            return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
