"""One packed all-reduce for a step's reads of sync-on-read variables (Keras metric states),
riding on the dense gradients' all-reduce when it can.

A Keras metric's `result()` reads its state variables in cross-replica context (tf_keras wraps
it in a `merge_call`), and every read of a sync-on-read variable there is a `strategy.reduce`
of its own: a Mean (the loss tracker) costs 2 collectives per step, an AUC 4, each paying
a CPU collective's fixed cost whatever its size. Inside `SummedReads.within_step` (entered around
a train / test step while it is traced) the step's variables (every metric's state) are packed
flat, one vector per dtype, and summed over the workers once per traced graph:

- in the dense gradients' all-reduce, if the step reaches it before any read (`riders`: the
  strategy appends the vectors to the gradients it sums anyway; no collective of their own):
  a TFRS `train_step` (metrics updated in `compute_loss`), and tf_keras' standard train step
  as the pipelines run it (metrics updated before the optimizer update);
- else at the first read, in an all-reduce of its own (evaluate's test step, a user's step).

Later reads, whoever reads (`get_metrics_result`, a TFRS `{m.name: m.result() ...}`, a user's
step), are answered from the sums if no op created after them in the traced graph writes the
variable (any op taking its handle that is not a `ReadVariableOp`): automatic control
dependencies run the summed reads after every write created before them, so the answer is the
variable's value at the read. A read of a variable written after the sums (a metric updated
after the gradients' all-reduce or after another metric's result was read) packs every variable
again, in an all-reduce of its own. The sums are bitwise those of per-variable all-reduces on
the socket mesh and Horovod (worker-order sums of the same values), and may differ in the last
bit on TensorFlow's ring for 3+ workers (another chunking).
"""
import contextlib
import dataclasses

import tensorflow as tf

_PACKED_AGGREGATIONS = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


def packable(variable):
    """Whether a read of `variable` in cross-replica context is an all-reduce `SummedReads` can
    pack: a distributed sync-on-read variable aggregated by SUM or MEAN."""
    return (isinstance(variable, tf.distribute.DistributedValues)
            and getattr(variable, "synchronization", None) == tf.VariableSynchronization.ON_READ
            and getattr(variable, "aggregation", None) in _PACKED_AGGREGATIONS
            and variable.shape.is_fully_defined())


@dataclasses.dataclass
class ReadCounts:
    """What the traced steps' cross-replica reads of packable step variables did."""

    packs: int = 0  # packs of the step's variables (each one all-reduce per dtype)
    riding: int = 0  # of which summed in the dense gradients' all-reduce (no collective of their own)
    packed: int = 0  # reads answered from a pack
    fresh: int = 0  # reads of a variable written after its pack (each made a new pack)


class _Pack:
    """A step's variables read in one traced graph, to be summed over the workers (`flats`, one
    per dtype; `take` their sums), and their handles there."""

    def __init__(self, graph, variables):
        self.graph = graph
        self.start = len(graph.get_operations())  # ops created from here on may write
        by_dtype = {}
        for variable in variables:
            by_dtype.setdefault(variable.dtype, []).append(variable)
        self._groups = []
        self._handles = {}
        for dtype in sorted(by_dtype, key=lambda d: d.name):
            reads = [variable.values[0].value() for variable in by_dtype[dtype]]
            for variable, read in zip(by_dtype[dtype], reads):
                self._handles[id(variable)] = _read_handle(read)
            self._groups.append((by_dtype[dtype], reads))
        self.flats = [tf.concat([tf.reshape(t, [-1]) for t in reads], 0)
                      for _, reads in self._groups]
        self.sums = {}  # id(variable) -> (variable, its sum over the workers)

    def take(self, summed):
        """Records the sums over the workers of `flats`."""
        for (variables, reads), total in zip(self._groups, summed):
            parts = tf.split(total, [t.shape.num_elements() for t in reads])
            for variable, read, part in zip(variables, reads, parts):
                self.sums[id(variable)] = (variable, tf.reshape(part, read.shape))

    def has(self, variable):
        entry = self.sums.get(id(variable))
        return entry is not None and entry[0] is variable

    def written_since(self, variable):
        """Whether an op created after this pack's reads may write `variable`."""
        handle = self._handles[id(variable)]
        return any(op.type != "ReadVariableOp" and any(_same(t, handle) for t in op.inputs)
                   for op in self.graph.get_operations()[self.start:])


def _read_handle(read):
    """The resource handle (as used in its graph) that the read tensor `read` reads."""
    op = read.op
    while op.type != "ReadVariableOp":
        op = op.inputs[0].op
    return op.inputs[0]


def _same(a, b):
    return a.op is b.op and a.value_index == b.value_index


class SummedReads:
    """Packed cross-replica reads of a step's sync-on-read variables (see the module).
    `sum_over_workers(tensors)` sums each local tensor over the workers (cross-replica
    context): a pack's all-reduce when it does not ride on the gradients' (`riders`)."""

    def __init__(self, sum_over_workers):
        self._sum_over_workers = sum_over_workers
        self._steps = []  # innermost last: [variables_fn, {graph: _Pack}]
        self.counts = ReadCounts()

    @contextlib.contextmanager
    def within_step(self, variables_fn):
        """Within this context, cross-replica reads of the packable variables of
        `variables_fn()` (called when a traced graph packs them, e.g. every metric's state
        variables) come from one packed all-reduce per dtype and graph."""
        self._steps.append((variables_fn, {}))
        try:
            yield
        finally:
            self._steps.pop()

    def _variables(self):
        variables_fn, _ = self._steps[-1]
        return list({id(v): v for v in variables_fn() if packable(v)}.values())

    def riders(self, dtypes=None):
        """Within a step whose graph has not packed its variables yet: a new pack of them,
        whose `flats` the caller sums in an all-reduce it issues anyway (the dense gradients')
        and hands back with `pack.take(sums)`; else None (also when `dtypes` is given and a
        variable has another dtype). Later reads are answered from it unless written after it
        (the step's metric updates must come before)."""
        if not self._steps:
            return None
        graph = tf.compat.v1.get_default_graph()
        packs = self._steps[-1][1]
        if graph in packs:
            return None
        variables = self._variables()
        if not variables or (dtypes is not None
                             and any(v.dtype not in dtypes for v in variables)):
            return None
        pack = packs[graph] = _Pack(graph, variables)
        self.counts.packs += 1
        self.counts.riding += 1
        return pack

    def read(self, reduce_op, value, num_replicas):
        """The cross-replica value of `value` (its sum, or mean for MEAN) from the innermost
        step's pack, or None when `value` is not one of its variables. A pack that misses
        `value` or its last write is replaced by a new one (one all-reduce for every
        variable)."""
        if not self._steps or not packable(value):
            return None
        variables = self._variables()
        if not any(v is value for v in variables):
            return None
        graph = tf.compat.v1.get_default_graph()
        packs = self._steps[-1][1]
        pack = packs.get(graph)
        if pack is not None and (not pack.has(value) or pack.written_since(value)):
            self.counts.fresh += 1  # written (or created) after the pack
            pack = None
        if pack is None:
            pack = packs[graph] = _Pack(graph, variables)
            pack.take(self._sum_over_workers(pack.flats))
            self.counts.packs += 1
        self.counts.packed += 1
        total = pack.sums[id(value)][1]
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            return total / tf.cast(num_replicas, total.dtype)
        return total
