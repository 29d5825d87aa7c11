"""`NestPipeStrategy`: synchronous hybrid-parallel training over the workers of a `TF_CONFIG` cluster.

Dense variables are mirrored and all-reduced exactly as in `MultiWorkerMirroredStrategy` (one
replica per worker). Each `tf_nestpipe.ShardedEmbedding` table is placed by the planner
(`placement="auto"` by default). A table placed `row_wise` (or `table_wise`) is a *row
shard*: a plain worker-local variable holding only the rows this worker owns; its optimizer
slots are worker-local too, and its gradient bypasses the dense all-reduce because the lookup's
backward all-to-all already delivered each owner the summed gradient of its rows. A table placed
`data_parallel` is a mirrored variable instead, its gradient made dense and all-reduced with the
dense ones.
"""
import contextlib
import dataclasses
import sys
import warnings

import tensorflow as tf
from tf_nestpipe import tf_private
from tf_nestpipe.tf_private import cluster_resolver_lib as _cluster_resolver_lib
from tf_nestpipe.tf_private import collective_all_reduce_strategy as _cars
from tf_nestpipe.tf_private import distribute_lib, distribute_utils
from tf_nestpipe.tf_private import distribute_values as _dist_values
from tf_nestpipe.tf_private import reduce_util as _reduce_util
from tf_nestpipe.tf_private import tfconfig_cluster_resolver
from tf_nestpipe.tf_private import trackable_base as _trackable_base

from tf_nestpipe.data.autoshard import check_auto_shard, equal_static_shares
from tf_nestpipe.launch import allocator, cluster_check
from tf_nestpipe.tf_config import check_synchronous_roles, parse_tf_config
from tf_nestpipe.ops import load_op_library
from tf_nestpipe.pipeline.config import as_pipeline_config
from tf_nestpipe.plan.placement import (Planner, TableSpec, collectives_from_linear, costs_source,
                                        default_collectives, linear_costs, render_plan)
from tf_nestpipe.sharding.dynamic_slots import fresh_slots_of
from tf_nestpipe.sharding.embedding import register_multi_worker_strategy
from tf_nestpipe.sharding.exchange import EmbeddingExchange
from tf_nestpipe.sharding.row_shard import (is_row_shard, replicated_table_name,
                                            row_shard_being_created, row_shard_layout)
from tf_nestpipe.strategy import equal_shares, exit_guard
from tf_nestpipe.strategy.coordination import configure_coordination_service
from tf_nestpipe.strategy.global_candidates import hook_tfrs
from tf_nestpipe.strategy.keras_checks import (check_keras3_variable, check_keras_environment,
                                               load_keras3_support_for_keras_rs)
from tf_nestpipe.strategy.summed_reads import SummedReads
from tf_nestpipe.strategy.row_shard_saving import make_checkpointable, restore_on_create_rows
from tf_nestpipe.collectives.communication import resolve_implementation
from tf_nestpipe.collectives.horovod_collectives import init_horovod
from tf_nestpipe.collectives.sockets import log_fallback
from tf_nestpipe.collectives.transport import (TransportConfig, TransportError,
                                               as_transport_config, create_transport)
from tf_nestpipe.collectives.wire import parse_wire_dtype
from tf_nestpipe import tf_private



# --- start-up checks -------------------------------------------------------------
_checked_clusters = set()


def check_cluster_at_startup(config, transport, timeout=None):
    """Before TensorFlow starts its server: refuses roles we do not run (e.g. evaluator) and
    checks with every other task that all were given the same cluster (once per process; see
    `tf_nestpipe.launch.cluster_check`). Under Horovod the comparison runs after `hvd.init()`
    instead (`check_horovod_cluster`)."""
    if config is None:
        return
    check_synchronous_roles(config)
    if not transport.engine_owns_cluster:
        _agree_once(config, timeout)


def check_horovod_cluster(config, timeout=None):
    """`collectives="horovod"` with a `TF_CONFIG`: once `hvd.init()` found Horovod's size and
    rank equal to it (`init_horovod`), the tasks compare their whole `TF_CONFIG` clusters with
    the same start-up check (under Horovod nothing else binds the leader's `TF_CONFIG`
    address), so a task given another cluster fails every task within the timeout, naming the
    field. A no-op without `TF_CONFIG` (`horovodrun`: the cluster is Horovod's alone)."""
    if config is not None:
        _agree_once(config, timeout)


def _agree_once(config, timeout):
    key = (cluster_check.fingerprint(config.cluster), config.task_type, config.task_index)
    if key in _checked_clusters:
        return  # a second strategy reuses the server
    cluster_check.agree_on_cluster(config.cluster, config.task_type, config.task_index,
                                   timeout=timeout)
    _checked_clusters.add(key)
# --- end of start-up checks ------------------------------------------------------------------


class NestPipeExtended(_cars.CollectiveAllReduceExtended):
    """The extended half of `NestPipeStrategy`: row-shard variables plus collective dense sync."""

    # Set by `tf_nestpipe.keras3` (its hooks): reduce a nested value leaf by leaf.
    reduce_structures_elementwise = False

    def __init__(self, container_strategy, cluster_resolver, communication_options,
                 transport=TransportConfig(), check_equal_shares=True):
        # Deleting a distributed iterator must not wait on an idle autotuning thread.
        tf_private.device_datasets_without_autotune()
        self._transport_config = transport = transport.resolved()
        self._nestpipe_check_shares = bool(check_equal_shares)
        self._nestpipe_share_size = None
        self._nestpipe_known_shares = None  # every share size, from the keys exchange
        self._nestpipe_known_check = None  # their check, where the step made it first
        # Packed metric-state reads within a step (metric_reads_within_step).
        self._summed_reads = SummedReads(self._sum_over_workers)
        if transport.engine_owns_cluster:
            # Horovod is the whole communication layer: TensorFlow runs as one local worker (no
            # gRPC server, no TF collectives) and the cluster is Horovod's (rank, size).
            hvd, rank, size = init_horovod()
            cluster_resolver = _cluster_resolver_lib.SimpleClusterResolver(
                tf.train.ClusterSpec({}), rpc_layer="grpc")
        super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        if transport.engine_owns_cluster:
            self._num_workers, self._id_in_cluster = size, rank
            self._is_chief = rank == 0
            self._task_type, self._task_id = "worker", rank
            self._nestpipe_collectives, _ = create_transport(
                transport, self._local_device_type, size, rank, self.worker_devices[0], None,
                hvd=hvd)
            self.embedding_exchange = EmbeddingExchange(self._nestpipe_collectives, size)
            if size > 1:
                exit_guard.install()
            return
        self._nestpipe_collectives, may_fall_back = create_transport(
            transport, self._local_device_type, self._num_workers, self._id_in_cluster,
            self.worker_devices[0],
            resolve_implementation(communication_options.implementation,
                                   self._local_device_type))
        self._nestpipe_collectives.worker_index = self._collective_rank()
        if self._num_workers > 1:
            self._open_transport(may_fall_back)
        if self._num_workers > 1:
            exit_guard.install()  # a worker dying of an uncaught error exits (peers wait on it)
        # The per-step exchange of every row-wise table (the pipelines install its fetchers).
        self.embedding_exchange = EmbeddingExchange(self._nestpipe_collectives, self._num_workers)

    # --- table placement -----------------------------------------------------------
    def set_placement(self, placement, memory_budget_bytes):
        """A new planner for the tables built from now on (checks `placement` at once)."""
        # Costed with the collectives of the transport in use (the socket mesh once open), as
        # worker 0 measured them (`_agreed_plan_costs`, gathered once).
        if getattr(self, "_nestpipe_plan_costs", None) is None:
            self._nestpipe_plan_costs = self._agreed_plan_costs()
        self._nestpipe_planner = Planner(placement, self._num_workers, memory_budget_bytes,
                                         collectives=self._nestpipe_plan_costs,
                                         transport=self._nestpipe_collectives.name,
                                         costs_source=self._nestpipe_costs_source)
        self._nestpipe_plan_reported = False
        self._nestpipe_announced = []  # tables constructed in the scope, not placed yet

    def _agreed_plan_costs(self):
        """The planner's collective costs, worker 0's on every worker (one all-gather at
        start-up): placement decides which variables each worker creates, so every worker must
        plan alike even where its calibration differs or is missing."""
        costs = default_collectives(self._nestpipe_collectives.name)
        # Worker 0 prints the plan, so its own source names the costs every worker uses.
        self._nestpipe_costs_source = costs_source(self._nestpipe_collectives.name)
        if self._num_workers <= 1:
            return costs
        mine = tf.constant([linear_costs(costs, self._num_workers)], tf.float64)
        gathered = self._nestpipe_collectives.all_gather(mine, "nestpipe/plan_costs").numpy()
        return collectives_from_linear(gathered[0], self._num_workers)

    @staticmethod
    def _table_spec(layer):
        return TableSpec(layer.name, layer.vocab_size, layer.dim,
                         tf.as_dtype(layer.dtype or tf.float32).size)

    def announce_table(self, layer):
        """Notes a `ShardedEmbedding` constructed in the scope: the tables of a model are
        usually all constructed before the first is built, and are then placed together."""
        self._nestpipe_announced.append(self._table_spec(layer))

    def placement_of(self, layer):
        """The placement of `layer`'s table ("data_parallel", "table_wise" or "row_wise"),
        decided by the
        planner (tf_nestpipe.plan.placement) when the table is built, together with every table
        constructed but not yet placed."""
        spec = self._table_spec(layer)
        pending = [t for t in self._nestpipe_announced if t.name != spec.name]
        mine = next((i for i, t in enumerate(self._nestpipe_announced) if t.name == spec.name),
                    len(pending))
        self._nestpipe_announced = []
        pending.insert(mine, spec)  # in construction order
        return self._nestpipe_planner.place_all(pending)[mine].placement

    def table_owner(self, layer):
        """The worker holding `layer`'s whole table, placed table_wise by the planner."""
        return self._nestpipe_planner.planned(layer.name).owner

    @property
    def placement_planner(self):
        """The `Planner` holding every table's `TablePlan` so far."""
        return self._nestpipe_planner

    def _report_placement(self):
        """Once all tables are built (the first gradient aggregation): refuses a placement
        dict naming an unknown table and prints the plan on worker 0."""
        if self._nestpipe_plan_reported:
            return
        self._nestpipe_planner.check_names()
        self._nestpipe_plan_reported = True
        plans = self._nestpipe_planner.plans
        if plans and self._num_workers > 1 and self._id_in_cluster == 0:
            print(render_plan(plans, self._num_workers, self._nestpipe_planner.transport,
                              self._nestpipe_planner.costs_source), flush=True)

    @staticmethod
    def _dense_gradient(value):
        """A replicated table's gradient as a dense tensor (an IndexedSlices summed into its
        rows), so it joins the dense all-reduce: exact, and the same update as one process's."""
        if isinstance(value, _dist_values.DistributedValues):
            return distribute_utils.regroup(
                tuple(NestPipeExtended._dense_gradient(v) for v in value.values))
        if isinstance(value, tf.IndexedSlices):
            return tf.math.unsorted_segment_sum(value.values, value.indices,
                                                value.dense_shape[0])
        return value
    # --- end of table placement --------------------------------------------------------------

    # --- equal shares of the global batch ---------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        """Runs `fn`, noting the size of this worker's share of the step's batch (its first
        argument) when it is not static, for `_equal_shares_check` (see `equal_shares`)."""
        if self._num_workers == 1 or not args or not self._nestpipe_check_shares:
            return super()._call_for_each_replica(fn, args, kwargs)
        previous = self._nestpipe_share_size
        self._nestpipe_share_size = equal_shares.leading_size(
            distribute_utils.select_replica(0, tuple(args[:1])))
        try:
            return super()._call_for_each_replica(fn, args, kwargs)
        finally:
            self._nestpipe_share_size = previous

    def _equal_shares_check(self, pairs):
        """Before a step's gradients are aggregated (the values reduced into trainable
        variables), checks once that every worker's share had the same size; returns the
        check (None when there is nothing to check: static shapes, evaluate / predict). When
        the step's keys exchange carried the sizes (`shares_known`), no collective is added."""
        size = self._nestpipe_share_size
        if size is None or not any(getattr(d, "trainable", False) for _, d in pairs):
            return None
        self._nestpipe_share_size = None  # once per step
        if self._nestpipe_known_check is not None:  # the step checked them already
            return self._nestpipe_known_check
        # After every value to aggregate, i.e. after every exchange the step made to compute
        # them: a failing check aborts the step, and an exchange still pending then would be
        # cancelled half-done, which closes the mesh.
        with tf.control_dependencies(equal_shares.graph_tensors([v for v, _ in pairs])):
            if self._nestpipe_known_shares is not None:
                return equal_shares.check_shares(self._nestpipe_known_shares)
            return equal_shares.check_equal_shares(size, self._nestpipe_collectives)

    def share_size_of(self, batch):
        """This worker's share size of `batch` for the keys exchange to carry (None when the
        check is off, the batch dimension is static, or there is one worker)."""
        if self._num_workers == 1 or not self._nestpipe_check_shares:
            return None
        return equal_shares.leading_size(batch)

    def check_known_shares(self, sizes):
        """The equal-shares check of a step whose every share size `sizes` (`[W]`, from the
        keys exchange; None: not known) is known before the step starts (a look-ahead
        pipeline's current batch): an op that fails with the check's message, or None when
        there is nothing to check. The pipeline runs every collective of the step after it, so
        that a refused step fails on every worker before any of them starts an exchange (a
        half-done exchange would leave its peers waiting)."""
        if sizes is None or self._num_workers == 1 or not self._nestpipe_check_shares:
            return None
        return equal_shares.check_shares(sizes)

    @contextlib.contextmanager
    def shares_known(self, sizes, check=None):
        """Within this context the step's equal-shares check uses `sizes` (every worker's
        share size, `[W]`, from the keys exchange; None: not known) instead of an all-gather;
        `check` (from `check_known_shares`, if the step made it already) is used as it is."""
        previous = self._nestpipe_known_shares, self._nestpipe_known_check
        self._nestpipe_known_shares, self._nestpipe_known_check = sizes, check
        try:
            yield
        finally:
            self._nestpipe_known_shares, self._nestpipe_known_check = previous
    # --- end of equal shares -----------------------------------------------------------------

    # --- one replica per worker -----------------------------------------------------------
    def _initialize_multi_worker(self, cluster_resolver):
        # The coordination service with a heartbeat timeout that survives a stalled machine
        # (coordination.py); TensorFlow's own set-up then finds it configured.
        configure_coordination_service(cluster_resolver)
        super()._initialize_multi_worker(cluster_resolver)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices, device_type = super()._initialize_local_devices(cluster_resolver, worker_device)
        return devices[:1], device_type

    def _initialize_local(self, cluster_resolver, devices=None):
        if devices is None:
            device_type = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
            devices = ("/device:%s:0" % device_type,)
        super()._initialize_local(cluster_resolver, devices=devices[:1])

    def _open_transport(self, may_fall_back):
        """Opens the transport (the socket mesh: `tf_nestpipe.collectives.sockets`); where it
        cannot open, falls back to TensorFlow's collectives (worker 0 saying why) or fails with
        the reason, as the transport config says."""
        address = self._cluster_resolver.cluster_spec().task_address(self._task_type,
                                                                     self._task_id)
        opened, reason = self._nestpipe_collectives.open(address.rsplit(":", 1)[0],
                                                         self._transport_config)
        if opened:
            return
        if not may_fall_back:
            raise TransportError("NestPipeStrategy(transport=%r): the workers could not open "
                                 "their socket mesh: %s. Open the workers' ports to each other, "
                                 "or use transport='auto' (falls back to TensorFlow's "
                                 "collectives) or 'tf'." % (self._transport_config.name, reason))
        log_fallback(self._nestpipe_collectives.worker_index, reason)

    def _collective_rank(self):
        """This worker's rank in the collective group, i.e. the row an all-to-all sends it.

        TensorFlow orders group members by device name; rather than re-deriving that order,
        every worker all-gathers its cluster id once and finds its own position.
        """
        if self._num_workers == 1:
            return 0
        ids = self._nestpipe_collectives.all_gather(
            tf.constant([self._id_in_cluster], tf.int32), "nestpipe/rank").numpy().tolist()
        if sorted(ids) != list(range(self._num_workers)):
            raise RuntimeError("workers reported cluster ids %s; expected each of 0..%d once"
                               % (ids, self._num_workers - 1))
        return ids.index(self._id_in_cluster)

    @property
    def collectives(self):
        """The `Collectives` the sharded embeddings use to talk to other workers."""
        return self._nestpipe_collectives

    @property
    def collectives_backend(self):
        """The embedding exchange's transport: "sockets" (the socket mesh, see
        `tf_nestpipe.collectives.sockets`), "tf" (TensorFlow collectives) or "horovod"."""
        return self._nestpipe_collectives.name

    @property
    def num_workers(self):
        """Number of synchronous workers (= number of table shards)."""
        return self._num_workers

    @property
    def worker_index(self):
        """This worker's position among all workers (= the table shard it owns)."""
        return self._nestpipe_collectives.worker_index

    # --- input ---------------------------------------------------------------------------
    def _experimental_distribute_dataset(self, dataset, options):
        """Checks the AutoShard policy (clear errors / DATA fallback instead of hangs and
        silent duplication, see `tf_nestpipe.data.autoshard`), then distributes as MWMS does,
        without partial-batch handling where no worker can run out first
        (`equal_static_shares`)."""
        def agree(status):
            return self._nestpipe_collectives.all_gather(
                tf.constant([status], tf.int32), "nestpipe/autoshard").numpy().tolist()

        dataset = check_auto_shard(dataset, self._num_workers, self._id_in_cluster,
                                             agree)
        if self._num_workers > 1 and self._nestpipe_check_shares:
            equal_shares.check_global_batch(dataset, self._num_workers)
        if not equal_static_shares(dataset, self._num_replicas_in_sync):
            return super()._experimental_distribute_dataset(dataset, options)
        # No worker can run out first: without TensorFlow's partial-batch handling, whose
        # agreement is an all-reduce at the start of every step (and whose batches have an
        # unknown batch dimension). The flag is read when the dataset is built, here.
        previous = self.experimental_enable_get_next_as_optional
        self.experimental_enable_get_next_as_optional = False
        try:
            return super()._experimental_distribute_dataset(dataset, options)
        finally:
            self.experimental_enable_get_next_as_optional = previous

    # --- variables -------------------------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        check_keras3_variable(sys._getframe(1))  # pylint: disable=protected-access
        layout = row_shard_being_created()
        colocate_with = kwargs.get("colocate_with")
        if layout is None and colocate_with is not None and is_row_shard(colocate_with):
            layout = row_shard_layout(colocate_with)  # an optimizer slot of a row shard
        if layout is None:
            return super()._create_variable(next_creator, **kwargs)
        kwargs.pop("colocate_with", None)
        kwargs.pop("distribute_strategy", None)
        if "initial_value" in kwargs:  # a whole table restored on creation -> this shard's rows
            kwargs["initial_value"] = restore_on_create_rows(
                kwargs["initial_value"], layout, kwargs.get("name") or "a table")
        with tf.device(self.worker_devices[0]):
            variable = next_creator(**kwargs)
        dynamic = fresh_slots_of(colocate_with) if colocate_with is not None else None
        if dynamic is not None:  # an optimizer slot of a dynamic table's rows
            dynamic.register_companion(variable)
        # Its checkpoints hold the whole table, so tf.train.Checkpoint and tf_keras callbacks
        # lose no worker's rows (see row_shard_saving).
        return make_checkpointable(variable, layout, self._nestpipe_collectives)

    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        if not self._nestpipe_collectives.broadcasts_initial_values or replica_id != 0:
            return super()._get_variable_creator_initial_value(replica_id, device, primary_var,
                                                               **kwargs)

        def initial_value_fn():
            # Mirrored variables start from worker 0's value (hvd.broadcast), as MWMS does with
            # its collective broadcast.
            with tf.device(device):
                initial_value = kwargs["initial_value"]
                if callable(initial_value):
                    initial_value = initial_value()
                if isinstance(initial_value, _trackable_base.CheckpointInitialValue):
                    initial_value = initial_value.wrapped_value
                initial_value = tf.convert_to_tensor(initial_value, dtype=kwargs.get("dtype"))
                return self._nestpipe_collectives.broadcast_initial_value(initial_value)

        return initial_value_fn

    def _validate_colocate_with_variable(self, colocate_with_variable):
        if is_row_shard(colocate_with_variable):
            return
        super()._validate_colocate_with_variable(colocate_with_variable)

    def variable_created_in_scope(self, v):
        if is_row_shard(v):
            return True
        return super().variable_created_in_scope(v)

    def _update(self, var, fn, args, kwargs, group):
        if isinstance(var, _dist_values.DistributedVariable):
            return super()._update(var, fn, args, kwargs, group)
        dynamic = fresh_slots_of(var)
        resets = dynamic.reset_ops() if dynamic is not None else []
        with tf.device(var.device), distribute_lib.UpdateContext(0), \
                tf.control_dependencies(resets):
            result = fn(var, *distribute_utils.select_replica(0, args),
                        **distribute_utils.select_replica(0, kwargs))
        if group:
            return result
        return tf.nest.map_structure(self._local_results, result)

    def read_var(self, replica_local_var):
        if is_row_shard(replica_local_var):
            return tf.identity(replica_local_var)
        return super().read_var(replica_local_var)

    # --- gradient aggregation --------------------------------------------------------------
    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        pairs = list(value_destination_pairs)
        if any(getattr(d, "trainable", False) for _, d in pairs):
            self._report_placement()
        pairs = [(self._dense_gradient(v) if replicated_table_name(d) else v, d)
                 for v, d in pairs]
        check = self._equal_shares_check(pairs)  # no update from unequal shares
        pairs = [(equal_shares.after(check, v), d) for v, d in pairs]
        dense = [(i, p) for i, p in enumerate(pairs) if not is_row_shard(p[1])]
        results = [None] * len(pairs)
        local = [(i, p) for i, p in dense if self._reduces_on_backend(p[0])]
        rest = [(i, p) for i, p in dense if not self._reduces_on_backend(p[0])]
        riders = self._metric_riders(reduce_op, pairs, local, rest)
        if local:  # Horovod, or the socket mesh: one grouped sum for all of them
            reduced = self._backend_reduce(
                reduce_op, [p[0] for _, p in local] + (riders.flats if riders else []))
            for (i, _), value in zip(local, reduced):
                results[i] = value
            if riders:
                riders.take([self._local_results(v)[0] for v in reduced[len(local):]])
                riders = None
        if rest:
            # One packed all-reduce needs every value on its destination's device: a gradient
            # computed from values the pipelines kept between steps can carry no device.
            extra = [(_dist_values.PerReplica((self._on_worker_device(f),)), rest[0][1][1])
                     for f in riders.flats] if riders else []
            reduced = super()._batch_reduce_to(
                reduce_op, [(self._on_worker_device(v), d) for _, (v, d) in rest] + extra,
                options)
            for (i, _), value in zip(rest, reduced):
                results[i] = value
            if riders:
                riders.take([self._local_results(v)[0] for v in reduced[len(rest):]])
        for i, (value, destination) in enumerate(pairs):
            if results[i] is None:
                # Row-shard gradients were already summed over workers by the lookup's backward
                # all-to-all: pass them through, never all-reduce them.
                results[i] = value
        return results

    def _metric_riders(self, reduce_op, pairs, local, rest):
        """The step's metric states to sum in this gradient all-reduce (`summed_reads.riders`:
        its later metric reads then need no collective of their own), or None: not a gradient
        sum, no dense gradient, or (TensorFlow's packed all-reduce, one dtype per pack) a
        metric state of another dtype than the gradients."""
        if (reduce_op != _reduce_util.ReduceOp.SUM or not (local or rest)
                or not any(getattr(d, "trainable", False) for _, d in pairs)):
            return None
        dtypes = None
        if rest and not local:
            dtypes = {(v.values[0] if isinstance(v, _dist_values.DistributedValues) else v).dtype
                      for _, (v, _) in rest}
        return self._summed_reads.riders(dtypes)

    def _reduces_on_backend(self, value):
        """Whether `value` is summed by our backend rather than TensorFlow's all-reduce: every
        value under Horovod; on the socket mesh the dense ones (IndexedSlices, e.g. of a
        replicated Keras Embedding, keep TensorFlow's all-gather)."""
        transport = self._nestpipe_collectives
        if not transport.reduces_dense:
            return False
        if isinstance(value, _dist_values.DistributedValues):
            value = value.values[0]
        return transport.reduces_sparse or not isinstance(value, tf.IndexedSlices)

    def _on_worker_device(self, value):
        """A plain tensor `value` placed on this worker's device (an identity there), so that
        tf.distribute batches the dense all-reduce instead of one collective per gradient."""
        device = self.worker_devices[0]
        if isinstance(value, tf.Tensor) and value.device != device:
            with tf.device(device):
                return tf.identity(value)
        return value

    def metric_reads_within_step(self, variables_fn):
        """A context, entered around a step while it is traced, within which cross-replica reads
        of the sync-on-read variables of `variables_fn()` (e.g. every metric's state, read by
        the results) come from one packed all-reduce per dtype instead of one each, riding on
        the dense gradients' all-reduce when the step reaches it first; a read of a variable
        written after the sums packs them again (see `summed_reads`)."""
        return self._summed_reads.within_step(variables_fn)

    @property
    def metric_read_counts(self):
        """The `summed_reads.ReadCounts` of the steps traced so far."""
        return self._summed_reads.counts

    def _sum_over_workers(self, tensors):
        """Each of this worker's plain `tensors` summed over the workers (cross-replica
        context), through the path `_reduce_to` takes for it."""
        sums = []
        for tensor in tensors:
            value = _dist_values.PerReplica((tensor,))
            if self._reduces_on_backend(value):
                summed = self._backend_reduce(_reduce_util.ReduceOp.SUM, [value])[0]
            else:
                summed = super()._reduce_to(_reduce_util.ReduceOp.SUM, value,
                                            self.worker_devices[0], None)
            sums.append(self._local_results(summed)[0])
        return sums

    def _reduce_to(self, reduce_op, value, destinations, options):
        if is_row_shard(destinations):
            return value
        if self.reduce_structures_elementwise and tf.nest.is_nested(value):
            # Keras 3 reduces a structure of per-replica values (a batch of features) to build
            # the model; tf_keras's reductions keep their own path (one collective for the
            # whole structure, which the equal-shares check relies on).
            return tf.nest.map_structure(
                lambda v: self._reduce_to(reduce_op, v, destinations, options), value)
        packed = self._summed_reads.read(reduce_op, value, self._num_replicas_in_sync)
        if packed is not None:
            return packed
        if self._reduces_on_backend(value):
            if isinstance(value, _dist_values.Mirrored) and reduce_op == _reduce_util.ReduceOp.MEAN:
                return value
            return self._backend_reduce(reduce_op, [value])[0]
        return super()._reduce_to(reduce_op, value, destinations, options)

    def _backend_reduce(self, reduce_op, values):
        """Sums this worker's `values` over all workers with our backend's `all_reduce_sum`
        (Horovod's, or the socket mesh's; divided by the number of replicas for MEAN): what the
        TF path's all-reduce computes."""
        local = []
        for value in values:
            if isinstance(value, _dist_values.DistributedValues):
                value = value.values[0]  # one replica per worker
            if not isinstance(value, tf.IndexedSlices):
                value = tf.convert_to_tensor(value)
            local.append(value)
        summed = self._nestpipe_collectives.all_reduce_sum(local, "nestpipe/all_reduce")
        if reduce_op == _reduce_util.ReduceOp.MEAN:
            scale = 1.0 / self._num_replicas_in_sync
            summed = [tf.IndexedSlices(v.values * scale, v.indices, v.dense_shape)
                      if isinstance(v, tf.IndexedSlices) else v * tf.cast(scale, v.dtype)
                      for v in summed]
        return [distribute_utils.regroup((v,), wrap_class=_dist_values.Mirrored) for v in summed]

    def _gather_to_implementation(self, value, destinations, axis, options):
        if not self._nestpipe_collectives.gathers:
            return super()._gather_to_implementation(value, destinations, axis, options)
        if isinstance(value, _dist_values.DistributedValues):
            value = value.values[0]
        value = tf.convert_to_tensor(value)
        rank = value.shape.rank
        perm = [axis] + [d for d in range(rank) if d != axis]
        moved = value if axis == 0 else tf.transpose(value, perm)
        gathered = self._nestpipe_collectives.all_gather(moved, "nestpipe/gather")
        if axis == 0:
            return gathered
        inverse = [perm.index(d) for d in range(rank)]
        return tf.transpose(gathered, inverse)

    def _use_merge_call(self):
        # Gradient aggregation must see (gradient, variable) pairs to skip row shards.
        return True


def _transport_config(transport, collectives, collective_timeout_seconds):
    """The strategy's `TransportConfig` from its `transport` argument and the older
    `collectives` spelling and `collective_timeout_seconds` (which sets the config's timeout)."""
    if collectives is not None:
        warnings.warn("NestPipeStrategy(collectives=...) is deprecated: pass "
                      "transport=%r (or a tnp.TransportConfig)" % (collectives,),
                      DeprecationWarning, stacklevel=3)
        if transport is not None:
            raise ValueError("pass transport= or its old spelling collectives=, not both")
        transport = collectives
    config = as_transport_config("auto" if transport is None else transport)
    if collective_timeout_seconds is not None:
        if collective_timeout_seconds < 0:
            raise ValueError("collective_timeout_seconds must be > 0 (or None: the transport's "
                             "default), got %r" % (collective_timeout_seconds,))
        if collective_timeout_seconds > 0:
            config = dataclasses.replace(config, timeout_seconds=float(collective_timeout_seconds))
    return config


def _communication_options(communication, communication_options):
    """The `CommunicationOptions` from `communication_options` or the deprecated
    `communication` (one of them: both would leave one silently ignored)."""
    if communication is None:
        return communication_options or tf.distribute.experimental.CommunicationOptions()
    warnings.warn("NestPipeStrategy(communication=...) is deprecated: pass communication_options="
                  "tf.distribute.experimental.CommunicationOptions(implementation=%s)"
                  % (communication,), DeprecationWarning, stacklevel=3)
    if communication_options is not None:
        raise ValueError("pass communication_options= or the deprecated communication=, not "
                         "both (communication_options.implementation is %s, communication %s)"
                         % (communication_options.implementation, communication))
    return tf.distribute.experimental.CommunicationOptions(implementation=communication)


class NestPipeStrategy(distribute_lib.Strategy):
    """Synchronous NestPipe training: embedding tables placed per table, dense weights mirrored,
    the same parameters as one process on the same global batches.

    Reads the cluster from `TF_CONFIG` (a single local worker without it). Build models under
    `strategy.scope()` and train them with tf_keras `fit`, `tnp.TrainPipeline` or `strategy.run`
    in a custom loop; Keras 3 models (`import keras`) with the layers of `tf_nestpipe.keras3`. Under `fit` (and `TrainPipeline`) every row-wise lookup of a step goes
    through one exchange per group of tables (one dim and dtype), however many layers the model
    has; `strategy.run` loops exchange each table on its own. Before TensorFlow's server starts,
    the tasks of a `TF_CONFIG` cluster check that all were given the same cluster
    (`tf_nestpipe.launch.cluster_check`). The arguments are grouped by concern: the cluster,
    the transport (`transport`), the pipeline (`pipeline`), placement (`placement`,
    `memory_budget_bytes`), the wire encoding (`wire_dtype`) and process settings.

    It is deliberately not a `tf.distribute.MultiWorkerMirroredStrategy` (nor a
    `CollectiveAllReduceStrategy`): code that asks `isinstance(strategy, ...)` for those takes
    their paths, which assume every variable mirrored on every worker (row shards are not) and
    report metrics and step values summed over the workers (NestPipe reports one process's
    global values), so it would be wrong rather than refused. tf_keras' paths that matter are
    adapted instead (BackupAndRestore, saving, predict, step outputs, loss reduction), and
    mixed_float16, whose loss scaling tf_keras allows only under those strategies, is refused
    with the reason (use mixed_bfloat16).

    Args:
        cluster_resolver: A `tf.distribute.cluster_resolver.ClusterResolver`; default: from
            `TF_CONFIG`.
        communication: Deprecated (as in `MultiWorkerMirroredStrategy`): pass
            `communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=...)`.
        communication_options: `tf.distribute.experimental.CommunicationOptions` of
            TensorFlow's collectives: `implementation` AUTO (NCCL on GPU, RING on CPU), RING or
            NCCL (RING without a GPU).
        collective_timeout_seconds: Sets `TransportConfig.timeout_seconds`: a collective that
            waits longer on a live peer that does not make the matching call fails every
            worker, naming the peer and the call.
        pipeline: A `tnp.PipelineConfig`, or its mode: "auto" (default: the first steps of
            `fit` try none, fwp, dbp and nested and keep the fastest on the slowest worker,
            see `tf_nestpipe.pipeline.auto`; its probe stops early where it would cost more
            than `strategy.auto_probe_budget`, default 0.05, of fit's first epoch), "none",
            "dbp" (the next batch's rows are routed
            and retrieved while the current batch computes), "fwp" (each step as micro-batches
            in a frozen window) or "nested" (both). Every mode is exact.
        micro_batches: Deprecated: `PipelineConfig.micro_batches`.
        cluster_samples: Deprecated: `PipelineConfig.cluster_samples`.
        unsafe_skip_buffer_sync: Deprecated: `PipelineConfig.unsafe_skip_buffer_sync`.
        collectives: Deprecated spelling of `transport`.
        auto_warmup_steps: Deprecated: `PipelineConfig.auto_warmup_steps`.
        auto_timed_steps: Deprecated: `PipelineConfig.auto_timed_steps`.
        auto_probe_rounds: Deprecated: `PipelineConfig.auto_probe_rounds`.
        auto_micro_batches: Deprecated: `PipelineConfig.auto_micro_batches`.
        startup_timeout_seconds: How long the start-up cluster check waits for every task
            (default `$TF_NESTPIPE_STARTUP_TIMEOUT`, else 30 s).
        check_equal_shares: Refuse, on every worker, a training step whose workers got shares
            of different sizes of the global batch (its mean gradient would differ from one
            process's; see `tf_nestpipe.strategy.equal_shares`). Settable later.
        wire_dtype: The encoding of the embedding exchanges (docs/guides/compressed_exchanges.md):
            a string for both directions or `{"forward": "fp32" | "bf16" | "fp16" | "int8",
            "backward": "fp32" | "bf16" | "fp16"}`; the default "fp32" is exact. Tables and
            optimizer state stay fp32.
        placement: How each `ShardedEmbedding` table is laid out (`tf_nestpipe.plan.placement`):
            "auto" (default: data_parallel or row_wise per table from its size and the
            collective costs of the transport in use, worker 0's on every worker), "row_wise",
            "table_wise" (only when requested: the whole table on one worker, tables balanced
            by bytes), "data_parallel" (a mirrored variable, its gradient in the dense
            all-reduce) or a dict {table name: placement or "auto"}. The plan is printed on
            worker 0 at the first training step, with the costs it used (`placement_plan()`
            returns it). Settable later.
        memory_budget_bytes: Bytes per worker all tables and their optimizer slots (2 assumed)
            may take: auto places row_wise the tables whose replica does not fit. Settable.
        malloc_top_pad_bytes: Freed memory each glibc malloc arena of this process keeps
            instead of returning it to the kernel (`mallopt(M_TOP_PAD)`, default 64 MiB; 0:
            leave the allocator alone), so that a step's large tensors are not page-faulted in
            afresh. A `MALLOC_TOP_PAD_` in the environment wins; `malloc_top_pad` says what
            was done.
        transport: A `tnp.TransportConfig` or its name: "auto" (default: a TCP mesh between
            the workers for the exchanges and the dense sums, falling back to TensorFlow's
            collectives, saying why, when the workers cannot reach each other's mesh ports, or
            on GPU), "sockets" (the mesh or an error), "tf" or "horovod" (the cluster is
            Horovod's: `horovodrun --gloo` or `python -m tf_nestpipe.launch --horovod`).

    Raises:
        ValueError: A bad argument (an unknown pipeline mode, placement or wire dtype, a count
            out of range, a `PipelineConfig` together with deprecated pipeline arguments,
            `communication` together with `communication_options`), naming it.
        tf_nestpipe.TFConfigError: A malformed `TF_CONFIG`.
        tf_nestpipe.launch.cluster_check.ClusterMismatchError: The tasks disagree about the
            cluster, or one never starts within `startup_timeout_seconds`.
        ValueError: The `mixed_float16` policy (tf_keras' or Keras 3's) is in use (the message
            names the fix).
    """

    # CollectiveAllReduceExtended reads the collective key base from its container strategy.
    _collective_key_base = 0

    def __init__(self, cluster_resolver=None, communication=None,
                 communication_options=None, collective_timeout_seconds=None, pipeline="auto",
                 micro_batches=None, cluster_samples=None, unsafe_skip_buffer_sync=None,
                 collectives=None, auto_warmup_steps=None, auto_timed_steps=None,
                 auto_probe_rounds=None, auto_micro_batches=None,
                 startup_timeout_seconds=None, check_equal_shares=True, wire_dtype="fp32",
                 placement="auto", memory_budget_bytes=None,
                 malloc_top_pad_bytes=allocator.DEFAULT_TOP_PAD_BYTES, transport=None):
        allocator.check_top_pad(malloc_top_pad_bytes)
        transport = _transport_config(transport, collectives, collective_timeout_seconds)
        if transport.engine_owns_cluster and cluster_resolver is not None:
            raise ValueError("transport='horovod' takes the cluster from Horovod (hvd.rank(), "
                             "hvd.size()); pass no cluster_resolver")
        config = as_pipeline_config(
            pipeline, micro_batches=micro_batches, cluster_samples=cluster_samples,
            unsafe_skip_buffer_sync=unsafe_skip_buffer_sync, auto_warmup_steps=auto_warmup_steps,
            auto_timed_steps=auto_timed_steps, auto_probe_rounds=auto_probe_rounds,
            auto_micro_batches=auto_micro_batches)
        Planner(placement, 1, memory_budget_bytes)  # bad placement arguments: refused now
        check_keras_environment()
        hook_tfrs()  # TFRS retrieval on local in-batch negatives warns (global_candidates)
        load_keras3_support_for_keras_rs()  # keras-rs's DistributedEmbedding: sharded tables
        # --- compressed exchanges (checked before the cluster starts) ---
        self.wire_dtype = parse_wire_dtype(wire_dtype)
        self.pipeline_config = config
        # The pipeline layer reads the config's fields as the strategy's attributes.
        self.pipeline = config.mode
        self.micro_batches = config.micro_batches
        self.cluster_samples = config.cluster_samples
        self.auto_warmup_steps = config.auto_warmup_steps
        self.auto_timed_steps = config.auto_timed_steps
        self.auto_probe_rounds = config.auto_probe_rounds
        # The fraction of fit's first epoch auto's probe may cost (None: probe every round).
        self.auto_probe_budget = 0.05
        self.auto_micro_batches = config.auto_micro_batches
        # Test-only: skip the dual-buffer re-sync to demonstrate that training then goes stale.
        self.unsafe_skip_buffer_sync = config.unsafe_skip_buffer_sync
        load_op_library()
        # Freed memory stays in the process: every step's tensors are page-faulted in afresh
        # otherwise (tf_nestpipe.launch.allocator).
        self.malloc_top_pad = allocator.keep_freed_memory(malloc_top_pad_bytes)
        if cluster_resolver is None:
            # A clear TFConfigError for a malformed TF_CONFIG; a ClusterMismatchError within
            # `startup_timeout_seconds` (default 30 s) when the tasks disagree or cannot meet.
            config = parse_tf_config()
            check_cluster_at_startup(config, transport, startup_timeout_seconds)
            cluster_resolver = tfconfig_cluster_resolver.TFConfigClusterResolver()
        communication_options = _communication_options(communication, communication_options)
        super().__init__(NestPipeExtended(self, cluster_resolver, communication_options,
                                          transport,
                                          check_equal_shares))
        if transport.engine_owns_cluster:  # after hvd.init() checked Horovod's size and rank
            check_horovod_cluster(config, startup_timeout_seconds)
        self.extended.embedding_exchange.set_wire_dtype(self.wire_dtype)
        self._placement, self._memory_budget_bytes = placement, memory_budget_bytes
        self.extended.set_placement(placement, memory_budget_bytes)
        register_multi_worker_strategy(self)  # a table built outside its scope is refused

    @property
    def placement(self):
        """How tables built from now on are placed: "auto" (the default), "row_wise",
        "table_wise", "data_parallel" or a dict {table name: placement}; settable (a new plan
        for the tables built after)."""
        return self._placement

    @placement.setter
    def placement(self, value):
        self.extended.set_placement(value, self._memory_budget_bytes)
        self._placement = value

    @property
    def memory_budget_bytes(self):
        """The per-worker bytes the tables and their optimizer slots may take (None: no
        limit); settable like `placement`."""
        return self._memory_budget_bytes

    @memory_budget_bytes.setter
    def memory_budget_bytes(self, value):
        self.extended.set_placement(self._placement, value)
        self._memory_budget_bytes = value

    def placement_plan(self):
        """The `TablePlan` of every table built so far (table, placement, bytes per worker,
        expected traffic per step), in build order."""
        return list(self.extended.placement_planner.plans)

    @property
    def check_equal_shares(self):
        """Whether a training step whose workers got shares of different sizes is refused
        (default True; settable, read at every step)."""
        return self.extended._nestpipe_check_shares  # pylint: disable=protected-access

    @check_equal_shares.setter
    def check_equal_shares(self, value):
        self.extended._nestpipe_check_shares = bool(value)  # pylint: disable=protected-access

    def scope(self):
        """`tf.distribute.Strategy.scope`, after the Keras checks (mixed_float16 is refused with
        the fix, and keras-rs's layers get sharded tables, see `keras_checks`)."""
        check_keras_environment()
        hook_tfrs()
        load_keras3_support_for_keras_rs()
        return super().scope()

    @property
    def collectives_backend(self):
        """The transport in use: "sockets", "tf" or "horovod"."""
        return self.extended.collectives_backend

    @property
    def cluster_resolver(self):
        """The cluster resolver this strategy was built from."""
        return tf_private.cluster_resolver(self.extended)

    @property
    def num_workers(self):
        """Number of synchronous workers (= number of shards of every table)."""
        return self.extended.num_workers

    @property
    def worker_index(self):
        """This worker's index among all workers (= the shard of every table it owns)."""
        return self.extended.worker_index
