"""AutoShard policies under `NestPipeStrategy` on a 2-worker cluster with 4 input files of
unequal size: which records each worker saw (none twice, none missed), the known traps (fewer
files than workers, HINT without a shard hint, workers running out at different steps), and
`distribute_datasets_from_function`."""
import json
import os

import pytest
import tensorflow as tf

from conftest import PROGRAMS, launch
from tf_nestpipe.data.autoshard import equal_static_shares, with_policy

FILE_SIZES = [5, 6, 7, 8]  # records per file; ids are consecutive: file 0 holds 0..4, ...
FILE_IDS = []
start = 0
for size in FILE_SIZES:
    FILE_IDS.append(list(range(start, start + size)))
    start += size
ALL_IDS = list(range(start))
CASES = ["HINT_MISSING", "ONE_FILE:FILE", "ONE_FILE:AUTO", "FILE", "DATA", "AUTO", "HINT", "OFF",
         "FROM_FUNCTION", "FIT:FILE", "FIT:DATA", "FULL:none", "PARTIAL:none", "FULL:dbp",
         "PARTIAL:dbp", "FULL:nested"]


@pytest.fixture(scope="session")
def autoshard_results(tmp_path_factory):
    data = tmp_path_factory.mktemp("autoshard_data")
    for index, ids in enumerate(FILE_IDS):
        with tf.io.TFRecordWriter(str(data / ("part-%d.tfrecord" % index))) as writer:
            for i in ids:
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))})
                ).SerializeToString())
    out = tmp_path_factory.mktemp("autoshard_out")
    result = launch(2, [os.path.join(PROGRAMS, "autoshard.py"), str(out),
                        str(data / "part-*.tfrecord")] + CASES)
    assert result.returncode == 0, result.stdout[-5000:]
    results = {}
    for case in CASES:
        results[case] = []
        for rank in range(2):
            with open(out / ("%s.%d.json" % (case.replace(":", "_"), rank))) as f:
                results[case].append(json.load(f))
    return results, result.stdout


def _seen(worker):
    assert "error" not in worker, worker
    return sorted(i for step in worker["steps"] for i in step)


def _assert_split_exactly(results, case, expected=ALL_IDS):
    seen = [_seen(w) for w in results[case]]
    assert not set(seen[0]) & set(seen[1]), "a record was seen by both workers"
    assert sorted(seen[0] + seen[1]) == expected, "a record was missed or duplicated"
    # Both workers run the same number of steps (the one that ran out got empty batches).
    assert len(results[case][0]["steps"]) == len(results[case][1]["steps"])
    return seen


@pytest.mark.parametrize("case", ["FILE", "AUTO", "HINT"])
def test_file_sharding_gives_each_worker_its_own_files(autoshard_results, case):
    results, _ = autoshard_results
    seen = _assert_split_exactly(results, case)
    assert seen[0] == sorted(FILE_IDS[0] + FILE_IDS[2])
    assert seen[1] == sorted(FILE_IDS[1] + FILE_IDS[3])


def test_data_sharding_splits_records_between_workers(autoshard_results):
    results, _ = autoshard_results
    seen = _assert_split_exactly(results, "DATA")
    assert all(len(s) == 13 for s in seen)


def test_off_gives_every_worker_every_record(autoshard_results):
    results, _ = autoshard_results
    assert [_seen(w) for w in results["OFF"]] == [ALL_IDS, ALL_IDS]


def test_distribute_datasets_from_function_gets_the_input_context(autoshard_results):
    results, _ = autoshard_results
    _assert_split_exactly(results, "FROM_FUNCTION")
    # Per-replica batch size = global batch 4 / 2 workers.
    assert max(len(step) for w in results["FROM_FUNCTION"] for step in w["steps"]) == 2


@pytest.mark.parametrize("case", ["FIT:FILE", "FIT:DATA"])
def test_fit_over_uneven_shards_consumes_every_record_once(autoshard_results, case):
    """Under FILE the workers' shards hold 12 and 14 records: one runs out first, and fit still
    stops on both at once with every record counted once."""
    results, _ = autoshard_results
    for worker in results[case]:
        assert worker == {"global_sum": sum(ALL_IDS), "global_count": len(ALL_IDS)}


@pytest.mark.parametrize("pipeline", ["none", "dbp", "nested"])
def test_full_data_sharded_batches_train_without_the_partial_batch_all_reduce(autoshard_results,
                                                                           pipeline):
    """DATA-sharded batches of one static size (drop_remainder=True): no worker can run out
    first, so the strategy distributes them without TensorFlow's partial-batch handling: every
    full batch trains once (6 steps, records 0..23), and a step issues one collective fewer
    than over the same records batched with a partial last batch (the positive control: the
    handling's all-reduce, at every step; 7 steps, all 26 records)."""
    results, _ = autoshard_results
    full = results["FULL:" + pipeline]
    for worker in full:
        assert {k: worker[k] for k in ("global_sum", "global_count", "steps")} == {
            "global_sum": sum(range(24)), "global_count": 24, "steps": 6}, worker
    control = results.get("PARTIAL:" + pipeline)  # run for none and dbp
    for worker, partial in zip(full, control or []):
        assert {k: partial[k] for k in ("global_sum", "global_count", "steps")} == {
            "global_sum": sum(ALL_IDS), "global_count": len(ALL_IDS), "steps": 7}, partial
        assert worker["collectives"] == partial["collectives"] - 1, (worker, partial)


def test_hint_without_a_shard_hint_is_refused_on_every_worker(autoshard_results):
    results, _ = autoshard_results
    for worker in results["HINT_MISSING"]:
        assert "SHARD_HINT" in worker["error"] and "every sample" in worker["error"]


def test_file_sharding_with_fewer_files_than_workers_fails_clearly_everywhere(autoshard_results):
    results, _ = autoshard_results
    for worker in results["ONE_FILE:FILE"]:
        assert "fewer files than workers" in worker["error"]
        assert "AutoShardPolicy.DATA" in worker["error"]


def test_auto_with_fewer_files_than_workers_falls_back_to_data(autoshard_results):
    results, stdout = autoshard_results
    _assert_split_exactly(results, "ONE_FILE:AUTO", FILE_IDS[0])
    assert "sharding by DATA instead" in stdout


def test_shard_hint_detection_and_file_probe_in_one_process(tmp_path):
    from tf_nestpipe.data import autoshard

    path = str(tmp_path / "only.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"x")
    files = tf.data.Dataset.from_tensor_slices([path])
    hinted = files.shard(tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT)
    assert autoshard.has_shard_hint(hinted.interleave(tf.data.TFRecordDataset).batch(2))
    assert not autoshard.has_shard_hint(files.shard(2, 0).interleave(tf.data.TFRecordDataset))
    reader = files.interleave(tf.data.TFRecordDataset)
    status, message = autoshard.probe_file_sharding(
        autoshard.with_policy(reader, autoshard.AutoShardPolicy.FILE), 2, 0)
    assert status == autoshard.TOO_FEW_FILES and "FILE based sharding" in message
    assert autoshard.probe_file_sharding(reader, 1, 0)[0] == autoshard.OK
    # One worker: nothing to check, nothing to agree on.
    assert autoshard.check_auto_shard(reader, 1, 0, agree=None) is reader


def test_equal_static_shares_only_for_data_sharded_batches_of_one_divisible_static_size():
    data = tf.data.experimental.AutoShardPolicy.DATA
    records = tf.data.Dataset.range(20)
    pairs = tf.data.Dataset.zip((records, records.map(lambda i: tf.ragged.range(i % 3))))
    assert equal_static_shares(with_policy(records.batch(4, drop_remainder=True), data), 2)
    # Ragged components with a static batch dimension qualify too.
    assert equal_static_shares(with_policy(pairs.batch(4, drop_remainder=True), data), 4)
    # A partial last batch, a size the replicas do not divide, or another policy: no.
    assert not equal_static_shares(with_policy(records.batch(4), data), 2)
    assert not equal_static_shares(with_policy(records.batch(4, drop_remainder=True), data), 3)
    for policy in ("AUTO", "FILE", "OFF"):
        assert not equal_static_shares(with_policy(
            records.batch(4, drop_remainder=True),
            getattr(tf.data.experimental.AutoShardPolicy, policy)), 2)
    assert not equal_static_shares(with_policy(records, data), 2)  # unbatched: scalars
