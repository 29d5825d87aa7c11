"""The local launcher: TF_CONFIG per task, prefixed output, fail-fast teardown, no orphans."""
import json
import os
import sys
import textwrap
import time

import pytest

from conftest import run_command
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
    json.dumps(cluster)
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
