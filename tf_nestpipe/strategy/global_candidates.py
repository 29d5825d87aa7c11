"""Global in-batch negatives for TFRS retrieval under `NestPipeStrategy`.

`tfrs.tasks.Retrieval(query, candidates)` scores every query against the candidates of its batch:
on W workers each worker's batch is 1/W of the global batch, so each query sees 1/W of the
negatives one process sees, and the model trained differs. `global_in_batch_candidates(c)`
all-gathers the candidate embeddings of every worker, this worker's first (Retrieval takes the
first `num_queries` candidates as the positives, the rest as extra negatives), so each query is
scored against the whole global batch, as in one process. Its gradient returns each worker's
share to the worker that computed it (an all-to-all, summed there). Extra tensors
(`candidate_ids`, `candidate_sampling_probability`) are gathered in the same order, without
gradient. Every worker's local batch must have the same size (`drop_remainder=True`).

`warn_local_negatives` wraps `Retrieval.__call__`: on more than one worker, a call whose
candidates did not come from `global_in_batch_candidates` warns once per task.
"""
import warnings
import weakref

import tensorflow as tf

from tf_nestpipe import tf_private

_gathered = weakref.WeakKeyDictionary()  # graph -> set of refs of gathered candidate tensors


class LocalNegativesWarning(UserWarning):
    """TFRS retrieval on several workers scoring only this worker's in-batch negatives."""


def _strategy_or_none():
    from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy  # avoid a cycle

    strategy = tf.distribute.get_strategy()
    return strategy if isinstance(strategy, NestPipeStrategy) else None


def _mark(tensor):
    graph = tf.compat.v1.get_default_graph()
    _gathered.setdefault(graph, set()).add(tensor.ref())
    return tensor


def is_global(tensor):
    """True if `tensor` was returned by `global_in_batch_candidates` in the current graph."""
    refs = _gathered.get(tf.compat.v1.get_default_graph(), set())
    return hasattr(tensor, "ref") and tensor.ref() in refs


def global_in_batch_candidates(candidate_embeddings, *extra, strategy=None):
    """Every worker's in-batch candidates, this worker's first (see module), for TFRS
    retrieval on the global batch's negatives. Call in the replica context of a
    `NestPipeStrategy` step, on every worker; local batches must be equal.

    Args:
        candidate_embeddings: `[b, d]` this worker's candidate embeddings.
        *extra: Tensors gathered alike (`[b, ...]` each), e.g. candidate ids or sampling
            probabilities.
        strategy: Default: the current one.

    Returns:
        `[W * b, d]` candidates; with `extra`, `(candidates, *gathered_extra)`. Gradients go
        back to each candidate's worker."""
    strategy = strategy or _strategy_or_none()
    if strategy is None or strategy.num_workers == 1:
        return (candidate_embeddings,) + extra if extra else candidate_embeddings
    collectives = strategy.extended.collectives
    workers, rank = strategy.num_workers, strategy.worker_index
    candidate_embeddings = tf.convert_to_tensor(candidate_embeddings)
    rows = tf.shape(candidate_embeddings)[0]
    sizes = collectives.all_gather(tf.reshape(rows, [1]), "nestpipe/candidates/rows")
    check = tf.debugging.assert_equal(
        sizes, tf.fill([workers], rows),
        message="global_in_batch_candidates needs the same local batch size on every worker "
                "(batch the dataset with drop_remainder=True)")
    with tf.control_dependencies([check]):
        rows = tf.identity(rows)

    @tf.custom_gradient
    def gather(local):
        everyone = collectives.all_gather(local, "nestpipe/candidates")

        def grad(upstream):
            # Row block j of `upstream` is this worker's gradient for worker j's candidates:
            # send it there, and sum what every worker computed for ours.
            blocks = tf.reshape(upstream, tf.concat([[workers, rows], tf.shape(local)[1:]], 0))
            received = collectives.all_to_all(blocks, "nestpipe/candidates/grad")
            return tf.reduce_sum(received, axis=0)

        return everyone, grad

    def own_first(gathered):
        return tf.roll(gathered, shift=-rank * rows, axis=0)

    candidates = _mark(own_first(gather(candidate_embeddings)))
    if not extra:
        return candidates
    others = tuple(own_first(collectives.all_gather(tf.convert_to_tensor(t),
                                                    "nestpipe/candidates/extra%d" % i))
                   for i, t in enumerate(extra))
    return (candidates,) + others


def warn_local_negatives(layer_call):
    """Wraps `tfrs.tasks.Retrieval.__call__` (see module); Keras still converts and runs the
    task's own `call`."""
    def wrapped(self, *args, **kwargs):
        candidates = args[1] if len(args) > 1 else kwargs.get("candidate_embeddings")
        strategy = _strategy_or_none()
        if (strategy is not None and strategy.num_workers > 1 and not is_global(candidates)
                and not getattr(self, "_nestpipe_warned", False)):
            self._nestpipe_warned = True  # pylint: disable=protected-access
            warnings.warn(
                "tfrs.tasks.Retrieval %r on %d workers scores each query against this worker's "
                "in-batch candidates only (1/%d of the global batch's negatives), so the model "
                "differs from one process. Pass tnp.global_in_batch_candidates(candidates) for "
                "the global batch's negatives." % (self.name, strategy.num_workers,
                                                   strategy.num_workers),
                LocalNegativesWarning, stacklevel=2)
        return layer_call(self, *args, **kwargs)

    return tf_private.mark_hooked(wrapped)


def hook_tfrs():
    """Wraps `tfrs.tasks.Retrieval.call` if TFRS is imported (idempotent)."""
    import sys

    tfrs = sys.modules.get("tensorflow_recommenders")
    if tfrs is None:
        return
    retrieval = tfrs.tasks.Retrieval
    if not tf_private.is_hooked(retrieval.__call__):
        retrieval.__call__ = warn_local_negatives(retrieval.__call__)
