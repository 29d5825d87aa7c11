"""Re-initialization of the optimizer slots of a dynamic table's reused row slots.

A `DynamicEmbedding` row slot freed by eviction or TTL and given to a new id starts from the
id's initial row (the layer writes it) and from fresh optimizer state: the optimizer's slot
variables of the row variable (Adagrad accumulators, Adam moments) are reset at those slots to
their initial value before the step's update. The strategy calls `register_companion` when it
creates a slot variable colocated with the row variable and `reset_ops` when it updates the row
variable (`NestPipeStrategy._update`), after the lookup recorded the step's fresh slots.
"""
import numpy as np
import tensorflow as tf
from tf_nestpipe.tf_private import resource_variable_ops

_ATTR = "_nestpipe_dynamic_slots"
_COMPANION_ATTR = "_nestpipe_dynamic_companion"


class FreshSlots:
    """The fresh row slots of a dynamic table's last training lookup and the optimizer slot
    variables (with their initial row) to reset there."""

    def __init__(self, device, name, layer=None):
        self.layer = layer  # the DynamicEmbedding (its table state, for checkpoints)
        with tf.init_scope(), tf.device(device):
            # Constructed directly (not tf.Variable): no strategy creator intercepts it.
            self._fresh = resource_variable_ops.ResourceVariable(
                tf.zeros([0], tf.int64), shape=tf.TensorShape([None]), trainable=False,
                name="nestpipe_fresh_slots_" + name)
        self._companions = []

    def record(self, slots):
        """Records the slots given out in this step (returns the op)."""
        return self._fresh.assign(tf.cast(slots, tf.int64), read_value=False)

    def register_companion(self, variable):
        """Adds an optimizer slot variable of the row variable (its value now is its initial
        value, equal in every row: what a reused slot restarts from)."""
        with tf.init_scope():
            initial = np.asarray(variable.read_value())[:1]
        if initial.size and not np.all(initial == initial.reshape(1, -1)[:, :1]):
            raise ValueError("optimizer slot %s of a DynamicEmbedding row variable has a "
                             "non-constant initial value; reused slots cannot be reset"
                             % variable.name)
        self._companions.append((variable, initial))
        setattr(variable, _COMPANION_ATTR, self)

    def reset_ops(self):
        """Ops resetting every registered companion at the recorded fresh slots."""
        fresh = self._fresh.read_value()
        ops = []
        for variable, initial in self._companions:
            values = tf.tile(tf.constant(initial, variable.dtype), [tf.size(fresh), 1])
            ops.append(variable.scatter_update(tf.IndexedSlices(values, fresh)))
        return ops


def mark_dynamic_rows(variable, fresh_slots):
    """Records on a row variable its `FreshSlots`."""
    setattr(variable, _ATTR, fresh_slots)


def fresh_slots_of(variable):
    """The `FreshSlots` of a dynamic table's row variable, else None."""
    return getattr(variable, _ATTR, None)


def dynamic_table_of(variable):
    """The `DynamicEmbedding` whose row variable (or optimizer slot) `variable` is, else None."""
    fresh = fresh_slots_of(variable) or getattr(variable, _COMPANION_ATTR, None)
    return fresh.layer if fresh is not None else None


def is_dynamic_table_variable(variable):
    """True for a dynamic table's row variable or one of its optimizer slots."""
    return fresh_slots_of(variable) is not None or getattr(variable, _COMPANION_ATTR,
                                                           None) is not None
