"""How AutoGraph treats tf_nestpipe: as a library, like TensorFlow and tf_keras themselves.

tf_nestpipe's code builds graphs with TensorFlow ops only, so AutoGraph has nothing to convert in
it; left to itself, it converted every function of ours a traced step reached (parsing and
rewriting its source, then routing each call through `converted_call`): about 12% of the
pipelined step's first trace. `register_library` adds tf_nestpipe to AutoGraph's do-not-convert
rules; the user functions our code calls inside a trace (a `TrainPipeline`'s step, route and
reduce functions, a DOWNPOUR loss) go through `user_function`, which converts them as
`strategy.run` converts its function: as the enclosing `tf.function` asks (AutoGraph on by
default, off under `tf.function(autograph=False)`). Keras layers convert their own `call`.
"""
import tensorflow as tf
from tensorflow.python.autograph.core import config as autograph_config

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
