"""Which cores the launcher pins each task to (tf_nestpipe.launch.cpu_pinning): whole physical
cores read from sysfs, disjoint blocks per task, the wrap-around when tasks outnumber cores, and
the refusals. The launcher applying it is tested in test_launcher.py."""
import os

import pytest

from tf_nestpipe.launch.cpu_pinning import describe, physical_cores, task_cpu_sets


def fake_sysfs(tmp_path, topology):
    """A sysfs cpu tree: {cpu: (package, core id)}."""
    for cpu, (package, core) in topology.items():
        folder = tmp_path / ("cpu%d" % cpu) / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text("%d\n" % package)
        (folder / "core_id").write_text("%d\n" % core)
    return str(tmp_path)


def test_hyperthread_siblings_stay_on_one_core(tmp_path):
    # Linux numbers the second thread of each core after all first threads: 0/2 and 1/3 share.
    sysfs = fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    assert physical_cores([0, 1, 2, 3], sysfs) == [[0, 2], [1, 3]]
    # Two tasks get a whole core each, never two siblings of one core.
    assert task_cpu_sets(2, physical_cores([0, 1, 2, 3], sysfs)) == [{0, 2}, {1, 3}]
    # Cores of two packages with the same core ids are different cores.
    sysfs = fake_sysfs(tmp_path / "two", {0: (0, 0), 1: (1, 0)})
    assert physical_cores([0, 1], sysfs) == [[0], [1]]


def test_an_unreadable_topology_pins_nothing(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: (0, 0)})
    assert physical_cores([0, 1], sysfs) is None  # cpu1 has no topology
    (tmp_path / "cpu0" / "topology" / "core_id").write_text("not a number")
    assert physical_cores([0], sysfs) is None


def test_equal_blocks_the_wrap_around_and_no_uneven_pinning():
    cores = [[c] for c in range(8)]
    assert task_cpu_sets(2, cores) == [set(range(4)), set(range(4, 8))]
    assert task_cpu_sets(8, cores) == [{c} for c in range(8)]
    # More tasks than cores, a multiple: task k on core k mod the number of cores.
    assert task_cpu_sets(4, [[0], [1]]) == [{0}, {1}, {0}, {1}]
    # Uneven shares stay unpinned: 3 tasks on 8 cores (3 + 3 + 2), 3 or 5 tasks on 2 cores (a
    # synchronous step would wait for the tasks that got less).
    assert task_cpu_sets(3, cores) is None
    assert task_cpu_sets(3, [[0], [1]]) is None and task_cpu_sets(5, [[0], [1]]) is None


def test_refusals():
    with pytest.raises(ValueError, match="at least one task"):
        task_cpu_sets(0, [[0]])
    with pytest.raises(ValueError, match="no cores"):
        task_cpu_sets(2, [])


def test_describe():
    assert describe(frozenset({0, 1, 2, 3})) == "0-3"
    assert describe(frozenset({0, 2})) == "0,2"
    assert describe(frozenset({0, 1, 3, 4, 5, 8})) == "0-1,3-5,8"
    assert describe(frozenset({7})) == "7"


@pytest.mark.skipif(not os.path.isdir("/sys/devices/system/cpu/cpu0/topology"),
                    reason="no sysfs cpu topology here")
def test_this_hosts_topology_covers_its_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    cores = physical_cores(cpus)
    assert cores is not None and sorted(c for core in cores for c in core) == cpus
