"""The default table placement ("auto") of a model whose tables are constructed lazily (in a
layer's `build`, i.e. at the model's first call inside `fit`), trained with `fit` under the
default pipeline ("auto": its probe runs none, fwp, dbp and nested).

Run in one process (no TF_CONFIG: the reference) or on a cluster through the launcher; both see
the same global batches (exactness.py's data, each worker its contiguous slice).

usage: placement_default.py OUT_DIR STEPS [--disagree]
  Every worker r writes OUT_DIR/rank<r>.json: {"placement": the strategy's placement argument
  (its default), "plan": [[table, placement, owner, reason], ...] as this worker's planner placed
  them, "own_costs": this worker's own collective costs (`linear_costs` of its
  `default_collectives`), "agreed_costs": those its planner used, "tables": {name: [rows, dim]}}.
  Worker 0 also writes OUT_DIR/params.npz (whole tables, dense weights by position).
  --disagree: worker 1's own all-reduce costs 1000 times what it measured, so that planned with
  its own costs every table would be row-wise: the strategy must plan with worker 0's.
"""
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tf_keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import exactness as ex  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.plan import placement as pl  # noqa: E402
from tf_nestpipe.plan.collective_costs import CollectiveParams  # noqa: E402
from tf_nestpipe.strategy import nestpipe_strategy  # noqa: E402


class LazyTables(tf_keras.layers.Layer):
    """exactness.TinyRanker's two tables, constructed when this layer is built (the model's first
    call), not when the model is."""

    def build(self, input_shape):
        self.table_a = tnp.ShardedEmbedding(
            ex.VOCAB_A, ex.DIM, name="table_a",
            embeddings_initializer=tf_keras.initializers.RandomUniform(-0.3, 0.3, seed=7))
        self.table_b = tnp.ShardedEmbedding(
            ex.VOCAB_B, ex.DIM, combiner="mean", name="table_b",
            embeddings_initializer=tf_keras.initializers.TruncatedNormal(stddev=0.2, seed=8))
        super().build(input_shape)

    def call(self, features):
        a = tf.reshape(self.table_a(features["ids"]), [-1, 2 * ex.DIM])
        return tf.concat([a, self.table_b(features["bag"])], axis=1)


class LazyRanker(tf_keras.Model):
    """exactness.TinyRanker with its tables in a LazyTables layer."""

    def __init__(self):
        super().__init__()
        self.tables = LazyTables()
        self.hidden = tf_keras.layers.Dense(
            8, activation="relu", kernel_initializer=tf_keras.initializers.GlorotUniform(seed=9))
        self.out = tf_keras.layers.Dense(
            1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=10))

    def call(self, features):
        return self.out(self.hidden(tf.concat([self.tables(features), features["dense"]], 1)))


def make_worker_1_disagree():
    """On worker 1: its own all-reduce costs 1000 times what it measured."""
    real = nestpipe_strategy.default_collectives

    def dearer(transport):
        costs = dict(real(transport))
        reduce = costs["all_reduce"]
        costs["all_reduce"] = CollectiveParams(
            reduce.alpha0_ms * 1000, reduce.alpha_step_ms * 1000, reduce.beta_ms_per_mb * 1000,
            reduce.algorithm, {w: (i * 1000, s * 1000) for w, (i, s) in
                               (reduce.measured or {}).items()})
        return costs

    nestpipe_strategy.default_collectives = dearer


def main():
    out, steps = sys.argv[1], int(sys.argv[2])
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    if "--disagree" in sys.argv and task.get("index") == 1:
        make_worker_1_disagree()
    strategy = tnp.NestPipeStrategy(micro_batches=3, auto_warmup_steps=0, auto_timed_steps=1,
                                    auto_probe_rounds=1, auto_micro_batches=(3,))
    rank, workers = strategy.worker_index, strategy.num_workers
    with strategy.scope():
        model = LazyRanker()
        model.compile(optimizer=ex.make_optimizer("adagrad"),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    dataset = strategy.distribute_datasets_from_function(
        ex.per_worker_dataset_fn(ex.make_batches(steps)))
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    planner = strategy.extended.placement_planner
    own = nestpipe_strategy.default_collectives(planner.transport)
    report = {"placement": strategy.placement,
              "plan": [[p.table.name, p.placement, p.owner, p.reason] for p in planner.plans],
              "own_costs": pl.linear_costs(own, workers),
              "agreed_costs": pl.linear_costs(planner.collectives, workers),
              "tables": {p.table.name: [p.table.rows, p.table.dim] for p in planner.plans}}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "rank%d.json" % rank), "w") as f:
        json.dump(report, f)
    tables = {"table_a": model.tables.table_a.full_table(),
              "table_b": model.tables.table_b.full_table()}
    if rank == 0:
        dense = [v.numpy() for v in model.trainable_variables if "table_" not in v.name]
        np.savez(os.path.join(out, "params.npz"), **tables,
                 **{"dense/%d" % i: v for i, v in enumerate(dense)})
    if workers > 1:  # leave together (worker 0 saved last)
        strategy.extended.collectives.all_gather(tf.constant([1], tf.int32), "default/done")
    print("placement_default done on worker %d" % rank, flush=True)


if __name__ == "__main__":
    main()
