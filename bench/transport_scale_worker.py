"""One worker of `bench/transport_scale.py`: a tiny DLRM-like model (one row-sharded table, a
dense tower of `--dense` parameters) trained with tf_keras `fit` under `NestPipeStrategy`; prints
one JSON line: start-up seconds (from `--launched`), the transport's bytes and frames per step
(the mesh's own counters), threads and sockets of the process, and the dense gradient's bytes."""
import argparse
import json
import os
import time

import tf_nestpipe as tnp  # noqa: I100  (first: picks tf_keras)
import numpy as np
import tensorflow as tf
import tf_keras

from tf_nestpipe.ops.sockets import socket_stats


def open_sockets():
    """The socket file descriptors of this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink("/proc/self/fd/" + fd).startswith("socket:")
        except OSError:
            pass
    return count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--launched", type=float, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="per worker")
    parser.add_argument("--dense", type=int, default=256, help="hidden width of the tower")
    args = parser.parse_args()
    strategy = tnp.NestPipeStrategy(pipeline="none")
    ready = time.time() - args.launched
    workers = strategy.num_workers
    global_batch = args.batch * workers

    def dataset_fn(context):
        rng = np.random.default_rng(context.input_pipeline_id)
        ids = rng.integers(0, 10_000 * workers, (4096, 4))
        labels = rng.integers(0, 2, (4096, 1)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(
            context.get_per_replica_batch_size(global_batch), drop_remainder=True)

    with strategy.scope():
        inputs = tf_keras.Input((4,), dtype=tf.int64)
        rows = tnp.ShardedEmbedding(10_000 * workers, 16, name="ids")(inputs)
        hidden = tf_keras.layers.Dense(args.dense, "relu")(tf_keras.layers.Flatten()(rows))
        hidden = tf_keras.layers.Dense(args.dense, "relu")(hidden)
        model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(hidden))
        model.compile(tf_keras.optimizers.SGD(0.01),
                      tf_keras.losses.BinaryCrossentropy(from_logits=True))
    data = strategy.distribute_datasets_from_function(dataset_fn)
    model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)  # traced and warm
    before = socket_stats() if strategy.collectives_backend == "sockets" else None
    started = time.time()
    model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
    step_ms = (time.time() - started) * 1000 / args.steps
    after = socket_stats() if before is not None else None
    dense_bytes = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights
                      if "ids" not in w.name)
    record = {
        "worker": strategy.worker_index, "workers": workers,
        "transport": strategy.collectives_backend, "startup_s": round(ready, 2),
        "step_ms": round(step_ms, 2), "dense_gradient_bytes": dense_bytes,
        "threads": len(os.listdir("/proc/self/task")), "sockets": open_sockets(),
    }
    if after is not None:
        record.update({
            "bytes_sent_per_step": (after["bytes_sent"] - before["bytes_sent"]) // args.steps,
            "frames_sent_per_step": (after["frames_sent"] - before["frames_sent"]) // args.steps,
            "mesh_peers": after["peers"], "mesh_io_threads": after["io_threads"]})
    print("SCALE " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
