"""The coordination service a multi-worker NestPipe cluster starts, with a heartbeat timeout that
survives a stalled machine.

`MultiWorkerMirroredStrategy` starts TensorFlow's coordination service with its defaults: a task
that sends no heartbeat for 10 s is declared dead and every pending collective in the cluster is
aborted, so a machine that stalls for longer (a loaded host) loses a healthy run. NestPipe
configures the service itself, exactly as the strategy would (the same leader and jobs), with a
longer timeout: `TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS` (default 30). A worker that really stops
answering is still named by the service's verdict, after that long (tests/test_dead_peer.py).
"""
from tf_nestpipe.tf_private import eager_context as context
from tf_nestpipe.tf_private import framework_ops as ops
from tf_nestpipe.tf_private import multi_worker_util

from tf_nestpipe import settings

# The protobuf module `context.configure_coordination_service` builds its config from.
coordination_config_pb2 = context.coordination_config_pb2

DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = settings.HEARTBEAT_TIMEOUT_SECONDS.default
# The tasks TensorFlow's strategy coordinates (its _initialize_multi_worker).
_COORDINATED_JOBS = ("chief", "worker")


def heartbeat_timeout_from_env(default=DEFAULT_HEARTBEAT_TIMEOUT_SECONDS):
    """The seconds `TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS` sets.

    Args:
        default: The timeout when the variable is unset or empty.

    Returns:
        Seconds, >= 1.

    Raises:
        tf_nestpipe.settings.SettingError: The variable is not a number >= 1.
    """
    return settings.HEARTBEAT_TIMEOUT_SECONDS.value(default=float(default))


def configure_coordination_service(cluster_resolver, heartbeat_timeout_seconds=None):
    """Start-up configuration of the coordination service for this worker of
    `cluster_resolver`'s cluster (the leader and jobs TensorFlow's strategy would pick) with the
    heartbeat timeout `heartbeat_timeout_seconds` (None: from the environment). Returns whether
    it configured anything: nothing for a single worker, a task outside the coordinated jobs,
    graph mode or a service already configured (by the user or an earlier strategy)."""
    if heartbeat_timeout_seconds is None:
        heartbeat_timeout_seconds = heartbeat_timeout_from_env()
    cluster_spec = multi_worker_util.normalize_cluster_spec(cluster_resolver.cluster_spec())
    task_type = cluster_resolver.task_type
    if (not cluster_spec.jobs or task_type not in _COORDINATED_JOBS
            or not ops.executing_eagerly_outside_functions()
            or context.context().coordination_service is not None):
        return False
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in _COORDINATED_JOBS if job in cluster_spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        coordinated_jobs=jobs,
        heartbeat_timeout_in_ms=int(round(heartbeat_timeout_seconds * 1000)))
    return True


def configured_heartbeat_timeout_seconds():
    """The heartbeat timeout (seconds) of the coordination service this process configured, or
    None when none is configured (or it leaves TensorFlow's default)."""
    config = context.context().coordination_service
    if config is None or not config.heartbeat_timeout_in_ms:
        return None
    return config.heartbeat_timeout_in_ms / 1000.0
