"""AutoGraph leaves tf_nestpipe's code alone (it is graph ops only) but still converts the user
functions our code calls inside a trace, as the enclosing tf.function asks."""
import gc

import pytest
import tensorflow as tf
from tensorflow.python.autograph.impl import conversion

import tf_nestpipe  # noqa: F401  (registers the library)
from tf_nestpipe import tracing
from tf_nestpipe.collectives.counting import count_collectives
from tf_nestpipe.pipeline import dual_buffer, train_pipeline
from tf_nestpipe.sharding.embedding import ShardedEmbedding


def _absolute(x):
    if x > 0:  # Python control flow on a tensor: needs AutoGraph inside a trace
        return x
    return -x


def test_our_code_is_not_converted_but_user_code_is():
    assert conversion.is_allowlisted(dual_buffer.fetch)
    assert conversion.is_allowlisted(train_pipeline.TrainPipeline._prefetch)
    # One rule for the whole package: also the layers' lookup path and the graph walk that runs
    # while each step is traced (each once carried its own do_not_convert).
    assert conversion.is_allowlisted(ShardedEmbedding._embed)
    assert conversion.is_allowlisted(count_collectives)
    assert not conversion.is_allowlisted(_absolute)  # control: a user's function


def test_registering_twice_adds_one_rule():
    from tensorflow.python.autograph.core import config
    before = len(config.CONVERSION_RULES)
    tracing.register_library()
    assert len(config.CONVERSION_RULES) == before


def test_user_functions_are_converted_as_the_enclosing_function_asks():
    @tf.function
    def converted(x):
        return tracing.user_function(_absolute)(x)

    assert float(converted(tf.constant(-2.0))) == 2.0
    assert float(converted(tf.constant(3.0))) == 3.0

    @tf.function(autograph=False)
    def unconverted(x):
        return tracing.user_function(_absolute)(x)

    # Control: with AutoGraph off, the same call cannot branch on a tensor.
    with pytest.raises(TypeError, match="bool"):
        unconverted(tf.constant(-2.0))


class _CountingFunction:
    """A tf.function wrapper counting the calls that go through the function's own matching."""

    def __init__(self, function):
        self.function = function
        self.calls = 0

    def __call__(self, iterator):
        self.calls += 1
        return self.function(iterator)

    def get_concrete_function(self, iterator):
        return self.function.get_concrete_function(iterator)


def _sum_next(iterator):
    return tf.reduce_sum(next(iterator))


def test_iterator_step_matches_the_function_once_per_iterator():
    dataset = tf.data.Dataset.range(12).batch(3)
    counting = _CountingFunction(tf.function(_sum_next))
    step = tracing.IteratorStep(counting)
    iterator = iter(dataset)
    assert [int(step(iterator)) for _ in range(3)] == [3, 12, 21]
    assert counting.calls == 1  # the later calls ran the kept concrete function
    # A new iterator goes through the function again, and reads from its own start.
    fresh = iter(dataset)
    assert [int(step(fresh)) for _ in range(2)] == [3, 12]
    assert counting.calls == 2
    assert counting.function.experimental_get_tracing_count() == 1  # same type: no new trace
    assert int(step(fresh)) == 21 and int(step(fresh)) == 30
    with pytest.raises(tf.errors.OutOfRangeError):  # the end of the data, as the function says
        step(fresh)
    # The iterator's handles are not kept past the iterator (its resources die with it).
    assert step.holds_iterator
    del iterator, fresh
    gc.collect()
    assert not step.holds_iterator


def test_iterator_step_control_a_plain_call_matches_every_time():
    # Control for the count above: without IteratorStep every call goes through the matching.
    counting = _CountingFunction(tf.function(_sum_next))
    iterator = iter(tf.data.Dataset.range(6).batch(3))
    assert [int(counting(iterator)) for _ in range(2)] == [3, 12]
    assert counting.calls == 2


def test_iterator_step_with_variables_and_a_distributed_iterator():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    dataset = tf.data.Dataset.range(8).batch(2)
    total = []

    @tf.function
    def accumulate(iterator):
        if not total:  # the first trace creates a variable (TF traces such a function twice)
            with strategy.scope():
                total.append(tf.Variable(0, dtype=tf.int64))
        value = strategy.run(tf.reduce_sum, args=(next(iterator),))
        total[0].assign_add(strategy.reduce("SUM", value, axis=None))
        return total[0].read_value()

    step = tracing.IteratorStep(accumulate)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    assert [int(step(iterator)) for _ in range(4)] == [1, 6, 15, 28]


def test_iterator_never_ends_only_for_an_infinite_distributed_dataset():
    """A look-ahead pipeline reads a never-ending iterator with `next` (no Optional): only a
    distributed iterator whose dataset TensorFlow knows to be infinite qualifies."""
    from tf_nestpipe import tf_private  # pylint: disable=import-outside-toplevel

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    batches = tf.data.Dataset.range(8).batch(2)

    def distributed(dataset):
        return iter(strategy.experimental_distribute_dataset(dataset))

    assert tf_private.iterator_never_ends(distributed(batches.repeat()))
    assert not tf_private.iterator_never_ends(distributed(batches))
    assert not tf_private.iterator_never_ends(distributed(batches.repeat().take(5)))
    assert not tf_private.iterator_never_ends(iter(batches.repeat()))  # not a distributed one
