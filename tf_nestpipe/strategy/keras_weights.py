"""tf_keras `get_weights()` / `set_weights()` of row-sharded tables hold whole tables.

Under a multi-worker `NestPipeStrategy` a row-sharded table's variable holds this worker's rows
only. Keras's weight-copy idiom (`other.set_weights(layer.get_weights())`, or a reference
model's weights copied into a sharded one) expects each weight whole, as it is in one process
and under MultiWorkerMirroredStrategy. So `get_weights()` returns every row-shard variable
(tables and their slots) as the whole table, in id order (an all-gather: every worker calls it
at the same point, as it saves), and `set_weights()` takes whole tables, keeping this worker's
rows of each; a value of another row count is refused naming both sizes.
"""
import functools

import numpy as np

from tf_nestpipe.sharding.row_shard import row_shard_layout
from tf_nestpipe.strategy.row_shard_saving import whole_table_values


def _sharded(variable):
    layout = row_shard_layout(variable)
    return layout if layout is not None and layout.num_shards > 1 else None


def own_rows(variable, value):
    """This worker's rows of `value`, the whole table of the row shard `variable` (any other
    variable's value is returned as it is)."""
    layout = _sharded(variable)
    if layout is None:
        return value
    value = np.asarray(value)
    rows = value.shape[0] if value.ndim else None
    if rows != layout.vocab_size:
        raise ValueError(
            "set_weights: the value for %s has shape %s, but under NestPipeStrategy a "
            "row-sharded table's weight is the whole table, %d rows (this worker holds %d of "
            "them): pass whole tables, as get_weights() returns them." % (
                variable.name, value.shape, layout.vocab_size, layout.local_rows))
    return value[layout.global_ids()]


def whole_get_weights(get_weights):
    """Wraps `Layer.get_weights`: row shards read as whole tables (a collective)."""
    @functools.wraps(get_weights)
    def wrapped(self):
        if not any(_sharded(v) for v in self.weights):
            return get_weights(self)
        with whole_table_values():
            return get_weights(self)

    return wrapped


def whole_set_weights(set_weights):
    """Wraps `Layer.set_weights`: whole tables set this worker's rows."""
    @functools.wraps(set_weights)
    def wrapped(self, weights):
        params = self.weights
        if len(params) == len(weights) and any(_sharded(v) for v in params):
            weights = [own_rows(param, value) for param, value in zip(params, weights)]
        return set_weights(self, weights)

    return wrapped
