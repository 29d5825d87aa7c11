"""Who fetches a sharded table's rows while a step is traced (docs/design/design.md §10).

A `ShardedEmbedding` layer asks the *installed row fetcher* for the rows of its ids. With none
installed that is `DirectFetcher`: the layer's own lookup (one table's synchronous exchange, a
local gather, or the ps gather). The pipelines (route pass, compute pass from prefetched
buffers, frozen windows), DOWNPOUR's route pass and export each install their own fetcher
explicitly for the passes they trace: this is the one control channel from the higher layers to
the layers, and it points down (the fetchers live above, the layer only calls `lookup`).
"""
import abc
import contextlib
import threading

import tensorflow as tf

_local = threading.local()


class RowFetcher(abc.ABC):
    """Returns the rows of a table lookup being traced."""

    @abc.abstractmethod
    def lookup(self, layer, flat_ids):
        """Rows `[n, layer.dim]` of the int64 vector `flat_ids` (already checked) of `layer`."""

    def lookup_dynamic(self, layer, flat_ids):
        """Rows of a `DynamicEmbedding` lookup (raw int64 ids). Dynamic tables are never
        prefetched: a fetcher that can let the table look up synchronously in the pass it
        traces (`layer.direct_lookup`) overrides this; by default the lookup is refused."""
        raise ValueError(
            "DynamicEmbedding '%s' cannot look up under %s: dynamic tables admit and evict ids "
            "once per training step, synchronously. Train it with fit or tnp.TrainPipeline "
            "(every pipeline: their frozen window looks the batch's micro-batches up as one "
            "step of the table) or a strategy.run loop without tnp.pipeline.frozen_window(), "
            "not DOWNPOUR; export with tnp.export_saved_model, not a SavedModel trace."
            % (layer.name, type(self).__name__))


class DirectFetcher(RowFetcher):
    """The layer's own lookup, nothing deferred or shared with other lookups."""

    def lookup(self, layer, flat_ids):
        return layer.direct_lookup(flat_ids)

    def lookup_dynamic(self, layer, flat_ids):
        return layer.direct_lookup(flat_ids)


_DIRECT = DirectFetcher()
_fallbacks = []


def set_fallback(choose):
    """Registers `choose()`: asked for a fetcher when none is installed (e.g. one that reads
    whole tables while TensorFlow's save context traces a SavedModel); None means direct."""
    _fallbacks.append(choose)


def _graph():
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()




def current_fetcher():
    """The fetcher installed in this thread (innermost) for the graph being traced, else a
    registered fallback's, else the `DirectFetcher`."""
    for fetcher, graph in reversed(getattr(_local, "stack", None) or []):
        if graph is None or graph is _graph():
            return fetcher
    for choose in _fallbacks:
        fetcher = choose()
        if fetcher is not None:
            return fetcher
    return _DIRECT


@contextlib.contextmanager
def installed(fetcher, any_graph=False):
    """Makes `fetcher` answer the sharded lookups traced in this thread inside the context, in
    the graph being traced when it is installed. Lookups traced in other graphs meanwhile are not
    the pass's and look up directly: tf_keras's scratch graphs (a layer inferring its output
    signature, a Sequential model building its functional graph on a first call), and the
    branches of a `tf.cond` in the model (traced alike in both passes). With `any_graph`, in
    every graph (e.g. the functions a SavedModel save traces)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append((fetcher, None if any_graph else _graph()))
    try:
        yield fetcher
    finally:
        stack.pop()
