"""Builds one large ShardedEmbedding table, trains 3 Adagrad steps, prints `RESULT {json}` with
this process's peak RSS growth since before the table existed (bytes)."""
import argparse
import json
import os
import resource

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4 << 20)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    strategy = tnp.NestPipeStrategy(placement="row_wise")  # the row shards' memory is measured
    with strategy.scope():
        table = tnp.ShardedEmbedding(args.rows, args.dim, name="big", embeddings_initializer=
                                     tf_keras.initializers.RandomUniform(-0.01, 0.01, seed=1))
        optimizer = tf_keras.optimizers.Adagrad(0.1)
    baseline = current_rss_bytes()
    ids = tf.constant(np.random.default_rng(strategy.worker_index).integers(0, args.rows, 4096))

    @tf.function
    def step():
        def fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(table(ids)) / 4096.0
            grads = tape.gradient(loss, table.trainable_variables)
            optimizer.apply_gradients(zip(grads, table.trainable_variables))
            return loss
        return strategy.run(fn)

    for _ in range(3):
        step()
    if strategy.worker_index == 0:
        print("RESULT " + json.dumps({
            "workers": strategy.num_workers, "table_bytes": args.rows * args.dim * 4,
            "local_rows": table.layout.local_rows,
            "peak_growth_bytes": peak_rss_bytes() - baseline}), flush=True)


if __name__ == "__main__":
    main()
