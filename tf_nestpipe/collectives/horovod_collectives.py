"""Horovod (Gloo) as the collectives backend of `NestPipeStrategy(collectives="horovod")`.

`HorovodCollectives` has the interface of `Collectives` (all-gather, all-to-all, streams), but
every exchange goes through Horovod: the embedding all-to-alls use `hvd.alltoall` with the *real*
split sizes, so only the rows that carry data travel (TensorFlow's CollectiveAllToAllV2 needs
equal splits and sends each padded `[num_workers, capacity]` block whole). The compute side keeps
the padded slot layout the custom ops and the pipeline buffers index: a worker packs the data
entries before sending and unpacks what it received into that layout.

Horovod pairs collectives across workers by *name*, not by launch order, so every op gets a
name made of its tag and its occurrence in the traced function (like the TF backend's instance
keys): a function retraced on one worker only still pairs up. Ops of one stream stay chained in
program order.

The cluster is Horovod's: `hvd.rank()` is the worker index (the table shard it owns),
`hvd.size()` the number of workers. Under `TF_CONFIG` (our launcher with `--horovod`) both must
agree with it; under `horovodrun --gloo` there is no `TF_CONFIG` at all.
"""
import itertools
import threading

import tensorflow as tf

from tf_nestpipe.tf_config import parse_tf_config
from tf_nestpipe.collectives.communication import Collectives

INSTALL_HINT = ("collectives='horovod' needs Horovod built against this TensorFlow: run "
                "scripts/install_horovod.sh (Horovod 0.28.1 with Gloo, about 2.5 minutes), or "
                "use collectives='tf'")


class HorovodUnavailableError(ImportError):
    """Raised when collectives="horovod" is asked for but `horovod.tensorflow` does not import."""


class HorovodClusterError(RuntimeError):
    """Raised when Horovod's cluster (rank, size) does not match `TF_CONFIG`'s."""


def import_horovod():
    """Imports `horovod.tensorflow`, or raises `HorovodUnavailableError` naming the install
    script."""
    try:
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise HorovodUnavailableError("%s (import horovod.tensorflow failed: %s)"
                                      % (INSTALL_HINT, e)) from e
    return hvd


def init_horovod():
    """Initializes Horovod (once per process) and checks its cluster against `TF_CONFIG`.

    Returns `(hvd, rank, size)`. With a `TF_CONFIG`, `hvd.size()` must be its number of
    synchronous workers (chief + workers) and `hvd.rank()` this task's position among them
    (chief first), as `python -m tf_nestpipe.launch --horovod` sets them; without one (e.g.
    under `horovodrun --gloo`) Horovod's cluster is used as it is.
    """
    hvd = import_horovod()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    config = parse_tf_config()
    if config is not None:
        if size != config.num_workers:
            raise HorovodClusterError(
                "collectives='horovod': hvd.size() is %d but TF_CONFIG has %d synchronous "
                "workers (chief + workers). Start every worker with Horovod's environment: "
                "`python -m tf_nestpipe.launch --workers %d --horovod -- ...` or "
                "`horovodrun --gloo -np %d ...` without TF_CONFIG"
                % (size, config.num_workers, config.num_workers, config.num_workers))
        expected = config.task_index
        if config.task_type == "worker":
            expected += len(config.cluster.get("chief", []))
        elif config.task_type != "chief":
            raise HorovodClusterError("collectives='horovod' runs on chief and worker tasks "
                                      "only; this task is %s:%d" % (config.task_type,
                                                                    config.task_index))
        if rank != expected:
            raise HorovodClusterError(
                "collectives='horovod': hvd.rank() is %d but this TF_CONFIG task (%s:%d) is "
                "synchronous worker %d; set HOROVOD_RANK to the task's position (chief first), "
                "as `python -m tf_nestpipe.launch --horovod` does"
                % (rank, config.task_type, config.task_index, expected))
    return hvd, rank, size


def _op_name(tag, count):
    # Horovod names must be valid TF op names; with ignore_name_scope only the text after the
    # last "/" would count, so the tag's "/" become ".".
    return "nestpipe.%s.%d" % (tag.replace("/", ".").replace(":", "."), count)


# Up to this many peers, pack / unpack copy one slice per peer (memcpy speed); beyond, one gather
# (a fixed number of ops, but per-element work: several times slower for scalar entries).
_MAX_PEERS_SLICED = 32


def pack(tensor, counts):
    """The first `counts[j]` entries of each `tensor[j]`, concatenated: `[sum(counts), ...]`."""
    counts = tf.cast(counts, tf.int32)
    peers = tensor.shape[0]
    if peers is not None and peers <= _MAX_PEERS_SLICED:
        return tf.concat([tensor[j, :counts[j]] for j in range(peers)], 0)
    shape = tf.shape(tensor)
    starts = tf.range(shape[0]) * shape[1]
    rows = tf.ragged.range(starts, starts + counts).flat_values
    return tf.gather(tf.reshape(tensor, tf.concat([[-1], shape[2:]], 0)), rows)


def unpack(flat, counts, capacity, fill, peers=None):
    """Inverse of `pack`: `[peers, capacity, ...]` (`peers` = `len(counts)`), entry j holding the
    next `counts[j]` rows of `flat` followed by `fill`."""
    counts = tf.cast(counts, tf.int32)
    capacity = tf.cast(capacity, tf.int32)
    fill = tf.cast(fill, flat.dtype)
    peers = peers if peers is not None else counts.shape[0]
    if peers is not None and peers <= _MAX_PEERS_SLICED:
        padding = [[0, 0]] * (flat.shape.rank - 1)
        parts = tf.split(flat, counts, num=peers)
        return tf.stack([tf.pad(part, [[0, capacity - counts[j]]] + padding, constant_values=fill)
                         for j, part in enumerate(parts)])
    offsets = tf.cumsum(counts, exclusive=True)
    position = tf.range(capacity)[None, :]
    # Slot (j, k) reads row offsets[j] + k of `flat`, or the fill row appended after the data.
    source = tf.where(position < counts[:, None], offsets[:, None] + position, tf.shape(flat)[0])
    fill_row = tf.fill(tf.concat([[1], tf.shape(flat)[1:]], 0), fill)
    rows = tf.gather(tf.concat([flat, fill_row], 0), tf.reshape(source, [-1]))
    return tf.reshape(rows, tf.concat([[tf.size(counts), capacity], tf.shape(flat)[1:]], 0))


class HorovodCollectives(Collectives):
    """`Collectives` over Horovod: `hvd.allgather` and `hvd.alltoall` with real split sizes
    (see the module docstring); `all_reduce_sum` sums dense gradients with `hvd.allreduce`.
    Horovod has no per-collective timeout: `HOROVOD_GLOO_TIMEOUT_SECONDS` bounds Gloo's waits."""

    name = "horovod"
    sends_real_splits = True
    reduces_dense = True
    reduces_sparse = True
    gathers = True
    broadcasts_initial_values = True

    def __init__(self, hvd, num_workers, worker_index, device, timeout_seconds=0):
        super().__init__(num_workers, worker_index, device, implementation=None,
                         timeout_seconds=timeout_seconds)
        self.hvd = hvd
        self._eager_names = itertools.count()
        self._initial_values = itertools.count()
        self._eager_lock = threading.Lock()

    def _ordering_token(self, stream):
        return None  # Horovod ops take no ordering token: a stream is a chain of control deps

    def _name(self, tag):
        if tf.executing_eagerly():
            # Eager collectives run one at a time, in the same order on every worker.
            with self._eager_lock:
                return "nestpipe.eager.%d" % next(self._eager_names)
        _, count = self._occurrence(tag)
        return _op_name(tag, count)

    def _issue(self, tag, issue):
        """Runs `issue(name)` on this worker's device, after the stream's previous collective."""
        eager = tf.executing_eagerly()
        graph = None if eager else tf.compat.v1.get_default_graph()
        stream = self.current_stream()
        previous = None if eager else self._last_in_graph.get(graph, {}).get(stream)
        deps = [previous] if previous is not None else []
        with tf.device(self.device), tf.control_dependencies(deps):
            out = issue(self._name(tag))
        if not eager:
            first = tf.nest.flatten(out)[0]
            self._last_in_graph.setdefault(graph, {})[stream] = first
        return out

    def all_gather(self, tensor, tag):
        """Concatenates `tensor` from all workers along axis 0 (`hvd.allgather`; the first
        dimension may differ between workers)."""
        if self.num_workers == 1:
            return tf.identity(tensor)
        return self._issue(tag, lambda name: self.hvd.allgather(
            tensor, name=name, ignore_name_scope=True))

    def _alltoall(self, flat, splits, name):
        out, received = self.hvd.alltoall(flat, splits=tf.cast(splits, tf.int32), name=name,
                                          ignore_name_scope=True)
        return out, received

    def all_to_all_with_counts(self, tensor, tag, send_counts, fill=0):
        """`all_to_all` of a padded `[num_workers, capacity, ...]` tensor sending only the first
        `send_counts[j]` entries of row j; returns `(received, received_counts)` with the
        received rows unpacked into the same padded layout (`fill` after the data)."""
        capacity = tf.shape(tensor)[1]

        def issue(name):
            flat, received = self._alltoall(pack(tensor, send_counts), send_counts, name)
            return unpack(flat, received, capacity, fill, self.num_workers), received

        return self._issue(tag, issue)

    def all_to_all(self, tensor, tag, bucket=None, send_counts=None, fill=0):
        """Sends `tensor[j]` to worker j and returns `[num_workers, ...]` with row i from worker i.

        With `send_counts`, only the first `send_counts[j]` entries of `tensor[j]` travel and the
        received padding is `fill` (real split sizes, no padded bucket on the wire); without,
        every row travels whole. `bucket` is not needed (Horovod pairs ops by name).
        """
        del bucket
        if self.num_workers == 1:
            return tf.identity(tensor)
        if send_counts is None:
            rows = tf.shape(tensor)[1:]

            def issue(name):
                flat = tf.reshape(tensor, tf.concat([[-1], tf.shape(tensor)[2:]], 0))
                even = tf.fill([self.num_workers], tf.shape(flat)[0] // self.num_workers)
                out, _ = self._alltoall(flat, even, name)
                return tf.reshape(out, tf.concat([[self.num_workers], rows], 0))

            out = self._issue(tag, issue)
            out.set_shape(tensor.shape)
            return out
        out, _ = self.all_to_all_with_counts(tensor, tag, send_counts, fill)
        out.set_shape(tensor.shape)
        return out

    def all_to_all_differentiable(self, tensor, tag, bucket=None, send_counts=None):
        """All-to-all whose gradient is the reverse all-to-all of the incoming gradient; with
        `send_counts`, both directions carry only the entries that hold data."""
        if self.num_workers == 1 or send_counts is None:
            return super().all_to_all_differentiable(tensor, tag, bucket)

        @tf.custom_gradient
        def exchange(x):
            out, received = self.all_to_all_with_counts(x, tag, send_counts)
            out.set_shape(x.shape)

            def grad(dy):
                back, _ = self.all_to_all_with_counts(dy, tag + "/grad", received)
                back.set_shape(x.shape)
                return back

            return out, grad

        return exchange(tensor)

    def all_reduce_sum(self, tensors, tag):
        """Sums each tensor (or `IndexedSlices`) of `tensors` over all workers with Horovod
        (`hvd.grouped_allreduce` for the dense ones, one negotiation for all)."""
        tensors = list(tensors)
        if self.num_workers == 1:
            return [tf.identity(t) if not isinstance(t, tf.IndexedSlices) else t for t in tensors]
        # Its own stream: not chained behind the embedding exchanges of the step.
        with self.stream("all_reduce"):
            return self._all_reduce_sum(tensors, tag)

    def _all_reduce_sum(self, tensors, tag):
        out = [None] * len(tensors)
        dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
        if dense:
            summed = self._issue(tag, lambda name: self.hvd.grouped_allreduce(
                [tensors[i] for i in dense], op=self.hvd.Sum, name=name,
                ignore_name_scope=True))
            for i, value in zip(dense, summed):
                out[i] = value
        for i, t in enumerate(tensors):
            if out[i] is None:
                # Sparse: all-gather the values and indices (duplicate indices sum when applied).
                out[i] = tf.IndexedSlices(self.all_gather(t.values, "%s/sparse%d/values" % (tag, i)),
                                          self.all_gather(t.indices, "%s/sparse%d/indices" % (tag, i)),
                                          t.dense_shape)
        return out

    def broadcast_initial_value(self, tensor):
        """Worker 0's `tensor` on every worker, for a mirrored variable's initial value. Every
        worker creates its variables in the same order, so a running count names them."""
        if self.num_workers == 1:
            return tensor
        with self._eager_lock:
            name = "nestpipe.initial_value.%d" % next(self._initial_values)
        with tf.device(self.device):
            return self.hvd.broadcast(tensor, root_rank=0, name=name, ignore_name_scope=True)

    def broadcast(self, tensor, tag, root=0):
        """`tensor` as worker `root` holds it, on every worker (`hvd.broadcast`)."""
        if self.num_workers == 1:
            return tf.identity(tensor)
        return self._issue(tag, lambda name: self.hvd.broadcast(
            tensor, root_rank=root, name=name, ignore_name_scope=True))
