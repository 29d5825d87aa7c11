"""The pipeline context: tells sharded embedding layers, while a step is traced, whether they
are routing the *next* batch or computing the *current* one from its prefetched buffer.

A table may be looked up several times in one step (e.g. once per micro-batch of the nested
pipeline): each lookup gets its own prefetch state, kept in call order, which is the same in the
route pass and the compute pass because both trace the same lookups on the same inputs."""
import contextlib
import threading

ROUTE = "route"
COMPUTE = "compute"

_local = threading.local()


class PipelineContext:
    """Per-trace bookkeeping: `states_in` maps each layer name to the list of prefetched states of
    the batch being computed (one per lookup, in call order); layers append the states they
    prefetch for the next batch to `states_out` (the same order on every worker)."""

    def __init__(self, mode, states_in=None):
        if mode not in (ROUTE, COMPUTE):
            raise ValueError("unknown pipeline mode %r" % mode)
        self.mode = mode
        self.states_in = {name: list(states) for name, states in (states_in or {}).items()}
        self.states_out = {}
        self.layers = {}

    def record(self, layer, state):
        """Route mode: appends a prefetched state of `layer` for the next step."""
        self.states_out.setdefault(layer.name, []).append(state)
        self.layers[layer.name] = layer

    def take(self, layer):
        """Compute mode: the next prefetched state of `layer` for the current batch."""
        if not self.states_in.get(layer.name):
            raise ValueError(
                "ShardedEmbedding '%s' has no prefetched rows for this lookup: the training step "
                "looked up the table more often than the route pass did. The route pass must call "
                "the model on the same inputs (and the same micro-batches); make the lookups "
                "depend only on the inputs." % layer.name)
        return self.states_in[layer.name].pop(0)

    def unused(self):
        """Names of layers with prefetched states the compute pass did not take."""
        return sorted(name for name, states in self.states_in.items() if states)


def current():
    """The active PipelineContext of this thread, or None outside a pipelined step."""
    return getattr(_local, "context", None)


@contextlib.contextmanager
def pipeline_mode(context):
    """Makes `context` current while a pipelined pass is traced."""
    previous = current()
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous
