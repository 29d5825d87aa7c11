"""AutoGraph leaves tf_nestpipe's code alone (it is graph ops only) but still converts the user
functions our code calls inside a trace, as the enclosing tf.function asks."""
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
