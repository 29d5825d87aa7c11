"""Datasets without tf.data autotuning."""
import tensorflow as tf


def without_autotuning(dataset):
    """`dataset` with tf.data autotuning off (its `AUTOTUNE` parallelism becomes one per core).

    For datasets with little or nothing to tune, in a multi-worker cluster: on TF 2.21 the
    autotuning thread of a distributed iterator sometimes sleeps through the iterator's deletion,
    which then blocks (the end of `fit`, a dropped iterator) for about as long as the iterator
    has lived (docs/guides/reliability.md, "Fewer stalls when an iterator is deleted")."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)
