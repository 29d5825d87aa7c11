"""The local launcher: TF_CONFIG per task, prefixed output, fail-fast teardown, no orphans."""
import json
import os
import re
import sys
import textwrap
import time
import types

import pytest

from conftest import run_command, through_forkserver
from tf_nestpipe.launch.__main__ import main as launch_main
from tf_nestpipe.launch.local_cluster import LocalCluster, make_cluster


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def launcher(*args, timeout=60):
    return run_command([sys.executable, "-m", "tf_nestpipe.launch"] + list(args), timeout=timeout)


def test_each_task_gets_its_own_tf_config_and_prefix(tmp_path):
    script = write(tmp_path, "echo.py", """
        import json, os, sys
        c = json.loads(os.environ["TF_CONFIG"])
        print("task", c["task"]["type"], c["task"]["index"], len(c["cluster"]["worker"]), sys.argv[1:])
    """)
    result = launcher("--workers", "3", "--", sys.executable, script, "a", "b")
    assert result.returncode == 0, result.stdout
    for i in range(3):
        assert "[worker:%d] task worker %d 3 ['a', 'b']" % (i, i) in result.stdout


def test_cluster_spec_and_task_prefix(tmp_path):
    script = write(tmp_path, "where.py", """
        import json, os
        c = json.loads(os.environ["TF_CONFIG"])
        print("at", c["cluster"]["worker"][c["task"]["index"]], "mark", os.environ["MARK"])
    """)
    spec = json.dumps({"worker": ["10.1.2.3:4000", "10.1.2.4:4001"]})
    result = launcher("--workers", "2", "--cluster-spec", spec,
                      "--task-prefix", "env MARK={role}{index}", "--", sys.executable, script)
    assert result.returncode == 0, result.stdout
    assert "[worker:0] at 10.1.2.3:4000 mark worker0" in result.stdout
    assert "[worker:1] at 10.1.2.4:4001 mark worker1" in result.stdout


@pytest.mark.parametrize("bad,message", [("{not json", "not valid JSON"),
                                         ('{"worker": "a:1"}', "lists of"),
                                         ('{"ps": ["a:1"]}', "needs a 'worker' or 'chief'")])
def test_bad_cluster_spec_is_refused(bad, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch_main(["--cluster-spec", bad, "--", "true"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,message", [
    (dict(horovod=True, num_ps=1), "cannot be combined with --ps"),
    (dict(horovod=True, task_prefix="ip netns exec ns_{role}{index}"), "needs --horovod-address"),
    (dict(horovod=True, cluster={"worker": ["10.0.0.1:1", "10.0.0.2:1"]},
          horovod_address="10.0.0.9"), "--horovod-interface"),
    (dict(horovod_address="10.0.0.9", horovod_interface="eth0"), "need --horovod"),
])
def test_bad_horovod_flags_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalCluster(["true"], 2, **kwargs)


def test_failure_tears_down_the_cluster_fast_and_leaves_no_orphans(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = write(tmp_path, "fail.py", """
        import json, os, sys, time
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
        if index == 1:
            time.sleep(1)
            print("worker 1 gives up", flush=True)
            sys.exit(3)
        time.sleep(120)
    """)
    start = time.time()
    result = launcher("--workers", "3", "--", sys.executable, script, str(pid_dir))
    assert result.returncode != 0
    assert time.time() - start < 30
    assert "[worker:1] worker 1 gives up" in result.stdout
    assert "task worker:1 failed (3)" in result.stdout
    pids = [int(p) for p in os.listdir(pid_dir)]
    assert len(pids) == 3
    time.sleep(0.5)
    for pid in pids:
        assert not os.path.exists("/proc/%d" % pid) or _is_zombie(pid), "orphan %d" % pid


class _Exited:
    """A finished (or, with None, running) process, as `LocalCluster` polls it."""

    def __init__(self, returncode):
        self.returncode = returncode

    def poll(self):
        return self.returncode


def test_a_task_killed_by_a_signal_is_reported_before_peers_that_failed_after_it():
    """Worker 1 killed (-9) and worker 0 exiting 1 on the broken connection, both found in one
    poll: the launcher names worker 1 (it polled worker 0 first and blamed it)."""
    cluster = LocalCluster(["true"], 2)

    def first_failure(codes):
        cluster.tasks = [types.SimpleNamespace(role="worker:%d" % i, process=_Exited(code),
                                               runs_command=True)
                         for i, code in enumerate(codes)]
        return cluster._first_failure(cluster.tasks[0]).role  # pylint: disable=protected-access

    assert first_failure([1, -9]) == "worker:1"
    assert first_failure([1, None]) == "worker:0"  # the controls: the peer still runs,
    assert first_failure([1, 3]) == "worker:0"  # or failed on its own,
    assert first_failure([-15, -9]) == "worker:0"  # or both were killed: polling order


def _is_zombie(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True


def test_timeout_fails(tmp_path):
    script = write(tmp_path, "slow.py", "import time\ntime.sleep(60)\n")
    result = launcher("--workers", "1", "--timeout", "2", "--", sys.executable, script)
    assert result.returncode != 0 and "timeout" in result.stdout


def test_missing_command_is_an_error():
    result = launcher("--workers", "2")
    assert result.returncode != 0 and "no command" in result.stdout


def test_make_cluster_roles_and_free_ports():
    cluster = make_cluster(2, num_ps=1, chief=True)
    assert sorted(cluster) == ["chief", "ps", "worker"] and len(cluster["worker"]) == 2
    ports = [a.split(":")[1] for role in cluster.values() for a in role]
    assert len(set(ports)) == 4
    assert all(a.startswith("127.0.0.1:") for role in cluster.values() for a in role)
    assert json.loads(json.dumps(cluster)) == cluster  # what every task's TF_CONFIG carries
    with pytest.raises(ValueError):
        make_cluster(0)


def test_parameter_server_mode_runs_servers_and_the_command_on_the_chief(tmp_path):
    script = write(tmp_path, "chief.py", """
        import json, os, socket, time
        c = json.loads(os.environ["TF_CONFIG"])
        # wait until every server task accepts connections, then finish
        for address in c["cluster"]["worker"] + c["cluster"]["ps"]:
            host, port = address.rsplit(":", 1)
            for _ in range(300):
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                raise SystemExit("server %s never came up" % address)
        print("chief saw", sorted(c["cluster"]), c["task"])
    """)
    result = launcher("--workers", "1", "--ps", "1", "--chief", "--", sys.executable, script,
                      timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[chief:0] chief saw ['chief', 'ps', 'worker'] {'type': 'chief', 'index': 0}" in result.stdout
    assert "[ps:0] tf_nestpipe.server: ps:0 serving at" in result.stdout
    assert "[worker:0] tf_nestpipe.server: worker:0 serving at" in result.stdout
    # The launcher's MALLOC_TOP_PAD_ reaches the serving tasks (tf_nestpipe.launch.allocator).
    assert "(malloc top pad: user_set)" in result.stdout


TERM_AWARE = """
    import json, os, signal, sys, time
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    mode = sys.argv[2]
    def on_term(signum, frame):
        open(os.path.join(sys.argv[1], "term-%d" % index), "w").close()
        time.sleep(0.5 * index)  # worker 1 "saves" longer: worker 0's exit must not kill it
        open(os.path.join(sys.argv[1], "saved-%d" % index), "w").close()
        sys.exit(42)
    if mode == "save":
        signal.signal(signal.SIGTERM, on_term)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("worker %d ready" % index, flush=True)
    time.sleep(120)
"""


def _launch_then_sigterm(tmp_path, mode, grace):
    import signal
    import subprocess

    script = write(tmp_path, "term.py", TERM_AWARE)
    out = tmp_path / mode
    out.mkdir()
    env = dict(os.environ, TF_NESTPIPE_LAUNCH_OUTPUT="all")
    process = subprocess.Popen(through_forkserver(
        [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", "--restarts", "1",
         "--grace-period", str(grace), "--log-dir", str(tmp_path / ("logs-" + mode)), "--",
         sys.executable, script, str(out), mode]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    while sum("ready" in line for line in lines) < 2:
        line = process.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
    start = time.time()
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=60)
    return process.returncode, "".join(lines) + rest, time.time() - start, out


def test_sigterm_is_forwarded_and_the_tasks_exit_code_returned(tmp_path):
    code, log, took, out = _launch_then_sigterm(tmp_path, "save", grace=20)
    # Both tasks handled the SIGTERM to the end (worker 1 after worker 0 had exited), the launcher
    # returned their code and did not restart the cluster.
    assert sorted(os.listdir(out)) == ["saved-0", "saved-1", "term-0", "term-1"], log
    assert code == 42, log
    assert "restarting" not in log and took < 10, log
    assert "[launch] worker:1: exit 42 after" in log and "stopped on signal 15; exit 42" in log


def test_tasks_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path):
    code, log, took, _ = _launch_then_sigterm(tmp_path, "ignore", grace=1)
    assert code == 143, log
    assert 1 <= took < 10, log
    assert "still running 1 s after SIGTERM; killing them" in log
    assert "[launch] worker:0: killed by the launcher after" in log


def test_quiet_by_default_other_tasks_log_to_files_and_a_summary_ends_the_run(tmp_path):
    script = write(tmp_path, "talk.py", """
        import json, os, sys
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        print("hello from", index, "level", os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
        sys.exit(int(sys.argv[1]) if index == 1 else 0)
    """)
    logs = tmp_path / "logs"
    env = {"TF_NESTPIPE_LAUNCH_OUTPUT": ""}
    ok = run_command([sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", "--log-dir",
                      str(logs), "--", sys.executable, script, "0"], timeout=60, env=env)
    assert ok.returncode == 0, ok.stdout
    assert "[worker:0] hello from 0 level 2" in ok.stdout
    assert "hello from 1" not in ok.stdout  # worker 1's output is only in its file
    assert "hello from 1 level 2" in (logs / "worker-1.log").read_text()
    summary = [l for l in ok.stdout.splitlines() if l.startswith("[launch] worker:")]
    assert len(summary) == 2 and all(" exit 0 after " in l for l in summary), ok.stdout
    assert str(logs / "worker-1.log") in summary[1]
    # The user's own log level wins; a failed hidden task's last lines are shown.
    failed = run_command([sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2",
                          "--log-dir", str(logs), "--", sys.executable, script, "3"],
                         timeout=60, env=dict(env, TF_CPP_MIN_LOG_LEVEL="0"))
    assert failed.returncode == 1
    assert "[worker:1] hello from 1 level 0" in failed.stdout  # the tail of its log
    assert "[launch] worker:1: exit 3 after" in failed.stdout
    # --output all shows every task's lines.
    every = run_command([sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2",
                         "--output", "all", "--", sys.executable, script, "0"], timeout=60,
                        env=env)
    assert "[worker:1] hello from 1" in every.stdout, every.stdout


def test_help_does_not_import_tensorflow():
    from tf_nestpipe import _started_as_launcher

    result = run_command([sys.executable, "-X", "importtime", "-m", "tf_nestpipe.launch",
                          "--help"], timeout=60)
    assert result.returncode == 0 and "--grace-period" in result.stdout
    imported = [l for l in result.stdout.splitlines() if "import time:" in l]
    assert any("tf_nestpipe.launch.local_cluster" in l for l in imported)  # the log is complete
    assert not any("tensorflow" in l for l in imported), [l for l in imported if "tensorflow" in l]
    # ... and the rule recognises only the launcher's entry points.
    assert _started_as_launcher(["python", "-u", "-m", "tf_nestpipe.launch", "--help"])
    assert not _started_as_launcher(["python", "-m", "tf_nestpipe.plan"])
    assert not _started_as_launcher(["python", "train.py", "-m", "x"])


@pytest.mark.cluster
def test_sigterm_to_the_launcher_makes_every_worker_save_its_preemption_checkpoint(tmp_path):
    """What Docker / Kubernetes do: SIGTERM to the launcher of a real 2-worker NestPipe job with
    a PreemptionCheckpointHandler: every worker saves the same step and exits 42, the launcher
    exits 42, and the next launch resumes from that step."""
    import signal
    import subprocess

    from conftest import REPO
    from tf_nestpipe.strategy.checkpoint import latest_step

    worker = os.path.join(REPO, "bench", "fault_worker.py")
    ckpt, final = str(tmp_path / "ckpt"), str(tmp_path / "final.npz")
    process = subprocess.Popen(through_forkserver(
        [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", "--output", "all", "--",
         sys.executable, worker, final, ckpt, "40", "--step-seconds", "0.3"]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "resumed at step 0" in line:
            break
    time.sleep(2.0)
    start = time.time()
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=60)
    log = "".join(lines) + rest
    assert process.returncode == 42, log[-3000:]
    assert time.time() - start < 15, log[-3000:]
    saved = [l for l in log.splitlines() if "tf_nestpipe: preempted; saved step" in l]
    assert len(saved) == 2 and saved[0].split("step")[-1] == saved[1].split("step")[-1], saved
    step = int(saved[0].split("saved step ")[1].split()[0])
    assert 0 < step < 40 and latest_step(ckpt) == step
    assert "stopped on signal 15; exit 42" in log
    resumed = run_command([sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", "--",
                           sys.executable, worker, final, ckpt, str(step + 2)], timeout=120)
    assert resumed.returncode == 0 and "resumed at step %d" % step in resumed.stdout, \
        resumed.stdout[-3000:]


def test_tensorflow_start_up_noise_stays_in_the_log_files(tmp_path):
    from tf_nestpipe.launch.local_cluster import is_startup_noise

    noise = ["WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
             "I0000 00:00:1796118273.616582   12175 port.cc:153] oneDNN custom operations are on. "
             "You may see slightly different numerical results",
             "I0000 00:00:1796118273.616885   12175 cudart_stub.cc:31] Could not find cuda drivers "
             "on your machine, GPU will not be used."]
    kept = ["E0000 00:00:1796118277.814994   12175 cuda_platform.cc:52] failed call to cuInit: "
            "INTERNAL: CUDA error", "epoch 1 loss 0.3 (oneDNN custom operations are on.)",
            "Could not find cuda drivers on your machine, GPU will not be used."]
    assert all(is_startup_noise(line) for line in noise)
    assert not any(is_startup_noise(line) for line in kept)  # errors and user lines are shown
    script = write(tmp_path, "noisy.py", "print(%r)\nprint('real output')\n" % noise[2])
    result = run_command([sys.executable, "-m", "tf_nestpipe.launch", "--workers", "1",
                          "--log-dir", str(tmp_path / "logs"), "--", sys.executable, script],
                         timeout=60)
    assert result.returncode == 0 and "[worker:0] real output" in result.stdout
    assert "cudart_stub" not in result.stdout
    assert "cudart_stub" in (tmp_path / "logs" / "worker-0.log").read_text()


def test_tasks_share_the_machines_cores_unless_the_user_sized_the_pools(tmp_path):
    """Each task's TensorFlow pools get the host's cores split among the tasks (at least 1); a
    variable the user set wins; --threads-per-task 0 leaves TensorFlow's own sizing."""
    from tf_nestpipe.launch.cpu_pinning import host_task_cpu_sets
    from tf_nestpipe.launch.threads import THREAD_VARIABLES, host_cores

    script = write(tmp_path, "threads.py", """
        import os
        print("threads", [os.environ.get(v, "-") for v in %r])
    """ % (THREAD_VARIABLES,))
    each = str(max(1, host_cores() // 3))
    pinned = host_task_cpu_sets(3)  # a pinned task's pools: one thread per CPU it has
    result = launcher("--workers", "3", "--output", "all", "--", sys.executable, script)
    assert result.returncode == 0, result.stdout
    third = str(len(pinned[2])) if pinned else each

    def sizes(threads):
        """Every pool `threads`, the inter-op pool at least 2 (one deadlocks a blocking
        kernel); the caller's own variables win."""
        own = {"TF_NUM_INTEROP_THREADS": str(max(2, int(threads)))}
        return [os.environ.get(v, own.get(v, threads)) for v in THREAD_VARIABLES]

    assert "[worker:2] threads %r" % sizes(third) in result.stdout
    result = launcher("--workers", "3", "--output", "all", "--no-pin-cpus", "--",
                      sys.executable, script)
    assert "[worker:2] threads %r" % sizes(each) in result.stdout  # unpinned: the equal split
    result = launcher("--workers", "1", "--ps", "1", "--chief", "--", sys.executable, script)
    assert result.returncode == 0, result.stdout
    expected = sizes(each)
    assert "[chief:0] threads %r" % expected in result.stdout, result.stdout
    result = launcher("--workers", "2", "--env", "TF_NUM_INTEROP_THREADS=7", "--threads-per-task",
                      "5", "--", sys.executable, script)
    assert "[worker:0] threads %r" % ["5", "7", "5"] in result.stdout, result.stdout
    result = launcher("--workers", "2", "--threads-per-task", "0", "--", sys.executable, script)
    expected = [os.environ.get(v, "-") for v in THREAD_VARIABLES]
    assert "[worker:0] threads %r" % expected in result.stdout, result.stdout


AFFINITY = """
    import os
    print("cpus", sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning needs CPU affinity and at least 2 CPUs")
def test_tasks_are_pinned_to_their_own_cores_where_the_launcher_splits_them(tmp_path):
    """Each task runs on its own cores (the summary names them); --no-pin-cpus, a user-sized
    pool (--threads-per-task) and parameter-server mode leave every task free."""
    from tf_nestpipe.launch.cpu_pinning import host_task_cpu_sets

    sets = host_task_cpu_sets(2)
    if sets is None:
        pytest.skip("this host's core topology cannot be read")
    everywhere = sorted(os.sched_getaffinity(0))
    script = write(tmp_path, "cpus.py", AFFINITY)
    result = launcher("--workers", "2", "--output", "all", "--", sys.executable, script)
    assert result.returncode == 0, result.stdout
    for k in range(2):
        assert "[worker:%d] cpus %r" % (k, sorted(sets[k])) in result.stdout, result.stdout
    assert not sets[0] & sets[1]  # disjoint cores
    assert re.search(r"\[launch\] worker:1: exit 0 after [\d.]+ s, cpus [\d,-]+, log ",
                     result.stdout), result.stdout
    for flags in (["--workers", "2", "--no-pin-cpus"],
                  ["--workers", "2", "--threads-per-task", "1"],
                  ["--workers", "1", "--ps", "1", "--chief"]):
        result = launcher(*flags, "--output", "all", "--", sys.executable, script)
        assert result.returncode == 0, result.stdout
        runs = "chief:0" if "--chief" in flags else "worker:1"
        assert "[%s] cpus %r" % (runs, everywhere) in result.stdout, (flags, result.stdout)
        assert ", cpus " not in result.stdout, result.stdout


def test_threads_per_task_split_and_refusals():
    from tf_nestpipe.launch.threads import thread_env, threads_per_task

    assert threads_per_task(2, cores=2) == 1 and threads_per_task(3, cores=16) == 5
    assert threads_per_task(8, cores=2) == 1  # never 0
    assert thread_env(4, {"OMP_NUM_THREADS": "2"}) == {"TF_NUM_INTRAOP_THREADS": "4",
                                                      "TF_NUM_INTEROP_THREADS": "4"}
    # The inter-op pool never drops below 2 (a blocking kernel deadlocks a task with 1).
    assert thread_env(1, {}) == {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
                                 "OMP_NUM_THREADS": "1"}
    assert thread_env(1, {"TF_NUM_INTEROP_THREADS": "1"}) == {
        "TF_NUM_INTRAOP_THREADS": "1", "OMP_NUM_THREADS": "1"}  # the user's choice wins
    with pytest.raises(ValueError, match="at least one task"):
        threads_per_task(0)
    with pytest.raises(ValueError, match=">= 0"):
        LocalCluster(["true"], 2, threads_per_task=-1)
