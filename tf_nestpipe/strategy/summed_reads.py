"""One packed all-reduce for a step's reads of sync-on-read variables (Keras metric states).

A Keras metric's `result()` reads its state variables in cross-replica context (tf_keras wraps
it in a `merge_call`), and every read of a sync-on-read variable there is a `strategy.reduce`
of its own: a Mean (the loss tracker) costs 2 collectives per step, an AUC 4, each ~1-3 ms on
TensorFlow's CPU collectives whatever its size. `SummedReads.packed` sums the local values of
all the given variables in one all-reduce per dtype, packed flat, and answers the reads inside
the context from it. Within the context nothing may write the variables (reading results after
the step's `update_state` calls, as tf_keras' `get_metrics_result` does); the sums are bitwise
those of per-variable all-reduces on the socket mesh and Horovod (worker-order sums of the same
values), and may differ in the last bit on TensorFlow's ring for 3+ workers (another chunking).
"""
import contextlib

import tensorflow as tf

_PACKED_AGGREGATIONS = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


def packable(variable):
    """Whether a read of `variable` in cross-replica context is an all-reduce `SummedReads` can
    pack: a distributed sync-on-read variable aggregated by SUM or MEAN."""
    return (isinstance(variable, tf.distribute.DistributedValues)
            and getattr(variable, "synchronization", None) == tf.VariableSynchronization.ON_READ
            and getattr(variable, "aggregation", None) in _PACKED_AGGREGATIONS
            and variable.shape.is_fully_defined())


class SummedReads:
    """The packed sums of the variables of the innermost `packed` context (see the module)."""

    def __init__(self):
        self._sums = {}  # id(variable) -> (variable, its sum over the replicas)

    @contextlib.contextmanager
    def packed(self, variables):
        """In a replica context: sums the local values of the packable `variables` over all
        replicas (one all-reduce per dtype, issued on entry); inside, `read` answers their
        cross-replica reads from those sums."""
        chosen = {id(v): v for v in variables if packable(v)}
        context = tf.distribute.get_replica_context()
        if not chosen or context is None or tf.distribute.in_cross_replica_context():
            yield
            return
        sums = {}
        by_dtype = {}
        for variable in chosen.values():
            by_dtype.setdefault(variable.dtype, []).append(variable)
        dtypes = sorted(by_dtype, key=lambda d: d.name)
        local = [[tf.identity(v.values[0]) for v in by_dtype[dtype]] for dtype in dtypes]
        flats = [tf.concat([tf.reshape(t, [-1]) for t in tensors], 0) for tensors in local]
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, flats)
        for dtype, tensors, total in zip(dtypes, local, summed):
            parts = tf.split(total, [t.shape.num_elements() for t in tensors])
            for variable, tensor, part in zip(by_dtype[dtype], tensors, parts):
                sums[id(variable)] = (variable, tf.reshape(part, tf.shape(tensor)))
        previous = self._sums
        self._sums = {**previous, **sums}
        try:
            yield
        finally:
            self._sums = previous

    def read(self, reduce_op, value, num_replicas):
        """The packed cross-replica value of `value` (its sum, or mean for MEAN), or None when
        `value` is not one of the variables of an enclosing `packed` context."""
        entry = self._sums.get(id(value))
        if entry is None or entry[0] is not value:
            return None
        total = entry[1]
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            return total / tf.cast(num_replicas, total.dtype)
        return total
