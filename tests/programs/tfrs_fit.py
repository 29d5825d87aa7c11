"""A TFRS DCN ranking model (tfrs.layers.dcn.Cross + tfrs.tasks.Ranking) on ShardedEmbedding
tables, written as the TFRS tutorials write it (default loss reduction, no route method), trained with tf_keras fit and evaluated; worker 0 writes history, metrics and weights.

usage: tfrs_fit.py OUT.npz
"""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders as tfrs  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402

NUM_FIELDS, VOCAB, DIM, NUM_DENSE = 3, 200, 8, 4
GLOBAL_BATCH, STEPS = 64, 12


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    cat = np.minimum(rng.zipf(1.4, size=(n, NUM_FIELDS)) - 1, VOCAB - 1).astype(np.int64)
    dense = rng.normal(size=(n, NUM_DENSE)).astype(np.float32)
    label = ((cat[:, 0] % 3 == 0) ^ (dense[:, 0] > 0.3)).astype(np.float32)[:, None]
    return {"cat": cat, "dense": dense, "label": label}


class DCNRanker(tfrs.Model):
    """One ShardedEmbedding per field, a Cross layer, a deep tower and a Ranking task."""

    def __init__(self):
        super().__init__()
        self.tables = [tnp.ShardedEmbedding(
            VOCAB, DIM, embeddings_initializer=tf_keras.initializers.RandomUniform(-0.1, 0.1, seed=i),
            name="field_%d" % i) for i in range(NUM_FIELDS)]
        self.cross = tfrs.layers.dcn.Cross(kernel_initializer=tf_keras.initializers.GlorotUniform(seed=40))
        self.deep = tf_keras.Sequential([
            tf_keras.layers.Dense(16, activation="relu", kernel_initializer=tf_keras.initializers.GlorotUniform(seed=41)),
            tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=42))])
        # As the TFRS tutorials write it: the task's default loss reduction, an unscaled
        # regularizer, no route method (the strategy reduces and routes it as one process).
        self.task = tfrs.tasks.Ranking(
            loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[tf_keras.metrics.AUC(from_logits=True, name="auc")])
        self.head = tf_keras.layers.Dense(
            1, kernel_regularizer=tf_keras.regularizers.L2(0.01),
            kernel_initializer=tf_keras.initializers.GlorotUniform(seed=43))

    def call(self, features):
        x = tf.concat([t(features["cat"][:, i]) for i, t in enumerate(self.tables)]
                      + [features["dense"]], axis=1)
        return self.deep(self.cross(x, x)) + self.head(features["dense"])

    def compute_loss(self, inputs, training=False):
        labels = inputs.pop("label")  # as the tutorials do: the route pass gets its own copy
        return self.task(labels=labels, predictions=self(inputs))


def main():
    out_path = sys.argv[1]
    # row_wise: the fused exchange the run counts ("auto" would replicate these tables).
    strategy = tnp.NestPipeStrategy(placement="row_wise")
    rank, workers = strategy.worker_index, strategy.num_workers
    train = make_data(GLOBAL_BATCH * STEPS, 0)
    test = make_data(GLOBAL_BATCH * 4, 1)

    def dataset_fn(features, repeat):
        def fn(context):
            per = GLOBAL_BATCH // context.num_input_pipelines
            ds = tf.data.Dataset.from_tensor_slices(features).batch(GLOBAL_BATCH)
            # keep this worker's contiguous slice of each global batch
            ds = ds.map(lambda f: tf.nest.map_structure(
                lambda t: t[context.input_pipeline_id * per:(context.input_pipeline_id + 1) * per], f))
            return ds.repeat() if repeat else ds
        return fn

    with strategy.scope():
        model = DCNRanker()
        model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1))
    train = strategy.distribute_datasets_from_function(dataset_fn(train, repeat=True))
    test = strategy.distribute_datasets_from_function(dataset_fn(test, repeat=False))
    history = model.fit(train, epochs=2, steps_per_epoch=STEPS, verbose=0)
    evaluation = model.evaluate(test, steps=4, return_dict=True, verbose=0)
    print("history", history.history, "evaluate", evaluation, flush=True)
    tables = {t.name: t.full_table() for t in model.tables}
    if rank == 0:
        dense = {"dense/" + v.name: v.numpy() for v in model.trainable_variables if "field_" not in v.name}
        pipeline = getattr(model, "_nestpipe_pipeline", None)
        fused = {} if pipeline is None else {"exchanges": pipeline.stats.exchanges}
        np.savez(out_path, **fused, train_auc=history.history["auc"], train_loss=history.history["loss"],
                 train_regularization=history.history["regularization_loss"],
                 eval_auc=evaluation["auc"], eval_loss=evaluation["loss"],
                 eval_regularization=evaluation["regularization_loss"], **tables, **dense)
    print("workers", workers, "done", flush=True)


if __name__ == "__main__":
    main()
