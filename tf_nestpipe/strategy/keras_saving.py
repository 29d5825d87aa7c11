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

from tf_nestpipe.strategy.export import serving_trace
from tf_nestpipe.strategy.row_shard_saving import whole_table_values


@contextlib.contextmanager
def keras_saving_context(serving=False):
    """Whole-table Keras files; with `serving`, SavedModel functions traced for plain-TF
    serving (see module)."""
    with whole_table_values(), (serving_trace() if serving else contextlib.nullcontext()):
        yield
