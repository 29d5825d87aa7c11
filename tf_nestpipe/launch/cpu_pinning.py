"""Which cores each task of a local cluster runs on: the host's physical cores split among the
tasks the launcher starts, each task pinned to its own (CPU affinity, inherited by every thread
the task starts).

Unpinned, the kernel moves the co-located workers' threads between the cores, so one worker's
step is preempted by the other's, and by the other's socket threads, at random. Measured on the
2-core testbed (natural-code DLRM cell, 2 workers, one thread per pool each, `bench/compare_worker.py
--steps 80 --warmup 40`, worker 0, three runs of `none` each way): median 4.3-5.8 ms/step pinned
against 5.4-8.1 unpinned, p90 4.8-7.9 against 7.4-11.2; 4 workers (2 per core) 9.9-13.5 against
13.2-15.3. Like the thread split (`threads.py`), whose sizes it matches, it applies only where
the launcher splits this machine's cores itself, and not in parameter-server mode (its ps and
chief tasks mostly wait, and the coordinator's scheduling was not measured pinned).

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


def task_cpu_sets(num_tasks: int, cores: Sequence[Sequence[int]]) -> List[FrozenSet[int]]:
    """The CPUs each of `num_tasks` tasks is pinned to, given the host's physical `cores` (lists
    of sibling CPUs): with at least as many cores as tasks a disjoint block of whole cores each
    (the first `len(cores) % num_tasks` tasks one core more), else task k on core k mod the
    number of cores."""
    if num_tasks < 1:
        raise ValueError("a cluster has at least one task, got %d" % num_tasks)
    if not cores:
        raise ValueError("no cores to pin %d tasks to" % num_tasks)
    if num_tasks > len(cores):
        return [frozenset(cores[k % len(cores)]) for k in range(num_tasks)]
    share, extra = divmod(len(cores), num_tasks)
    sets, start = [], 0
    for k in range(num_tasks):
        size = share + (1 if k < extra else 0)
        sets.append(frozenset(cpu for core in cores[start:start + size] for cpu in core))
        start += size
    return sets


def host_task_cpu_sets(num_tasks: int, sysfs: str = SYSFS_CPUS) -> Optional[List[FrozenSet[int]]]:
    """`task_cpu_sets` over this host's physical cores (those this process may run on); None
    where they cannot be known (no affinity support, unreadable topology)."""
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
