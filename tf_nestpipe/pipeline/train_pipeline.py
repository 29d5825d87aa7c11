"""`TrainPipeline`: runs training steps through the fused exchange, with or without look-ahead.

Every step's row-wise lookups go through one exchange per group of tables and round (see
`fused_exchange`): a route pass records the ids, the exchanges fetch the rows into buffers, the
compute pass reads them. `lookahead=1` is the Dual-Buffer Pipeline; step i, traced as one
`tf.function` (independent subgraphs run concurrently in TF's executor):

    batch i's sync: owners read the rows planned one step earlier, fresh (step i-1's update
          is done), and send them *in batch i+1's keys all-to-all* (one per group: no
          collective of its own); requesters patch batch i's buffers
    route + retrieve batch i+1 (reads the tables before step i's update),  ─┐  overlaps
    planning its sync: (keys updated at i) ∩ (keys prefetched for i+1)      │
    compute batch i from its patched buffers: forward, backward, update ───┘
    swap: batch i+1's buffers and their plans become the next step's (pending sync)

The first call primes the pipeline (routes batch 0, nothing to sync); when the iterator runs dry
the last batch is computed by the same step function once more (the drain): its sync rides on the
keys exchanges of a prefetch of the last batch again, whose rows are then dropped, so the drain
costs one exchange's worth of discarded rows instead of a step function of its own to trace
(about a third of a pipelined run's tracing). Every row read at step i+1 equals the row a
non-pipelined run reads at step i+1. `lookahead=0` routes and retrieves each batch in its own
step, before its compute (no sync needed): the synchronous step, and with micro-batches in a
frozen window the Frozen-Window Pipeline (micro-batch j+1's exchange overlaps j's compute).
With look-ahead and micro-batches (nested) a batch's window is fetched in one exchange per
group: every micro-batch's rows arrive a step ahead, so an exchange per micro-batch would
only add collectives.
"""
import contextlib
import dataclasses
import weakref
from typing import Callable, NamedTuple

import tensorflow as tf
import tf_keras

from tf_nestpipe import tf_private
from tf_nestpipe.collectives.counting import CollectiveCount, count_collectives
from tf_nestpipe.collectives.communication import capacity_bucket
from tf_nestpipe.pipeline.fused_exchange import (BufferReader, PendingSync, RouteRecorder,
                                                 lookup_counts, prefetch_lookups, rows_requested,
                                                 run_route_pass, shares_of)
from tf_nestpipe.pipeline.state_store import (KEEP_SHAPES, VARY_ALL_DIMS, VARY_FIRST_DIM,
                                              TensorStore)
from tf_nestpipe.sharding.fetch import installed
from tf_nestpipe.tracing import IteratorStep, user_function


def updates_only_touched_rows(optimizer):
    """True if `optimizer` changes only the rows a sparse gradient touches (SGD without momentum,
    Adagrad; no weight decay or EMA). Otherwise every prefetched row is re-synced after the update
    (e.g. tf_keras Adam decays its moments and moves every row each step)."""
    if optimizer is None:
        return False
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    if getattr(inner, "weight_decay", None) or getattr(inner, "use_ema", False):
        return False
    if isinstance(inner, tf_keras.optimizers.Adagrad):
        return True
    if isinstance(inner, tf_keras.optimizers.SGD):
        momentum = getattr(inner, "momentum", 0.0)
        return not momentum
    return False


class _UpcomingRead(NamedTuple):
    """A read of the iterator's next element that does not fail at the end of the data:
    `has_value` (bool tensor), `value()` (the element; run only where it has one), its
    `element_spec`, and `always` (the iterator never ends: `has_value` is True)."""

    has_value: tf.Tensor
    value: Callable
    element_spec: object
    always: bool


@dataclasses.dataclass
class PipelineStats:
    """Counters of the Dual-Buffer Pipeline on this worker."""

    steps: int = 0
    primes: int = 0
    drains: int = 0
    rows_synced: int = 0  # fresh rows this worker received into its prefetch buffers
    rows_planned: int = 0  # fresh rows this worker sent as an owner
    rows_requested: int = 0  # distinct rows this worker prefetched (all tables and lookups)
    first_lookup_rows: int = 0  # of which by the first round of each step (fwp: the first
    # micro-batch; nested fetches its window in one round, so all of them)
    exchanges: int = 0  # fused exchanges a step runs (rounds x groups of tables), as traced
    collectives: CollectiveCount = None  # the collectives a step issues, as traced


class TrainPipeline:
    """Runs `step_fn(batch)` (per replica: forward, backward, optimizer update) for successive
    batches of an iterator through the fused exchange; `lookahead=1` (default) with the
    Dual-Buffer Pipeline, `lookahead=0` without.

    `route_fn(batch)` must look up the same tables with the same ids as `step_fn` (typically it
    calls the model on the batch's features, micro-batch by micro-batch in a frozen window if
    `step_fn` does); it runs with the layers' lookups recorded and answered with zeros, so its
    dense compute is pruned. `reduce_fn(outputs)` (optional) reduces the per-replica outputs
    inside the step function.

    `trainable_variables` (optional, a callable returning the variables `optimizer` updates,
    e.g. `lambda: model.trainable_variables`) lets the pipeline create, before it traces its
    first step, the variables that step would create: the model's (a route pass is traced, never
    run, while the optimizer is not built) and a tf_keras optimizer's slots
    (`optimizer.build`). A `tf.function` whose first trace creates variables is traced twice;
    with this the prime and the step are traced once each. Give every variable the optimizer
    updates: a tf_keras optimizer refuses to update a variable it was not built with.

    Args:
        strategy: The `NestPipeStrategy`.
        step_fn: `step_fn(batch)`, per replica: forward, backward, optimizer update.
        route_fn: `route_fn(batch)`: the same lookups as `step_fn` (e.g. the model called on
            the features).
        optimizer: The optimizer `step_fn` applies (its update decides which prefetched rows
            are re-synced).
        reduce_fn: `reduce_fn(outputs)`, optional, reduces the per-replica outputs.
        skip_buffer_sync: Testing only: skip the re-sync (training goes stale).
        lookahead: 1 (default): the Dual-Buffer Pipeline; 0: the fused exchange without
            look-ahead.
        trainable_variables: Optional callable returning the variables `optimizer` updates.

    Raises:
        ValueError: `lookahead` is not 0 or 1.
        TypeError: `trainable_variables` is not callable.
    """

    def __init__(self, strategy, step_fn, route_fn, optimizer=None, reduce_fn=None,
                 skip_buffer_sync=False, lookahead=1, trainable_variables=None):
        if lookahead not in (0, 1):
            raise ValueError("lookahead must be 0 or 1, got %r" % (lookahead,))
        if trainable_variables is not None and not callable(trainable_variables):
            raise TypeError("trainable_variables must be a callable returning the variables the "
                            "optimizer updates (e.g. lambda: model.trainable_variables), got %r"
                            % (trainable_variables,))
        self._strategy = strategy
        self._optimizer = optimizer
        self._trainable_variables = trainable_variables
        self._variables_created = trainable_variables is None
        self._step_fn = step_fn
        self._route_fn = route_fn
        self._reduce_fn = reduce_fn
        self._lookahead = lookahead
        self._all_updated = not updates_only_touched_rows(optimizer)
        self._skip_buffer_sync = skip_buffer_sync
        self._exchange = strategy.extended.embedding_exchange
        self._collectives = self._exchange.collectives
        device = strategy.extended.worker_devices[0]
        # Between steps, in worker-local variables: the batch to compute next with what it
        # needs, and the batch after it. What the next step computes is one store of four parts
        # (one variable: two ops to store them and two to read, not eight and eight): the batch
        # (its static shapes, as the iterator gives them), the prefetch buffers holding its rows
        # with its routing (sizes vary by batch), their sync plans (the fresh rows they still
        # need, applied at the next step's start) and the ids its frozen window's dynamic-table
        # lookups recorded (see BufferReader).
        self._next_step = TensorStore(device, "nestpipe_next_step",
                                      (KEEP_SHAPES, VARY_FIRST_DIM, VARY_ALL_DIMS, VARY_FIRST_DIM))
        self._upcoming = TensorStore(device, "nestpipe_upcoming_batch")
        # {(group, round key): lookups} of the model's route pass (the same for every batch),
        # learnt where a step's route pass is traced and read by the compute passes.
        self._lookup_counts = {}
        self._step_gate = []  # the pipelined step's equal-shares check, while it is traced
        self._primed = False
        self._has_upcoming = False
        self._iterator_ref = None
        self.stats = PipelineStats()
        self._prime = tf.function(self._prime_step)  # only writes the stores: never stale
        self._build_pipelined_steps()
        # The steps called once per batch skip tf.function's argument matching (IteratorStep).
        self._synchronous = IteratorStep(tf.function(self._synchronous_step))

    def _stores_version(self):
        return self._next_step.version + self._upcoming.version

    def _build_pipelined_steps(self):
        """(Re)creates the step functions that read the stores, to be traced with the stores'
        present specs; a relaxed spec (`TensorStore.version`) makes them stale."""
        self._steps_version = self._stores_version()
        self._step = IteratorStep(tf.function(self._pipelined_step))
        self._step_held = tf.function(lambda: self._pipelined_step(None))

    # --- traced pieces -----------------------------------------------------------------------
    def _prefetch(self, batch, current=None, pending=None):
        """Route pass over `batch` and its fused exchanges: (the buffers of its rows, the sync
        plans, the dynamic-table ids its frozen window recorded, synced). The plans are those of
        the rows the `current` batch (its buffers, DBP) updates; None without it. `pending`
        (the `current` buffers' own plans) rides on the keys exchanges: `synced` is (the
        `current` buffers patched with their fresh rows, the rows received)."""
        updated = None
        if current is not None and not self._skip_buffer_sync:
            # Rows updated by the current step: every row any of its buffers of a group read.
            updated = {group: tf.concat([b.routing.local_rows for b in buffers.rounds.values()],
                                        0) for group, buffers in current.items()}
        # The equal-shares check of the strategy (if any) reads every worker's share size from
        # the keys headers instead of an all-gather of its own.
        with self._collectives.stream("prefetch"):
            recorded = run_route_pass(self._route_fn, batch)
            buffers, plans, synced = prefetch_lookups(
                self._exchange, recorded.lookups, recorded.windowed, updated, self._all_updated,
                self._share_size_of(batch),
                None if pending is None else PendingSync(current, pending),
                one_window_exchange=self._lookahead == 1)
        self._lookup_counts = lookup_counts(self._exchange, recorded.lookups)
        self.stats.exchanges = sum(len(group.rounds) for group in buffers.values())
        return buffers, plans, recorded.dynamic_ids, synced

    def _share_size_of(self, batch):
        """This worker's share size of `batch` for the keys exchange to carry and the
        equal-shares check to read; None when nothing is checked (the strategy checks no
        shares, or the batch dimension is static: the same on every worker)."""
        return getattr(self._strategy.extended, "share_size_of", lambda batch: None)(batch)

    def _compute_pass(self, batch, buffers, dynamic_ids=None, shares_check=None):
        """`step_fn(batch)` reading `buffers`; `shares_check`: the step's equal-shares check,
        if it made one already (the aggregation then uses it instead of another)."""
        reader = BufferReader(self._exchange, buffers, self._lookup_counts, dynamic_ids)
        shares_known = getattr(self._strategy.extended, "shares_known",
                               lambda sizes, check=None: contextlib.nullcontext())
        with installed(reader), shares_known(shares_of(buffers), shares_check):
            outputs = user_function(self._step_fn)(batch)
        if reader.untaken():
            raise ValueError("the training step did not look up the prefetched tables %s as "
                             "often as the route pass did" % reader.untaken())
        return outputs

    def _local(self, value):
        """`value` as this worker's plain tensors (one replica per worker; plain tensors pass
        through unchanged)."""
        return tf.nest.map_structure(
            lambda v: self._strategy.experimental_local_results(v)[0], value)

    def _reduce(self, outputs):
        if self._reduce_fn is None:
            return outputs
        return user_function(self._reduce_fn)(outputs)

    def _synchronous_step(self, iterator):
        """lookahead=0: route, retrieve and compute the next batch."""
        def replica_step(batch):
            buffers, _, dynamic_ids, _ = self._prefetch(batch)
            return self._compute_pass(batch, buffers, dynamic_ids), rows_requested(buffers)

        outputs, requested = self._strategy.run(replica_step, args=(next(iterator),))
        outputs, requested = self._reduce(outputs), self._local(requested)
        self.stats.collectives = count_collectives(tf.compat.v1.get_default_graph())
        return outputs, requested

    def _next_local(self, iterator):
        """Requests the next element without failing at the end of the data: an `_UpcomingRead`.
        An iterator that never ends (a repeated dataset) is read with `next` (no Optional to
        build and unpack, about 8 ops a step); any other as an Optional: this worker's own when
        no worker can run out first (no all-reduce, `tf_private.local_next_as_optional`), else
        the distributed iterator's (which agrees across workers whether any has data left)."""
        if tf_private.iterator_never_ends(iterator):
            element = next(iterator)
            return _UpcomingRead(tf.constant(True), lambda: element, iterator.element_spec,
                                 always=True)
        optional = tf_private.local_next_as_optional(iterator)
        if optional is None:
            optional = iterator.get_next_as_optional()
        return _UpcomingRead(optional.has_value(), optional.get_value, optional.element_spec,
                             always=False)

    def _store_if_present(self, store, read, otherwise=None):
        """Stores the element of `read` (an `_UpcomingRead`) if it has one (else `otherwise`,
        if given); returns whether it had one."""
        def keep():
            with tf.control_dependencies(store.assign(self._local(read.value()))):
                return tf.constant(True)

        if read.always:
            return keep()

        def absent():
            if otherwise is None:
                return tf.constant(False)
            with tf.control_dependencies(store.assign(otherwise)):
                return tf.constant(False)

        return tf.cond(read.has_value, keep, absent)

    def _prime_buffers(self, batch):
        buffers, _, dynamic_ids, _ = self._prefetch(batch)
        return buffers, self._no_sync(buffers), dynamic_ids

    def _no_sync(self, buffers):
        """Pending plans that sync nothing, one per buffer (none with `skip_buffer_sync`): the
        primed buffers read the tables as they are."""
        if self._skip_buffer_sync:
            return {}
        bucket, capacity = capacity_bucket(1)
        plans = {}
        for group, group_buffers in buffers.items():
            workers = self._exchange.tables(group).layout.num_shards
            slots = tf.fill(tf.stack([workers, capacity]), -1)
            plans[group] = {key: _stored_plan({"slots": slots, "bucket": bucket,
                                               "capacity": capacity})
                            for key in group_buffers.rounds}
        return plans

    def _prime_step(self, iterator):
        batch = self._local(next(iterator))
        states, pending, dynamic_ids = self._local(
            self._strategy.run(self._prime_buffers, args=(batch,)))
        upcoming = self._next_local(iterator)
        # The next step's batch admits the upcoming batches' spec (the iterator's optional element
        # may have a dimension `next` gives statically): the pipelined step moves them into it.
        upcoming_spec = tf_private.single_replica_spec(upcoming.element_spec)
        with tf.control_dependencies(self._next_step.assign(
                (batch, states, pending, dynamic_ids), admit=(upcoming_spec, None, None, None))):
            # Without one, the upcoming store holds the batch itself, as it holds the last batch
            # after a pipelined step: the drain prefetches it again (see `_advance`).
            return self._store_if_present(self._upcoming, upcoming, otherwise=batch)

    def _pipelined_step(self, iterator=None):
        """Computes the current batch while prefetching the upcoming one; with an `iterator`,
        reads the batch after next (without: trains a held batch, reading nothing)."""
        next_batch = self._upcoming.read()
        batch, states, pending, dynamic_ids = self._next_step.read()
        # The current batch's share sizes are known (its keys exchange carried them a step ago):
        # a refused batch (unequal shares) fails the step on every worker before any collective
        # of the step starts (the iterator's too), none left half-done with peers waiting on it.
        # The replica step is built in another thread (control dependencies are per thread):
        # it reads the check from `_step_gate`.
        check = None
        if self._share_size_of(batch) is not None:
            check = getattr(self._strategy.extended, "check_known_shares", lambda sizes: None)(
                shares_of(states))
        self._step_gate = [] if check is None else [check]
        try:
            with tf.control_dependencies(self._step_gate):
                # The batch after next is requested without failing at its end (`_next_local`);
                # it overlaps this step and tells the driver whether to pipeline or drain on
                # the next call.
                if iterator is not None:
                    upcoming = self._next_local(iterator)
                outputs, next_states, plans, next_dynamic, received, sent, requested = (
                    self._strategy.run(self._replica_step,
                                       args=(batch, next_batch, states, pending, dynamic_ids)))
        finally:
            self._step_gate = []
        next_states, plans, next_dynamic, received, sent, requested = self._local(
            (next_states, plans, next_dynamic, received, sent, requested))
        with tf.control_dependencies(self._next_step.assign(
                (next_batch, next_states, plans, next_dynamic))):
            if iterator is None:
                has_upcoming = tf.identity(tf.constant(False))
            else:
                has_upcoming = self._store_if_present(self._upcoming, upcoming)
        outputs = self._reduce(outputs)
        self.stats.collectives = count_collectives(tf.compat.v1.get_default_graph())
        # One tensor for the driver to read (a host read per tensor costs on every step).
        return outputs, tf.concat([tf.stack([tf.cast(has_upcoming, tf.int64), received, sent]),
                                   requested], 0)

    def _replica_step(self, batch, next_batch, states, pending, dynamic_ids):
        """One replica's step: route + retrieve batch i+1 and plan its sync, with batch i's
        fresh rows (the sync planned one step earlier, read after that step's update) riding
        on the keys exchanges; compute batch i from its patched buffers. Batch i+1's sync is
        left pending: its rows are fresh only after this step's update."""
        with tf.control_dependencies(self._step_gate):  # see `_pipelined_step`
            next_states, plans, next_dynamic, (states, received) = self._prefetch(
                next_batch, current=states, pending=pending)
            outputs = self._compute_pass(batch, states, dynamic_ids,
                                         self._step_gate[0] if self._step_gate else None)
        sent = tf.constant(0, tf.int64)
        for group_plans in plans.values():
            sent += tf.add_n([tf.cast(plan["rows_sent"], tf.int64)
                              for plan in group_plans.values()])
        stored = {group: {key: _stored_plan(plan) for key, plan in group_plans.items()}
                  for group, group_plans in plans.items()}
        return (outputs, next_states, stored, next_dynamic, received, sent,
                rows_requested(next_states))

    # --- variables ahead of the first trace ---------------------------------------------------
    def _create_variables(self, iterator):
        """Creates the model's variables (tracing, never running, a route pass over `iterator`'s
        element spec) and a tf_keras optimizer's slots, before the first step function is traced
        (see the class docstring)."""
        self._variables_created = True
        if not isinstance(self._optimizer, tf_keras.optimizers.Optimizer):
            return  # a legacy optimizer creates its slots in its own way, on its first update
        if getattr(self._optimizer, "_built", False):
            return  # built (e.g. by another pipeline of the same model): nothing to create
        # The route pass is traced even when the model has variables already: a model partly
        # built (one layer called on its own) would otherwise build the optimizer without the
        # others' variables.
        traced = []

        def route_once(iterator):
            # TF traces a function again once its first trace created variables; the second trace
            # has nothing left to create.
            if traced:
                return
            traced.append(True)

            def replica_route(batch):
                with installed(RouteRecorder()):
                    user_function(self._route_fn)(batch)

            self._strategy.run(replica_route, args=(self._local(next(iterator)),))

        tf.function(route_once).get_concrete_function(iterator)
        try:
            variables = self._trainable_variables()
        except ValueError:
            # A sub-model the route pass does not call (a `nestpipe_route` that only looks up)
            # has no weights yet, and Keras refuses to list them: the first step creates them
            # and the optimizer's slots, as without this pass.
            return
        if variables:
            with self._strategy.scope():
                self._optimizer.build(variables)

    # --- driver ------------------------------------------------------------------------------
    def _count_requested(self, requested):
        """Adds `requested` (rows per round, a list) to the stats."""
        self.stats.rows_requested += sum(requested)
        self.stats.first_lookup_rows += requested[0] if requested else 0

    def progress(self, iterator):
        """Trains on the next batch of `iterator`.

        Args:
            iterator: An iterator of a distributed dataset (the same one, step after step; a
                new one drops the look-ahead of the old).

        Returns:
            `step_fn`'s outputs (reduced by `reduce_fn`, if given).

        Raises:
            StopIteration: Or `tf.errors.OutOfRangeError`, once the iterator and the pipeline
                are empty.
            ValueError: The step did not look up the prefetched tables as `route_fn` did."""
        if not self._variables_created:
            self._create_variables(iterator)
        if self._lookahead == 0:
            outputs, requested = self._synchronous(iterator)
            self._count_requested(requested.numpy().tolist())
            self.stats.steps += 1
            return outputs
        if self._iterator_ref is None or self._iterator_ref() is not iterator:
            # A new iterator (e.g. a new fit call): the old look-ahead is dropped, as the old
            # iterator's remaining elements would have been without the pipeline.
            self.reset()
            self._iterator_ref = weakref.ref(iterator)
        if not self._primed:
            self._has_upcoming = bool(self._prime(iterator))  # raises at the end of the data
            self._primed = True
            self.stats.primes += 1
        return self._advance(iterator)

    def _advance(self, iterator):
        """One step of a primed pipeline: pipelined (reading `iterator` unless None) while a
        batch is upcoming, else the drain."""
        # The drain (no batch upcoming) is the same step: the upcoming store still holds the
        # last batch (the current one), whose prefetch is dropped with its stats.
        if self._steps_version != self._stores_version():  # e.g. a batch of a new size
            self._build_pipelined_steps()
        outputs, counters = self._step(iterator) if iterator is not None else self._step_held()
        has_upcoming, received, sent, *requested = counters.numpy().tolist()
        self.stats.rows_synced += received
        if self._has_upcoming:
            self._has_upcoming = bool(has_upcoming)
            self.stats.rows_planned += sent
            self._count_requested(requested)
        else:
            if has_upcoming:  # the batch now upcoming would follow a second copy of the last
                raise RuntimeError(
                    "the iterator gave an element after it had reported its end; TrainPipeline "
                    "needs an iterator that stays at its end (a tf.data or tf.distribute one); "
                    "give progress() a new iterator to train on more data")
            self.reset()
            self.stats.drains += 1
        self.stats.steps += 1
        return outputs

    def progress_held(self, iterator):
        """Trains the next batch the look-ahead holds from `iterator`, reading nothing more
        (to switch to another pipeline without skipping a batch).

        Args:
            iterator: The iterator the look-ahead was read from.

        Returns:
            `step_fn`'s outputs; None once it holds no batch, or if `iterator` is not the one
            it read them from (they are dropped, as a new fit call drops them)."""
        if self._lookahead == 0 or not self._primed:
            return None
        if self._iterator_ref is None or self._iterator_ref() is not iterator:
            self.reset()
            return None
        return self._advance(None)

    def reset(self):
        """Forgets the prefetched batch (e.g. after the tables were restored from a checkpoint);
        the next `progress` primes the pipeline again from its iterator."""
        self._primed = self._has_upcoming = False


def _stored_plan(plan):
    """The part of a sync plan (`dual_buffer.fetch`) kept until the next step applies it."""
    return {"slots": tf.cast(plan["slots"], tf.int32), "bucket": tf.cast(plan["bucket"], tf.int32),
            "capacity": tf.cast(plan["capacity"], tf.int32)}
