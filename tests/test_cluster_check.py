"""Start-up agreement of a cluster's tasks: a disagreement, a duplicate task, a task that never
starts or a leader nobody listens at fails every task within the timeout, naming the field or
address; roles and addresses we cannot run are refused at once."""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import through_forkserver
from tf_nestpipe.launch import cluster_check
from tf_nestpipe.launch.cluster_check import ClusterMismatchError, agree_on_cluster
from tf_nestpipe.launch.local_cluster import free_ports
from tf_nestpipe.settings import SettingError
from tf_nestpipe.tf_config import TFConfigError, check_synchronous_roles, parse_tf_config


def _cluster(workers, ports=None):
    ports = ports or free_ports(workers)
    return {"worker": ["127.0.0.1:%d" % p for p in ports[:workers]]}


def _run_tasks(tasks, timeout=5.0):
    """Runs agree_on_cluster for every (cluster, index) worker in threads; returns each one's
    (error message or "ok", seconds)."""
    return _run_agreements([(cluster, "worker", index) for cluster, index in tasks], timeout,
                           cluster_check.TRAINING_ROLES)


def _run_agreements(tasks, timeout, roles):
    """Runs agree_on_cluster(roles=roles) for every (cluster, role, index) in threads, 50 ms
    apart; returns each one's (error message or "ok", seconds)."""
    results = [None] * len(tasks)

    def one(position, cluster, role, index):
        start = time.time()
        try:
            agree_on_cluster(cluster, role, index, timeout=timeout, roles=roles)
            results[position] = ("ok", time.time() - start)
        except ClusterMismatchError as error:
            results[position] = (str(error), time.time() - start)

    threads = [threading.Thread(target=one, args=(i,) + task) for i, task in enumerate(tasks)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout + 20)
    return results


def test_tasks_given_the_same_cluster_agree():  # the positive control of every case below
    cluster = _cluster(3)
    results = _run_tasks([(cluster, 2), (cluster, 1), (cluster, 0)])
    assert [r[0] for r in results] == ["ok"] * 3 and all(r[1] < 5 for r in results)


def test_a_disagreeing_worker_list_fails_every_task_naming_the_field():
    three = _cluster(3)
    two = {"worker": three["worker"][:2]}
    results = _run_tasks([(three, 0), (two, 1)])
    for message, took in results:
        assert "cluster.worker: worker:0 (the leader) lists 3 address(es)" in message, message
        assert "worker:1 lists 2" in message and took < 5
    assert results[1][0].startswith("worker:1: the tasks were given different clusters")


def test_a_different_address_is_named_with_its_index():
    cluster = _cluster(2)
    other = {"worker": [cluster["worker"][0], "127.0.0.1:1"]}
    message = _run_tasks([(cluster, 0), (other, 1)])[1][0]
    assert "cluster.worker[1]: worker:0 (the leader) has %r, worker:1 has '127.0.0.1:1'" % (
        cluster["worker"][1]) in message


def test_two_processes_with_the_same_index_fail_every_task():
    cluster = _cluster(3)  # worker 2 never starts: the leader is still waiting
    results = _run_tasks([(cluster, 0), (cluster, 1), (cluster, 1)])
    for message, took in results:
        assert "two processes were started as worker:1" in message and took < 5, message


def test_a_second_leader_cannot_take_the_address():
    cluster = _cluster(2)
    results = _run_tasks([(cluster, 0), (cluster, 0), (cluster, 1)])
    messages = sorted(r[0] for r in results)
    assert messages[:2] == ["ok", "ok"], messages
    assert "worker:0 cannot listen at its address %s" % cluster["worker"][0] in messages[2]
    assert "same task index" in messages[2]


def test_a_task_that_never_starts_is_named_with_its_address():
    cluster = _cluster(3)
    (message, took), = _run_tasks([(cluster, 0)], timeout=1.5)
    assert "timed out after 2 s waiting at %s for worker:1, worker:2" % cluster["worker"][0] in message
    assert "worker:2 at %s" % cluster["worker"][2] in message and 1.5 <= took < 5


def test_a_leader_nobody_listens_at_is_named_with_its_address():
    cluster = _cluster(2)
    (message, took), = _run_tasks([(cluster, 1)], timeout=1.5)
    assert ("worker:1 timed out after 2 s joining the cluster: nobody answered at the leader "
            "worker:0's address %s" % cluster["worker"][0]) in message, message
    assert 1.5 <= took < 5


def test_a_port_held_by_another_program_is_reported(tmp_path):
    import socket

    cluster = _cluster(2)
    host, port = cluster["worker"][0].split(":")
    squatter = socket.socket()
    squatter.bind((host, int(port)))
    squatter.listen(1)
    accepted = []
    threading.Thread(target=lambda: accepted.append(squatter.accept()[0].close()),
                     daemon=True).start()
    try:
        (message, _), = _run_tasks([(cluster, 1)], timeout=3)
    finally:
        squatter.close()
    assert "did not answer the start-up check" in message, message


def test_fingerprint_and_difference():
    a = {"worker": ["h:1", "h:2"], "chief": ["h:0"]}
    assert cluster_check.fingerprint(a) == cluster_check.fingerprint(dict(reversed(list(a.items()))))
    assert cluster_check.fingerprint(a) != cluster_check.fingerprint({"worker": ["h:1", "h:2"]})
    assert cluster_check.describe_difference(a, "A", a, "B") is None
    assert cluster_check.describe_difference(a, "A", {"worker": a["worker"]}, "B") == (
        "cluster.chief: A lists 1 chief task(s) ['h:0'], B lists none")
    assert cluster_check.leader_of(a) == ("chief", 0)
    assert cluster_check.leader_of({"worker": ["h:1"]}) == ("worker", 0)


@pytest.mark.parametrize("task,message", [
    ({"type": "evaluator", "index": 0}, "does not support the role 'evaluator'"),
    ({"type": "ps", "index": 0}, "python -m tf_nestpipe.server"),
])
def test_roles_a_synchronous_cluster_cannot_run_are_refused(task, message):
    config = parse_tf_config(json.dumps({"cluster": {"worker": ["h:1"], "ps": ["h:2"]},
                                         "task": task}))
    with pytest.raises(TFConfigError, match=message):
        check_synchronous_roles(config)
    check_synchronous_roles(parse_tf_config(json.dumps(  # positive control
        {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}})))


def test_an_address_listed_twice_is_refused():
    with pytest.raises(TFConfigError, match=r"cluster.worker\[1\]: 'h:1' is also cluster.chief\[0\]"):
        parse_tf_config(json.dumps({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:1"]},
                                    "task": {"type": "worker", "index": 0}}))


def test_timeout_setting_is_validated(monkeypatch):
    monkeypatch.setenv(cluster_check.STARTUP_TIMEOUT_ENV, "abc")
    with pytest.raises(SettingError, match="TF_NESTPIPE_STARTUP_TIMEOUT must be a number of seconds > 0, got 'abc'"):
        cluster_check.startup_timeout()
    monkeypatch.setenv(cluster_check.STARTUP_TIMEOUT_ENV, "7")
    assert cluster_check.startup_timeout() == 7.0 and cluster_check.startup_timeout(2) == 2.0


STRATEGY = textwrap.dedent("""
    import tf_nestpipe as tnp
    strategy = tnp.NestPipeStrategy()
    print("started", strategy.num_workers, strategy.worker_index, flush=True)
""")


@pytest.mark.cluster
def test_strategies_given_different_clusters_fail_fast_on_every_task():
    """Two real processes whose TF_CONFIGs disagree (3 workers vs 2) used to hang silently,
    ignoring SIGTERM; now both exit within the timeout, naming the field."""
    three = _cluster(3)
    configs = [{"cluster": three, "task": {"type": "worker", "index": 0}},
               {"cluster": {"worker": three["worker"][:2]}, "task": {"type": "worker", "index": 1}}]
    start = time.time()
    processes = [subprocess.Popen(  # forked (tests/forkserver.py): the time is the check's
        through_forkserver([sys.executable, "-c", STRATEGY]), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, TF_CONFIG=json.dumps(c), TF_NESTPIPE_STARTUP_TIMEOUT="20"))
        for c in configs]
    outputs = [p.communicate(timeout=90)[0] for p in processes]
    took = time.time() - start
    for process, output in zip(processes, outputs):
        assert process.returncode != 0, output[-3000:]
        assert "ClusterMismatchError" in output and "cluster.worker: worker:0 (the leader) lists 3" \
            in output, output[-3000:]
        assert "started" not in output
    # Forked, they took ~4 s; as fresh processes beside the forked suite's denser runs, 44 s.
    assert took < 30, took


def test_a_leader_that_gives_no_verdict_in_time_is_reported(monkeypatch):
    monkeypatch.setattr(cluster_check, "_VERDICT_GRACE", 0.5)
    cluster = _cluster(3)  # worker 2 never starts; the leader waits longer than worker 1
    results = [None, None]

    def leader():
        try:
            agree_on_cluster(cluster, "worker", 0, timeout=4)
        except ClusterMismatchError as error:
            results[0] = str(error)

    thread = threading.Thread(target=leader)
    thread.start()
    time.sleep(0.1)
    start = time.time()
    with pytest.raises(ClusterMismatchError, match="took the report but gave no verdict within 2 s"):
        agree_on_cluster(cluster, "worker", 1, timeout=1.5)
    assert time.time() - start < 3
    thread.join(15)
    assert "waiting at %s for worker:2 to report" % cluster["worker"][0] in results[0]


# --- parameter-server mode: the chief leads, workers and ps tasks report ----------------------
def _ps_cluster(ports=None):
    ports = ports or free_ports(3)
    return {"chief": ["127.0.0.1:%d" % ports[0]], "worker": ["127.0.0.1:%d" % ports[1]],
            "ps": ["127.0.0.1:%d" % ports[2]]}


def _run_ps_tasks(tasks, timeout=5.0):
    """`_run_tasks` for (cluster, role, index) tasks with PS_MODE_ROLES."""
    return _run_agreements(tasks, timeout, cluster_check.PS_MODE_ROLES)


def test_ps_mode_tasks_given_the_same_cluster_agree():  # positive control of the two below
    cluster = _ps_cluster()
    results = _run_ps_tasks([(cluster, "ps", 0), (cluster, "worker", 0), (cluster, "chief", 0)])
    assert [r[0] for r in results] == ["ok"] * 3, results


def test_ps_mode_a_ps_task_given_another_cluster_fails_every_task():
    cluster = _ps_cluster()
    other = dict(cluster, ps=cluster["ps"] + ["127.0.0.1:1"])  # the ps thinks there are 2
    results = _run_ps_tasks([(other, "ps", 0), (cluster, "worker", 0), (cluster, "chief", 0)])
    for message, took in results:
        assert "the tasks were given different clusters: cluster.ps: chief:0 (the leader) lists " \
            "1 address(es)" in message and "ps:0 lists 2" in message, results
        assert took < 5


def test_ps_mode_a_restarted_task_skips_the_check(monkeypatch):
    """A worker server the launcher restarted does not wait for a leader that stopped listening
    (its cluster was checked when it first started)."""
    monkeypatch.setenv(cluster_check.RESTARTED_ENV, "1")
    start = time.time()
    agree_on_cluster(_ps_cluster(), "worker", 0, timeout=5, roles=cluster_check.PS_MODE_ROLES)
    assert time.time() - start < 1
    monkeypatch.delenv(cluster_check.RESTARTED_ENV)
    with pytest.raises(ClusterMismatchError, match="nobody answered at the leader chief:0"):
        agree_on_cluster(_ps_cluster(), "worker", 0, timeout=1, roles=cluster_check.PS_MODE_ROLES)


PS_CHIEF = textwrap.dedent("""
    import tf_nestpipe as tnp
    strategy = tnp.ParameterServerStrategy()
    print("started", strategy.num_workers, strategy.num_ps, flush=True)
""")


@pytest.mark.cluster
def test_ps_mode_processes_given_different_clusters_fail_fast_on_every_task():
    """Real processes: the chief (tnp.ParameterServerStrategy), a worker and a ps server
    (`python -m tf_nestpipe.server`), the worker's TF_CONFIG naming another ps address: every
    task exits within the timeout naming the field (before, the servers started, and the worker
    would look for the ps at an address nobody serves)."""
    cluster = _ps_cluster()
    other = dict(cluster, ps=["127.0.0.1:%d" % free_ports(1)[0]])
    tasks = [("chief", cluster, [sys.executable, "-c", PS_CHIEF]),
             ("worker", other, [sys.executable, "-m", "tf_nestpipe.server"]),
             ("ps", cluster, [sys.executable, "-m", "tf_nestpipe.server"])]
    start = time.time()
    processes = [subprocess.Popen(  # forked (tests/forkserver.py): the time is the check's
        through_forkserver(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, TF_CONFIG=json.dumps({"cluster": c, "task": {"type": role,
                                                                          "index": 0}}),
                 TF_NESTPIPE_STARTUP_TIMEOUT="20")) for role, c, argv in tasks]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    took = time.time() - start
    expected = "cluster.ps[0]: chief:0 (the leader) has '%s', worker:0 has '%s'" % (
        cluster["ps"][0], other["ps"][0])
    for process, output in zip(processes, outputs):
        assert process.returncode != 0, output[-3000:]
        assert "ClusterMismatchError" in output and expected in output, output[-3000:]
        assert "started" not in output
    # As 3 fresh processes (each importing TensorFlow) beside the suite's runs it took 11 s in
    # one fresh-clone suite and 43 s in the next; forked, the time is the check's.
    assert took < 40, took


def test_ps_mode_server_reporting_while_serving_exits_only_on_the_chiefs_verdict():
    """`report_while_serving`: a chief that leads no check (nobody at its address, or TF's own
    ParameterServerStrategy) leaves the server serving; the leader's "wrong cluster" verdict
    calls on_mismatch with the field."""
    cluster = _ps_cluster()
    verdicts = []
    thread = cluster_check.report_while_serving(cluster, "ps", 0, verdicts.append, timeout=1)
    thread.join(10)
    assert not thread.is_alive() and verdicts == []  # no leader: no verdict, keeps serving
    other = dict(cluster, worker=["127.0.0.1:1"])
    thread = cluster_check.report_while_serving(other, "ps", 0, verdicts.append, timeout=5)
    results = _run_ps_tasks([(cluster, "worker", 0), (cluster, "chief", 0)])
    thread.join(10)
    assert len(verdicts) == 1 and "cluster.worker[0]" in verdicts[0], verdicts
    assert all("cluster.worker[0]" in message for message, _ in results), results


def _strangers(address, count=73):
    """Connections a stranger holds open on the leader's port: silent ones, random bytes, and
    an unsigned report claiming another cluster. Returns them."""
    import socket  # pylint: disable=import-outside-toplevel
    host, port = address.rsplit(":", 1)
    held = []
    deadline = time.time() + 5
    while len(held) < count and time.time() < deadline:
        try:
            held.append(socket.create_connection((host, int(port)), timeout=1))
        except OSError:
            time.sleep(0.02)  # the leader does not listen yet
    for sock in held[:5]:
        sock.sendall(os.urandom(512))
    forged = {"role": "worker", "index": 1, "cluster": {"worker": ["10.0.0.1:1", "10.0.0.2:1"]},
              "pid": 1, "fingerprint": "x"}
    held[5].sendall((json.dumps(forged) + "\n").encode())
    return held


def test_strangers_on_the_leaders_port_neither_delay_nor_fail_the_check(monkeypatch):
    monkeypatch.setenv("TF_NESTPIPE_TRANSPORT_SECRET", "the job's secret")
    cluster = _cluster(2)
    results = [None]
    started = time.time()

    def lead():
        try:
            agree_on_cluster(cluster, "worker", 0, timeout=20.0)
            results[0] = ("ok", time.time() - started)
        except ClusterMismatchError as error:
            results[0] = (str(error), time.time() - started)

    leader = threading.Thread(target=lead)
    leader.start()
    held = _strangers(cluster["worker"][0])
    agree_on_cluster(cluster, "worker", 1, timeout=20.0)  # the real worker 1, after them
    leader.join(30)
    for sock in held:
        sock.close()
    assert results[0][0] == "ok" and results[0][1] < 5, results[0]


def test_a_report_without_the_jobs_secret_is_refused_with_the_fix(monkeypatch):
    # Positive control of the signature check: the same report, unsigned, does not count.
    cluster = _cluster(2)
    monkeypatch.setenv("TF_NESTPIPE_TRANSPORT_SECRET", "the job's secret")
    leader = threading.Thread(target=lambda: pytest.raises(
        ClusterMismatchError, agree_on_cluster, cluster, "worker", 0, timeout=3.0))
    leader.start()
    time.sleep(0.3)
    monkeypatch.setattr(cluster_check, "_job_secret", lambda: None)
    with pytest.raises(ClusterMismatchError, match="not signed with the job's secret"):
        agree_on_cluster(cluster, "worker", 1, timeout=3.0)
    leader.join(15)
