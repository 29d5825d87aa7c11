"""Trains exactness.py's model with compressed exchanges (`wire_dtype`) and saves its parameters
and the exchange's wire counters of each run.

usage: wire_dtypes.py OUT_PREFIX STEPS RUN [RUN ...] [--horovod]
  RUN is MODE:OPTIMIZER:WIRE[:OPTION ...]: MODE and OPTIMIZER as in exactness.py (loop, direct,
  fit; sgd, adagrad, adam), WIRE a forward-backward pair (fp32-fp32, int8-bf16, ...), OPTION
  dbp, fwp or nested (the run's pipeline, as in exactness.py) or scaled (direct mode only: the loss is multiplied by 2**24
  and the gradients divided by it again, as a loss-scaling optimizer does, so the gradient
  exchange carries values beyond float16's range). Worker 0 writes OUT_PREFIX.RUN.npz (":"
  replaced by ".") with the parameters (exactness.py's names) and wire/<counter> for each of
  the run's wire counters (bytes this worker sent per exchange kind, float16 values clamped).
--horovod: the strategy's collectives are Horovod's (launch with `--horovod`).
"""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import exactness  # noqa: E402  (tests/programs is the script's directory)
import tf_nestpipe as tnp  # noqa: E402

LOSS_SCALE = 2.0 ** 24


def train_scaled(strategy, batches, opt_name, out_path):
    """exactness.py's direct mode with the loss scaled by LOSS_SCALE and the gradients
    unscaled before they are applied."""
    rank, workers = strategy.worker_index, strategy.num_workers
    with strategy.scope():
        model = exactness.TinyRanker()
        optimizer = exactness.make_optimizer(opt_name)
    loss_fn = exactness.new_loss_fn()

    def step_fn(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)),
                                              global_batch_size=exactness.GLOBAL_BATCH)
            scaled = loss * LOSS_SCALE
        grads = [tf.IndexedSlices(g.values / LOSS_SCALE, g.indices, g.dense_shape)
                 if isinstance(g, tf.IndexedSlices) else g / LOSS_SCALE
                 for g in tape.gradient(scaled, model.trainable_variables)]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function(input_signature=exactness.BATCH_SPEC)
    def train_step(features, labels):
        return strategy.run(step_fn, args=((features, labels),))

    for batch in batches:
        train_step(*exactness.local_slice(batch, rank, workers))
    tables = exactness.model_tables(model)
    dense = [v.numpy() for v in model.trainable_variables if "table_" not in v.name]
    if rank == 0:
        np.savez(out_path, **tables, **{"dense/%d" % i: v for i, v in enumerate(dense)})


def main():
    prefix, steps = sys.argv[1], int(sys.argv[2])
    runs = [a for a in sys.argv[3:] if not a.startswith("--")]
    collectives = "horovod" if "--horovod" in sys.argv else "tf"
    # row_wise: the exchanges are what is compressed ("auto" would replicate the tables).
    strategy = tnp.NestPipeStrategy(micro_batches=3, transport=collectives,
                                    placement="row_wise")
    exchange = strategy.extended.embedding_exchange
    batches = exactness.make_batches(steps)
    for run in runs:
        mode, opt_name, wire, *options = run.split(":")
        forward, backward = wire.split("-")
        exchange.set_wire_dtype({"forward": forward, "backward": backward})
        strategy.pipeline = next((o for o in options if o in ("dbp", "fwp", "nested")), "none")
        strategy.cluster_samples = False
        strategy.unsafe_skip_buffer_sync = "nosync" in options  # the positive control
        path = "%s.%s.npz" % (prefix, run.replace(":", "."))
        before = exchange.wire_stats()
        if "scaled" in options:
            train_scaled(strategy, batches, opt_name, path)
        else:
            exactness.train(strategy, batches, mode, opt_name, path)
        after = exchange.wire_stats()
        if strategy.worker_index == 0:
            saved = dict(np.load(path))
            saved.update({"wire/" + k: after[k] - before[k] for k in after})
            np.savez(path, **saved)
        print("wire", run, {k: after[k] - before[k] for k in after}, flush=True)


if __name__ == "__main__":
    main()
