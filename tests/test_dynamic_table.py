"""The dynamic-table ops against the Python-dict reference (tests/dynamic_reference.py), the
per-id initial rows against TensorFlow's stateless kernels, and DynamicEmbedding in one process
against the reference model."""
import threading

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_nestpipe as tnp
from tf_nestpipe import ops
from tf_nestpipe.sharding.dynamic_init import initial_rows

from dynamic_reference import RefDynamicModel, RefTable, owner


def run_against_reference(steps, **config):
    table = ops.DynamicTable(**config)
    ref = RefTable(**config)
    for ids in steps:
        slots, fresh = table.admit(np.asarray(ids, np.int64))
        ref_slots, ref_fresh, _ = ref.admit(list(ids))
        np.testing.assert_array_equal(slots.numpy(), ref_slots)
        np.testing.assert_array_equal(fresh.numpy(), ref_fresh)
    stats = table.stats_dict()
    for name, value in ref.stats.items():
        assert stats[name] == value, (name, stats, ref.stats)
    assert stats["size"] == len(ref.map) and stats["pending"] == len(ref.pending)
    return table, ref


def random_steps(seed, steps=40, batch=12, vocab=40):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = np.minimum(rng.zipf(1.3, size=batch) - 1, vocab).astype(np.int64)
        out.append(list(ids * 7919 - 3 * vocab))  # negative and large ids too
    return out


@pytest.mark.parametrize("config", [
    dict(capacity=100),
    dict(capacity=6, policy="lru"),
    dict(capacity=6, policy="lfu"),
    dict(capacity=8, admit_after=3),
    dict(capacity=5, admit_after=2, policy="lfu", ttl=3),
    dict(capacity=50, ttl=2),
    dict(capacity=4, admit_after=2, counter_capacity=3),
])
def test_admit_matches_dict_reference(config):
    table, ref = run_against_reference(random_steps(len(str(config))), **config)
    # find changes nothing and agrees with the reference
    probe = np.array(sorted(ref.map)[:5] + [123456789, -1], np.int64)
    before = table.stats_dict()
    np.testing.assert_array_equal(table.find(probe).numpy(), ref.find(list(probe)))
    assert table.stats_dict() == before


def test_first_sight_capacity_and_lru_order():
    table = ops.DynamicTable(3)
    slots, fresh = table.admit(np.array([5, -7, 5, 9], np.int64))
    assert slots.numpy().tolist() == [1, 0, 1, 2] and fresh.numpy().all()
    table.admit(np.array([5], np.int64))           # 5 is now the most recent
    slots, _ = table.admit(np.array([11, 12], np.int64))  # evict -7 then 9 (least recent)
    assert slots.numpy().tolist() == [0, 2]
    assert table.find(np.array([-7, 9, 5], np.int64)).numpy().tolist() == [-1, -1, 1]
    assert table.stats_dict()["evicted"] == 2


def test_lfu_keeps_frequent_ids():
    table = ops.DynamicTable(2, policy="lfu")
    for _ in range(3):
        table.admit(np.array([1], np.int64))
    table.admit(np.array([2], np.int64))
    table.admit(np.array([3], np.int64))  # 2 (freq 1) goes, 1 (freq 3) stays
    assert table.find(np.array([1, 2, 3], np.int64)).numpy().tolist() == [0, -1, 1]


def test_ids_of_this_step_are_never_evicted_refused_instead():
    table = ops.DynamicTable(2)
    slots, _ = table.admit(np.array([1, 2, 3], np.int64))
    assert slots.numpy().tolist() == [0, 1, -1]
    assert table.stats_dict()["refused"] == 1


def test_admission_after_n_steps_counts_steps_not_occurrences():
    table = ops.DynamicTable(10, admit_after=2)
    slots, _ = table.admit(np.array([4, 4, 4], np.int64))
    assert slots.numpy().tolist() == [-1, -1, -1]
    assert table.stats_dict()["pending"] == 1
    slots, fresh = table.admit(np.array([4], np.int64))
    assert slots.numpy().tolist() == [0] and fresh.numpy().tolist() == [True]


def test_ttl_expires_unseen_ids():
    table = ops.DynamicTable(10, ttl=2)
    table.admit(np.array([1, 2], np.int64))
    table.admit(np.array([1], np.int64))
    table.admit(np.array([1], np.int64))
    table.admit(np.array([1], np.int64))  # step 4: 2 last seen at step 1, 1 + 2 < 4
    assert table.find(np.array([1, 2], np.int64)).numpy().tolist() == [0, -1]
    assert table.stats_dict()["expired"] == 1


def test_export_restore_round_trip_and_inconsistent_state_refused():
    table, ref = run_against_reference(random_steps(3), capacity=7, admit_after=2)
    state = table.export()
    other = ops.DynamicTable(7, admit_after=2)
    other.restore(state)
    assert other.stats_dict() == table.stats_dict()
    for ids in random_steps(4, steps=10):
        a = table.admit(np.asarray(ids, np.int64))
        b = other.admit(np.asarray(ids, np.int64))
        np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())
    small = ops.DynamicTable(2, admit_after=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="capacity_per_worker"):
        small.restore(state)


def test_concurrent_admits_from_threads():
    table = ops.DynamicTable(4000)
    errors = []

    def worker(t):
        try:
            for step in range(20):
                ids = np.arange(50, dtype=np.int64) + 1000 * t + 50 * step
                table.admit(ids)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ids = np.concatenate([np.arange(1000, dtype=np.int64) + 1000 * t for t in range(4)])
    slots = table.find(ids).numpy()
    assert (slots >= 0).all() and len(set(slots.tolist())) == 4000
    stats = table.stats_dict()
    assert stats["admitted"] == 4000 and stats["size"] == 4000 and stats["step"] == 80


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        ops.DynamicTable(0)
    with pytest.raises(ValueError, match="admit_after"):
        ops.DynamicTable(4, admit_after=0)
    with pytest.raises(ValueError, match="eviction policy"):
        ops.DynamicTable(4, policy="fifo")
    with pytest.raises(ValueError, match="ttl"):
        ops.DynamicTable(4, ttl=-1)


def test_owner_hash_is_splitmix64_mod_w():
    ids = np.array([0, 1, -1, 2 ** 62, -(2 ** 63), 123456789], np.int64)
    for workers in (1, 2, 3, 7):
        got = ops.dynamic_owner(ids, workers).numpy().tolist()
        assert got == [owner(int(k), workers) for k in ids]


@pytest.mark.parametrize("kind,raw_op", [("uniform", "StatelessRandomUniformV2"),
                                         ("normal", "StatelessRandomNormalV2"),
                                         ("truncated_normal", "StatelessTruncatedNormalV2")])
def test_initial_rows_are_the_stateless_stream_of_seed_and_id(kind, raw_op):
    seed = tf.constant([7, 0], tf.int64)
    ids = np.array([0, 5, -3, 2 ** 61], np.int64)
    got = ops.dynamic_row_init(seed, ids, 6, kind).numpy()
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    for i, k in enumerate(ids):
        mixed = tf.bitwise.bitwise_xor(counter, tf.constant([0, int(k) & (2**64 - 1)], tf.uint64))
        want = getattr(tf.raw_ops, raw_op)(shape=[6], key=key, counter=mixed, alg=1)
        np.testing.assert_array_equal(got[i], want.numpy())


def test_initializers_without_seed_or_per_id_form_are_refused():
    with tnp.NestPipeStrategy().scope():
        with pytest.raises(ValueError, match="seed"):
            tnp.DynamicEmbedding(4, embeddings_initializer=tf_keras.initializers.RandomUniform())
        with pytest.raises(ValueError, match="per id"):
            tnp.DynamicEmbedding(4, embeddings_initializer="glorot_uniform")
    with pytest.raises(ValueError, match="NestPipeStrategy"):
        tnp.DynamicEmbedding(4)


def test_string_ids_use_the_documented_hash():
    with tnp.NestPipeStrategy().scope():
        layer = tnp.DynamicEmbedding(2, embeddings_initializer="ones", name="strings")
    out = layer(tf.constant(["a", "b"]), training=True)
    assert out.numpy().tolist() == [[1, 1], [1, 1]]
    ids, _ = layer.full_table()
    want = tf.strings.to_hash_bucket_fast(["a", "b"], 2 ** 63 - 1).numpy()
    assert sorted(ids.tolist()) == sorted(want.tolist())


def test_two_training_lookups_in_one_step_are_refused():
    with tnp.NestPipeStrategy().scope():
        layer = tnp.DynamicEmbedding(2, name="twice")

    @tf.function
    def step(ids):
        return layer(ids, training=True) + layer(ids, training=True)

    with pytest.raises(ValueError, match="twice in one training step"):
        step(tf.constant([1, 2], tf.int64))
    # positive control: one lookup per step traces
    layer2 = None
    with tnp.NestPipeStrategy().scope():
        layer2 = tnp.DynamicEmbedding(2, name="once")
    tf.function(lambda ids: layer2(ids, training=True))(tf.constant([1, 2], tf.int64))


def test_inference_never_admits():
    with tnp.NestPipeStrategy().scope():
        layer = tnp.DynamicEmbedding(2, embeddings_initializer="ones", name="infer")
    assert layer(tf.constant([5, 6], tf.int64)).numpy().tolist() == [[0, 0], [0, 0]]
    assert layer.table_stats()["size"] == 0 and layer.table_stats()["step"] == 0
