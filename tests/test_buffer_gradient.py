"""A prefetch buffer's lookups and their gradient (`dual_buffer.lookup_from_buffer`), in one
process: an echoing all-to-all stands in for the peer, who sends this worker what it sends. The
rows are the buffer's, the table's gradient is NumPy's, and the lookups' gradients reach the
exchange in one segment-sum, without a concatenation of the pieces or a sum per buffer row
first."""
from typing import NamedTuple

import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.pipeline import dual_buffer
from tf_nestpipe.sharding.layout import ShardLayout
from tf_nestpipe.sharding.records import PrefetchedRows, RoutingRecord

DIM, VOCAB, CAPACITY = 3, 10, 4


class _EchoCollectives:
    def __init__(self):
        self.tags = []

    def all_to_all(self, tensor, tag, bucket=None, send_counts=None, fill=0):
        del bucket, send_counts, fill
        self.tags.append(tag)
        return tf.identity(tensor)


class _Tables(NamedTuple):
    """The part of `FusedTables` a buffer's lookup uses: one table of `VOCAB` local rows."""

    layout: ShardLayout
    table: tf.Variable

    def gradient_carrier(self, local_rows, distinct_rows=False, table_sizes=None):
        return ops.gradient_carrier([self.table], local_rows, [0], tf.float32, DIM,
                                    distinct_rows=distinct_rows, table_sizes=table_sizes)


# This worker's buffer holds 5 distinct rows, 3 asked of owner 0 (itself) and 2 of owner 1.
# With the echo, owner j receives in requester block j what this worker sent owner j: slot
# (j, k) holds buffer row `sum(SPLITS[:j]) + k`, which the owner keeps as local row
# `OWNER_ROWS[j][k]` (rows 7 and 2 are asked for by both "requesters": the owner sums them).
SPLITS = [3, 2]
OWNER_ROWS = [[7, 2, 5], [2, 7]]
LOCAL_ROWS = [7, 2, 5]


def _buffer():
    slot_to_unique = np.full([2 * CAPACITY], -1, np.int32)
    for j, rows in enumerate(OWNER_ROWS):
        for k, row in enumerate(rows):
            slot_to_unique[j * CAPACITY + k] = LOCAL_ROWS.index(row)
    splits = tf.constant(SPLITS, tf.int32)
    routing = RoutingRecord(
        splits=splits, inverse=tf.constant([4, 0, 0, 3, 1, 2, 4], tf.int32),
        slot_of_bucket_pos=ops.bucket_slots(splits, CAPACITY), bucket=tf.constant(0),
        capacity=tf.constant(CAPACITY), local_rows=tf.constant(LOCAL_ROWS, tf.int64),
        slot_to_unique=tf.constant(slot_to_unique), received=splits,
        shares=tf.constant([-1, -1]), table_sizes=tf.constant([len(LOCAL_ROWS)]))
    rows = tf.constant(np.arange(5 * DIM, dtype=np.float32).reshape(5, DIM))
    return PrefetchedRows(routing=routing, rows=rows)


def _expected_table_gradient(index, upstream):
    """Each looked-up row's gradient goes to the buffer row it read, that row's slot, and the
    owner's local row the slot holds."""
    owner_of_buffer_row = [row for rows in OWNER_ROWS for row in rows]
    grad = np.zeros([VOCAB, DIM], np.float32)
    for position, buffer_row in enumerate(index):
        grad[owner_of_buffer_row[buffer_row]] += upstream[position]
    return grad


@pytest.mark.parametrize("distinct", [False, True])
def test_buffer_lookup_gives_the_buffers_rows_and_the_owners_gradient(distinct):
    """Three pieces (one left unused: its gradient is zero) of the rows of the ids routed, or
    the buffer's distinct rows as one piece (a frozen window's own indexing)."""
    tables = _Tables(ShardLayout(vocab_size=2 * VOCAB, dim=DIM, num_shards=2, shard_index=0),
                     tf.Variable(tf.zeros([VOCAB, DIM])))
    prefetched = _buffer()
    index = [4, 0, 0, 3, 1, 2, 4] if not distinct else [0, 1, 2, 3, 4]
    sizes = [2, 3, 2] if not distinct else [5]
    weights = [1.0, 0.0, 2.0] if not distinct else [3.0]  # the middle piece unused
    upstream = np.random.default_rng(0).normal(size=(len(index), DIM)).astype(np.float32)
    collectives = _EchoCollectives()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            pieces = dual_buffer.lookup_from_buffer(
                tables, prefetched, collectives, "t", distinct=distinct,
                sizes=None if distinct else tf.constant(sizes), num=len(sizes))
            parts = tf.split(tf.constant(upstream), sizes)
            loss = tf.add_n([w * tf.reduce_sum(p * u)
                             for w, p, u in zip(weights, pieces, parts) if w])
        return tf.concat(pieces, 0), tf.convert_to_tensor(tape.gradient(loss, tables.table))

    rows, grad = step()
    np.testing.assert_array_equal(rows.numpy(), prefetched.rows.numpy()[index])
    ends = np.cumsum(sizes)
    weighted = np.concatenate([w * upstream[e - s:e] for w, s, e in zip(weights, sizes, ends)])
    np.testing.assert_allclose(grad.numpy(), _expected_table_gradient(index, weighted),
                               rtol=1e-6)
    assert collectives.tags == ["t/rows/grad"]  # the gradient exchange, once
    types = [op.type for op in step.get_concrete_function().graph.get_operations()]
    # One sum into the slots, one on the owner; no concatenation of the pieces' gradients (a
    # ConcatV2 is the step's own concat of the rows it returns, for more than one piece).
    assert types.count("NestpipeSegmentSum") == 2, sorted(types)
    assert types.count("ConcatV2") == (len(sizes) > 1), sorted(types)


def test_distinct_rows_come_as_one_piece():
    tables = _Tables(ShardLayout(vocab_size=2 * VOCAB, dim=DIM, num_shards=2, shard_index=0),
                     tf.Variable(tf.zeros([VOCAB, DIM])))
    with pytest.raises(ValueError, match="distinct rows as one piece, got num=2"):
        dual_buffer.lookup_from_buffer(tables, _buffer(), _EchoCollectives(), "t",
                                       distinct=True, sizes=[2, 3], num=2)


def test_a_split_of_the_buffers_rows_concatenates_its_pieces_gradients():
    """Positive control of the graph check above: splitting one piece of the buffer's rows
    afterwards puts a ConcatV2 in the gradient."""
    tables = _Tables(ShardLayout(vocab_size=2 * VOCAB, dim=DIM, num_shards=2, shard_index=0),
                     tf.Variable(tf.zeros([VOCAB, DIM])))
    prefetched = _buffer()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            (rows,) = dual_buffer.lookup_from_buffer(tables, prefetched, _EchoCollectives(), "t")
            loss = tf.add_n([tf.reduce_sum(p) for p in tf.split(rows, [3, 4])])
        return tf.convert_to_tensor(tape.gradient(loss, tables.table))

    grad = step()
    np.testing.assert_allclose(grad.numpy(), _expected_table_gradient(
        [4, 0, 0, 3, 1, 2, 4], np.ones([7, DIM], np.float32)), rtol=1e-6)
    types = [op.type for op in step.get_concrete_function().graph.get_operations()]
    assert "ConcatV2" in types
