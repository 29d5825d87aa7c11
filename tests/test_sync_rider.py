"""DBP's fresh rows riding on the keys all-to-all (single process): the rider's bit copies and
its place in the keys exchange, with and without the overflow round."""
import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.collectives.communication import capacity_bucket
from tf_nestpipe.collectives.wire import PLAIN, Wire, WireStats
from tf_nestpipe.sharding.exchange import CapacityHint
from tf_nestpipe.sharding.layout import ShardLayout
from tf_nestpipe.sharding.lookup import _send_keys


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int8,
                                   tf.int32])
@pytest.mark.parametrize("shape", [[2, 3, 5], [3, 0, 4], [2, 1, 1]])
def test_int64_words_are_bit_copies_of_any_block(dtype, shape):
    rng = np.random.default_rng(1)
    values = rng.normal(size=shape) * 50
    block = tf.cast(tf.constant(values), dtype)
    words = ops.to_int64_words(block)
    assert words.dtype == tf.int64 and words.shape[0] == shape[0]
    back = ops.from_int64_words(words, dtype, tf.shape(block))
    np.testing.assert_array_equal(tf.bitcast(back, tf.uint8).numpy() if dtype.size > 1
                                  else back.numpy(),
                                  tf.bitcast(block, tf.uint8).numpy() if dtype.size > 1
                                  else block.numpy())


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.int8, tf.float64])
def test_int64_words_lay_each_rows_bytes_out_in_order_then_zeros(dtype):
    """Row w of the words is block[w]'s bytes in row-major order, then zero bytes up to a whole
    word (the NumPy reference); fewer words than a row needs are refused."""
    block = tf.cast(tf.reshape(tf.range(2 * 3 * 3) - 7, [2, 3, 3]), dtype)
    data = block.numpy().reshape(2, -1).view(np.uint8)  # [2, 9 * itemsize] bytes
    words = -(-data.shape[1] // 8)
    expected = np.zeros([2, words * 8], np.uint8)
    expected[:, :data.shape[1]] = data
    got = ops.to_int64_words(block)
    assert got.shape == [2, words]
    np.testing.assert_array_equal(got.numpy().view(np.uint8).reshape(2, -1), expected)
    with pytest.raises(tf.errors.InvalidArgumentError, match="the words hold"):
        ops.from_int64_words(got[:, :words - 1], dtype, tf.shape(block))
    with pytest.raises(tf.errors.InvalidArgumentError, match="must start with the 2 workers"):
        ops.from_int64_words(got, dtype, [3, 3, 3])


class _EchoCollectives:
    """A keys all-to-all as seen by a worker whose every peer sends what this worker sends it
    (`tensor` comes back as it is); records each call's tag and width."""

    def __init__(self):
        self.calls = []

    def all_to_all(self, tensor, tag, bucket=None, send_counts=None, fill=0):
        del bucket, send_counts, fill
        self.calls.append((tag, int(tensor.shape[1])))
        return tf.identity(tensor)


def _keys(splits):
    return tf.concat([tf.range(n, dtype=tf.int64) * 2 + owner
                      for owner, n in enumerate(splits)], axis=0)


def _send(splits, rider, wire=PLAIN):
    fake = _EchoCollectives()
    hint = CapacityHint("/cpu:0", "test/rider/%d" % id(fake))
    splits_t = tf.constant(splits, tf.int32)
    layout = ShardLayout(vocab_size=1000, dim=1, num_shards=len(splits), shard_index=0)
    arrived, keys_in, rider_in = _send_keys(_keys(splits), splits_t, splits_t[:, None], None,
                                            layout, fake, "t", hint, wire, rider)
    return fake, arrived, keys_in, rider_in


def _assert_keys_arrived(splits, keys_in):
    for owner, n in enumerate(splits):
        row = keys_in[owner].numpy()
        np.testing.assert_array_equal(row[:n], np.arange(n) * 2 + owner)
        assert (row[n:] == -1).all()


def test_the_rider_travels_behind_the_header_in_the_one_keys_exchange():
    splits = [3, 2]
    rider = tf.constant([[7, -1, 2 ** 40, 0, 5], [1, 2, 3, 4, -(2 ** 62)]], tf.int64)
    fake, arrived, keys_in, rider_in = _send(splits, rider)
    assert [tag for tag, _ in fake.calls] == ["t/keys"]  # no collective of the rider's own
    np.testing.assert_array_equal(rider_in.numpy(), rider.numpy())
    # Every (echoed) header arrived whole: each sender sent owner 0 splits[0] keys.
    assert arrived.sent.numpy().tolist() == [[3], [3]] and int(arrived.largest) == 3
    assert arrived.shares.numpy().tolist() == [-1, -1]
    _assert_keys_arrived(splits, keys_in)
    # Positive control: without a rider nothing else arrives, in the same single exchange.
    fake, _, keys_in, rider_in = _send(splits, None)
    assert rider_in is None and [tag for tag, _ in fake.calls] == ["t/keys"]
    _assert_keys_arrived(splits, keys_in)


def test_keys_beyond_the_riders_share_of_the_exchange_take_the_overflow_round():
    width = 40
    rider = tf.reshape(tf.range(2 * width, dtype=tf.int64), [2, width])
    # The keys' share of the first exchange: its bucketed size less the rider and the header.
    _, padded = capacity_bucket(width + 64)  # 64: a new hint's capacity
    key_capacity = int(padded) - width
    splits = [key_capacity + 5, 1]
    fake, _, keys_in, rider_in = _send(splits, rider)
    assert [tag for tag, _ in fake.calls] == ["t/keys", "t/keys_overflow"]
    np.testing.assert_array_equal(rider_in.numpy(), rider.numpy())
    _assert_keys_arrived(splits, keys_in)  # nothing dropped
    # At the boundary the one exchange suffices.
    fake, _, keys_in, _ = _send([key_capacity, 1], rider)
    assert [tag for tag, _ in fake.calls] == ["t/keys"]
    _assert_keys_arrived([key_capacity, 1], keys_in)


def test_the_keys_bytes_leave_out_the_riders():
    """The rider's bytes are its sender's to count (`dual_buffer.sync_rider` counts them as the
    sync's): the keys counter sees the header and the keys' share of the exchange only."""
    splits, width = [3, 2], 5
    rider = tf.zeros([2, width], tf.int64)
    stats = WireStats("/cpu:0")
    fake, _, _, _ = _send(splits, rider, Wire(stats=stats))
    # One peer's block (the other stays): header (2 counts + share) + the keys' capacity.
    (_, sent_width), = fake.calls
    assert stats.read()["keys"] == (sent_width - width) * 8
    # Positive control: without a rider the whole block is keys.
    stats = WireStats("/cpu:0")
    fake, _, _, _ = _send(splits, None, Wire(stats=stats))
    (_, sent_width), = fake.calls
    assert stats.read()["keys"] == sent_width * 8
