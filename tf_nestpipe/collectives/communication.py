"""Cross-worker collectives used by the sharded embeddings: all-gather and padded all-to-all.

Collectives are issued on *streams* (see `Collectives.stream`). Each stream has an ordering token
(a resource), so TensorFlow's automatic control dependencies serialize one stream's collectives in
program order, identically on every worker, while different streams may overlap.

Every collective carries a *tag* (e.g. "user_table/keys"). Its instance key is derived from the
tag, its occurrence count inside the traced function and the bucket of its padded size, so a
function retraced on one worker but not on another still pairs the same collectives, and each
instance key always sees one shape (TensorFlow caches shapes by instance key).

Callers pass the real per-worker counts of a padded exchange (`send_counts`); this backend sends
the padded blocks whole (CollectiveAllToAllV2 needs equal splits), while
`horovod_collectives.HorovodCollectives` (same interface) sends only the data entries.
"""
import bisect
import contextlib
import threading
import weakref
import zlib

import numpy as np
import tensorflow as tf
from tf_nestpipe.tf_private import collective_ops, resource_variable_ops

from tf_nestpipe import ops
from tf_nestpipe.collectives.transport import Transport

CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation

# Our own group key, far from the ones MultiWorkerMirroredStrategy hands out (small integers).
_NESTPIPE_GROUP_KEY = 0x4E5050
_MAX_USES_PER_TAG = 64
# TensorFlow caches a collective's shape by instance key, so a tensor whose size changes from step
# to step (the padded key/row exchange) is padded to one of these capacities and each capacity
# gets its own instance key: bounded keys, fixed shape per key, at most ~19% padding.
_CAPACITIES = sorted({int(np.ceil(1.19 ** k)) for k in range(0, 124)})
_MAX_BUCKETS = 128
_EAGER_KEY_BASE = (1 << 30) + (1 << 29)  # eager collectives (full_table) take fresh keys above


MAX_BUCKET = len(_CAPACITIES) - 1
# The capacities, for an op that buckets a size itself (as `capacity_bucket` does) on its way.
EXCHANGE_CAPACITIES = tuple(_CAPACITIES)


def capacity_bucket(capacity):
    """Returns `(bucket, padded_capacity)`: the smallest bucketed capacity >= `capacity` (int32),
    a scalar, or elementwise for a vector of capacities."""
    return ops.capacity_bucket(capacity, _CAPACITIES)  # one op (it was four)


def static_capacity_bucket(capacity):
    """`capacity_bucket` of a Python int, as a Python int (the bucket index)."""
    return bisect.bisect_left(_CAPACITIES, int(capacity))


def resolve_implementation(implementation, device_type):
    """AUTO picks NCCL on GPU and RING on CPU; NCCL without a GPU falls back to RING."""
    if implementation in (None, CommunicationImplementation.AUTO):
        return CommunicationImplementation.NCCL if device_type == "GPU" else CommunicationImplementation.RING
    if implementation == CommunicationImplementation.NCCL and device_type != "GPU":
        return CommunicationImplementation.RING
    return implementation


class Collectives(Transport):
    """The "tf" transport: CollectiveGatherV2 / CollectiveAllToAllV2 over the group of all
    `num_workers` workers (the base of the other engines' streams and keys)."""

    name = "tf"

    @property
    def backend(self):
        """The engine's name (`name`), under its older spelling."""
        return self.name

    def __init__(self, num_workers, worker_index, device, implementation, timeout_seconds=0):
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.device = device
        self.implementation = implementation
        self.timeout_seconds = timeout_seconds
        self._hint = "nccl" if implementation == CommunicationImplementation.NCCL else "ring"
        self._lock = threading.Lock()
        self._key_owner = {}  # instance-key base -> tag, to refuse colliding tags
        self._uses_in_graph = weakref.WeakKeyDictionary()  # graph -> {tag: occurrences}
        self._last_in_graph = weakref.WeakKeyDictionary()  # graph -> {stream: last collective}
        self._stream = threading.local()
        self._tokens = {}
        for name in ("main", "prefetch"):
            self._ordering_token(name)
        self._eager_key = _EAGER_KEY_BASE

    def _occurrence(self, tag):
        """How many collectives with `tag` the function being traced issued before this one
        (refuses tags whose key ranges collide and tags used too often in one function)."""
        with self._lock:
            base = (zlib.crc32(tag.encode()) & 0x1FFFF) * _MAX_USES_PER_TAG
            if self._key_owner.setdefault(base, tag) != tag:
                raise ValueError("collective tags %r and %r collide; rename one of the tables"
                                 % (self._key_owner[base], tag))
            uses = self._uses_in_graph.setdefault(tf.compat.v1.get_default_graph(), {})
            count = uses.get(tag, 0)
            if count >= _MAX_USES_PER_TAG:
                raise ValueError("tag %r used more than %d times in one function"
                                 % (tag, _MAX_USES_PER_TAG))
            uses[tag] = count + 1
            return base, count

    def _instance_key(self, tag, bucket=None):
        if tf.executing_eagerly():
            with self._lock:
                self._eager_key += 1
                return self._eager_key
        base, count = self._occurrence(tag)
        key = 1 + (base + count) * _MAX_BUCKETS
        if bucket is None:
            return key
        return key + tf.cast(bucket, tf.int32)

    def _chained(self, tag, issue, bucket=None):
        eager = tf.executing_eagerly()
        graph = None if eager else tf.compat.v1.get_default_graph()
        stream = self.current_stream()
        previous = None if eager else self._last_in_graph.get(graph, {}).get(stream)
        deps = [previous] if previous is not None else []
        token = None if eager else self._ordering_token(stream).handle
        with tf.device(self.device), tf.control_dependencies(deps):
            out = issue(self._instance_key(tag, bucket), token)
        if not eager:
            self._last_in_graph.setdefault(graph, {})[stream] = out
        return out

    def _ordering_token(self, stream):
        with self._lock:
            if stream not in self._tokens:
                with tf.init_scope(), tf.device(self.device):
                    # Constructed directly (not tf.Variable) so no strategy creator intercepts it.
                    self._tokens[stream] = resource_variable_ops.ResourceVariable(
                        0.0, name="nestpipe_ordering_token_" + stream)
            return self._tokens[stream]

    def current_stream(self):
        """Name of the stream new collectives are chained on in this thread ("main" by default)."""
        return getattr(self._stream, "name", "main")

    @contextlib.contextmanager
    def stream(self, name):
        """Chains the collectives issued inside on their own stream: ordered among themselves
        (identically on every worker) but free to run concurrently with other streams, e.g. the
        next batch's prefetch alongside the current batch's gradient exchange."""
        previous = self.current_stream()
        self._stream.name = name
        try:
            yield
        finally:
            self._stream.name = previous

    def all_gather(self, tensor, tag):
        """Concatenates `tensor` (same shape on every worker) from all workers along axis 0."""
        if self.num_workers == 1:
            return tf.identity(tensor)
        return self._chained(tag, lambda key, token: collective_ops.all_gather_v2(
            tensor, self.num_workers, _NESTPIPE_GROUP_KEY, key,
            communication_hint=self._hint, timeout=self.timeout_seconds, ordering_token=token))

    def all_to_all(self, tensor, tag, bucket=None, send_counts=None, fill=0):
        """Sends `tensor[j]` to worker j and returns `[num_workers, ...]` with row i from worker i.

        A tensor whose shape varies between steps must pass the `bucket` of its padded size
        (see `capacity_bucket`), so that each shape has its own instance key. `send_counts[j]`
        (optional) is how many leading entries of `tensor[j]` carry data, the rest being padding:
        a backend with variable splits (`HorovodCollectives`) sends only those and fills the
        received padding with `fill`; CollectiveAllToAllV2 sends the padded tensor as it is.
        """
        del send_counts, fill  # equal splits: the padding travels with the data
        if self.num_workers == 1:
            return tf.identity(tensor)
        return self._chained(tag, lambda key, token: collective_ops.all_to_all_v2(
            tensor, self.num_workers, _NESTPIPE_GROUP_KEY, key,
            communication_hint=self._hint, timeout=self.timeout_seconds, ordering_token=token),
            bucket)

    def all_to_all_differentiable(self, tensor, tag, bucket=None, send_counts=None):
        """All-to-all whose gradient is the reverse all-to-all of the incoming gradient
        (`send_counts` as in `all_to_all`; padding entries carry no gradient that is used)."""

        @tf.custom_gradient
        def exchange(x):
            def grad(dy):
                return self.all_to_all(dy, tag + "/grad", bucket)

            return self.all_to_all(x, tag, bucket, send_counts), grad

        return exchange(tensor)
