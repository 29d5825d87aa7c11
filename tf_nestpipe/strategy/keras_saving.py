"""tf_keras saving under `NestPipeStrategy`: every Keras file holds whole tables.

`keras_saving_context(serving)` wraps tf_keras' save and load entry points (`Model.save`,
`save_weights`, `load_weights`, `load_model`; see `tf_nestpipe.keras_hooks`):
- `.h5` / `.weights.h5` / `.keras` files read each row shard as the whole table and load a whole
  table into this worker's rows (`row_shard_saving.whole_table_values`), so a file written on W
  workers (or by one process) loads on any number of workers;
- SavedModel (`model.save(dir)`, `serving=True`): the functions are traced with plain
  `tf.gather` lookups in the tables, which the SavedModel holds whole (`export.serving_trace`),
  so it loads and serves in a process without tf_nestpipe.
Every worker must save (the tables are gathered, a collective), each to its own path, as with
MultiWorkerMirroredStrategy: the chief's file is the one to keep.
"""
import contextlib

from tf_nestpipe.sharding.row_shard import is_row_shard, row_shard_layout
from tf_nestpipe.strategy.export import serving_trace
from tf_nestpipe.strategy.row_shard_saving import whole_table_values


@contextlib.contextmanager
def keras_saving_context(serving=False):
    """Whole-table Keras files; with `serving`, SavedModel functions traced for plain-TF
    serving (see module)."""
    with whole_table_values(), (serving_trace() if serving else contextlib.nullcontext()):
        yield


def check_load_by_name(model):
    """Refuses `model.load_weights(path, by_name=True)` when `model` holds tables sharded over
    more than one worker: tf_keras matches by name by comparing each variable's own shape (a
    row shard's) with the file's whole table, so it raised a generic shape error (and with
    `skip_mismatch=True` it would skip every table silently)."""
    sharded = [v.name for v in getattr(model, "weights", [])
               if is_row_shard(v) and row_shard_layout(v).num_shards > 1]
    if sharded:
        raise ValueError(
            "load_weights(..., by_name=True) is not supported for row-sharded tables on more "
            "than one worker (%s): load by topology instead (by_name=False, into a model built "
            "like the one that saved the file), or save and restore with tf.train.Checkpoint / "
            "tnp.ShardedCheckpoint, which match variables by object path on any worker count."
            % ", ".join(sharded))
