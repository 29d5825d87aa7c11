"""How many CPU threads each task of a local cluster gets: the host's cores split among the tasks
the launcher starts on it.

Every TensorFlow process sizes its intra-op and inter-op thread pools to all the cores it sees,
so W co-located tasks run W times as many busy threads as there are cores, and their ops
preempt one another. Like `torchrun`, which sets `OMP_NUM_THREADS=1` when it starts several
processes per node, the launcher gives each task `cores // tasks` threads (at least 1) through
TensorFlow's environment variables. The inter-op pool keeps at least `MIN_INTEROP_THREADS`
(two) in every task: with a single inter-op thread, a kernel that blocks while it holds that
thread waits for work that can only run on it, and the task deadlocks. A `ClusterCoordinator`
cluster does (a DOWNPOUR program hangs), and so does a custom loop that calls `next()` on a
distributed iterator inside a `tf.function` (TensorFlow's ctl_correctness pattern; under
`MultiWorkerMirroredStrategy` as under NestPipe): it hangs at its first step with one
inter-op thread and completes with two. The second thread idles unless a blocking kernel
holds the first, so the pools of the intra-op work keep the equal split.
A variable the user set (in the launcher's environment or with `--env`) is never overridden.
Where the launcher also pins each task to its own cores (`cpu_pinning`), a task's pools get one
thread per CPU it is pinned to instead of this equal split.
"""
import os
from typing import Dict, Mapping, Optional

# The environment variables that size a task's thread pools: TensorFlow's intra-op (also the
# pool oneDNN's kernels run on) and inter-op pools, and OpenMP's for any library that uses it.
THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS")

# The fewest inter-op threads a task gets (a blocking kernel deadlocks a task that has one).
MIN_INTEROP_THREADS = 2


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_per_task(num_tasks: int, cores: Optional[int] = None) -> int:
    """Threads of each pool for each of `num_tasks` tasks sharing `cores` (default: this host's):
    an equal split, at least 1."""
    if num_tasks < 1:
        raise ValueError("a cluster has at least one task, got %d" % num_tasks)
    cores = host_cores() if cores is None else cores
    return max(1, cores // num_tasks)


def thread_env(threads: int, env: Mapping[str, str]) -> Dict[str, str]:
    """The thread variables to add to a task's environment `env` for `threads` threads per pool
    (the inter-op pool at least `MIN_INTEROP_THREADS`): those `env` does not set already (the
    user's choice wins); none for `threads` 0 (TensorFlow's own sizing).

    Args:
        threads: Threads per pool (0: leave TensorFlow's sizing).
        env: The task's environment so far.

    Returns:
        The variables to add.

    Raises:
        ValueError: `threads` is negative."""
    if threads < 0:
        raise ValueError("threads per task must be >= 0 (0: TensorFlow's default), got %d"
                         % threads)
    if threads == 0:
        return {}
    sizes = {"TF_NUM_INTRAOP_THREADS": threads,
             "TF_NUM_INTEROP_THREADS": max(MIN_INTEROP_THREADS, threads),
             "OMP_NUM_THREADS": threads}
    return {name: str(sizes[name]) for name in THREAD_VARIABLES if name not in env}
