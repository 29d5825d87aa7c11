"""Deleting a distributed iterator should not wait on tf.data's autotuning: NestPipeStrategy's
iterators prefetch per device without it (`tf_private.device_datasets_without_autotune`), and
`tnp.data.without_autotuning` turns it off on a user's dataset.

In a 2-worker cluster on TF 2.21 an autotuning thread sometimes sleeps through the iterator's
deletion, which (the end of every `fit`) then blocks for up to as long as the iterator has
lived; the timings are in bench/results/iterator_teardown.md (no timed tests)."""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe import tf_private  # noqa: E402


def _batches_of_eight(context):
    del context
    return tf.data.Dataset.range(8).batch(2)


def _per_device_datasets(iterator):
    """The per-device prefetch datasets behind a distributed iterator (one per worker device)."""
    return [device_iterator._dataset  # pylint: disable=protected-access
            for worker in iterator._iterators  # pylint: disable=protected-access
            for device_iterator in worker._iterator._device_iterators]  # pylint: disable=protected-access


def test_the_strategys_iterators_prefetch_per_device_without_autotuning():
    strategy = tnp.NestPipeStrategy()
    iterator = iter(strategy.distribute_datasets_from_function(_batches_of_eight))
    datasets = _per_device_datasets(iterator)
    assert datasets and all(d.options().autotune.enabled is False for d in datasets)
    # The elements are the source's, in order.
    assert [batch.numpy().tolist() for batch in iterator] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_second_strategy_does_not_wrap_the_device_datasets_twice():
    tnp.NestPipeStrategy()
    tnp.NestPipeStrategy()
    create = tf_private.multi_device_iterator_ops._create_device_dataset  # pylint: disable=protected-access
    assert create._nestpipe_without_autotune  # pylint: disable=protected-access
    assert not getattr(create.__wrapped__, "_nestpipe_without_autotune", False)


def test_positive_control_stock_per_device_datasets_autotune(monkeypatch):
    """The check above fails on TensorFlow's own per-device datasets (autotuning left on)."""
    strategy = tnp.NestPipeStrategy()
    module = tf_private.multi_device_iterator_ops
    monkeypatch.setattr(module, "_create_device_dataset",
                        module._create_device_dataset.__wrapped__)  # pylint: disable=protected-access
    iterator = iter(strategy.distribute_datasets_from_function(_batches_of_eight))
    datasets = _per_device_datasets(iterator)
    assert datasets and all(d.options().autotune.enabled is not False for d in datasets)


def test_without_autotuning_turns_it_off_and_keeps_the_elements():
    dataset = tf.data.Dataset.range(5).map(lambda x: x * 2, num_parallel_calls=tf.data.AUTOTUNE)
    untuned = tnp.data.without_autotuning(dataset)
    assert untuned.options().autotune.enabled is False
    assert dataset.options().autotune.enabled is not False  # positive control: the default
    assert [int(x) for x in untuned] == [0, 2, 4, 6, 8]
