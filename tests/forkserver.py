"""A fork server for the test suite's Python processes: start them without importing TensorFlow.

Each test process that trains imports TensorFlow, tf_keras and tf_nestpipe first: ~4 CPU-s of
its ~7 (measured: a fresh `python exactness.py OUT 20 fit:adam loop:adagrad` took 7.4 CPU-s,
the same run forked from a process that had imported them 2.6 CPU-s, with bitwise-equal
parameters). The suite starts ~110 such processes on 2 cores. The server (`serve`) imports them
once; the client (`python_shim` writes it: an executable that stands where the tests name
`sys.executable`) sends the server its command line, environment, working folder, CPU affinity
and standard streams; the server forks a child that becomes that Python process (the script,
`-m` module or `-c` code runs as `__main__` in it, and the interpreter exits as it would).

What a fresh process would see is kept: the child is its own session and process group, dies
with the server (PR_SET_PDEATHSIG), runs with the client's affinity, streams and environment;
the client forwards every signal it can catch to the child and exits as the child did (its exit
code, or killed by the same signal), and the server kills the child when the client dies (a
SIGKILLed task, the launcher's process-group kill). A command the server cannot run as a fresh
process would (an interpreter option other than -u, an environment variable that the
pre-imported modules read at import and that differs from the server's, such as
TF_USE_LEGACY_KERAS=0 or LD_PRELOAD), and any command when no server answers, runs the real
interpreter instead (`exec`), unchanged.

Only stdlib at module level: the client runs with `python -S -E`.
"""
import array
import gc
import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "NESTPIPE_TEST_FORKSERVER"
LOG_ENV = "NESTPIPE_TEST_FORKSERVER_LOG"  # if set: a line per command run by exec, and why

# Variables that the pre-imported modules do not read at import (or that the child applies):
# they may differ between the server and a command it forks.
_RUNTIME_VARIABLES = {"TF_CONFIG", "PYTHONUNBUFFERED", "TF_NUM_INTRAOP_THREADS",
                      "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS", "MALLOC_TOP_PAD_",
                      "PYTEST_CURRENT_TEST", "PWD", "OLDPWD", "_", "SHLVL", SOCKET_ENV, LOG_ENV}
_RUNTIME_PREFIXES = ("TF_NESTPIPE_", "HOROVOD_", "NESTPIPE_TEST_")
_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                      signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGABRT,
                      signal.SIGCONT, signal.SIGWINCH)
_PR_SET_PDEATHSIG = 1
_M_TOP_PAD = -2
_HEADER = struct.Struct("!I")
_THIS_FILE = os.path.abspath(__file__)  # before a child changes its working folder


def parse_command(args):
    """`args` (a Python command line without the interpreter) as (kind, target, argv,
    unbuffered), kind "path" / "module" / "code", or None when it is not one the server runs
    (an option other than -u, or an interactive interpreter)."""
    unbuffered = False
    position = 0
    while position < len(args) and args[position].startswith("-") and args[position] != "-":
        option = args[position]
        if option == "-u":
            unbuffered = True
        elif option in ("-m", "-c"):
            if position + 1 >= len(args):
                return None
            target = args[position + 1]
            rest = list(args[position + 2:])
            if option == "-m":
                return "module", target, [target] + rest, unbuffered
            return "code", target, ["-c"] + rest, unbuffered
        else:
            return None
        position += 1
    if position >= len(args) or args[position] == "-":
        return None
    return "path", args[position], list(args[position:]), unbuffered


def env_mismatch(server_env, command_env, set_by_import=None):
    """The first variable that the server's pre-imported modules may have read at import and
    that differs in `command_env`, or None. `server_env` is the server's environment before
    the imports; a variable they set (`set_by_import`) may have their value (a fresh process
    would set it too). LD_PRELOAD may name a subset of the server's (a preloaded library such
    as the bind interposer only acts on its own variables)."""
    set_by_import = set_by_import or {}
    for name in sorted(set(server_env) | set(command_env)):
        if name in _RUNTIME_VARIABLES or name.startswith(_RUNTIME_PREFIXES):
            continue
        mine, theirs = server_env.get(name), command_env.get(name)
        if mine == theirs or (name in set_by_import and theirs == set_by_import[name]):
            continue
        if name == "LD_PRELOAD":
            if set(filter(None, (theirs or "").split(":"))) <= set((mine or "").split(":")):
                continue
        return name
    return None


def _send(sock, message, fds=()):
    data = json.dumps(message).encode()
    packet = _HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([packet], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(packet)


def _receive_exactly(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _receive(sock, with_fds=False):
    """(message, fds) from `sock`; (None, []) at end of stream."""
    fds = []
    if with_fds:
        data, ancillary, _, _ = sock.recvmsg(_HEADER.size, socket.CMSG_SPACE(16 * 4))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds.extend(array.array("i", payload[:usable]))
        if len(data) < _HEADER.size:
            more = _receive_exactly(sock, _HEADER.size - len(data)) if data else None
            if more is None:
                for fd in fds:
                    os.close(fd)
                return None, []
            data += more
    else:
        data = _receive_exactly(sock, _HEADER.size)
        if data is None:
            return None, []
    (size,) = _HEADER.unpack(data)
    body = _receive_exactly(sock, size)
    if body is None:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(body), fds


# ---------------------------------------------------------------------------------------------
# The client.


def _log(reason, args):
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as log:
            log.write("exec %s: %s\n" % (reason, " ".join(args)[:300]))


def _exec_real(real_python, args, reason):
    _log(reason, args)
    os.execv(real_python, [real_python] + list(args))


def client_main(real_python, args):
    """Runs `real_python args` through the server named by $NESTPIPE_TEST_FORKSERVER, or
    execs it when that cannot be done as a fresh process would; exits as the command did."""
    address = os.environ.get(SOCKET_ENV)
    if not address or parse_command(args) is None:
        _exec_real(real_python, args, "no server" if not address else "options")
    # Signals ignored at start stay ignored (a fresh interpreter keeps SIG_IGN, e.g. SIGINT in
    # a background job of a shell), in the child and here.
    ignored = [s for s in _FORWARDED_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        _send(sock, {"args": list(args), "env": dict(os.environ), "cwd": os.getcwd(),
                     "cpus": sorted(os.sched_getaffinity(0)), "umask": _umask(),
                     "ignored": ignored, "shim": sys.argv[0]}, fds=(0, 1, 2))
        reply, _ = _receive(sock)
    except OSError as error:
        sock.close()
        _exec_real(real_python, args, "server unreachable (%s)" % error)
    if reply is None or "exec" in reply:
        sock.close()
        _exec_real(real_python, args, reply["exec"] if reply else "server closed")
    child = reply["pid"]

    def forward(signum, frame):
        del frame
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in _FORWARDED_SIGNALS:
        if signum not in ignored:
            signal.signal(signum, forward)
    reply, _ = _receive(sock)  # a forwarded signal's handler runs; the read resumes (PEP 475)
    if reply is None:  # the server died: its children die with it
        os._exit(128 + signal.SIGKILL)
    status = reply["status"]
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        import resource  # pylint: disable=import-outside-toplevel
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def python_shim(folder, real_python, tests_folder):
    """Writes `folder/python`, the client: an executable that runs like `real_python`."""
    path = os.path.join(folder, "python")
    with open(path, "w") as shim:
        shim.write("#!%s -SE\nimport sys\nsys.path.insert(0, %r)\nimport forkserver\n"
                   "forkserver.client_main(%r, sys.argv[1:])\n"
                   % (real_python, tests_folder, real_python))
    os.chmod(path, 0o755)
    return path


# ---------------------------------------------------------------------------------------------
# The server.


class _Request:
    """What a forked child runs: its command line, environment and streams."""

    def __init__(self, message, fds):
        self.args = message["args"]
        self.env = message["env"]
        self.cwd = message["cwd"]
        self.cpus = message["cpus"]
        self.umask = message["umask"]
        self.ignored = message["ignored"]
        self.shim = message["shim"]
        self.fds = fds


def _become(request, listener, connections):
    """In the forked child: take over the client's process state; returns the command."""
    import ctypes  # pylint: disable=import-outside-toplevel

    listener.close()
    for connection in connections:
        connection.close()
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT,
                   signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in request.ignored:
        signal.signal(signum, signal.SIG_IGN)
    for target, fd in enumerate(request.fds[:3]):
        os.dup2(fd, target)
    for fd in request.fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request.cwd)
    os.umask(request.umask)
    os.sched_setaffinity(0, request.cpus)
    os.environ.clear()
    os.environ.update(request.env)
    top_pad = request.env.get("MALLOC_TOP_PAD_")
    if top_pad and top_pad.isdigit():
        libc.mallopt(_M_TOP_PAD, int(top_pad))
    kind, target, argv, unbuffered = parse_command(request.args)
    unbuffered = unbuffered or bool(request.env.get("PYTHONUNBUFFERED"))
    _reopen_streams(unbuffered)
    sys.argv = argv
    # What the program starts as Python (the launcher's parameter servers, ...) comes here too.
    sys.executable = request.shim
    if kind == "path":
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    elif kind == "module":
        sys.path[0] = os.getcwd()
    else:
        sys.path[0] = ""
    import numpy  # pylint: disable=import-outside-toplevel
    numpy.random.seed()  # a fresh process's global generator is seeded from the OS, not copied
    return kind, target


def _reopen_streams(unbuffered):
    """sys.stdin/stdout/stderr over fds 0-2 as the interpreter makes them at start-up."""
    import io  # pylint: disable=import-outside-toplevel

    def stream(fd, mode, errors):
        buffered = not unbuffered or mode == "r"
        raw = io.FileIO(fd, mode + "b", closefd=False)
        binary = raw
        if buffered:
            binary = (io.BufferedReader if mode == "r" else io.BufferedWriter)(raw)
        tty = os.isatty(fd)
        return io.TextIOWrapper(binary, encoding="utf-8", errors=errors,
                                line_buffering=buffered and tty and mode == "w",
                                write_through=not buffered)

    sys.stdin = sys.__stdin__ = stream(0, "r", "strict")
    sys.stdout = sys.__stdout__ = stream(1, "w", "strict")
    sys.stderr = sys.__stderr__ = stream(2, "w", "backslashreplace")


def serve(address, preload):
    """Imports the modules `preload` names, then forks a child per client connection on the
    Unix socket `address` until the server is killed. Returns (in a forked child only) the
    command the child is to run, as (kind, target)."""
    import importlib  # pylint: disable=import-outside-toplevel
    import select  # pylint: disable=import-outside-toplevel

    import_env = dict(os.environ)  # what the modules read as they were imported
    for name in preload:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    # The imported objects move to the collector's permanent generation: a child's collections
    # (and its exit's) then do not walk them, which would copy every page they sit on into the
    # child (measured: a forked `-c pass` took 0.95 s wall without this, ~0.25 s with it).
    gc.collect()
    gc.freeze()
    # What importing them set (TensorFlow sets TF2_BEHAVIOR, ...): a fresh process sets it too.
    set_by_import = {name: value for name, value in os.environ.items()
                     if import_env.get(name) != value}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(64)
    os.rename(address + ".tmp", address)  # clients connect only once the server listens
    parent = os.getppid()  # the test session: the server ends with it
    children = {}  # child pid -> its client's connection
    waiting = {}  # a client connection -> its child's pid
    # A child's exit wakes the loop: SIGCHLD writes a byte to this pipe.
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    while True:
        readable, _, _ = select.select([listener, wakeup_read] + list(waiting), [], [], 1.0)
        if os.getppid() != parent:  # the session died without stopping it; children follow
            os._exit(0)
        for ready in readable:
            if ready == wakeup_read:
                os.read(wakeup_read, 4096)
            elif ready is listener:
                connection, _ = listener.accept()
                try:
                    message, fds = _receive(connection, with_fds=True)
                except OSError:
                    connection.close()
                    continue
                if message is None:
                    connection.close()
                    continue
                mismatch = env_mismatch(import_env, message["env"], set_by_import)
                if len(fds) != 3 or mismatch is not None:
                    for fd in fds:
                        os.close(fd)
                    _send_quietly(connection, {"exec": "%s differs from the server's" % mismatch
                                               if mismatch else "no streams"})
                    connection.close()
                    continue
                message["env"] = dict(message["env"], **set_by_import)
                request = _Request(message, fds)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for fd in (wakeup_read, wakeup_write):
                        os.close(fd)
                    return _become(request, listener,
                                   set(children.values()) | set(waiting) | {connection})
                for fd in fds:
                    os.close(fd)
                _send_quietly(connection, {"pid": pid})
                children[pid] = connection
                waiting[connection] = pid
            else:  # a client spoke or closed: it died, so its child is killed
                try:
                    gone = not ready.recv(1)
                except OSError:
                    gone = True
                if gone:
                    for kill in (os.killpg, os.kill):
                        try:
                            kill(waiting[ready], signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    del waiting[ready]
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is None:
                continue
            if connection in waiting:
                _send_quietly(connection, {"status": status})
                del waiting[connection]
            connection.close()


def _send_quietly(connection, message):
    try:
        _send(connection, message)
    except OSError:
        pass


def _run(kind, target):
    """Runs the command as `__main__` (in the forked child) and exits as the interpreter
    would: an uncaught exception is printed (without this module's and runpy's frames) and
    exits 1, `sys.exit(code)` exits `code`, KeyboardInterrupt kills the process with SIGINT."""
    import builtins  # pylint: disable=import-outside-toplevel
    import runpy  # pylint: disable=import-outside-toplevel

    try:
        if kind == "path":
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            code = compile(target, "<string>", "exec")
            main = type(sys)("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            exec(code, main.__dict__)  # pylint: disable=exec-used
    except SystemExit as request:
        _exit(_exit_code(request.code))
    except KeyboardInterrupt as error:
        _print_uncaught(error, runpy)
        _exit(None)
    except BaseException as error:  # pylint: disable=broad-except
        _print_uncaught(error, runpy)
        _exit(1)
    _exit(0)


def _print_uncaught(error, runpy):
    ours = {_THIS_FILE, os.path.abspath(runpy.__file__)}
    trace = error.__traceback__
    while trace is not None and os.path.abspath(trace.tb_frame.f_code.co_filename) in ours:
        trace = trace.tb_next
    sys.excepthook(type(error), error.with_traceback(trace), trace)


def _exit_code(code):
    """The exit status of `sys.exit(code)` (a message is printed and exits 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write("%s\n" % (code,))
    except Exception:  # pylint: disable=broad-except
        pass
    return 1


def _exit(code):
    """The interpreter's exit without its module teardown: the teardown frees every imported
    object, which in a forked child copies the server's pages (measured: a forked `-c pass`
    took ~0.25 s wall with it, 0.06 s without; a fresh `python -c pass` 0.07 s). What a program
    can observe still happens: non-daemon threads are joined, atexit functions run, every open
    Python file and the C library's streams are flushed. `code` None: killed by SIGINT
    (KeyboardInterrupt)."""
    import atexit  # pylint: disable=import-outside-toplevel
    import ctypes  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel

    try:
        threading._shutdown()  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
        pass
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    for stream in gc.get_objects():
        if isinstance(stream, (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)):
            try:
                if not stream.closed:
                    stream.flush()
            except Exception:  # pylint: disable=broad-except
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pylint: disable=broad-except
            pass
    ctypes.CDLL(None).fflush(None)
    if code is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    os._exit(code)


if __name__ == "__main__":
    _run(*serve(sys.argv[1], sys.argv[2:]))
