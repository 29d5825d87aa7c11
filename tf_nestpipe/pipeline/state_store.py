"""Keeps a nested structure of tensors (a batch, the prefetch buffers) in worker-local variables
whose shapes may change on every assignment, so a pipelined step takes no tensor arguments:
calling a `tf.function` with only an iterator is much cheaper than binding dozens of tensors."""
import tensorflow as tf
from tf_nestpipe.tf_private import resource_variable_ops


class TensorStore:
    """Variables for every component tensor of a structure (ragged tensors are split into their
    components). The structure is fixed by the first `assign`; dimension 0 may vary (every
    dimension with `vary_all_dims`)."""

    def __init__(self, device, name, vary_all_dims=False):
        self._device = device
        self._name = name
        self._vary_all_dims = vary_all_dims
        self._structure = None
        self._variables = None

    @property
    def initialized(self):
        """Whether a structure has been stored."""
        return self._variables is not None

    def _shape(self, t):
        if not t.shape.rank:
            return tf.TensorShape([])
        if self._vary_all_dims:
            return tf.TensorShape([None] * t.shape.rank)
        return tf.TensorShape([None] + t.shape[1:].as_list())

    def _create(self, flat):
        with tf.init_scope(), tf.device(self._device):
            self._variables = [
                # Constructed directly (not tf.Variable) so no strategy creator intercepts it.
                resource_variable_ops.ResourceVariable(
                    tf.zeros([0 if d is None else d for d in self._shape(t).as_list()], t.dtype),
                    shape=self._shape(t), trainable=False, name="%s_%d" % (self._name, i))
                for i, t in enumerate(flat)]

    def assign(self, value):
        """Stores `value` (same structure as the first value ever stored); returns the ops."""
        flat = tf.nest.flatten(value, expand_composites=True)
        if self._variables is None:
            self._structure = value
            self._create(flat)
        if len(flat) != len(self._variables):
            raise ValueError("%s: the stored structure changed (%d tensors, now %d)"
                             % (self._name, len(self._variables), len(flat)))
        return [v.assign(t, read_value=False) for v, t in zip(self._variables, flat)]

    def read(self):
        """The stored structure."""
        flat = [v.read_value() for v in self._variables]
        return tf.nest.pack_sequence_as(self._structure, flat, expand_composites=True)
