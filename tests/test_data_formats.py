"""Schema, TFRecord writer/reader, synthetic generator and Criteo TSV format: checked against
NumPy references, `tf.train.Example` and hand-computed rows."""
import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.data.experimental.ops import distribute as tf_data_distribute

import tf_nestpipe.data as data_package
from tf_nestpipe.data import (RaggedIds, Schema, ShardWriter, SparseFeature, SyntheticClickLog,
                              convert_criteo, criteo_kaggle_table_sizes, encode_examples,
                              fold_ids, format_criteo_tsv, load_metadata, make_dataset,
                              parse_batch, power_law_ids, read_criteo_tsv, schema_from_metadata,
                              split_files, write_criteo_tsv, write_synthetic_tfrecords)
from tf_nestpipe.data.__main__ import ProgressBar, main
from tf_nestpipe.data.tfrecord import dataset_metadata, write_metadata

MIXED = Schema((SparseFeature("a", 1000), SparseFeature("b", (5, 1 << 40, 7), 3),
                SparseFeature("g", 300, None)), num_dense=4)


def mixed_batch(rows, seed=0):
    """A batch of MIXED columns (some empty multi-hot rows, some multi-byte varints)."""
    rng = np.random.default_rng(seed)
    bags = [list(rng.integers(0, 300, rng.integers(0, 5))) for _ in range(rows)]
    features = {"dense": rng.normal(size=(rows, 4)).astype(np.float32),
                "a": rng.integers(0, 1000, rows),
                "b": np.stack([rng.integers(0, 5, rows), rng.integers(0, 1 << 40, rows),
                               rng.integers(0, 7, rows)], axis=1),
                "g": RaggedIds.from_lists(bags)}
    return features, rng.integers(0, 2, rows).astype(np.float32), bags


# ------------------------------------------------------------------------------------- schema
def test_schema_round_trips_through_json_and_builds_parse_specs():
    d = json.loads(json.dumps(MIXED.to_dict()))
    assert Schema.from_dict(d) == MIXED
    assert MIXED.vocab_sizes() == {"a": 1000, "b": (5, 1 << 40, 7), "g": 300}
    spec = MIXED.parse_spec()
    assert spec["a"].shape == [] and spec["b"].shape == [3] and spec["dense"].shape == [4]
    assert isinstance(spec["g"], tf.io.RaggedFeature)
    assert isinstance(MIXED.parse_spec(ragged=False)["g"], tf.io.VarLenFeature)
    assert "dense" not in Schema((SparseFeature("a", 3),)).parse_spec()


@pytest.mark.parametrize("make, message", [
    (lambda: SparseFeature("dense", 3), "other than"),
    (lambda: SparseFeature("", 3), "non-empty"),
    (lambda: SparseFeature("a", 0), ">= 1"),
    (lambda: SparseFeature("a", 3, 0), "positive int or None"),
    (lambda: SparseFeature("a", (3, 4), 3), "length == len"),
    (lambda: SparseFeature("a", (3, 4), None), "length == len"),
    (lambda: Schema((SparseFeature("a", 3), SparseFeature("a", 4))), "unique"),
    (lambda: Schema((), num_dense=-1), "num_dense"),
    (lambda: Schema.from_dict({"sparse": []}), "keys 'num_dense' and 'sparse'"),
    (lambda: Schema.from_dict({"num_dense": 0, "sparse": [{"name": "a"}]}), "name, vocab_size, length"),
])
def test_schema_rejects_bad_definitions(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_schema_feature_lookup_names_missing_feature():
    assert MIXED.feature("b").length == 3
    with pytest.raises(KeyError, match="no sparse feature 'zz'"):
        MIXED.feature("zz")


# ----------------------------------------------------------------------------------- encoding
def test_encoded_examples_equal_tf_train_example():
    features, labels, bags = mixed_batch(300)
    records = encode_examples(MIXED, features, labels)
    for i, record in enumerate(records):
        expected = tf.train.Example()
        f = expected.features.feature
        f["label"].float_list.value.append(labels[i])
        f["dense"].float_list.value.extend(features["dense"][i])
        f["a"].int64_list.value.append(features["a"][i])
        f["b"].int64_list.value.extend(features["b"][i])
        f["g"].int64_list.value.extend(bags[i])
        assert tf.train.Example.FromString(record) == expected, i


def test_parse_batch_returns_dense_fixed_and_ragged_ids():
    features, labels, bags = mixed_batch(50)
    parsed, parsed_labels = parse_batch(tf.constant(encode_examples(MIXED, features, labels)), MIXED)
    assert set(parsed) == {"dense", "a", "b", "g"}
    np.testing.assert_array_equal(parsed["dense"], features["dense"])
    np.testing.assert_array_equal(parsed["a"], features["a"])
    np.testing.assert_array_equal(parsed["b"], features["b"])
    assert isinstance(parsed["g"], tf.RaggedTensor) and parsed["g"].dtype == tf.int64
    assert parsed["g"].to_list() == [[int(v) for v in bag] for bag in bags]
    np.testing.assert_array_equal(parsed_labels, labels[:, None])


@pytest.mark.parametrize("change, error, message", [
    (lambda f: f.update(a=np.full(10, 1000)), ValueError, r"id 1000 in row 0 is outside \[0, 1000\)"),
    (lambda f: f.update(b=np.full((10, 3), 6)), ValueError, r"id 6 in row 0 is outside \[0, 5\)"),
    (lambda f: f.update(a=np.zeros((10, 2), np.int64)), ValueError, "expected integer ids of shape"),
    (lambda f: f.update(a=np.zeros(11, np.int64)), ValueError, "'a' has 11 rows but there are 10 labels"),
    (lambda f: f.update(a=np.zeros(10, np.float32)), ValueError, "expected integer ids of shape"),
    (lambda f: f.pop("b"), KeyError, "lack sparse feature 'b'"),
    (lambda f: f.pop("dense"), KeyError, "lack 'dense'"),
    (lambda f: f.update(dense=np.zeros((10, 3))), ValueError, "expected 4 floats per row"),
    (lambda f: f.update(g=np.zeros(10, np.int64)), TypeError, "needs RaggedIds"),
    (lambda f: f.update(g=RaggedIds(np.zeros(3, np.int64), np.arange(11))), ValueError, "row_splits"),
])
def test_encode_rejects_bad_columns(change, error, message):
    features, labels, _ = mixed_batch(10)
    change(features)
    with pytest.raises(error, match=message):
        encode_examples(MIXED, features, labels)


# ------------------------------------------------------------------------------------ reading
def write_mixed_shards(directory, rows=103, shards=3, seed=0):
    """Writes a MIXED batch in two writes (rows 0-39, 40-) to `shards` files."""
    features, labels, bags = mixed_batch(rows, seed)
    with ShardWriter(str(directory), "train", shards, MIXED) as writer:
        for rows_ in (slice(0, 40), slice(40, rows)):
            part = {k: v[rows_] for k, v in features.items() if k != "g"}
            part["g"] = RaggedIds.from_lists(bags[rows_])
            writer.write(part, labels[rows_])
        info = writer.close()
    return features, labels, bags, info


def test_shards_read_back_in_written_order(tmp_path):
    features, labels, bags, info = write_mixed_shards(tmp_path)
    assert info["rows"] == 103 and info["rows_per_file"] == [35, 34, 34]
    assert info["positives"] == int(labels.sum())
    files = [str(tmp_path / f) for f in info["files"]]
    # Round-robin writing + a deterministic interleave of single records = the original order.
    batches = list(make_dataset(files, MIXED, batch_size=16, block_size=1))
    assert [int(b[1].shape[0]) for b in batches] == [16] * 6 + [7]
    np.testing.assert_array_equal(np.concatenate([b[0]["a"] for b in batches]), features["a"])
    np.testing.assert_array_equal(np.concatenate([b[0]["b"] for b in batches]), features["b"])
    np.testing.assert_array_equal(np.concatenate([b[0]["dense"] for b in batches]), features["dense"])
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches])[:, 0], labels)
    assert sum((b[0]["g"].to_list() for b in batches), []) == [[int(v) for v in g] for g in bags]


def test_default_blocks_read_whole_files_in_turn(tmp_path):
    features, labels, _, info = write_mixed_shards(tmp_path)
    files = [str(tmp_path / f) for f in info["files"]]
    batches = list(make_dataset(files, MIXED, batch_size=16))   # block_size 256 > rows per file
    assert [int(b[1].shape[0]) for b in batches] == [16] * 6 + [7]
    order = np.concatenate([np.arange(103)[k::3] for k in range(3)])
    np.testing.assert_array_equal(np.concatenate([b[0]["a"] for b in batches]), features["a"][order])
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches])[:, 0], labels[order])


def test_make_dataset_options(tmp_path):
    features, _, _, info = write_mixed_shards(tmp_path)
    pattern = str(tmp_path / "train-*.tfrecord")
    fixed = make_dataset(pattern, MIXED, batch_size=10, drop_remainder=True)
    spec = fixed.element_spec
    assert spec[0]["a"].shape == [10] and spec[0]["b"].shape == [10, 3] and spec[1].shape == [10, 1]
    assert spec[0]["g"].shape.as_list() == [10, None]
    shuffled = make_dataset(pattern, MIXED, batch_size=7, shuffle=True, seed=3, num_epochs=2)
    ids = np.concatenate([b[0]["a"] for b in shuffled])
    np.testing.assert_array_equal(np.sort(ids), np.sort(np.concatenate([features["a"]] * 2)))
    context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                         num_replicas_in_sync=4)
    per_replica = make_dataset(pattern, MIXED, batch_size=32, input_context=context)
    assert int(next(iter(per_replica))[1].shape[0]) == 8


@pytest.mark.parametrize("policy, shuffle, rows", [("FILE", False, 35 + 34), ("FILE", True, 35 + 34),
                                                   ("DATA", False, 52), ("DATA", True, 52)])
def test_tf_data_autoshard_acts_on_the_reader(tmp_path, policy, shuffle, rows):
    _, _, _, info = write_mixed_shards(tmp_path)
    files = [str(tmp_path / f) for f in info["files"]]
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy)
    dataset = make_dataset(files, MIXED, batch_size=1, shuffle=shuffle).with_options(options)
    # The rewrite tf.distribute applies per worker (worker 0 of 2).
    sharded = tf_data_distribute._AutoShardDataset(dataset, 2, 0)  # pylint: disable=protected-access
    assert sum(int(b[1].shape[0]) for b in sharded) == rows


def test_make_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no files match .*prepare"):
        make_dataset(str(tmp_path / "nothing-*.tfrecord"), MIXED, 4)
    with pytest.raises(FileNotFoundError, match="do not exist"):
        make_dataset([str(tmp_path / "missing.tfrecord")], MIXED, 4)
    with pytest.raises(ValueError, match="empty"):
        make_dataset([], MIXED, 4)
    _, _, _, info = write_mixed_shards(tmp_path)
    with pytest.raises(ValueError, match="batch_size and block_size must be >= 1"):
        make_dataset(str(tmp_path / "train-*"), MIXED, 0)
    with pytest.raises(ValueError, match="batch_size and block_size must be >= 1"):
        make_dataset(str(tmp_path / "train-*"), MIXED, 4, block_size=0)
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        ShardWriter(str(tmp_path), "x", 0, MIXED)


def test_metadata_round_trip_and_errors(tmp_path):
    splits = {"train": {"files": ["train-00000-of-00001.tfrecord"], "rows": 1}}
    write_metadata(str(tmp_path), dataset_metadata("toy", MIXED, splits, note="x"))
    metadata = load_metadata(str(tmp_path))
    assert schema_from_metadata(metadata) == MIXED
    assert metadata["vocab_sizes"] == {"a": 1000, "b": [5, 1 << 40, 7], "g": 300}
    assert split_files(str(tmp_path), "train") == [str(tmp_path / "train-00000-of-00001.tfrecord")]
    with pytest.raises(KeyError, match="split 'test' not in"):
        split_files(str(tmp_path), "test")
    with pytest.raises(FileNotFoundError, match="prepare"):
        load_metadata(str(tmp_path / "nowhere"))
    (tmp_path / "metadata.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format 'other'"):
        load_metadata(str(tmp_path))


# ---------------------------------------------------------------------------------- synthetic
def reference_fold(raw, size):
    """SyntheticClickLog's fold of one Zipf id into a table, in Python integers: below 2**53 the id
    wraps (`% size`); from there up (rounded doubles) the splitmix64 finalizer of it does."""
    if raw < 2 ** 53:
        return raw % size
    mask = (1 << 64) - 1
    z = (raw + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) % size


def reference_batch(table_sizes, num_dense, zipf_exponent, seed, index, batch_size):
    """The SyntheticClickLog.batch algorithm, spelled out independently."""
    rng = np.random.default_rng([seed, index])
    sizes = np.asarray(table_sizes, np.int64)
    raw = rng.zipf(zipf_exponent, size=(batch_size, len(sizes))) - 1
    sparse = np.array([[reference_fold(int(r), int(n)) for r, n in zip(row, sizes)] for row in raw],
                      np.int64)
    dense = np.log1p(rng.lognormal(0.0, 1.0, size=(batch_size, num_dense)).astype(np.float32))
    weight = np.zeros(batch_size)
    for f in range(len(sizes)):
        h = (sparse[:, f].astype(np.uint64) * np.uint64(2654435761) + np.uint64(f * 40503 + 7)) \
            % np.uint64(1 << 20)
        weight += (h.astype(np.float64) / float(1 << 20) - 0.5) * 3.0
    logit = weight / np.sqrt(len(sizes)) + (dense - dense.mean()) @ np.linspace(-1, 1, num_dense) * 0.5
    labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-2.0 * logit))).astype(np.float32)
    return dense, sparse, labels[:, None]


def test_synthetic_batch_is_unchanged():
    sizes = criteo_kaggle_table_sizes(0.001)
    features, labels = SyntheticClickLog(sizes, 13, 1.2, 5).batch(3, 64)
    dense, sparse, ref_labels = reference_batch(sizes, 13, 1.2, 5, 3, 64)
    np.testing.assert_array_equal(features["dense"], dense)
    np.testing.assert_array_equal(features["sparse"], sparse)
    np.testing.assert_array_equal(labels, ref_labels)
    assert criteo_kaggle_table_sizes(1.0)[2] == 10131227 and min(criteo_kaggle_table_sizes(1e-9)) == 4


def test_synthetic_batch_with_float_rounded_zipf_draws_matches_the_reference():
    # Exponent 1.05: about 7% of numpy's Zipf draws are 2**53 or more (rounded doubles).
    features, _ = SyntheticClickLog((1000, 200_000), 2, 1.05, 5).batch(1, 512)
    _, sparse, _ = reference_batch((1000, 200_000), 2, 1.05, 5, 1, 512)
    np.testing.assert_array_equal(features["sparse"], sparse)


def test_fold_ids_keeps_the_exact_ids_and_spreads_the_rounded_tail():
    size = 200_000
    exact = np.array([0, 5, size - 1, size, 3 * size + 7, 2 ** 53 - 1], np.int64)
    np.testing.assert_array_equal(fold_ids(exact, size), exact % size)
    # Rounded doubles as the samplers give them: multiples of 2**12, less one (all 4095 mod 4096).
    rounded = 2 ** 55 + np.arange(1, 40_001, dtype=np.int64) * 2 ** 12 - 1
    folded = fold_ids(rounded, size)
    assert folded.min() >= 0 and folded.max() < size
    for workers in (2, 4):
        shares = np.bincount(folded % workers, minlength=workers) / folded.size
        assert np.all(np.abs(shares - 1 / workers) < 0.02), (workers, shares)
    assert len(np.unique(folded)) > 0.9 * folded.size
    # Positive control: wrapped without the hash, that tail is all on one shard's rows.
    assert np.all((rounded % size) % 2 == 1) and len(np.unique(rounded % size)) < 4000


def test_zipf_ids_spread_evenly_over_the_row_wise_shards():
    """Each worker of two requests about as many distinct rows from the other's shard (id mod 2)
    as the other requests from its own, even at the heavy-tailed exponent 1.05."""
    log = SyntheticClickLog((200_000,) * 8, 2, 1.05, 1)

    def requests(sparse):
        halves = sparse[:2048], sparse[2048:]  # worker 0's and worker 1's shares of the batch
        return [sum(len(np.unique(half[:, t][half[:, t] % 2 == 1 - w])) for t in range(8))
                for w, half in enumerate(halves)]

    ours, wrapped = np.zeros(2), np.zeros(2)
    for index in range(4):
        features, _ = log.batch(index, 4096)
        ours += requests(features["sparse"])
        raw = np.random.default_rng([1, index]).zipf(1.05, size=(4096, 8)) - 1
        wrapped += requests(raw % 200_000)
    assert abs(ours[0] / ours[1] - 1) < 0.05, ours
    # Positive control: the plain wrap puts the rounded tail on the odd rows, worker 1's shard.
    assert wrapped[0] / wrapped[1] > 1.1, wrapped


def test_multi_hot_batches_extend_the_single_hot_ones():
    sizes = (50, 7, 1000, 3)
    plain = SyntheticClickLog(sizes, num_dense=2, seed=1)
    multi = SyntheticClickLog(sizes, num_dense=2, seed=1, multi_hot=(1, 4, 1, 2))
    (features, labels), (base, _) = multi.example_batch(2, 200), plain.batch(2, 200)
    assert set(features) == {"dense", "C1", "C2", "C3", "C4"}
    np.testing.assert_array_equal(features["dense"], base["dense"])
    np.testing.assert_array_equal(features["C1"], base["sparse"][:, 0])
    np.testing.assert_array_equal(features["C3"], base["sparse"][:, 2])
    for name, f, hot in (("C2", 1, 4), ("C4", 3, 2)):
        bag = features[name]
        lengths = bag.row_lengths()
        assert lengths.min() >= 1 and lengths.max() == hot
        np.testing.assert_array_equal(bag.values[bag.row_splits[:-1]], base["sparse"][:, f])
        assert 0 <= bag.values.min() and bag.values.max() < sizes[f]
    assert labels.shape == (200, 1) and set(np.unique(labels)) <= {0.0, 1.0}
    again, _ = multi.example_batch(2, 200)
    np.testing.assert_array_equal(again["C2"].values, features["C2"].values)
    assert [f.length for f in multi.schema().sparse] == [1, None, 1, None]
    assert plain.schema().sparse[0].vocab_size == sizes
    np.testing.assert_array_equal(plain.example_batch(2, 200)[0]["sparse"], base["sparse"])


def test_synthetic_errors():
    with pytest.raises(ValueError, match="use example_batch"):
        SyntheticClickLog((5, 5), multi_hot=(1, 2)).batch(0, 4)
    with pytest.raises(ValueError, match="one entry >= 1 per table"):
        SyntheticClickLog((5, 5), multi_hot=(2,)).example_batch(0, 4)
    with pytest.raises(ValueError, match="num_dense=13 and 26 tables"):
        SyntheticClickLog((5, 5)).criteo_rows(0, 4)
    with pytest.raises(ValueError, match="exponent must be > 1"):
        power_law_ids(np.random.default_rng(0), 1.0, 4)


def test_power_law_ids_follow_the_zipf_tail():
    ids = power_law_ids(np.random.default_rng(0), 1.5, 400_000)
    for k in (0, 1, 3, 10, 100):
        assert abs(np.mean(ids >= k) - (k + 1) ** -0.5) < 0.005


def test_synthetic_tfrecords_match_the_generator(tmp_path):
    log = SyntheticClickLog((20, 9, 300), num_dense=3, seed=2, multi_hot=(1, 3, 1))
    metadata = write_synthetic_tfrecords(log, str(tmp_path), rows=70, shards=2, test_rows=10,
                                         batch_size=32)
    assert metadata["splits"]["train"]["rows"] == 70 and metadata["splits"]["test"]["rows"] == 10
    schema = schema_from_metadata(load_metadata(str(tmp_path)))
    assert schema == log.schema()
    test = list(make_dataset(split_files(str(tmp_path), "test"), schema, batch_size=10, block_size=1))
    expected, labels = log.example_batch(3, 10)   # test rows come from the batch after train's
    assert test[0][0]["C2"].to_list() == expected["C2"].to_lists()
    np.testing.assert_array_equal(test[0][0]["dense"], expected["dense"])
    np.testing.assert_array_equal(test[0][1], labels)


# ------------------------------------------------------------------------------------- criteo
HAND_SIZES = (1000, 7, 1000) + (1000,) * 23
HAND_ROWS = [
    ["1", "5", "-1", "", "0", "12", "", "", "", "", "", "", "", "100",
     "68fd1e64", "", "ffffffff"] + ["00000001"] * 23,
    ["0", "", "3", "1", "", "", "", "", "", "", "", "", "", "",
     "80e26c9b", "0000a3f2", "9f3b2c1d"] + [""] * 23,
]
# log(5+1), negative -> 0, empty -> 0, log(0+1), log(12+1), ..., log(100+1)
HAND_DENSE = np.array([[1.7917595, 0, 0, 0, 2.5649493, 0, 0, 0, 0, 0, 0, 0, 4.6151204],
                       [0, 1.3862944, 0.6931472, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], np.float32)
# 0x68fd1e64 = 1761418852 -> 852; empty -> 0; 0xffffffff = 4294967295 -> 295; 1 -> 1
# 0x80e26c9b = 2162322587 -> 587; 0xa3f2 = 41970 -> 41970 mod 7 = 5; 0x9f3b2c1d = 2671455261 -> 261
HAND_SPARSE = np.array([[852, 0, 295] + [1] * 23, [587, 5, 261] + [0] * 23], np.int64)


def write_lines(path, rows, ending="\n", final=True):
    text = ending.join("\t".join(r) for r in rows) + (ending if final else "")
    path.write_bytes(text.encode())
    return str(path)


@pytest.mark.parametrize("ending, final", [("\n", True), ("\r\n", True), ("\n", False)])
def test_criteo_reader_on_hand_checked_rows(tmp_path, ending, final):
    path = write_lines(tmp_path / "day_0", HAND_ROWS, ending, final)
    batches = list(read_criteo_tsv(path, HAND_SIZES))
    np.testing.assert_allclose(np.concatenate([b[0]["dense"] for b in batches]), HAND_DENSE, rtol=1e-6)
    np.testing.assert_array_equal(np.concatenate([b[0]["sparse"] for b in batches]), HAND_SPARSE)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), [1.0, 0.0])


# raw_ids=True: the hashes themselves, empty -> -1
HAND_RAW = np.array([[0x68fd1e64, -1, 0xffffffff] + [1] * 23,
                     [0x80e26c9b, 0xa3f2, 0x9f3b2c1d] + [-1] * 23], np.int64)


def test_criteo_reader_keeps_raw_hashes(tmp_path):
    """raw_ids=True: the hand-checked hashes as int64 ids (dense and labels as before); a
    16-digit hash above 2^63 - 1 wraps to a negative id."""
    rows = [list(r) for r in HAND_ROWS]
    rows[1][16] = "8000000000000001"
    path = write_lines(tmp_path / "day_0", rows)
    (features, labels), = list(read_criteo_tsv(path, raw_ids=True))
    expected = HAND_RAW.copy()
    expected[1, 2] = -(1 << 63) + 1
    np.testing.assert_array_equal(features["sparse"], expected)
    np.testing.assert_allclose(features["dense"], HAND_DENSE, rtol=1e-6)
    np.testing.assert_array_equal(labels, [1.0, 0.0])


def test_criteo_reader_raw_ids_argument_errors(tmp_path):
    path = write_lines(tmp_path / "day_0", HAND_ROWS)
    with pytest.raises(ValueError, match="pass table_sizes=None"):
        list(read_criteo_tsv(path, HAND_SIZES, raw_ids=True))
    with pytest.raises(ValueError, match="or raw_ids=True"):
        list(read_criteo_tsv(path))


def test_criteo_tsv_writer_matches_python_formatting_and_reader_matches_numpy(tmp_path):
    log = SyntheticClickLog(criteo_kaggle_table_sizes(0.001), seed=4)
    rows = log.criteo_rows(0, 300)
    lines = ["\t".join([str(rows.labels[i])]
                       + ["" if rows.integers_missing[i, j] else str(rows.integers[i, j]) for j in range(13)]
                       + ["" if rows.categorical_missing[i, j] else "%08x" % rows.categorical[i, j]
                          for j in range(26)]) + "\n" for i in range(300)]
    assert format_criteo_tsv(rows).decode() == "".join(lines)
    assert (rows.integers < 0).any() and rows.integers_missing.any() and rows.categorical_missing.any()
    path = str(tmp_path / "synthetic.tsv")
    assert write_criteo_tsv(path, log, 300, batch_size=300) == 300
    sizes = criteo_kaggle_table_sizes(0.01)
    batches = list(read_criteo_tsv(path, sizes, chunk_bytes=4096))   # many chunk boundaries
    assert len(batches) > 5
    dense = np.concatenate([b[0]["dense"] for b in batches])
    sparse = np.concatenate([b[0]["sparse"] for b in batches])
    np.testing.assert_array_equal(dense, np.log1p(np.where(
        rows.integers_missing, 0, np.maximum(rows.integers, 0))).astype(np.float32))
    np.testing.assert_array_equal(sparse, np.where(rows.categorical_missing, 0,
                                                   rows.categorical % np.asarray(sizes)))
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), rows.labels)
    raw = np.concatenate([b[0]["sparse"] for b in read_criteo_tsv(path, raw_ids=True,
                                                                   chunk_bytes=4096)])
    np.testing.assert_array_equal(raw, np.where(rows.categorical_missing, -1, rows.categorical))


def test_criteo_rows_look_like_criteo():
    rows = SyntheticClickLog(criteo_kaggle_table_sizes(0.01), seed=0).criteo_rows(0, 20000)
    assert 0.15 < rows.labels.mean() < 0.35
    assert 0.4 < rows.integers_missing[:, 0].mean() < 0.5 and not rows.integers_missing[:, 1].any()
    assert 0.7 < rows.categorical_missing[:, 21].mean() < 0.8
    assert rows.categorical.min() >= 0 and rows.categorical.max() < 1 << 32
    values, counts = np.unique(rows.categorical[:, 2], return_counts=True)
    assert counts.max() > 0.05 * len(rows.labels)   # Zipf: a hot hash


@pytest.mark.parametrize("line, message", [
    ("1\t2\t3", r"day_0:2: expected 40 tab-separated fields .* got 3"),
    ("2" + "\t" * 39, r"day_0:2: column label must be 0 or 1: '2'"),
    ("1\tx1" + "\t" * 38, r"day_0:2: column I1 is not an integer .*: 'x1'"),
    ("1\t-" + "\t" * 38, r"day_0:2: column I1 is not an integer .*: '-'"),
    ("1" + "\t" * 13 + "12" + "3" * 30 + "\t" * 26, r"day_0:2: column I13 is not an integer"),
    ("1" + "\t" * 14 + "zz12" + "\t" * 25, r"day_0:2: column C1 is not a hex string .*: 'zz12'"),
    ("1" + "\t" * 15 + "1" * 17 + "\t" * 24, r"day_0:2: column C2 is not a hex string"),
    ("", r"day_0:2: expected 40 tab-separated fields"),
])
def test_criteo_reader_names_file_line_and_column(tmp_path, line, message):
    path = tmp_path / "day_0"
    path.write_text("\t".join(HAND_ROWS[0]) + "\n" + line + "\n" + "\t".join(HAND_ROWS[1]) + "\n")
    with pytest.raises(ValueError, match=message):
        list(read_criteo_tsv(str(path), HAND_SIZES))


def test_criteo_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_criteo_tsv(str(tmp_path / "nope"), HAND_SIZES))
    with pytest.raises(ValueError, match="26 table sizes"):
        list(read_criteo_tsv(str(tmp_path / "nope"), (3, 4)))
    with pytest.raises(FileNotFoundError, match="missing"):
        convert_criteo([str(tmp_path / "nope")], str(tmp_path / "out"))


def test_criteo_conversion_and_cli(tmp_path, capsys):
    out = tmp_path / "tsv"
    assert main(["prepare", "synthetic", "--format", "criteo-tsv", "--out", str(out), "--rows", "500",
                 "--test-rows", "100", "--table-scale", "0.001"]) == 0
    sizes = ["%d" % n for n in criteo_kaggle_table_sizes(0.0001)]
    assert main(["prepare", "criteo", "--input", str(out / "train.tsv"), "--test-input",
                 str(out / "test.tsv"), "--out", str(tmp_path / "tf"), "--shards", "2",
                 "--table-sizes"] + sizes) == 0
    printed = capsys.readouterr()
    assert "train: 500 rows" in printed.out and "100.0%" in printed.err
    metadata = load_metadata(str(tmp_path / "tf"))
    assert metadata["vocab_sizes"]["sparse"] == [int(s) for s in sizes]
    schema = schema_from_metadata(metadata)
    read = list(make_dataset(split_files(str(tmp_path / "tf"), "train", metadata), schema, 128,
                             block_size=1))
    (expected, labels), = list(read_criteo_tsv(str(out / "train.tsv"), [int(s) for s in sizes]))
    np.testing.assert_array_equal(np.concatenate([b[0]["sparse"] for b in read]), expected["sparse"])
    np.testing.assert_array_equal(np.concatenate([b[0]["dense"] for b in read]), expected["dense"])
    np.testing.assert_array_equal(np.concatenate([b[1] for b in read])[:, 0], labels)
    assert metadata["splits"]["train"]["positives"] == int(labels.sum())


@pytest.mark.parametrize("argv, message", [
    (["prepare", "criteo", "--out", "x"], "criteo needs --input"),
    (["prepare", "synthetic", "--out", "x", "--input", "a"], "only apply to criteo"),
    (["prepare", "movielens-1m", "--out", "x", "--shards", "0"], "--shards must be >= 1"),
    (["prepare", "synthetic", "--out", "x", "--table-scale", "1", "--table-sizes"] + ["3"] * 26,
     "not both"),
    (["prepare", "criteo", "--input", "a", "--out", "x", "--format", "criteo-tsv"],
     "only apply to synthetic"),
    (["prepare", "synthetic", "--out", "x", "--multi-hot", "2", "3"], "--multi-hot needs 26 values"),
])
def test_cli_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_cli_reports_converter_errors(tmp_path, capsys):
    assert main(["prepare", "criteo", "--input", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 1
    assert "error: Criteo input files missing" in capsys.readouterr().err


def test_progress_bar_prints_deciles_when_not_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar("job", "rows", stream=stream)
    for done in range(0, 1001, 50):
        bar(done, 1000)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("job [" + "#" * 30 + "] 100.0% 1.00k/1.00k rows")


def test_data_package_has_no_pickle_use():
    folder = os.path.dirname(os.path.abspath(data_package.__file__))
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                text = f.read()
            assert "pickle" not in text and "eval(" not in text, name
