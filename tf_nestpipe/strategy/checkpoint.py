"""Checkpoints of NestPipe training that restore on any number of workers.

Plain `tf.train.Checkpoint`s (and tf_keras `ModelCheckpoint` / `BackupAndRestore`) also work
under NestPipeStrategy: they gather every table whole (see `row_shard_saving`).
`ShardedCheckpoint(strategy, model=..., optimizer=...)`, for tables too big for one host, wraps a `tf.train.Checkpoint`. `save`
writes, per step, one TensorFlow checkpoint per worker (its own table row shards, the optimizer
slots next to them, and its copy of the mirrored dense state) plus a JSON manifest naming the
worker count; a step counts as written only once every worker finished (the manifest is written
last). `restore` on the same number of workers reads each worker's own file. On a different
number of workers, or under another placement, it reshards: every row-shard variable (tables
and their optimizer slots) is rebuilt from the rows of all old shards (row-wise, id k: old owner
k mod W, local row k // W; table_wise, every id on the one worker whose file holds all rows) into
its new layout (`ShardLayout`), dynamic tables re-hash every old worker's ids onto their new
owners with their rows, optimizer slots and counters (`sharding.dynamic_state`), and every other
variable is read from worker 0's file. The manifest records how each row-shard variable was
laid out when written (its table's rows, the worker count, the owner of a table_wise table;
every other variable was written whole), and a restore reads each file by that record: a file's
row count never decides whether it holds a whole table or one shard of a larger one. Build the
model and the
optimizer (`optimizer.build(model.trainable_variables)` inside `strategy.scope()`, so the slots
of row shards are row shards too) before a resharding restore.
"""
import json
import os
import re

import numpy as np
import tensorflow as tf
from tf_nestpipe.tf_private import graph_view, trackable_utils

from tf_nestpipe.sharding.layout import ShardLayout
from tf_nestpipe.strategy.nestpipe_strategy import row_shard_layout
from tf_nestpipe.sharding.dynamic_slots import dynamic_table_of
from tf_nestpipe.sharding.dynamic_state import (STATE_KEYS, DynamicTableSaveable, restored_rows,
                                                state_row_keys, whole_rows, whole_state)
from tf_nestpipe.strategy.row_shard_saving import local_shard_serialization

MANIFEST = "manifest.json"
# Manifests of this format record each row-shard variable's layout ("layouts"); format 1 did not.
LAYOUT_FORMAT = 2


def _step_dir(directory, step):
    return os.path.join(directory, "step-%d" % step)


def _worker_prefix(directory, step, rank, num_workers):
    return os.path.join(_step_dir(directory, step), "worker-%d-of-%d" % (rank, num_workers))


def latest_step(directory):
    """The newest step of `directory` whose manifest exists (every worker finished), or None."""
    if not tf.io.gfile.isdir(directory):
        return None
    steps = []
    for name in tf.io.gfile.listdir(directory):
        match = re.fullmatch(r"step-(\d+)/?", name)
        if match and tf.io.gfile.exists(os.path.join(directory, name.rstrip("/"), MANIFEST)):
            steps.append(int(match.group(1)))
    return max(steps) if steps else None


def _dynamic_table_states(root):
    """`(DynamicTableSaveable, object path)` of every dynamic table reachable from `root`."""
    objects, paths = graph_view.ObjectGraphView(root).breadth_first_traversal()
    return [(obj, trackable_utils.object_path_to_string(paths[obj])) for obj in objects
            if isinstance(obj, DynamicTableSaveable)]


def _variable_keys(root):
    """{variable: checkpoint key} for every variable reachable from `root`."""
    objects, paths = graph_view.ObjectGraphView(root).breadth_first_traversal()
    keys = {}
    for obj in objects:
        if isinstance(obj, tf.Variable):
            path = trackable_utils.object_path_to_string(paths[obj])
            keys[id(obj)] = (obj, trackable_utils.checkpoint_key(path, "VARIABLE_VALUE"))
    return list(keys.values())


class ShardedCheckpoint:
    """A checkpoint of `objects` for `strategy`'s workers that keeps tables sharded and
    restores on another worker count or placement (see the module docstring).

    Args:
        strategy: The `NestPipeStrategy`.
        **objects: Trackables to save, by name (e.g. `model=model, optimizer=optimizer,
            input=tnp.data.InputPosition()`)."""

    def __init__(self, strategy, **objects):
        self.strategy = strategy
        self.checkpoint = tf.train.Checkpoint(**objects)

    def _barrier(self, tag):
        if self.strategy.num_workers > 1:
            self.strategy.extended.collectives.all_gather(tf.constant([1], tf.int32), tag)

    def save(self, directory, step):
        """Writes this worker's part of step `step` (the manifest once every worker is done).
        Call on every worker at the same point of training.

        Args:
            directory: The checkpoint directory (`step-N/` subdirectories).
            step: The step number.

        Returns:
            The step's directory.
        """
        rank, workers = self.strategy.worker_index, self.strategy.num_workers
        prefix = _worker_prefix(directory, step, rank, workers)
        tf.io.gfile.makedirs(os.path.dirname(prefix))
        with local_shard_serialization():
            self.checkpoint.write(prefix)
        self._barrier("nestpipe/checkpoint_saved")
        if rank == 0:
            manifest = {"step": int(step), "num_workers": workers, "format": LAYOUT_FORMAT,
                        "layouts": _written_layouts(self.checkpoint)}
            with tf.io.gfile.GFile(os.path.join(_step_dir(directory, step), MANIFEST), "w") as f:
                f.write(json.dumps(manifest))
        self._barrier("nestpipe/checkpoint_manifest")
        return _step_dir(directory, step)

    def restore(self, directory, step=None):
        """Restores a step, on any number of workers (every table and slot resharded when the
        count or the placement differs). Call on every worker.

        Args:
            directory: The checkpoint directory.
            step: The step (default: the latest complete one).

        Returns:
            The step restored.

        Raises:
            FileNotFoundError: No complete step, or the step asked is incomplete.
            ValueError: A damaged manifest, variables missing from the step, or a table of
                another size (each named, with the fix).
        """
        step = latest_step(directory) if step is None else step
        if step is None:
            raise FileNotFoundError("no complete checkpoint (step-N/%s) in %s" % (MANIFEST, directory))
        manifest_path = os.path.join(_step_dir(directory, step), MANIFEST)
        if not tf.io.gfile.exists(manifest_path):
            raise FileNotFoundError("checkpoint step %d in %s is incomplete (no %s): a worker did "
                                    "not finish writing it" % (step, directory, MANIFEST))
        manifest = read_manifest(manifest_path)
        saved_workers = manifest["num_workers"]
        rank, workers = self.strategy.worker_index, self.strategy.num_workers
        readers = [tf.train.load_checkpoint(_worker_prefix(directory, step, k, saved_workers))
                   for k in range(saved_workers)]
        shapes = [reader.get_variable_to_shape_map() for reader in readers]
        variables = _variable_keys(self.checkpoint)
        saved = _saved_layouts(manifest, variables, shapes, manifest_path)
        # Every worker checks every table against all files before reading any: a table of
        # another size is refused on all of them (never restored wrongly on some).
        _check_table_sizes(variables, saved, shapes, step, directory)
        if saved_workers == workers and _same_placement(variables, saved, shapes[rank]):
            with local_shard_serialization():
                self.checkpoint.read(_worker_prefix(directory, step, rank, workers)).assert_consumed()
            return step
        available = set(shapes[0])
        # Dynamic tables: every old worker's ids re-hashed onto this run (see dynamic_state).
        tables = {id(saveable._layer): (saveable, whole_state([  # pylint: disable=protected-access
            {name: reader.get_tensor(trackable_utils.checkpoint_key(path, name))
             for name in STATE_KEYS} for reader in readers]))
                  for saveable, path in _dynamic_table_states(self.checkpoint)}
        missing = []
        for variable, key in variables:
            if key not in available:
                missing.append(key)
                continue
            table = dynamic_table_of(variable)
            if table is not None:
                state = tables[id(table)][1]
                whole = whole_rows([reader.get_tensor(key) for reader in readers])
                variable.assign(restored_rows(table, variable, state_row_keys(state),
                                              tf.constant(whole)))
                continue
            layout, old = row_shard_layout(variable), saved.get(key)
            if old is None:  # written whole: worker 0's file holds the value
                value = readers[0].get_tensor(key)
                if layout is not None:  # a replicated table restored row-wise: this worker's rows
                    value = value[layout.global_ids()]
            else:
                if layout is None:  # row shards restored into a replicated table: every row
                    layout = ShardLayout(old.vocab_size, 1)
                value = _reshard_rows([reader.get_tensor(key) for reader in readers], old, layout)
            variable.assign(value)
        for saveable, state in tables.values():
            saveable._restore_from_tensors(  # pylint: disable=protected-access
                {name: tf.constant(value) for name, value in state.items()})
        if missing:
            raise ValueError("variables %s are not in checkpoint step %d of %s (a model or "
                             "optimizer of another shape?)" % (missing, step, directory))
        return step


def _written_layouts(root):
    """{checkpoint key: {"vocab_size", "num_shards", "owner_shard"}} of every row-shard
    variable (table or optimizer slot) reachable from `root`, as this save writes it; every
    other variable is written whole. Dynamic tables restore by their ids, not by a layout."""
    layouts = {}
    for variable, key in _variable_keys(root):
        layout = row_shard_layout(variable)
        if layout is not None and dynamic_table_of(variable) is None:
            layouts[key] = {"vocab_size": layout.vocab_size, "num_shards": layout.num_shards,
                            "owner_shard": layout.owner_shard}
    return layouts


def _saved_layouts(manifest, variables, shapes, manifest_path):
    """{checkpoint key: ShardLayout (shard 0) it was written with} of every variable written as
    row shards; a key not in it was written whole.

    A manifest without layouts (format 1) records no layout: files of unequal row counts are
    row shards; a row shard whose files all hold its current shard's rows resumes in place; any
    other row shard whose files hold equal row counts (a whole table, or shards of a table that
    many times larger: the files cannot tell) is refused, naming the way to restore it."""
    if "layouts" in manifest:
        return {key: ShardLayout(int(spec["vocab_size"]), 1, int(spec["num_shards"]), 0,
                                 owner_shard=spec["owner_shard"])
                for key, spec in manifest["layouts"].items()}
    layouts = {}
    for variable, key in variables:
        if dynamic_table_of(variable) is not None or any(key not in s for s in shapes) or \
                variable.shape.rank is None or variable.shape.rank < 1:
            continue
        rows = _saved_rows(key, shapes)
        if len(rows) == 1:
            continue  # one worker: its file holds the whole table either way
        if len(set(rows)) > 1:
            layouts[key] = _format1_layout(rows)
        elif row_shard_layout(variable) is not None:
            current = row_shard_layout(variable)
            if (current.num_shards, current.local_rows) == (len(rows), rows[0]) and \
                    not current.table_wise and current.vocab_size % len(rows) == 0:
                # The layout this run writes itself (same workers, same shard rows): the
                # per-worker files resume as they are.
                layouts[key] = ShardLayout(current.vocab_size, 1, len(rows), 0)
                continue
            raise ValueError(
                "cannot restore %s from %s: the checkpoint was written by a tf_nestpipe that "
                "did not record table layouts, and each of its %d files holds %d rows (a whole "
                "replicated table, or row shards of a table of %d rows). Restore it with a "
                "tf_nestpipe of that version on the worker count and placement it was written "
                "with, then save it again." % (variable.name, manifest_path, len(rows), rows[0],
                                               rows[0] * len(rows)))
    return layouts


def _format1_layout(rows):
    """The layout of row shards of unequal row counts `rows` (one per old worker): one file
    holding every row is a table_wise table on that worker, anything else row-wise."""
    total = sum(rows)
    owner = rows.index(max(rows))
    if rows[owner] == total:
        return ShardLayout(total, 1, len(rows), 0, owner_shard=owner)
    return ShardLayout(max(total, 1), 1, len(rows), 0)


def read_manifest(path):
    """The manifest of a step (`{"step", "num_workers", "format"}`); a damaged one is refused
    with its path and what to do."""
    with tf.io.gfile.GFile(path) as f:
        text = f.read()
    try:
        manifest = json.loads(text)
    except ValueError as error:
        manifest, problem = None, "is not valid JSON (%s)" % error
    else:
        problem = "has no integer num_workers"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("num_workers"), int) \
            or manifest["num_workers"] < 1:
        raise ValueError(
            "checkpoint manifest %s %s: the step was not written completely or the file was "
            "damaged. Restore another step (ShardedCheckpoint.restore(directory, step=N)) or "
            "delete that step's directory so that the latest complete step is used."
            % (path, problem))
    return manifest


def _same_placement(variables, saved, shapes):
    """Whether every variable is laid out as when written (same table size, worker count and
    owner, or whole then and now) and has the shape this worker's file holds for it, so the
    file restores as it is."""
    for variable, key in variables:
        if key not in shapes:
            continue
        layout, old = row_shard_layout(variable), saved.get(key)
        if dynamic_table_of(variable) is None and not _same_layout(layout, old):
            return False
        if list(shapes[key]) != variable.shape.as_list():
            return False
    return True


def _same_layout(layout, old):
    if layout is None or old is None:
        return layout is None and old is None
    return (layout.vocab_size, layout.num_shards, layout.owner_shard) == (
        old.vocab_size, old.num_shards, old.owner_shard)


def _saved_rows(key, shapes):
    return [int(shape[key][0]) if shape[key] else 0 for shape in shapes]


def _check_table_sizes(variables, saved, shapes, step, directory):
    """Refuses to restore a table (or slot) from a checkpoint of a table of another size: a
    table written as row shards has the rows its manifest records, one written whole the rows
    of its file."""
    for variable, key in variables:
        layout, old = row_shard_layout(variable), saved.get(key)
        if layout is None and old is None or any(key not in shape for shape in shapes):
            continue  # whole then and now: TensorFlow checks the shape; missing keys: restore
        if dynamic_table_of(variable) is not None:
            continue  # re-hashed by id: its owners' capacities are checked then
        old_rows = old.vocab_size if old is not None else (
            int(shapes[0][key][0]) if shapes[0][key] else 0)
        new_rows = layout.vocab_size if layout is not None else (
            int(variable.shape[0]) if variable.shape.rank else 0)
        old_tail = list(shapes[0][key][1:])
        new_tail = variable.shape.as_list()[1:]
        if old_rows != new_rows or old_tail != new_tail:
            raise ValueError(
                "cannot restore %s from checkpoint step %d of %s: it was written for a table of "
                "%d rows x %s, this model's table has %d rows x %s. Build the model with the "
                "table size the checkpoint was written with." % (
                    variable.name, step, directory, old_rows, old_tail, new_rows, new_tail))


def _reshard_rows(old_shards, old, layout):
    """This worker's rows under `layout` from the row shards `old_shards` (one per old worker)
    written under the layout `old` (row-wise: id k on old shard k mod W at row k // W;
    table_wise: every id on its owner)."""
    ids = layout.global_ids()
    rows = np.zeros((len(ids),) + old_shards[0].shape[1:], old_shards[0].dtype)
    owners = old.owner(ids)
    for owner in range(len(old_shards)):
        mine = owners == owner
        rows[mine] = old_shards[owner][old.local_row(ids[mine])]
    return rows
