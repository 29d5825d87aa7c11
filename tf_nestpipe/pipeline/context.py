"""The pipeline context: tells sharded embedding layers, while a step is traced, whether they
are routing the *next* batch or computing the *current* one from its prefetched buffer."""
import contextlib
import threading

ROUTE = "route"
COMPUTE = "compute"

_local = threading.local()


class PipelineContext:
    """Per-trace bookkeeping: `states_in` holds each layer's prefetched state for the batch being
    computed; layers record the state they prefetch for the next batch in `states_out`, in call
    order (the same on every worker)."""

    def __init__(self, mode, states_in=None):
        if mode not in (ROUTE, COMPUTE):
            raise ValueError("unknown pipeline mode %r" % mode)
        self.mode = mode
        self.states_in = dict(states_in or {})
        self.states_out = {}
        self.layers = {}

    def record(self, layer, state):
        """Route mode: stores the prefetched state of `layer` for the next step."""
        if layer.name in self.states_out:
            raise ValueError(
                "ShardedEmbedding '%s' was called twice in one pipelined step; a pipelined table "
                "must be looked up once per step (concatenate the ids, or use "
                "pipeline='none')" % layer.name)
        self.states_out[layer.name] = state
        self.layers[layer.name] = layer

    def take(self, layer):
        """Compute mode: returns the prefetched state of `layer` for the current batch."""
        if layer.name not in self.states_in:
            raise ValueError(
                "ShardedEmbedding '%s' has no prefetched rows for this step: the model looked up "
                "a table in the training step that it did not look up when routing the batch. "
                "The route pass calls the model on the same inputs; make the lookups depend only "
                "on the inputs." % layer.name)
        return self.states_in.pop(layer.name)


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
