"""`TrainPipeline`: runs training steps through the Dual-Buffer Pipeline.

Step i, traced as one `tf.function` (independent subgraphs run concurrently in TF's executor):

    route + retrieve batch i+1 (reads the tables before step i's update)  ─┐  overlaps
    plan the sync: (keys updated at i) ∩ (keys prefetched for i+1)        ─┤
    compute batch i from the active buffer: forward, backward, update  ───┘
    sync: owners send the planned rows, fresh; requesters patch the prefetch buffer
    swap: the patched prefetch buffer becomes step i+1's active buffer

The first call primes the pipeline (routes batch 0); when the iterator runs dry the last batch
is computed without a prefetch (drain). Every row read at step i+1 equals the row a
non-pipelined run reads at step i+1.
"""
import dataclasses
import weakref

import tensorflow as tf
import tf_keras

from tf_nestpipe.pipeline import dual_buffer
from tf_nestpipe.pipeline.context import COMPUTE, ROUTE, PipelineContext, pipeline_mode
from tf_nestpipe.pipeline.state_store import TensorStore


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


@dataclasses.dataclass
class PipelineStats:
    """Counters of the Dual-Buffer Pipeline on this worker."""

    steps: int = 0
    primes: int = 0
    drains: int = 0
    rows_synced: int = 0  # fresh rows this worker received into its prefetch buffers
    rows_planned: int = 0  # fresh rows this worker sent as an owner
    rows_requested: int = 0  # distinct rows this worker prefetched (all tables and lookups)
    first_lookup_rows: int = 0  # of which by the first lookup of each step (first micro-batch)


def _rows_requested(states):
    """Distinct rows requested per lookup index (summed over tables): `[lookups]` int64."""
    per_lookup = {}
    for table_states in states.values():
        for j, state in enumerate(table_states):
            per_lookup.setdefault(j, []).append(tf.reduce_sum(tf.cast(state["splits"], tf.int64)))
    return tf.stack([tf.add_n(per_lookup[j]) for j in sorted(per_lookup)]) if per_lookup else \
        tf.zeros([0], tf.int64)


class TrainPipeline:
    """Runs `step_fn(batch)` (per replica: forward, backward, optimizer update) for successive
    batches of an iterator with the Dual-Buffer Pipeline.

    `route_fn(batch)` must look up the same tables with the same ids as `step_fn` (typically it
    calls the model on the batch's features); it runs with the layers in routing mode, where
    lookups only record and prefetch and return zeros, so its dense compute is pruned.
    `reduce_fn(outputs)` (optional) reduces the per-replica outputs inside the step function.
    """

    def __init__(self, strategy, step_fn, route_fn, optimizer=None, reduce_fn=None,
                 skip_buffer_sync=False):
        self._strategy = strategy
        self._step_fn = step_fn
        self._route_fn = route_fn
        self._reduce_fn = reduce_fn
        self._all_updated = not updates_only_touched_rows(optimizer)
        self._skip_buffer_sync = skip_buffer_sync
        self._collectives = strategy.extended.collectives
        device = strategy.extended.worker_devices[0]
        # Between steps, in worker-local variables: the batch to compute next, the prefetch
        # buffers holding its rows (with its routing), and the batch after it.
        self._current = TensorStore(device, "nestpipe_current_batch")
        self._states = TensorStore(device, "nestpipe_prefetch_buffers")
        self._upcoming = TensorStore(device, "nestpipe_upcoming_batch")
        self._primed = False
        self._has_upcoming = False
        self._iterator_ref = None
        self.stats = PipelineStats()
        self._prime = tf.function(self._prime_step)
        self._step = tf.function(self._pipelined_step)
        self._drain = tf.function(self._drain_step)

    # --- traced pieces -----------------------------------------------------------------------
    def _route_pass(self, batch):
        context = PipelineContext(ROUTE)
        with pipeline_mode(context), self._collectives.stream("prefetch"):
            self._route_fn(batch)
        return context

    def _compute_pass(self, batch, states):
        context = PipelineContext(COMPUTE, states)
        with pipeline_mode(context):
            outputs = self._step_fn(batch)
        if context.unused():
            raise ValueError("the training step did not look up the prefetched tables %s as "
                             "often as the route pass did" % context.unused())
        return outputs

    def _local(self, value):
        """`value` as this worker's plain tensors (one replica per worker; plain tensors pass
        through unchanged)."""
        return tf.nest.map_structure(
            lambda v: self._strategy.experimental_local_results(v)[0], value)

    def _reduce(self, outputs):
        return self._reduce_fn(outputs) if self._reduce_fn is not None else outputs

    def _next_local(self, iterator):
        """Requests the next element as an Optional; returns (has_value, the Optional)."""
        optional = iterator.get_next_as_optional()
        return optional.has_value(), optional

    def _store_if_present(self, store, has_value, optional):
        def keep():
            with tf.control_dependencies(store.assign(self._local(optional.get_value()))):
                return tf.constant(True)

        return tf.cond(has_value, keep, lambda: tf.constant(False))

    def _prime_step(self, iterator):
        batch = self._local(next(iterator))
        states = self._local(self._strategy.run(lambda b: self._route_pass(b).states_out,
                                                args=(batch,)))
        has_upcoming, optional = self._next_local(iterator)
        with tf.control_dependencies(self._current.assign(batch) + self._states.assign(states)):
            return self._store_if_present(self._upcoming, has_upcoming, optional)

    def _pipelined_step(self, iterator):
        batch, next_batch, states = (self._current.read(), self._upcoming.read(),
                                     self._states.read())
        # The batch after next is requested as an Optional: it never fails, overlaps this step,
        # and tells the driver whether to pipeline or drain on the next call.
        has_upcoming, optional = self._next_local(iterator)
        outputs, next_states, received, sent, requested = self._strategy.run(
            self._replica_step, args=(batch, next_batch, states))
        next_states, received, sent, requested = self._local(
            (next_states, received, sent, requested))
        with tf.control_dependencies(self._current.assign(next_batch)
                                     + self._states.assign(next_states)):
            has_upcoming = self._store_if_present(self._upcoming, has_upcoming, optional)
        return self._reduce(outputs), has_upcoming, received, sent, requested

    def _replica_step(self, batch, next_batch, states):
        """One replica's step: route + retrieve batch i+1, plan the sync, compute batch i, sync."""
        routed = self._route_pass(next_batch)
        next_states = routed.states_out
        plans = {}
        # Its own stream: the plan's count exchange overlaps the prefetch's row exchange.
        with self._collectives.stream("sync_plan"):
            for name, prefetched in next_states.items():
                if name in states and not self._skip_buffer_sync:
                    layer = routed.layers[name]
                    # Rows updated at step i: every row any lookup of this table read at step i.
                    updated = {"local_rows": tf.concat([s["local_rows"] for s in states[name]], 0)}
                    plans[name] = [dual_buffer.plan_sync(updated, state, layer.layout,
                                                         layer.collectives(), layer.name,
                                                         self._all_updated)
                                   for state in prefetched]
        outputs = self._compute_pass(batch, states)
        received = tf.constant(0, tf.int64)
        sent = tf.constant(0, tf.int64)
        # No control dependency on `outputs`: automatic control dependencies already order the
        # sync's table reads after the update, and waiting for the metrics' all-reduces too
        # would put them on the critical path.
        for name, table_plans in plans.items():
            layer = routed.layers[name]
            synced = []
            for state, plan in zip(next_states[name], table_plans):
                rows, count = dual_buffer.apply_sync(layer.embeddings, state, plan, layer.layout,
                                                     layer.collectives(), layer.name)
                synced.append(dict(state, rows=rows))
                received += count
                sent += tf.cast(plan["rows_sent"], tf.int64)
            next_states[name] = synced
        return outputs, next_states, received, sent, _rows_requested(next_states)

    def _drain_step(self):
        batch, states = self._current.read(), self._states.read()
        return self._reduce(self._strategy.run(lambda b, s: self._compute_pass(b, s),
                                               args=(batch, states)))

    # --- driver ------------------------------------------------------------------------------
    def progress(self, iterator):
        """Trains on the next batch of `iterator` and returns `step_fn`'s (reduced) outputs.
        Raises StopIteration / OutOfRangeError once the iterator and the pipeline are empty."""
        if self._iterator_ref is None or self._iterator_ref() is not iterator:
            # A new iterator (e.g. a new fit call): the old look-ahead is dropped, as the old
            # iterator's remaining elements would have been without the pipeline.
            self.reset()
            self._iterator_ref = weakref.ref(iterator)
        if not self._primed:
            self._has_upcoming = bool(self._prime(iterator))  # raises at the end of the data
            self._primed = True
            self.stats.primes += 1
        if self._has_upcoming:
            outputs, has_upcoming, received, sent, requested = self._step(iterator)
            self._has_upcoming = bool(has_upcoming)
            self.stats.rows_synced += int(received)
            self.stats.rows_planned += int(sent)
            requested = requested.numpy().tolist()
            self.stats.rows_requested += sum(requested)
            self.stats.first_lookup_rows += requested[0] if requested else 0
        else:
            outputs = self._drain()
            self.reset()
            self.stats.drains += 1
        self.stats.steps += 1
        return outputs

    def reset(self):
        """Forgets the prefetched batch (e.g. after the tables were restored from a checkpoint);
        the next `progress` primes the pipeline again from its iterator."""
        self._primed = self._has_upcoming = False
