"""A worker that dies of an uncaught error exits, even when its shutdown would block.

A worker whose step raised prints the traceback and starts to shut down; if that shutdown
blocks (e.g. on a peer's pending collective) while its socket mesh keeps sending heartbeats,
its peers wait in their exchanges and the launcher, which tears the cluster down when a task
exits, never sees an exit. `install(grace_seconds)` chains `sys.excepthook`: after the usual traceback it arms
`faulthandler.dump_traceback_later(grace_seconds, exit=True)`, a native watchdog that outlives
the interpreter's own threads during shutdown. A shutdown that finishes in time is untouched
(atexit handlers run as usual); one that blocks longer prints every thread's stack (where it
blocked) and exits with status 1, so the launcher (or a cluster manager) sees the failure and
the peers' exchanges fail naming this worker.
"""
import faulthandler
import sys
import threading

from tf_nestpipe import settings

# Seconds a worker's shutdown may take after an uncaught error (TF_NESTPIPE_EXIT_GRACE_SECONDS).
DEFAULT_GRACE_SECONDS = settings.EXIT_GRACE_SECONDS.default
_ENV = settings.EXIT_GRACE_SECONDS.name

_lock = threading.Lock()
_installed = {"grace": None, "previous": None}


def grace_from_env(default=DEFAULT_GRACE_SECONDS):
    """The grace period `TF_NESTPIPE_EXIT_GRACE_SECONDS` sets (0 disables the guard).

    Args:
        default: The grace period when the variable is unset or empty.

    Returns:
        Seconds, >= 0.

    Raises:
        tf_nestpipe.settings.SettingError: The variable is not a number >= 0.
    """
    return settings.EXIT_GRACE_SECONDS.value(default=float(default))


def _guarded_excepthook(kind, value, traceback):
    previous = _installed["previous"] or sys.__excepthook__
    previous(kind, value, traceback)
    grace = _installed["grace"]
    if not grace or issubclass(kind, KeyboardInterrupt):
        return
    print("tf_nestpipe: this worker exits after an uncaught %s; if its shutdown blocks (e.g. on "
          "a peer's pending collective) it is forced out in %.0f s (%s)"
          % (kind.__name__, grace, _ENV), file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()  # the faulthandler dump and a forced exit skip Python's own flush
    except Exception:  # pylint: disable=broad-except
        pass
    faulthandler.dump_traceback_later(grace, exit=True)


def install(grace_seconds=None):
    """Chains `sys.excepthook` (once per process; a later call only updates the grace period)
    so that after an uncaught error the process exits within `grace_seconds` (default:
    `grace_from_env()`; 0: never forced)."""
    grace = grace_from_env() if grace_seconds is None else float(grace_seconds)
    if grace < 0:
        raise ValueError("grace_seconds must be >= 0, got %r" % (grace_seconds,))
    with _lock:
        _installed["grace"] = grace
        if sys.excepthook is not _guarded_excepthook:
            _installed["previous"] = sys.excepthook
            sys.excepthook = _guarded_excepthook
