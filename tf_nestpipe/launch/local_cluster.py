"""Starts a cluster of local processes, one `TF_CONFIG` each, and supervises it.

Every task's output is prefixed with its role and index, and every task's TensorFlow server
listens only on its own address (see `listen`). The cluster fails fast: when one task
exits non-zero, every other task is killed and the launcher exits non-zero. Children run in their
own process groups and die with the launcher (PR_SET_PDEATHSIG), so no orphan survives. With
`horovod=True` the launcher also runs Horovod's Gloo rendezvous and gives every training task its
`HOROVOD_*` environment (see `horovod_rendezvous`).

Quiet by default: every task's output goes to its own log file (`log_dir`), and only the first
training task's (the chief's, else worker 0's) also to the console; `output="all"` (or
`TF_NESTPIPE_LAUNCH_OUTPUT=all`) shows every task's. A failed task's last lines are shown
whatever the mode, and every attempt ends with one summary line per task (exit code, duration,
log file). TensorFlow's informational start-up lines, printed before its log level applies,
stay in the log files only. SIGTERM / SIGINT to the launcher is forwarded to the training tasks
as SIGTERM (so `PreemptionCheckpointHandler` saves); after `grace_period` seconds what still runs is killed, and
the launcher exits with the tasks' code (128 + signal if it had to kill them). A task that exits
with `PREEMPTED_EXIT_CODE` (it saved on a preemption) does not fail fast either: the others,
saving the same step, get `grace_period` seconds to exit before the cluster is torn down. Where the
launcher splits this machine's cores among the tasks (no `threads_per_task` given, no ps tasks)
it also pins each task to its own physical cores (`cpu_pinning`), its thread pools sized to
them; `pin_cpus=False` leaves the tasks unpinned, `True` pins them in any cluster.
"""
import ctypes
import dataclasses
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

from tf_nestpipe import settings
from tf_nestpipe.launch.cluster_check import RESTARTED_ENV
from tf_nestpipe.launch.listen import ShimMissingError, listen_only_env
from tf_nestpipe.launch import cpu_pinning
from tf_nestpipe.launch import threads as thread_pools
from tf_nestpipe.launch.allocator import allocator_env
from tf_nestpipe.transport_config import SECRET_ENV, SECRET_FILE_ENV

_PR_SET_PDEATHSIG = 1
OUTPUT_ENV = settings.LAUNCH_OUTPUT.name
OUTPUT_MODES = settings.LAUNCH_OUTPUT_MODES
DEFAULT_GRACE_PERIOD = 25.0  # below Kubernetes' default terminationGracePeriodSeconds (30)
# The exit code of a training task that saved on preemption (its peers save the same step).
PREEMPTED_EXIT_CODE = 42
_FAILURE_TAIL_LINES = 30
# TensorFlow's start-up lines that come before it reads TF_CPP_MIN_LOG_LEVEL (so that setting
# cannot hide them): informational, printed by every task. Kept in the log files; not shown on
# the console. Errors (e.g. a failed cuInit on a GPU machine) are always shown.
_STARTUP_NOISE = ("WARNING: All log messages before absl::InitializeLog() is called",
                  "] oneDNN custom operations are on.",
                  "] Could not find cuda drivers on your machine, GPU will not be used.")


def is_startup_noise(line: str) -> bool:
    """Whether `line` is one of TensorFlow's informational start-up lines (`_STARTUP_NOISE`)."""
    if line.startswith("WARNING: All log messages before absl"):
        return True
    return line[:1] == "I" and any(marker in line for marker in _STARTUP_NOISE[1:])


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


def _child_setup(cpus):
    """What a task's process runs before its command: its own process group, death with the
    launcher, and (with `cpus`) its CPU affinity, which every thread it starts inherits."""
    def setup():
        _die_with_parent()
        if cpus:
            cpu_pinning.pin_this_process(cpus)

    return setup


@dataclasses.dataclass
class _Task:
    role: str
    process: subprocess.Popen
    runs_command: bool
    pump: Optional[threading.Thread] = None
    log_path: Optional[str] = None
    to_console: bool = True
    started: float = 0.0
    ended: Optional[float] = None
    killed: bool = False


class LocalCluster:
    """Runs `command` on every training task of a localhost cluster; ps tasks (and, in
    parameter-server mode, workers) run the `tf_nestpipe.server` entry point instead. In
    parameter-server mode a worker server that dies is restarted (up to 3 times)."""

    def __init__(self, command: Sequence[str], num_workers: int, num_ps: int = 0,
                 chief: bool = False, env: Optional[Dict[str, str]] = None,
                 output=None, cluster: Optional[Dict[str, List[str]]] = None,
                 task_prefix: str = "", horovod: bool = False,
                 horovod_address: Optional[str] = None, horovod_interface: Optional[str] = None,
                 output_mode: Optional[str] = None, log_dir: Optional[str] = None,
                 grace_period: float = DEFAULT_GRACE_PERIOD,
                 threads_per_task: Optional[int] = None, pin_cpus: Optional[bool] = None):
        """`cluster` overrides the generated localhost addresses (e.g. hosts inside network
        namespaces); `task_prefix` is a command template put before each task's command, with
        `{role}` and `{index}` filled in (e.g. `ip netns exec ns_{role}{index}`). `horovod`
        starts a Gloo rendezvous and sets each chief / worker task's `HOROVOD_*` variables
        (rank = position among chief + workers, chief first); the tasks reach the rendezvous at
        `horovod_address` and Gloo uses `horovod_interface` (default: loopback), which tasks
        with their own `cluster` addresses or `task_prefix` (namespaces) must name.
        `output_mode` "first" (default, or `$TF_NESTPIPE_LAUNCH_OUTPUT`) shows only the first
        training task's output on the console, "all" every task's; each task's output is also
        written to `log_dir` (default: a new temporary directory). `grace_period`: seconds the
        tasks get to exit after the launcher forwarded them a SIGTERM. `pin_cpus` (default:
        where the launcher splits the cores itself, i.e. no `threads_per_task`, and not in
        parameter-server mode) pins each task to its own physical cores, its thread pools sized
        to them (`cpu_pinning`)."""
        output_mode = output_mode or settings.LAUNCH_OUTPUT.value()
        if output_mode not in OUTPUT_MODES:
            raise ValueError("output mode must be one of %s, got %r" % (OUTPUT_MODES, output_mode))
        if grace_period < 0:
            raise ValueError("the grace period must be >= 0 seconds, got %r" % (grace_period,))
        self.output_mode = output_mode
        self.log_dir = log_dir
        self.grace_period = float(grace_period)
        self._attempt = 0
        self._signal = None  # the signal that asked the launcher to stop
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
        # One secret per job, the same in every task (restarts included), unless the caller's
        # environment brings one: the socket transport's peers prove they hold it.
        if not (self.env.get(SECRET_ENV) or os.environ.get(SECRET_ENV)
                or self.env.get(SECRET_FILE_ENV) or os.environ.get(SECRET_FILE_ENV)):
            self.env[SECRET_ENV] = secrets.token_hex(32)
        num_tasks = sum(len(addresses) for addresses in self.cluster.values())
        if pin_cpus is None:
            pin_cpus = threads_per_task is None and not self.parameter_server_mode
        # {task name: the CPUs it is pinned to}; {} unpinned (or the topology is unknown).
        cpu_sets = cpu_pinning.host_task_cpu_sets(num_tasks) if pin_cpus else None
        names = ["%s:%d" % (role, index) for role, addresses in self.cluster.items()
                 for index in range(len(addresses))]
        self.task_cpus = dict(zip(names, cpu_sets)) if cpu_sets else {}
        self._pools_per_cpu = threads_per_task is None  # the user did not size the pools
        if threads_per_task is None:  # every task runs on this machine: split its cores
            threads_per_task = thread_pools.threads_per_task(num_tasks)
        thread_pools.thread_env(threads_per_task, {})  # refuses a negative count now
        self.threads_per_task = threads_per_task
        self.output = output or sys.stdout
        self._lock = threading.Lock()
        self.tasks: List[_Task] = []
        self._warned_listen_all = False

    def _task_command(self, role: str) -> (List[str], bool):
        if role == "ps" or (self.parameter_server_mode and role == "worker"):
            return [sys.executable, "-u", "-m", "tf_nestpipe.server"], False
        return self.command, True

    def _say(self, text: str):
        with self._lock:
            self.output.write("[launch] %s\n" % text)
            self.output.flush()

    def _first_command_role(self) -> str:
        return "chief:0" if self.cluster.get("chief") else "worker:0"

    def _log_path(self, role: str, index: int) -> str:
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="tf_nestpipe-launch-")
        os.makedirs(self.log_dir, exist_ok=True)
        suffix = ".restart%d" % self._attempt if self._attempt else ""
        return os.path.join(self.log_dir, "%s-%d%s.log" % (role, index, suffix))

    def _pump(self, task: _Task):
        prefix = "[%s] " % task.role
        with open(task.log_path, "a") as log:
            for line in task.process.stdout:
                log.write(line)
                log.flush()
                if task.to_console and not is_startup_noise(line):
                    with self._lock:
                        self.output.write(prefix + line)
                        self.output.flush()

    def _show_tail(self, task: _Task):
        """Shows the last lines of a failed task's log when its output was not on the console."""
        if task.to_console or task.log_path is None:
            return
        if task.pump is not None:
            task.pump.join(timeout=5)
        try:
            with open(task.log_path, errors="replace") as log:
                lines = log.readlines()[-_FAILURE_TAIL_LINES:]
        except OSError:
            return
        with self._lock:
            self.output.write("[launch] last lines of %s (%s):\n" % (task.role, task.log_path))
            for line in lines:
                self.output.write("[%s] %s" % (task.role, line))
            self.output.flush()

    def _spawn(self, role: str, index: int, restarted: bool = False) -> _Task:
        env = dict(os.environ)
        env.update(self.env)
        env.pop(RESTARTED_ENV, None)
        if restarted:  # its cluster was checked at start-up; the leader no longer listens
            env[RESTARTED_ENV] = "1"
        env["TF_CONFIG"] = json.dumps(
            {"cluster": self.cluster, "task": {"type": role, "index": index}})
        if self._rendezvous is not None:
            rank = index + (len(self.cluster.get("chief", [])) if role == "worker" else 0)
            env.update(self._rendezvous.env(rank))
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.setdefault("PYTHONUNBUFFERED", "1")
        name = "%s:%d" % (role, index)
        cpus = self.task_cpus.get(name)
        # A pinned task's pools: one thread per CPU it has, unless the user sized them (an
        # explicit --threads-per-task wins, also with --pin-cpus); otherwise the equal split.
        threads = len(cpus) if cpus and self._pools_per_cpu else self.threads_per_task
        env.update(thread_pools.thread_env(threads, env))
        env.update(allocator_env(env))  # freed memory stays in the task (launch.allocator)
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
        log_path = self._log_path(role, index)
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   errors="replace", preexec_fn=_child_setup(cpus))
        task = _Task(name, process, runs_command, log_path=log_path,
                     to_console=self.output_mode == "all" or name == self._first_command_role(),
                     started=time.time())
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
        self.tasks[position] = self._spawn(role, int(index), restarted=True)
        return True

    def _stop_rendezvous(self):
        if self._rendezvous is not None:
            self._rendezvous.stop()
            self._rendezvous = None

    def kill_all(self):
        """Kills every task's process group and reaps it (and stops the Horovod rendezvous)."""
        for task in self.tasks:
            if task.process.poll() is None:
                task.killed = True
                try:
                    os.killpg(task.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for task in self.tasks:
            task.process.wait()
            if task.ended is None:
                task.ended = time.time()
            if task.pump is not None:
                task.pump.join(timeout=5)
        self._stop_rendezvous()

    def _note_exits(self):
        for task in self.tasks:
            if task.ended is None and task.process.poll() is not None:
                task.ended = time.time()

    def summary(self) -> List[str]:
        """One line per task of the last attempt: its exit code, how long it ran, the CPUs it
        was pinned to (if pinned), its log."""
        lines = []
        for task in self.tasks:
            code = task.process.returncode
            if task.killed:
                status = "killed by the launcher"
            elif code is not None and code < 0:
                status = "killed by signal %d" % -code
            else:
                status = "exit %s" % code
            duration = (task.ended or time.time()) - task.started
            cpus = self.task_cpus.get(task.role)
            pinned = ", cpus %s" % cpu_pinning.describe(cpus) if cpus else ""
            lines.append("%s: %s after %.1f s%s, log %s" % (task.role, status, duration, pinned,
                                                            task.log_path))
        return lines

    def forward_signal(self, signum: int):
        """Asks every training task to stop (SIGTERM to its process group) on behalf of signal
        `signum` to the launcher; `wait` then gives them `grace_period` seconds to exit."""
        self._signal = signum
        for task in self.tasks:
            if task.runs_command and task.process.poll() is None:
                try:
                    os.killpg(task.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    @staticmethod
    def _exit_code(code: Optional[int]) -> int:
        return 128 - code if code is not None and code < 0 else int(code or 0)

    def _wait_for_training_tasks(self) -> List[str]:
        """Waits up to the grace period for every training task to exit; returns the roles of
        those still running."""
        deadline = time.time() + self.grace_period
        commands = [t for t in self.tasks if t.runs_command]
        while any(t.process.poll() is None for t in commands) and time.time() < deadline:
            time.sleep(0.1)
        self._note_exits()
        return [t.role for t in commands if t.process.poll() is None]

    def _wait_after_signal(self) -> int:
        """The tasks got SIGTERM: waits up to the grace period for every training task to exit
        (no fail-fast: the others may still be writing their preemption checkpoint), then kills
        what runs. Returns the first non-zero exit code of a training task (0 if all succeeded),
        or 128 + the signal when one had to be killed."""
        running = self._wait_for_training_tasks()
        if running:
            self._say("%s still running %.0f s after SIGTERM; killing them"
                      % (", ".join(running), self.grace_period))
            return 128 + self._signal
        codes = [self._exit_code(t.process.returncode) for t in self.tasks if t.runs_command]
        return next((c for c in codes if c), 0)

    def _wait_after_preemption(self, role: str) -> bool:
        """`role` exited after its preemption save: the other training tasks save the same step
        and exit; waits up to the grace period for them (what still runs is then killed).
        Returns whether every training task exited with 0 or `PREEMPTED_EXIT_CODE`."""
        self._say("%s saved on preemption (exit %d); waiting up to %.0f s for the other tasks"
                  % (role, PREEMPTED_EXIT_CODE, self.grace_period))
        running = self._wait_for_training_tasks()
        if running:
            self._say("%s still running %.0f s after %s's preemption exit; killing them"
                      % (", ".join(running), self.grace_period, role))
            return False
        return all(t.process.returncode in (0, PREEMPTED_EXIT_CODE)
                   for t in self.tasks if t.runs_command)

    def _first_failure(self, failed):
        """The failure to report when `failed` (a task found exited with an error) may only
        follow another: a training task killed by a signal by now (its peers then exit with an
        error of their own, and one polled first would be blamed) is the one that failed first."""
        if failed.process.returncode < 0:
            return failed
        for task in self.tasks:
            if task.runs_command and task is not failed:
                code = task.process.poll()
                if code is not None and code < 0:
                    return task
        return failed

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits until every command task succeeded (0) or one failed / timed out (non-zero:
        `PREEMPTED_EXIT_CODE` when every training task exited after its preemption save)."""
        deadline = None if timeout is None else time.time() + timeout
        failed, failed_task, signalled, preempted = None, None, None, False
        try:
            while True:
                if self._signal is not None:
                    signalled = self._wait_after_signal()
                    break
                pending = False
                for position, task in enumerate(self.tasks):
                    code = task.process.poll()
                    if code is None:
                        pending = pending or task.runs_command
                    elif code != 0 and not self._restart_if_worker_server(position, code):
                        task = self._first_failure(task)
                        code = task.process.returncode
                        failed, failed_task = (task.role, code), task
                        if code == PREEMPTED_EXIT_CODE and task.runs_command:
                            preempted = self._wait_after_preemption(task.role)
                        break
                self._note_exits()
                if failed or not pending:
                    break
                if deadline is not None and time.time() > deadline:
                    failed = ("launcher", "timeout after %.0fs" % timeout)
                    break
                time.sleep(0.1)
        finally:
            self.kill_all()
        if preempted:
            self._say("every training task saved on preemption; the cluster stopped (exit %d)"
                      % PREEMPTED_EXIT_CODE)
        elif failed_task is not None:
            self._show_tail(failed_task)
        if failed and not preempted:
            self._say("task %s failed (%s); the cluster was torn down" % failed)
        for line in self.summary():
            self._say(line)
        if signalled is not None:
            self._say("stopped on signal %d; exit %d" % (self._signal, signalled))
            return signalled
        if preempted:
            return PREEMPTED_EXIT_CODE
        return 1 if failed else 0

    def run(self, timeout: Optional[float] = None, restarts: int = 0) -> int:
        """Starts the cluster and waits for it; returns the launcher's exit code. After a failed
        attempt the whole cluster is started again, up to `restarts` times (with fresh ports
        unless the addresses were given): a training script that resumes from its latest
        checkpoint then continues where the failed attempt saved last."""
        previous = {}

        def _terminate(signum, _frame):
            if self._signal is not None:  # a second signal: stop waiting
                self.kill_all()
                sys.exit(128 + signum)
            self.forward_signal(signum)

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, _terminate)
        try:
            for attempt in range(int(restarts) + 1):
                if self._signal is not None:  # no restart after the launcher was asked to stop
                    return 128 + self._signal
                self._attempt = attempt
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
                if self._signal is not None:  # the signal came while the tasks were starting
                    self.forward_signal(self._signal)
                code = self.wait(timeout)
                if code == 0 or self._signal is not None:
                    return code
            return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
