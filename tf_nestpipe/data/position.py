"""The input position as checkpointed state: how many global batches training has consumed."""
import tensorflow as tf


class InputPosition(tf.Module):
    """Counts the global batches a run has trained on; track it in a checkpoint (e.g.
    `ShardedCheckpoint(strategy, model=..., input=position)`) and build the input with
    `distribute`, so that a restored run reads on from the first batch not yet trained on, on any
    number of workers (the count is of global batches, the same on every worker).

    With the Dual-Buffer Pipeline the batches read ahead (the one computed next and the one being
    prefetched) are not counted: `advance()` once per `progress` counts computed batches, and a
    restored pipeline re-reads the in-flight batches and re-fetches their rows from the restored
    tables, which hold exactly the re-synced buffer rows."""

    def __init__(self, name="input_position"):
        super().__init__(name=name)
        with tf.init_scope():
            self.batches = tf.Variable(0, dtype=tf.int64, trainable=False, name="batches",
                                       synchronization=tf.VariableSynchronization.ON_WRITE,
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def advance(self, batches=1):
        """Counts `batches` more global batches as trained on."""
        self.batches.assign_add(batches)

    def skip(self, dataset):
        """`dataset` (one worker's per-global-batch stream) without the batches already trained on."""
        return dataset.skip(self.batches.read_value())

    def distribute(self, strategy, dataset_fn, options=None):
        """`strategy.distribute_datasets_from_function(dataset_fn)` starting at this position:
        `dataset_fn(input_context)` must yield one element per global batch (this worker's share)."""
        start = int(self.batches.numpy())
        return strategy.distribute_datasets_from_function(
            lambda context: dataset_fn(context).skip(start), options)
