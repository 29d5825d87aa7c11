"""The test suite's background lane (conftest.background_fixture): a fixture runs once whoever
claims it first, its failure reaches every test that asks for it, and the lane's commands start
from the session's environment, not from a test's monkeypatched one."""
import os
import sys
import threading

import pytest

import conftest


@pytest.fixture
def probe_fixture():
    """Registers a background fixture `lane_probe` whose function is the test's to set."""
    name = "lane_probe"
    holder = {}
    conftest.BACKGROUND_FIXTURES[name] = lambda factory: holder["function"](factory)
    yield name, holder
    del conftest.BACKGROUND_FIXTURES[name]
    conftest._CLAIMS.pop(name, None)


def test_a_fixture_runs_once_whoever_claims_it_first(probe_fixture):
    name, holder = probe_fixture
    calls = []
    holder["function"] = lambda factory: calls.append(factory) or len(calls)
    assert conftest._background_value(name, "first") == 1
    assert conftest._background_value(name, "second") == 1  # claimed: its value, not a new run
    assert calls == ["first"]


def test_a_fixture_claimed_by_the_lane_is_waited_for(probe_fixture):
    name, holder = probe_fixture
    started, release = threading.Event(), threading.Event()

    def slow(factory):
        started.set()
        release.wait(30)
        return factory

    holder["function"] = slow
    lane = threading.Thread(target=lambda: conftest._background_value(name, "lane"))
    lane.start()
    assert started.wait(30)
    threading.Timer(0.2, release.set).start()
    assert conftest._background_value(name, "test") == "lane"  # waited; not run again
    lane.join(30)


def test_a_fixture_failure_reaches_every_test_that_asks(probe_fixture):
    name, holder = probe_fixture

    def failing(factory):
        raise ValueError("the launch failed")

    holder["function"] = failing
    for _ in range(2):
        with pytest.raises(ValueError, match="the launch failed"):
            conftest._background_value(name, None)


PRINT_PROBE = "import os; print(os.environ.get('LANE_PROBE', 'unset'))"


def _in_thread(name, function):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", function()), name=name)
    thread.start()
    thread.join(120)
    return result["value"]


def test_the_lane_runs_commands_in_the_session_environment(monkeypatch):
    monkeypatch.setattr(conftest, "_SESSION_ENV", dict(os.environ, LANE_PROBE="session"))
    monkeypatch.setenv("LANE_PROBE", "a test's")  # as a running test's monkeypatch would
    command = [sys.executable, "-c", PRINT_PROBE]
    in_lane = _in_thread(conftest.BACKGROUND_THREAD,
                         lambda: conftest.run_together((conftest.run_command, command))[0])
    assert in_lane.stdout.strip() == "session"
    # Positive control: outside the lane a command sees the current environment.
    assert conftest.run_command(command).stdout.strip() == "a test's"
    elsewhere = _in_thread("another thread", lambda: conftest.run_command(command))
    assert elsewhere.stdout.strip() == "a test's"
