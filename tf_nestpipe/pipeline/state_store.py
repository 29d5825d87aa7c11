"""Keeps a nested structure of tensors (a batch, the prefetch buffers) between steps in one
worker-local variable, so a pipelined step takes no tensor arguments: calling a `tf.function`
with only an iterator is much cheaper than binding dozens of tensors."""
import tensorflow as tf
from tf_nestpipe.tf_private import resource_variable_ops

# How a store's spec treats the static dimensions of what it is given (`TensorStore`).
KEEP_SHAPES = "keep"  # as traced, relaxed only when a value does not fit
VARY_FIRST_DIM = "first"  # dimension 0 of every tensor may vary
VARY_ALL_DIMS = "all"  # every dimension may vary
_POLICIES = (KEEP_SHAPES, VARY_FIRST_DIM, VARY_ALL_DIMS)


class TensorStore:
    """One variable holding every component tensor of a structure (ragged tensors are split into
    their components) as one `Optional` value: storing is two ops and reading two, whatever the
    structure's size, and a stored tensor is referenced, never copied.

    The store keeps the structure's `TypeSpec`: what a `read` returns has its static shapes
    (a batch of a fixed size reads back with that size, so the step that computes it keeps its
    shapes static, as it would reading the batch from the iterator). `shapes` sets which
    dimensions may vary from the start (`VARY_FIRST_DIM`, `VARY_ALL_DIMS`; tensors only);
    with `KEEP_SHAPES` they are the first value's. A later value that does not fit the spec (a
    batch of another size, from a new `fit`) relaxes it to the most specific spec both fit and
    increments `version`: a function that reads the store must then be traced again, as its
    trace read the narrower spec (`TrainPipeline` rebuilds its step functions). The structure
    and the dtypes are fixed by the first value.

    `shapes` may also be a tuple of policies: the store then holds a tuple of that many parts
    (e.g. a batch, its buffers and their plans), part i under policy i, still in one variable
    (two ops to store, two to read, for all the parts)."""

    def __init__(self, device, name, shapes=KEEP_SHAPES):
        policies = shapes if isinstance(shapes, tuple) else (shapes,)
        if not policies or any(policy not in _POLICIES for policy in policies):
            raise ValueError("shapes must be one of %s or a tuple of them, got %r"
                             % (_POLICIES, shapes))
        self._device = device
        self._name = name
        self._shapes = shapes
        self._spec = None  # the structure's TypeSpecs
        self._variable = None
        self.version = 0  # incremented whenever the spec is relaxed

    def _spec_of(self, value):
        if isinstance(self._shapes, tuple):
            if not isinstance(value, tuple) or len(value) != len(self._shapes):
                raise ValueError("%s holds a tuple of %d parts, got %r"
                                 % (self._name, len(self._shapes), type(value).__name__))
            return tuple(_spec_under(part, policy) for part, policy in zip(value, self._shapes))
        return _spec_under(value, self._shapes)

    def _relaxed(self, stored, spec):
        """`stored` (a structure of TypeSpecs), relaxed until `spec` fits it (itself if it
        does)."""
        try:
            tf.nest.assert_same_structure(stored, spec)
        except (ValueError, TypeError) as error:
            raise ValueError("%s: the stored structure changed: %s" % (self._name, error)) from None
        old, given = tf.nest.flatten(stored), tf.nest.flatten(spec)
        if all(g.is_subtype_of(s) for s, g in zip(old, given)):
            return stored
        merged = []
        for i, (s, g) in enumerate(zip(old, given)):
            common = s.most_specific_common_supertype([g])
            if common is None:
                raise ValueError("%s: component %d is %s, was stored as %s"
                                 % (self._name, i, g, s))
            merged.append(common)
        return tf.nest.pack_sequence_as(stored, merged)

    def assign(self, value, admit=None):
        """Stores `value` (the structure and dtypes of the first value ever stored); returns the
        ops. `admit` (TypeSpecs of the same structure, e.g. an iterator's element spec when
        `value` is a batch it gave with more static shapes) relaxes the spec to admit them too,
        so a later value of that spec needs no new trace; for a store of parts, a tuple whose
        None entries admit nothing more for their part."""
        spec = self._spec_of(value)
        if admit is not None and isinstance(self._shapes, tuple):
            admit = tuple(own if extra is None else extra for own, extra in zip(spec, admit))
        stored = spec if self._spec is None else self._relaxed(self._spec, spec)
        if admit is not None:
            stored = self._relaxed(stored, admit)
        if self._spec is not None and stored is not self._spec:
            self.version += 1
        self._spec = stored
        flat = tf.nest.flatten(value, expand_composites=True)
        if not flat:
            return []  # nothing to keep: `read` packs the empty structure
        if self._variable is None:
            with tf.init_scope(), tf.device(self._device):
                # Constructed directly (not tf.Variable) so no strategy creator intercepts it.
                self._variable = resource_variable_ops.ResourceVariable(
                    tf.raw_ops.OptionalNone(), trainable=False, name=self._name)
        return [self._variable.assign(tf.raw_ops.OptionalFromValue(components=flat),
                                      read_value=False)]

    def read(self):
        """The stored structure, with the stored spec's static shapes."""
        components = tf.nest.flatten(self._spec, expand_composites=True)
        if self._variable is None:
            return tf.nest.pack_sequence_as(self._spec, [], expand_composites=True)
        flat = tf.raw_ops.OptionalGetValue(
            optional=self._variable.read_value(),
            output_types=[c.dtype for c in components],
            output_shapes=[c.shape for c in components])
        return tf.nest.pack_sequence_as(self._spec, flat, expand_composites=True)


def _spec_under(value, policy):
    """The TypeSpecs of `value`'s leaves, their dimensions relaxed as `policy` says."""
    def leaf_spec(leaf):
        spec = tf.type_spec_from_value(leaf)
        if policy == KEEP_SHAPES or not isinstance(spec, tf.TensorSpec):
            return spec
        rank = spec.shape.rank
        if not rank:
            return spec
        if policy == VARY_ALL_DIMS:
            return tf.TensorSpec([None] * rank, spec.dtype)
        return tf.TensorSpec([None] + spec.shape[1:].as_list(), spec.dtype)

    return tf.nest.map_structure(leaf_spec, value)
