"""Which records each worker sees through `NestPipeStrategy.experimental_distribute_dataset`
under every AutoShard policy, and through `distribute_datasets_from_function`.

usage: autoshard.py OUT_DIR FILE_GLOB CASE [CASE ...]
  CASE is POLICY (FILE, DATA, AUTO, HINT, OFF), ONE_FILE:POLICY (only the first file), HINT_MISSING (HINT without SHARD_HINT in the
  pipeline), FROM_FUNCTION (distribute_datasets_from_function with the InputContext), or
  FIT:POLICY (tf_keras fit of a model with a sharded table until the data runs out, with a
  metric summing every consumed record id over all workers, so a dropped or duplicated sample
  shows). Every worker writes OUT_DIR/CASE.RANK.json: the record ids it saw per step (or the
  fit's global id sum and count), or the error it raised.
"""
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402

GLOBAL_BATCH = 4
POLICIES = {name: getattr(tf.data.experimental.AutoShardPolicy, name)
            for name in ("FILE", "DATA", "AUTO", "HINT", "OFF")}


def read_ids(pattern, hint=False):
    """Record ids (int64 feature 'id') of the sorted files matching `pattern`, unbatched."""
    files = tf.data.Dataset.list_files(pattern, shuffle=False)
    if hint:
        files = files.shard(tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT)
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=1)
    return records.map(lambda r: tf.io.parse_single_example(
        r, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"])


def with_policy(dataset, policy):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def local_ids(strategy, value):
    return [int(i) for t in strategy.experimental_local_results(value) for i in t.numpy()]


def run_case(strategy, pattern, case):
    """Returns the JSON-able result of one case on this worker."""
    if case.startswith("ONE_FILE:"):
        pattern, case = sorted(tf.io.gfile.glob(pattern))[0], case.split(":", 1)[1]
    if case.startswith("FIT:"):
        return counted_training(strategy, pattern, case.split(":", 1)[1])
    if case.startswith(("FULL:", "PARTIAL:")):
        kind, pipeline = case.split(":", 1)
        return data_sharded_training(strategy, pattern, pipeline, full=kind == "FULL")
    if case == "FROM_FUNCTION":
        def dataset_fn(context):
            batch = context.get_per_replica_batch_size(GLOBAL_BATCH)
            return (read_ids(pattern).shard(context.num_input_pipelines, context.input_pipeline_id)
                    .batch(batch))
        dist = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        policy = "HINT" if case == "HINT_MISSING" else case
        dataset = read_ids(pattern, hint=(case == "HINT")).batch(GLOBAL_BATCH)
        dist = strategy.experimental_distribute_dataset(with_policy(dataset, POLICIES[policy]))
    return {"steps": [local_ids(strategy, batch) for batch in dist]}


class IdTotals(tf_keras.metrics.Metric):
    """Sum and number of the labels (= record ids) the training steps consumed."""

    def __init__(self, **kwargs):
        super().__init__(name="id_totals", **kwargs)
        self.totals = self.add_weight("totals", shape=[2], initializer="zeros", dtype=tf.float64)

    def update_state(self, y_true, y_pred, sample_weight=None):
        del y_pred, sample_weight
        y_true = tf.cast(tf.reshape(y_true, [-1]), tf.float64)
        return self.totals.assign_add(tf.stack([tf.reduce_sum(y_true),
                                                tf.cast(tf.size(y_true), tf.float64)]))

    def result(self):
        return self.totals


def counted_training(strategy, pattern, policy):
    """tf_keras `fit` of a model with a sharded table over the data until it runs out; the
    metric counts every label (= record id) a step consumed, summed over the workers."""
    dataset = with_policy(read_ids(pattern).map(lambda i: (i, tf.cast(i, tf.float32)))
                          .batch(GLOBAL_BATCH), POLICIES[policy])
    with strategy.scope():
        model = tf_keras.Sequential([tnp.ShardedEmbedding(64, 2), tf_keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=[IdTotals()])
    # The workers' shards differ in length, so the last steps split unevenly, which training
    # refuses by default (tests/test_unequal_shares.py); this case counts the records consumed.
    strategy.check_equal_shares = False
    try:
        history = model.fit(dataset, epochs=1, verbose=0)
    finally:
        strategy.check_equal_shares = True
    totals = history.history["id_totals"][-1]
    return {"global_sum": int(round(totals[0])), "global_count": int(round(totals[1]))}


def data_sharded_training(strategy, pattern, pipeline, full):
    """tf_keras `fit` under `pipeline` of DATA-sharded global batches until the data runs out:
    `full` batches (drop_remainder=True: 6 of the 26 records' 7 batches, every worker's share 2
    records, no worker can run out first) or all 7 (the last one of 2 records, 1 per worker);
    the records consumed (as `counted_training`), the steps and the collectives a step issued."""
    dataset = with_policy(read_ids(pattern).map(lambda i: (i, tf.cast(i, tf.float32)))
                          .batch(GLOBAL_BATCH, drop_remainder=full), POLICIES["DATA"])
    previous = strategy.pipeline
    strategy.pipeline = pipeline
    try:
        with strategy.scope():
            model = tf_keras.Sequential([tnp.ShardedEmbedding(64, 2), tf_keras.layers.Dense(1)])
            model.compile("sgd", "mse", metrics=[IdTotals()])
        history = model.fit(dataset, epochs=1, verbose=0)
    finally:
        strategy.pipeline = previous
    totals = history.history["id_totals"][-1]
    stats = model._nestpipe_pipeline.stats  # pylint: disable=protected-access
    return {"global_sum": int(round(totals[0])), "global_count": int(round(totals[1])),
            "steps": stats.steps, "collectives": stats.collectives.total}


def main():
    out_dir, pattern, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    # row_wise: the sharded table's exchange under the uneven last steps ("auto", the
    # default, would replicate this small table).
    strategy = tnp.NestPipeStrategy(placement="row_wise")
    for case in cases:
        try:
            result = run_case(strategy, pattern, case)
        except Exception as e:  # noqa: BLE001 - the test inspects the message
            result = {"error": "%s: %s" % (type(e).__name__, e)}
        path = os.path.join(out_dir, "%s.%d.json" % (case.replace(":", "_"), strategy.worker_index))
        with open(path, "w") as f:
            json.dump(result, f)
        print("case", case, "done", flush=True)


if __name__ == "__main__":
    main()
