"""Which cores each task of a local cluster runs on: the host's physical cores split among the
tasks the launcher starts, each task pinned to its own (CPU affinity, inherited by every thread
the task starts).

Unpinned, the kernel moves the co-located workers' threads between the cores, so one worker's
step is preempted by the other's, and by the other's socket threads, at random: pinned steps
are faster and steadier (`bench/compare_worker.py` times both). Tasks are pinned only where every task gets the same
share (the tasks divide the cores, or the cores the tasks): a synchronous step waits for its
slowest worker, so 3 workers on 2 cores, two of them sharing a core, would run at the pace of
half a core where the kernel gives each two thirds. Like the thread split (`threads.py`; a
pinned task's pools get one thread per CPU it has), it applies only where the launcher splits
this machine's cores itself, and not in parameter-server mode (its ps and chief tasks mostly
wait, and the coordinator's scheduling is not known to gain from pinning).

Cores are whole physical cores (hyperthread siblings stay together, read from sysfs), so two
tasks never share one through its siblings; where the topology cannot be read nothing is pinned.
"""
import os
from typing import Dict, FrozenSet, List, Optional, Sequence

SYSFS_CPUS = "/sys/devices/system/cpu"


def allowed_cpus() -> List[int]:
    """The logical CPUs this process may run on, sorted (empty where affinity is unsupported)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def physical_cores(cpus: Sequence[int], sysfs: str = SYSFS_CPUS) -> Optional[List[List[int]]]:
    """`cpus` grouped by physical core (package, core id), each group's CPUs sorted, the groups
    in order of their first CPU; None if a CPU's topology cannot be read."""
    cores: Dict[tuple, List[int]] = {}
    for cpu in cpus:
        topology = os.path.join(sysfs, "cpu%d" % cpu, "topology")
        try:
            with open(os.path.join(topology, "physical_package_id")) as f:
                package = int(f.read())
            with open(os.path.join(topology, "core_id")) as f:
                core = int(f.read())
        except (OSError, ValueError):
            return None
        cores.setdefault((package, core), []).append(cpu)
    return sorted((sorted(group) for group in cores.values()), key=lambda group: group[0])


def task_cpu_sets(num_tasks: int,
                  cores: Sequence[Sequence[int]]) -> Optional[List[FrozenSet[int]]]:
    """The CPUs each of `num_tasks` tasks is pinned to, given the host's physical `cores` (lists
    of sibling CPUs), where every task gets the same share: the tasks divide the cores (a
    disjoint block of whole cores each) or the cores divide the tasks (task k on core k mod the
    number of cores). None otherwise: the tasks stay unpinned."""
    if num_tasks < 1:
        raise ValueError("a cluster has at least one task, got %d" % num_tasks)
    if not cores:
        raise ValueError("no cores to pin %d tasks to" % num_tasks)
    if num_tasks > len(cores):
        if num_tasks % len(cores):
            return None
        return [frozenset(cores[k % len(cores)]) for k in range(num_tasks)]
    if len(cores) % num_tasks:
        return None
    share = len(cores) // num_tasks
    return [frozenset(cpu for core in cores[k * share:(k + 1) * share] for cpu in core)
            for k in range(num_tasks)]


def host_task_cpu_sets(num_tasks: int, sysfs: str = SYSFS_CPUS) -> Optional[List[FrozenSet[int]]]:
    """`task_cpu_sets` over this host's physical cores (those this process may run on); None
    where they cannot be known (no affinity support, unreadable topology) or would be uneven."""
    cpus = allowed_cpus()
    cores = physical_cores(cpus, sysfs) if cpus else None
    if not cores:
        return None
    return task_cpu_sets(num_tasks, cores)


def pin_this_process(cpus: FrozenSet[int]):
    """Pins the calling process (and the threads it starts afterwards) to `cpus`."""
    os.sched_setaffinity(0, cpus)


def describe(cpus: FrozenSet[int]) -> str:
    """`cpus` as a short list of runs, e.g. "0-3" or "0,2"."""
    ordered = sorted(cpus)
    runs = []
    start = previous = ordered[0]
    for cpu in ordered[1:]:
        if cpu != previous + 1:
            runs.append((start, previous))
            start = cpu
        previous = cpu
    runs.append((start, previous))
    return ",".join(str(a) if a == b else "%d-%d" % (a, b) for a, b in runs)
