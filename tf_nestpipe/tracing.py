"""How AutoGraph treats tf_nestpipe: as a library, like TensorFlow and tf_keras themselves.

tf_nestpipe's code builds graphs with TensorFlow ops only, so AutoGraph has nothing to convert in
it; left to itself, it would convert every function of ours a traced step reaches (parsing
and rewriting its source, then routing each call through `converted_call`), a large part of a
pipelined step's first trace. `register_library` adds tf_nestpipe to AutoGraph's do-not-convert
rules; the user functions our code calls inside a trace (a `TrainPipeline`'s step, route and
reduce functions, a DOWNPOUR loss) go through `user_function`, which converts them as
`strategy.run` converts its function: as the enclosing `tf.function` asks (AutoGraph on by
default, off under `tf.function(autograph=False)`). Keras layers convert their own `call`.

`IteratorStep` calls a step `tf.function` of one iterator argument without matching the
iterator against the function's traces on every call (see its docstring).
"""
import weakref

import tensorflow as tf

from tf_nestpipe import tf_private
from tf_nestpipe.tf_private import autograph_config

_PACKAGE = "tf_nestpipe"


def register_library():
    """Adds tf_nestpipe to AutoGraph's do-not-convert rules (once)."""
    rules = tuple(autograph_config.CONVERSION_RULES)
    if any(isinstance(rule, autograph_config.DoNotConvert) and rule.matches(_PACKAGE)
           for rule in rules):
        return
    autograph_config.CONVERSION_RULES = (autograph_config.DoNotConvert(_PACKAGE),) + rules


def user_function(fn):
    """`fn` (a user's function, called by our code inside a trace) converted by AutoGraph as the
    enclosing `tf.function` asks; call it inside that trace."""
    return tf.__internal__.autograph.tf_convert(fn, tf.__internal__.autograph.control_status_ctx())


class IteratorStep:
    """Calls `function` (a `tf.function` whose only argument is an iterator) step after step
    without binding the iterator anew on every call.

    A `tf.function` call matches its arguments against its traces: for a distributed iterator
    that computes the iterator's type (its element spec, per worker) and flattens it, a cost
    a small model's step notices. The first call
    with an iterator goes through `function` (tracing it, creating variables, as usual) and keeps
    the concrete function it ran and the iterator's tensors (its resource handles, fixed for the
    iterator's life); later calls with the same iterator run that concrete function on them
    directly. A new iterator goes through `function` again (a trace only if its type is new);
    a collected iterator's handles are dropped with it (`_forget_callback`)."""

    def __init__(self, function):
        self._function = function
        self._iterator_ref = None
        self._concrete = None
        self._flat_iterator = None

    def __call__(self, iterator):
        if self._iterator_ref is not None and self._iterator_ref() is iterator:
            # The private entry the public call ends in, after its matching (TF 2.21).
            return tf_private.call_concrete_flat(self._concrete, self._flat_iterator)
        outputs = self._function(iterator)
        self._concrete = self._function.get_concrete_function(iterator)
        self._flat_iterator = tf.nest.flatten(iterator, expand_composites=True)
        self._iterator_ref = weakref.ref(iterator, self._forget_callback())
        return outputs

    def _forget_callback(self):
        """A weakref callback that drops the iterator's handles when the iterator is collected:
        they must not keep its resources (a prefetching multi-device iterator, its threads)
        alive past the iterator, as nothing did before."""
        step_ref = weakref.ref(self)

        def forget(iterator_ref):
            step = step_ref()
            if step is not None and step._iterator_ref is iterator_ref:
                step._iterator_ref = step._concrete = step._flat_iterator = None

        return forget

    @property
    def holds_iterator(self):
        """Whether this keeps an iterator's handles (only while that iterator is alive)."""
        return self._flat_iterator is not None
