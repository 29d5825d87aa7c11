"""Steps whose workers got shares of different sizes of a global batch are refused.

usage: unequal_shares.py OUT_DIR CASE...   (on 2 workers)
  Each CASE trains a tiny model (a 20-row table and a dense layer) with fit and writes
  OUT_DIR/<case>-<rank>.json: {"steps": steps finished, "error": message or None,
  "checks": equal-share checks traced, "gathered_checks": of which with an all-gather of their
  own (the others read the sizes from the keys exchange)}. Cases: <kind>[:<pipeline>], kind one of
  uneven (global batches of 4 then 3: shares 2+2, then 2+1), even (4 then 2: 2+2, 1+1),
  static (4 and 4, drop_remainder=True; TensorFlow still relaxes a finite dataset's batch
  dimension on several workers), repeated (static, repeated: static shapes), loop (uneven,
  eager strategy.run of a training step), evaluate (uneven, model.evaluate: not refused),
  middle (4, 3, then 4: the refused batch is not the last one, so a look-ahead pipeline's
  refused step is one that also prefetches and reads the iterator).
  "racing" lists the collectives of a traced step that may run while its check fails (neither
  before nor after the check in the graph): a step aborted then would leave their exchanges
  half-done and close the mesh (the cases after it would fail).
"""
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.collectives import counting  # noqa: E402
from tf_nestpipe.strategy import equal_shares  # noqa: E402

SHARES = {"uneven": [[2, 2], [2, 1]], "even": [[2, 2], [1, 1]], "static": [[2, 2], [2, 2]],
          "repeated": [[2, 2], [2, 2]], "loop": [[2, 2], [2, 1]],
          "evaluate": [[2, 2], [2, 1]], "middle": [[2, 2], [2, 1], [2, 2]]}  # per step, worker


class Tiny(tf_keras.Model):
    """A table lookup and a dense layer."""

    def __init__(self):
        super().__init__()
        self.table = tnp.ShardedEmbedding(20, 4)
        self.out = tf_keras.layers.Dense(1)

    def call(self, ids):
        return self.out(self.table(ids))


def dataset_fn_for(kind):
    def dataset_fn(context):
        rank = context.input_pipeline_id
        sizes = [step[rank] for step in SHARES[kind]]
        ids = np.arange(sum(sizes), dtype=np.int64) + 7 * rank
        labels = (ids % 2).astype(np.float32)[:, None]
        dataset = tf.data.Dataset.from_tensor_slices((ids, labels))
        if kind == "static":
            return dataset.batch(2, drop_remainder=True)
        if kind == "repeated":  # infinite: TensorFlow keeps the static batch dimension
            return dataset.batch(2, drop_remainder=True).repeat()
        # batches of this worker's sizes, dynamic batch dimension
        bounds = np.cumsum([0] + sizes)
        return tf.data.Dataset.range(len(sizes)).map(
            lambda i: (tf.gather(ids, tf.range(tf.gather(bounds, i), tf.gather(bounds, i + 1))),
                       tf.gather(labels, tf.range(tf.gather(bounds, i),
                                                  tf.gather(bounds, i + 1)))))
    return dataset_fn


def racing_collectives(graph):
    """The collectives of `graph` (nodes issuing one, calls of functions that do included) that
    are neither ancestors nor descendants of its equal-shares Assert."""
    graph_def = graph.as_graph_def()
    issues_collective = counting.collective_issuers(graph_def)
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in graph_def.node}
    outputs = {}
    for name, sources in inputs.items():
        for source in sources:
            outputs.setdefault(source, []).append(name)

    def reach(start, edges):
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), []):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    checks = [n.name for n in graph_def.node
              if n.op == "Assert" and "nestpipe_equal_shares" in n.name]
    racing = set()
    for check in checks:
        ordered = reach(check, inputs) | reach(check, outputs)
        racing.update(n.name for n in graph_def.node
                      if issues_collective(n) and n.name not in ordered)
    return sorted(racing)


def run(strategy, case):
    kind, _, pipeline = case.partition(":")
    strategy.pipeline = pipeline or "none"
    traced, gathered, graphs = [], [], []
    original, original_gathered = equal_shares.check_shares, equal_shares.check_equal_shares

    def counting(sizes):
        traced.append(1)
        if not tf.executing_eagerly():
            graphs.append(tf.compat.v1.get_default_graph())
        return original(sizes)

    def counting_gathered(size, collectives):
        gathered.append(1)
        return original_gathered(size, collectives)

    equal_shares.check_shares = counting
    equal_shares.check_equal_shares = counting_gathered
    steps = []
    error = None
    try:
        with strategy.scope():
            model = Tiny()
            model.compile(optimizer=tf_keras.optimizers.SGD(0.1),
                          loss=tf_keras.losses.MeanSquaredError())
        data = strategy.distribute_datasets_from_function(dataset_fn_for(kind))
        if kind == "loop":
            with strategy.scope():
                model(tf.constant([0], tf.int64))

            def train_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(x) - y) ** 2) / strategy.num_replicas_in_sync
                gradients = tape.gradient(loss, model.trainable_variables)
                model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))

            for features, labels in data:
                strategy.run(train_step, args=(features, labels))
                steps.append(1)
        elif kind == "evaluate":
            model.evaluate(data, steps=2, verbose=0, callbacks=[
                tf_keras.callbacks.LambdaCallback(on_test_batch_end=lambda b, l: steps.append(b))])
        else:
            model.fit(data, epochs=1, steps_per_epoch=len(SHARES[kind]), verbose=0, callbacks=[
                tf_keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, l: steps.append(b))])
    except (ValueError, tf.errors.OpError) as e:
        error = str(e)[:3000]
    finally:
        equal_shares.check_shares, equal_shares.check_equal_shares = original, original_gathered
    return {"steps": len(steps), "error": error, "checks": len(traced),
            "gathered_checks": len(gathered),
            "racing": sorted({n for g in graphs for n in racing_collectives(g)})}


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    # row_wise: the share sizes come with the keys exchange ("auto" would replicate the
    # table; tests/test_unequal_shares.py counts the checks that read them there).
    strategy = tnp.NestPipeStrategy(micro_batches=2, placement="row_wise")
    for case in cases:
        result = run(strategy, case)
        with open(os.path.join(out, "%s-%d.json" % (case.replace(":", "."),
                                                    strategy.worker_index)), "w") as f:
            json.dump(result, f)
        print("case", case, result["steps"], (result["error"] or "")[:200], flush=True)


if __name__ == "__main__":
    main()
