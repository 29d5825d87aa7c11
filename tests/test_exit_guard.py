"""A worker dying of an uncaught error exits even when its shutdown blocks (exit_guard)."""
import subprocess
import sys
import time

import pytest

# An uncaught error in a process whose shutdown blocks: a non-daemon thread that never ends
# (the interpreter joins it before exiting), standing in for a shutdown blocked on a peer.
BLOCKED_SHUTDOWN = """
import sys, threading
sys.path.insert(0, sys.argv[2])
if sys.argv[1] == "guarded":
    from tf_nestpipe.strategy import exit_guard
    exit_guard.install(1.0)
threading.Thread(target=threading.Event().wait, daemon=False).start()
raise ValueError("bad input on this worker")
"""


def _run(mode, timeout):
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", BLOCKED_SHUTDOWN, mode, repo], timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_blocked_shutdown_after_an_uncaught_error_is_forced_out_with_every_stack():
    start = time.time()
    result = _run("guarded", timeout=60)
    assert result.returncode == 1, result.stdout
    assert time.time() - start < 30
    assert "ValueError: bad input on this worker" in result.stdout  # the usual traceback first
    assert "forced out in 1 s" in result.stdout
    assert "Timeout (0:00:01)!" in result.stdout  # faulthandler: where every thread blocked


def test_positive_control_without_the_guard_the_shutdown_blocks():
    with pytest.raises(subprocess.TimeoutExpired):
        _run("plain", timeout=8)


def test_grace_period_from_the_environment(monkeypatch):
    from tf_nestpipe.strategy import exit_guard

    monkeypatch.delenv("TF_NESTPIPE_EXIT_GRACE_SECONDS", raising=False)
    assert exit_guard.grace_from_env() == exit_guard.DEFAULT_GRACE_SECONDS
    monkeypatch.setenv("TF_NESTPIPE_EXIT_GRACE_SECONDS", "0")
    assert exit_guard.grace_from_env() == 0.0
    for bad in ("soon", "-3", "nan"):
        monkeypatch.setenv("TF_NESTPIPE_EXIT_GRACE_SECONDS", bad)
        with pytest.raises(ValueError, match="TF_NESTPIPE_EXIT_GRACE_SECONDS must be"):
            exit_guard.grace_from_env()


def test_install_refuses_a_negative_grace_and_chains_the_previous_hook(monkeypatch):
    from tf_nestpipe.strategy import exit_guard

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[0]))
    monkeypatch.setitem(exit_guard._installed, "previous", None)
    with pytest.raises(ValueError, match="grace_seconds must be >= 0"):
        exit_guard.install(-1)
    exit_guard.install(0)  # 0: the hook chains, but never arms the watchdog
    sys.excepthook(KeyError, KeyError("x"), None)
    assert seen == [KeyError]
