"""`tnp.ParameterServerStrategy`: TensorFlow's parameter-server training (a chief coordinates,
workers run scheduled functions, variables live on ps tasks) with tf_nestpipe's tables, custom
ops and DOWNPOUR update windows."""
import tensorflow as tf
from tf_nestpipe.tf_private import tfconfig_cluster_resolver

from tf_nestpipe.launch import allocator, cluster_check
from tf_nestpipe.tf_config import parse_tf_config
from tf_nestpipe.strategy import coordinator_errors
from tf_nestpipe.strategy.downpour import local_optimizer_from
from tf_nestpipe.ops import load_op_library
from tf_nestpipe import tf_private

_checked_ps_clusters = set()


def check_ps_cluster_once(config):
    """The chief's side of parameter-server mode's start-up check (once per process): every
    worker and ps task (`python -m tf_nestpipe.server`) reports its `TF_CONFIG` cluster before
    it serves; a disagreement, a duplicate or a task that never reports fails every task within
    the start-up timeout, naming the field or address (`tf_nestpipe.launch.cluster_check`)."""
    key = (cluster_check.fingerprint(config.cluster), config.task_type, config.task_index)
    if key in _checked_ps_clusters:
        return
    cluster_check.agree_on_cluster(config.cluster, config.task_type, config.task_index,
                                   roles=cluster_check.PS_MODE_ROLES)
    _checked_ps_clusters.add(key)


class ParameterServerStrategy(tf.distribute.ParameterServerStrategy):
    """A `tf.distribute.ParameterServerStrategy` over the chief, workers and ps tasks of
    `TF_CONFIG` (`python -m tf_nestpipe.launch --workers N --ps K --chief -- python script.py`
    starts one; worker and ps tasks run `python -m tf_nestpipe.server`, which loads our ops).

    `variable_partitioner` shards variables over the ps tasks (see
    `tf_nestpipe.sharding.partitioners`; a partitioner that takes its size from the number of ps
    tasks is bound here). `update_window=T` and `local_optimizer` ("sgd", "adagrad",
    `tnp.LocalSGD(lr)`, `tnp.LocalAdagrad(lr)`) configure DOWNPOUR training with
    `tnp.DownpourTrainer`: T local steps per worker between a pull and a push of the summed
    gradient; T=1 pushes every step (Hogwild-style). tf_keras `fit` runs one window per step
    (see `downpour_fit`).

    `malloc_top_pad_bytes` (default 64 MiB; 0: leave the allocator alone): the freed memory each
    glibc malloc arena of the chief keeps instead of returning it to the kernel, as in
    `tnp.NestPipeStrategy` (`tf_nestpipe.launch.allocator`; `malloc_top_pad` says what was
    done). The worker and ps tasks do the same in `python -m tf_nestpipe.server`.

    Args:
        cluster_resolver: Default: from `TF_CONFIG` (after the start-up cluster check).
        variable_partitioner: Shards variables over the ps tasks (e.g.
            `tnp.MinSizePartitioner()`).
        update_window: DOWNPOUR's T (1: push every step).
        local_optimizer: DOWNPOUR's local optimizer: "sgd", "adagrad", `tnp.LocalSGD(lr)` or
            `tnp.LocalAdagrad(lr)`.
        malloc_top_pad_bytes: As `tnp.NestPipeStrategy`'s.

    Raises:
        ValueError: A bad `update_window` or `local_optimizer`.
        tf_nestpipe.TFConfigError: A malformed `TF_CONFIG`.
        tf_nestpipe.launch.cluster_check.ClusterMismatchError: The tasks disagree about the
            cluster, or one never starts.
    """

    def __init__(self, cluster_resolver=None, variable_partitioner=None, update_window=1,
                 local_optimizer=None, malloc_top_pad_bytes=allocator.DEFAULT_TOP_PAD_BYTES):
        allocator.check_top_pad(malloc_top_pad_bytes)
        if int(update_window) < 1:
            raise ValueError("update_window must be >= 1, got %r" % (update_window,))
        local_optimizer_from(local_optimizer)  # validates it
        self.malloc_top_pad = allocator.keep_freed_memory(malloc_top_pad_bytes)
        load_op_library()
        if cluster_resolver is None:
            config = parse_tf_config()  # raises a clear TFConfigError for a malformed TF_CONFIG
            if config is None or not config.cluster.get("ps"):
                raise ValueError(
                    "tnp.ParameterServerStrategy needs a TF_CONFIG cluster with ps tasks (and a "
                    "chief running this script); start one with `python -m tf_nestpipe.launch "
                    "--workers N --ps K --chief -- python script.py`")
            check_ps_cluster_once(config)
            cluster_resolver = tfconfig_cluster_resolver.TFConfigClusterResolver()
        self._nestpipe_ps_addresses = list(cluster_resolver.cluster_spec().as_dict().get("ps", []))
        num_ps = len(self._nestpipe_ps_addresses)
        if hasattr(variable_partitioner, "bind"):
            variable_partitioner.bind(num_ps)
        super().__init__(cluster_resolver, variable_partitioner=variable_partitioner)
        self.update_window = int(update_window)
        self.local_optimizer = local_optimizer
        coordinator_errors.install()  # a ps failure under a plain ClusterCoordinator explained

    @property
    def variable_partitioner(self):
        """The partitioner variables created in the scope are sharded with (or None)."""
        return tf_private.variable_partitioner(self.extended)

    @property
    def ps_addresses(self):
        """The ps tasks' addresses, in task order (from the cluster this strategy was built on)."""
        return list(self._nestpipe_ps_addresses)

    @property
    def num_ps(self):
        """Number of parameter-server tasks."""
        return tf_private.num_ps(self.extended)

    @property
    def num_workers(self):
        """Number of worker tasks."""
        return tf_private.num_workers(self.extended)
