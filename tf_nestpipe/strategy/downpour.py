"""DOWNPOUR update windows over `tnp.ParameterServerStrategy` (docs/design/design.md §5).

One scheduled *window* on a worker: pull the parameters from the ps tasks into that worker's
own copy of the model, run `update_window` (T) local steps on it with a local optimizer (its
slot variables live on the worker, never on a ps), sum the T gradients, push the sum to the ps
where the global optimizer applies it. T=1 pushes every step's gradient (Hogwild-style).

Each worker keeps its copy of the model in per-worker variables (TensorFlow's
`PerWorkerVariable`: one instance per worker, the function resolves it to the worker it runs
on), so windows on different workers never share local state. A window pulls the dense
parameters whole but of each table only the rows its T batches read (found by a route pass that
records the lookups' ids), each row just before the first step that reads it, so the pull of step
s+1 overlaps the compute of step s: only the first step's pull is exposed. (The next *window*'s
rows are not prefetched: its batches are read by the next scheduled function.) Rows a window
does not read stay stale in the local copy and are never read. A restarted worker gets fresh
per-worker variables from the coordinator: its local optimizer state (e.g. the local Adagrad
accumulators) starts again from the initial value, and every row it reads is pulled anew.
Automatic control dependencies do not order per-worker variables, so the window orders pulls,
local steps and updates itself.
"""
import contextlib
import re

import numpy as np
import tensorflow as tf
from tf_nestpipe.tf_private import eager_context as context
from tf_nestpipe.tf_private import framework_ops as ops
from tf_nestpipe.tf_private import ps_values, save_context

from tf_nestpipe.sharding import partitioners
from tf_nestpipe.strategy.ps_watch import UnreachablePsError, call_watching_ps, refusing_ps
from tf_nestpipe.sharding.fetch import RowFetcher, installed
from tf_nestpipe.tracing import user_function
from tf_nestpipe import tf_private


class _LocalVariable(ps_values.PerWorkerVariable):
    """A per-worker variable that a gradient tape can differentiate: trainable, and its handle
    is captured once per traced function (TensorFlow's captures a new one at every access, so
    the tape never sees the reads it watched)."""

    def __init__(self, strategy, next_creator, **kwargs):
        super().__init__(strategy, next_creator, **kwargs)
        self._trainable = True

    @property
    def handle(self):
        if context.executing_eagerly() or save_context.in_save_context():
            return self._coordinator_instance.handle
        self._maybe_create_per_worker_vars()
        closure, spec = self.handle_call_time_value()
        return ops.get_default_graph().capture_call_time_value(
            closure, spec, key=("tf_nestpipe_local_variable", id(self)))


class _IdRecorder(RowFetcher):
    """A DOWNPOUR window's route pass: records each table lookup's checked ids (only their rows
    are pulled from the ps tasks) and returns zeros."""

    def __init__(self):
        self.lookups = []

    def lookup(self, layer, flat_ids):
        self.lookups.append((layer, layer.checked_ids(flat_ids)))
        return tf.zeros([tf.size(flat_ids), layer.dim], layer.embeddings.dtype)


@contextlib.contextmanager
def worker_local_variables(strategy):
    """Within this context (and `strategy.scope()`), new variables are per-worker
    `_LocalVariable`s: one independent copy on every worker, none on a ps."""
    extended = strategy.extended

    def create(next_creator, **kwargs):
        kwargs["per_worker_variable"] = True
        return next_creator(**kwargs)

    def per_worker(next_creator, **kwargs):
        return _LocalVariable(strategy, next_creator, **kwargs)

    original = tf_private.per_worker_variable_creator(extended)
    tf_private.set_per_worker_variable_creator(extended, per_worker)
    try:
        with strategy.scope(), tf.variable_creator_scope(create):
            yield
    finally:
        tf_private.set_per_worker_variable_creator(extended, original)


class LocalSGD:
    """Local optimizer: v -= learning_rate * g (stateless).

    Args:
        learning_rate: The step size."""

    def __init__(self, learning_rate):
        self.learning_rate = float(learning_rate)

    def create_slots(self, variable):
        """No state.

        Args:
            variable: Unused.

        Returns:
            None."""
        del variable
        return None

    def apply(self, variable, gradient, slot):
        """One update of a worker-local variable.

        Args:
            variable: The worker-local variable.
            gradient: Its gradient (dense or `IndexedSlices`).
            slot: Unused (None).

        Returns:
            The update op."""
        del slot
        if isinstance(gradient, tf.IndexedSlices):
            return variable.scatter_sub(tf.IndexedSlices(self.learning_rate * gradient.values,
                                                         gradient.indices))
        return variable.assign_sub(self.learning_rate * gradient)


class LocalAdagrad:
    """Local optimizer: acc += g^2; v -= learning_rate * g / sqrt(acc). The accumulator is a
    variable on the worker that holds `variable`.

    Args:
        learning_rate: The step size.
        initial_accumulator_value: The accumulator's starting value.
        epsilon: Added to sqrt(acc)."""

    def __init__(self, learning_rate, initial_accumulator_value=0.1, epsilon=1e-7):
        self.learning_rate = float(learning_rate)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.epsilon = float(epsilon)

    def create_slots(self, variable):
        """The accumulator (created by the trainer as a per-worker variable).

        Args:
            variable: The variable the accumulator belongs to.

        Returns:
            A `tf.Variable` of `variable`'s shape holding `initial_accumulator_value`."""
        return tf.Variable(tf.fill(variable.shape, tf.cast(self.initial_accumulator_value,
                                                           variable.dtype)),
                           trainable=False, name="local_adagrad_accumulator")

    def apply(self, variable, gradient, slot):
        """One update of a worker-local variable and its accumulator.

        Args:
            variable: The worker-local variable.
            gradient: Its gradient (dense or `IndexedSlices`).
            slot: Its accumulator.

        Returns:
            The update op."""
        if isinstance(gradient, tf.IndexedSlices):
            gradient = _dedup(gradient)
            squared = tf.IndexedSlices(tf.square(gradient.values), gradient.indices)
            with tf.control_dependencies([slot.scatter_add(squared)]):
                acc = tf.gather(slot, gradient.indices)
            step = self.learning_rate * gradient.values / (tf.sqrt(acc) + self.epsilon)
            return variable.scatter_sub(tf.IndexedSlices(step, gradient.indices))
        with tf.control_dependencies([slot.assign_add(tf.square(gradient))]):
            acc = tf.convert_to_tensor(slot)
        return variable.assign_sub(self.learning_rate * gradient / (tf.sqrt(acc) + self.epsilon))


def local_optimizer_from(spec):
    """`"sgd"` / `"adagrad"` (learning rate 0.1), a LocalSGD / LocalAdagrad, or None (SGD 0.1)."""
    if spec is None or spec == "sgd":
        return LocalSGD(0.1)
    if spec == "adagrad":
        return LocalAdagrad(0.1)
    if isinstance(spec, (LocalSGD, LocalAdagrad)):
        return spec
    raise ValueError("local_optimizer must be 'sgd', 'adagrad', tnp.LocalSGD(lr) or "
                     "tnp.LocalAdagrad(lr), got %r" % (spec,))


def _dedup(slices):
    """IndexedSlices with each index once (values summed)."""
    unique, position = tf.unique(slices.indices)
    return tf.IndexedSlices(tf.math.unsorted_segment_sum(slices.values, position, tf.size(unique)),
                            unique, slices.dense_shape)


def _add(total, gradient):
    if total is None:
        return gradient
    if isinstance(gradient, tf.IndexedSlices) or isinstance(total, tf.IndexedSlices):
        total, gradient = (g if isinstance(g, tf.IndexedSlices) else
                           tf.IndexedSlices(g, tf.range(tf.shape(g, out_type=tf.int64)[0]))
                           for g in (total, gradient))
        return tf.IndexedSlices(tf.concat([total.values, gradient.values], 0),
                                tf.concat([tf.cast(total.indices, tf.int64),
                                           tf.cast(gradient.indices, tf.int64)], 0))
    return total + gradient


class _ParameterGroup:
    """One parameter of the model: its shards on the ps tasks (one if unsplit) and the row
    layout of a split table ("div" ranges or "mod" round-robin)."""

    def __init__(self, shards, row_order):
        self.shards = shards
        self.row_order = row_order
        self.sizes = [int(s.shape[0]) for s in shards] if shards[0].shape.rank else [1]
        self.rows = sum(self.sizes)

    def pull(self):
        """The whole parameter as one tensor, rows in their natural (id) order."""
        if len(self.shards) == 1:
            return tf.convert_to_tensor(self.shards[0])
        values = [tf.convert_to_tensor(s) for s in self.shards]
        if self.row_order == partitioners.ROW_ORDER_MOD:
            count = len(self.shards)
            return tf.dynamic_stitch([tf.range(k, self.rows, count) for k in range(count)], values)
        return tf.concat(values, axis=0)

    def pull_rows(self, ids):
        """Rows `ids` (int64, natural order) of a table, read from the ps shards that own them."""
        return partitioners.gather_shard_rows(self.shards, ids, self.row_order)

    def split(self, gradient):
        """The gradient of the whole parameter as one gradient per shard."""
        if len(self.shards) == 1:
            return [gradient]
        count = len(self.shards)
        offsets = [sum(self.sizes[:k]) for k in range(count)]
        if not isinstance(gradient, tf.IndexedSlices):
            if self.row_order == partitioners.ROW_ORDER_MOD:
                return [tf.gather(gradient, tf.range(k, self.rows, count)) for k in range(count)]
            return tf.split(gradient, self.sizes, axis=0)
        indices = tf.cast(gradient.indices, tf.int64)
        parts = []
        for k in range(count):
            if self.row_order == partitioners.ROW_ORDER_MOD:
                mask, local = tf.equal(indices % count, k), indices // count
            else:
                mask = tf.logical_and(indices >= offsets[k], indices < offsets[k] + self.sizes[k])
                local = indices - offsets[k]
            parts.append(tf.IndexedSlices(tf.boolean_mask(gradient.values, mask),
                                          tf.boolean_mask(local, mask)))
        return parts


def _groups(model):
    """The model's trainable parameters as groups of ps shards, in variable order."""
    mod_tables = set()
    for layer in tf_private.flatten_layers(model):
        if getattr(layer, "_ps_row_order", None) == partitioners.ROW_ORDER_MOD:
            mod_tables.update(id(v) for v in layer._table_shards())  # pylint: disable=protected-access
    groups, current, current_name = [], [], None
    for variable in model.trainable_variables:
        name = re.sub(r"/part_\d+(:\d+)?$", "", variable.name)
        if current and (name != current_name or "/part_" not in variable.name):
            groups.append(current)
            current = []
        current.append(variable)
        current_name = name
    if current:
        groups.append(current)
    return [_ParameterGroup(g, partitioners.ROW_ORDER_MOD if id(g[0]) in mod_tables else
                            partitioners.ROW_ORDER_DIV) for g in groups]


class ParameterServerUnavailableError(RuntimeError):
    """A parameter-server task failed during DOWNPOUR training. The ps tasks hold the only copy
    of the parameters, so the run cannot continue: restart the cluster (the launcher's
    `--restarts N` does) and resume with `DownpourTrainer.restore`."""


def explain_ps_failure(error, ps_addresses=None):
    """A `ParameterServerUnavailableError` naming the failed ps tasks if `error` is a ps
    failure as `ClusterCoordinator` reports it, else None. The tasks are read from the error's
    message; when it names none (TensorFlow's `PSUnavailableError` from the coordination
    service carries the worker's message only), each of `ps_addresses` is probed and the ones
    that refuse connections are named."""
    if not tf_private.is_ps_failure(error):
        return None
    message = str(getattr(error, "original_exception", None) or error)
    tasks = set(tf_private.failed_ps_tasks(message))
    tasks.update(int(t) for t in re.findall(r"/job:ps/task:(\d+)", message))
    if tasks:
        named = ", ".join("/job:ps/task:%d" % t for t in sorted(tasks))
    else:
        refusing = refusing_ps(ps_addresses)
        if refusing:
            named = ", ".join("/job:ps/task:%d at %s (it refuses connections: %s)" % (
                t, ps_addresses[t], why) for t, why in sorted(refusing.items()))
        elif ps_addresses:
            named = ("a ps task (the error names none and every ps address still accepts "
                     "connections)")
        else:
            named = "a ps task (the error names none)"
    return ParameterServerUnavailableError(
        "parameter server %s became unavailable, so training stopped (the ps tasks hold the only "
        "copy of the parameters). Restart the cluster (python -m tf_nestpipe.launch ... "
        "--restarts N restarts it automatically) and resume from the last checkpoint with "
        "DownpourTrainer.restore(directory). Original error: %s" % (named, message[:500]))


@contextlib.contextmanager
def explaining_ps_failures(ps_addresses=None):
    """Re-raises a ps failure (as `ClusterCoordinator.schedule` / `join` report it, or as the
    ps watch finds it: `ps_watch`) as a `ParameterServerUnavailableError`; other errors pass
    unchanged. `ps_addresses` name the failed task when the error does not (`explain_ps_failure`)."""
    try:
        yield
    except UnreachablePsError as error:
        raise ParameterServerUnavailableError(
            "%s while the coordinator waited (TensorFlow took the failure for a transient "
            "one and kept retrying), so training stopped (the ps tasks hold the only copy of "
            "the parameters). Restart the cluster (python -m tf_nestpipe.launch ... --restarts "
            "N restarts it automatically) and resume from the last checkpoint with "
            "DownpourTrainer.restore(directory)." % error) from error
    except Exception as error:  # pylint: disable=broad-except
        explained = explain_ps_failure(error, ps_addresses)
        if explained is None:
            raise
        raise explained from error


class DownpourTrainer:
    """DOWNPOUR over `strategy` (a `tnp.ParameterServerStrategy`; its `update_window` and
    `local_optimizer` set T and the local optimizer). `model_fn()` builds the model: once in the
    strategy scope (the global model on the ps tasks, `self.model`) and once more in per-worker
    variables (`self.local_model`: every worker's own copy). `loss_fn(labels, outputs)`
    returns a scalar; `optimizer` is the global optimizer
    (e.g. tf_keras Adagrad) applied on the ps to each window's summed gradient (`model`: use this
    global model, built in the scope, instead of building one). `schedule` runs
    one window; `join` waits (explaining ps failures); `save` / `restore` checkpoint the global
    state for a restart after a ps failure.

    Args:
        strategy: A `tnp.ParameterServerStrategy` with `update_window` and `local_optimizer`.
        coordinator: The `tf.distribute.coordinator.ClusterCoordinator` of `strategy`.
        model_fn: Builds the model (called in the scope, and again per worker).
        loss_fn: `loss_fn(labels, outputs)` -> a scalar loss.
        optimizer: The global optimizer (a tf_keras optimizer) applied on the ps.
        model: A global model already built in the scope, used instead of `model_fn()`'s.

    Raises:
        ValueError: `model_fn` builds models of different parameters on a worker and in the
            scope."""

    def __init__(self, strategy, coordinator, model_fn, loss_fn, optimizer, model=None):
        self.strategy = strategy
        self.coordinator = coordinator
        self.update_window = strategy.update_window
        self.local_optimizer = local_optimizer_from(strategy.local_optimizer)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        # join() probes these while it waits (see ps_watch)
        self._ps_addresses = list(getattr(strategy, "ps_addresses", None) or [])
        if model is None:  # `model`: a global model built in the scope already (tf_keras fit)
            with strategy.scope():
                model = model_fn()
        self.model = model
        self._groups = _groups(self.model)
        with worker_local_variables(strategy):
            self.local_model = model_fn()
            self.local_slots = [self.local_optimizer.create_slots(v)
                                for v in self.local_model.trainable_variables]
        shapes = [tuple(v.shape.as_list()) for v in self.local_model.trainable_variables]
        expected = [(g.rows,) + tuple(g.shards[0].shape.as_list()[1:]) for g in self._groups]
        if shapes != expected:
            raise ValueError("model_fn built different models: local parameters %s, global %s"
                             % (shapes, expected))
        self._window = tf.function(self._window_fn)
        self.windows = 0  # windows scheduled so far
        # The global optimizer's slots are built now (on the ps, next to each shard), so that a
        # checkpoint restores into them before the first window.
        with strategy.scope():
            self.optimizer.build([shard for group in self._groups for shard in group.shards])
        self._windows_done = tf.Variable(0, dtype=tf.int64, trainable=False, name="windows")
        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer,
                                              windows=self._windows_done)
        self._managers = {}

    def _window_fn(self, iterator):
        return self._window_body(iterator, read_outside=False)

    def _distributed_window_fn(self, iterator):
        """`_window_fn` for a distributed iterator (tf_keras fit), read outside replica_fn."""
        return self._window_body(iterator, read_outside=True)

    def _window_body(self, iterator, read_outside):
        def replica_fn(batches=None):
            variables = self.local_model.trainable_variables
            if batches is None:
                batches = [next(iterator) for _ in range(self.update_window)]
            # Which rows each step reads: a route pass per batch records every table lookup's
            # ids (its dense ops have no consumer and are pruned from the function).
            step_ids = []
            for features, _ in batches:
                route = _IdRecorder()
                with installed(route):
                    self.local_model(features, training=True)
                step_ids.append(self._ids_by_variable(route))
            # Pull: the dense parameters whole, and of each table only the rows the window
            # reads. A row is pulled before the first step that reads it; the pull of step s+1
            # depends only on the ps, so it overlaps step s's compute (every row a step updates
            # locally was read, hence pulled, earlier: the new rows never race with an update).
            # Per-worker variables get no automatic control dependencies: every read and update
            # below is ordered explicitly.
            pulls, seen, pulled = [[] for _ in batches], {}, []
            tables = set().union(*step_ids)
            for index, (variable, group) in enumerate(zip(variables, self._groups)):
                if index not in tables:
                    pulls[0].append(variable.assign(group.pull(), read_value=False))
                    pulled.append(tf.constant(
                        group.rows * int(np.prod(group.shards[0].shape[1:])), tf.int32))
                    continue
                for step, ids in enumerate(step_ids):
                    new = tf.unique(ids.get(index, tf.zeros([0], tf.int64)))[0]
                    if index in seen:
                        new = tf.sets.difference(new[None, :], seen[index][None, :]).values
                        seen[index] = tf.concat([seen[index], new], 0)
                    else:
                        seen[index] = new
                    rows = group.pull_rows(new)
                    pulls[step].append(variable.scatter_update(tf.IndexedSlices(rows, new)))
                    pulled.append(tf.size(rows))
            after = []
            totals = [None] * len(variables)
            losses = []
            for step, (features, labels) in enumerate(batches):
                with tf.control_dependencies(after + pulls[step]):
                    with tf.GradientTape() as tape:
                        outputs = self.local_model(features, training=True)
                        loss = user_function(self.loss_fn)(labels, outputs)
                    gradients = tape.gradient(loss, variables)
                    after = [self.local_optimizer.apply(v, g, s) for v, g, s in
                             zip(variables, gradients, self.local_slots)]
                totals = [_add(t, g) for t, g in zip(totals, gradients)]
                losses.append(loss)
            shard_gradients, shard_variables, pushed = [], [], []
            for group, total in zip(self._groups, totals):  # push the summed gradients
                if isinstance(total, tf.IndexedSlices):
                    total = _dedup(total)
                    pushed.append(tf.size(total.values))
                else:
                    pushed.append(tf.size(total))
                shard_gradients += group.split(total)
                shard_variables += group.shards
            with tf.control_dependencies(after):
                self.optimizer.apply_gradients(zip(shard_gradients, shard_variables))
            return tf.reduce_mean(tf.stack(losses)), tf.add_n(pushed), tf.add_n(pulled)

        if read_outside:
            return self.strategy.run(
                replica_fn, args=([next(iterator) for _ in range(self.update_window)],))
        return self.strategy.run(replica_fn)

    def _ids_by_variable(self, route):
        """{position of a table in the local model's trainable variables: the ids all lookups
        of that table recorded in `route`}."""
        positions = {id(v): i for i, v in enumerate(self.local_model.trainable_variables)}
        recorded = {}
        for layer, flat_ids in route.lookups:
            recorded.setdefault(positions[id(layer.embeddings)], []).append(flat_ids)
        return {position: tf.concat(parts, 0) for position, parts in recorded.items()}

    def global_values(self):
        """The model's parameters as NumPy arrays, rows in natural order (read from the ps)."""
        return [group.pull().numpy() for group in self._groups]

    def join(self):
        """`coordinator.join()`; a ps failure is raised as a `ParameterServerUnavailableError`
        that names the failed task and says how to resume (as `schedule` does), also when
        TensorFlow took it for a transient failure and would retry forever: while it waits,
        every ps address is probed, and one that refuses 3 probes in a row is a failure
        (`ps_watch`)."""
        addresses = getattr(self, "_ps_addresses", None)
        with explaining_ps_failures(addresses):
            call_watching_ps(self.coordinator.join, addresses)

    def _manager(self, directory, max_to_keep=3):
        if directory not in self._managers:
            self._managers[directory] = tf.train.CheckpointManager(
                self.checkpoint, directory, max_to_keep=max_to_keep)
        return self._managers[directory]

    def save(self, directory):
        """Joins, then writes the global model, the global optimizer and the number of windows
        run so far. Workers' local state (the local copy and local optimizer slots) is scratch
        and not saved.

        Args:
            directory: Where a `tf.train.CheckpointManager` keeps the checkpoints.

        Returns:
            The path of the checkpoint written.

        Raises:
            ParameterServerUnavailableError: A ps task failed (named, with the fix)."""
        self.join()
        self._windows_done.assign(self.windows)
        return self._manager(directory).save(checkpoint_number=self.windows)

    def restore(self, directory):
        """Restores the latest checkpoint of `directory` onto the (possibly restarted) ps tasks.

        Args:
            directory: Where `save` wrote.

        Returns:
            The number of windows the checkpoint had run (0 when there is none)."""
        latest = tf.train.latest_checkpoint(directory)
        if latest is None:
            return 0
        self.checkpoint.read(latest).assert_existing_objects_matched()
        self.windows = int(self._windows_done.numpy())
        return self.windows

    def schedule(self, iterator):
        """Schedules one window (T batches) on some worker.

        Args:
            iterator: A per-worker iterator (`coordinator.create_per_worker_dataset(...)`).

        Returns:
            A `RemoteValue` of (mean loss, values pushed, values pulled).

        Raises:
            ParameterServerUnavailableError: A ps failure of an earlier window (which
                `ClusterCoordinator` raises here), naming the task, as in `join`."""
        # schedule raises the error of an earlier window
        with explaining_ps_failures(getattr(self, "_ps_addresses", None)):
            remote = self.coordinator.schedule(self._window, args=(iterator,))
        self.windows += 1
        return remote
