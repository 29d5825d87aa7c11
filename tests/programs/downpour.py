"""DOWNPOUR windows on a chief + 2 workers + 2 ps cluster (run on the chief by the launcher with
`--workers 2 --ps 2 --chief`). Writes OUT_DIR/downpour.json.

usage: downpour.py OUT_DIR [--ps-failure]
  exact: one window (T=3, local SGD, global SGD with learning rate 1) must leave the ps holding
  pulled - sum of the three local-step gradients, computed here by a plain model on the same
  three batches. train_T<T>_<opt>: 90 local steps of each setting; the loss of the ps values on
  a fixed 1024 samples must fall, and the local Adagrad accumulators must live on the workers.
  fit_T3: tf_keras fit over a T=3 DOWNPOUR strategy (each fit step one window); the loss of the
  ps values on the same fixed samples must fall.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from ps_mode import kill_task_soon  # noqa: E402

VOCAB, DIM, BATCH = 200, 4, 16
STEPS = 90  # local steps per setting: 90 windows of T=1, 30 of T=3


def make_model():
    model = tf_keras.Sequential([
        tnp.ShardedEmbedding(VOCAB, DIM, combiner="mean", name="table",
                             embeddings_initializer=tf_keras.initializers.RandomUniform(-0.3, 0.3,
                                                                                        seed=1)),
        tf_keras.layers.Dense(8, activation="relu",
                              kernel_initializer=tf_keras.initializers.GlorotUniform(seed=2)),
        tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=3))])
    model.build((None, 3))
    return model


def dataset_fn(_context=None):
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, size=(2048, 3)) - 1, VOCAB - 1).astype(np.int64)
    labels = ((ids[:, 0] % 3) == 0).astype(np.float32)[:, None]
    return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)


def loss_fn(labels, logits):
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))


def model_holding(values):
    """A plain (one-process) model whose trainable variables hold `values`."""
    model = make_model()
    for variable, value in zip(model.trainable_variables, values):
        variable.assign(value)
    return model


def eval_loss(values):
    """The loss of a plain model holding VALUES on a fixed 1024 samples of the data: a measure of
    training that does not depend on which worker ran which window (the per-window losses do)."""
    model = model_holding(values)
    losses = [float(loss_fn(labels, model(features))) for features, labels in
              dataset_fn().take(64)]
    return float(np.mean(losses))


def exact_window(out):
    strategy = tnp.ParameterServerStrategy(variable_partitioner=tnp.ModShardsPartitioner(),
                                           update_window=3, local_optimizer=tnp.LocalSGD(0.5))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    trainer = tnp.DownpourTrainer(strategy, coordinator, make_model, loss_fn,
                                  tf_keras.optimizers.SGD(1.0))
    before = trainer.global_values()
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    _, _, pulled = trainer.schedule(iterator).fetch()
    coordinator.join()
    after = trainer.global_values()
    # Reference: a plain model from the pulled values, three SGD(0.5) steps, summed gradients.
    reference = model_holding(before)
    total = [np.zeros_like(v) for v in before]
    for features, labels in dataset_fn().take(3):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, reference(features, training=True))
        grads = tape.gradient(loss, reference.trainable_variables)
        for i, (variable, grad) in enumerate(zip(reference.trainable_variables, grads)):
            grad = tf.convert_to_tensor(grad)
            variable.assign_sub(0.5 * grad)
            total[i] += grad.numpy()
    expected = [b - t for b, t in zip(before, total)]
    # Pulled: the dense parameters whole, and of the table only the rows the 3 batches read.
    window_ids = np.concatenate([f.numpy().ravel() for f, _ in dataset_fn().take(3)])
    dense_values = sum(v.size for v in before[1:])
    out["pulled"] = {"values": int(pulled), "expected": int(len(np.unique(window_ids)) * DIM
                                                          + dense_values),
                     "whole_model": int(sum(v.size for v in before))}
    out["exact"] = {"max_diff": max(float(np.abs(a - e).max()) for a, e in zip(after, expected)),
                    "moved": max(float(np.abs(a - b).max()) for a, b in zip(after, before)),
                    "shards": [len(g.shards) for g in trainer._groups],  # pylint: disable=protected-access
                    "row_orders": [g.row_order for g in trainer._groups]}  # pylint: disable=protected-access


def train(out):
    for window, local in ((1, "sgd"), (3, "sgd"), (3, "adagrad")):
        strategy = tnp.ParameterServerStrategy(variable_partitioner=tnp.FixedShardsPartitioner(2),
                                               update_window=window,
                                               local_optimizer=(tnp.LocalAdagrad(0.2)
                                                                if local == "adagrad" else
                                                                tnp.LocalSGD(0.2)))
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        trainer = tnp.DownpourTrainer(strategy, coordinator, make_model, loss_fn,
                                      tf_keras.optimizers.Adagrad(0.5))
        eval_before = eval_loss(trainer.global_values())
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        windows = STEPS // window
        # With local Adagrad, worker 1 is SIGKILLed mid-run: the launcher restarts it, the
        # coordinator re-runs its windows and gives it fresh local variables.
        killer = kill_task_soon("worker", 1, 1.0) if local == "adagrad" else None
        results = []
        for _ in range(windows):
            results.append(trainer.schedule(iterator))
            time.sleep(0.05 if killer else 0.0)
        coordinator.join()
        if killer is not None:
            killer.join()
        values = [r.fetch() for r in results]
        losses = [float(loss) for loss, _, _ in values]
        pushed = sum(int(p) for _, p, _ in values)
        slots = [type(s).__name__ for s in trainer.local_slots if s is not None]
        ps_optimizer = [shard.device for v in trainer.optimizer.variables()
                        for shard in getattr(v, "variables", [v])]
        out["train_T%d_%s" % (window, local)] = {
            "first_loss": float(np.mean(losses[:windows // 3])),
            "last_loss": float(np.mean(losses[-(windows // 3):])),
            "eval_before": eval_before, "eval_after": eval_loss(trainer.global_values()),
            "pushed_per_sample": pushed / float(STEPS * BATCH),
            "windows_done": len(values), "windows_scheduled": windows,
            "worker_killed": killer is not None and killer.killed,
            "local_slot_types": slots, "global_optimizer_devices": ps_optimizer}


def fit(out):
    """tf_keras fit over a DOWNPOUR strategy (T=3, local SGD): each step is one window."""
    strategy = tnp.ParameterServerStrategy(variable_partitioner=tnp.FixedShardsPartitioner(2),
                                           update_window=3, local_optimizer=tnp.LocalSGD(0.2))
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=tf_keras.optimizers.Adagrad(0.5),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    before = [v.numpy() for v in model.trainable_variables]
    # The same values whole, in `make_model`'s order (each variable is partitioned over the ps).
    before_whole = [tf.convert_to_tensor(w).numpy() for layer in model.layers
                    for w in ([layer.embeddings] if hasattr(layer, "embeddings")
                              else [layer.kernel, layer.bias])]
    history = model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=6,
                        steps_per_epoch=5, verbose=0)
    trainer = model._nestpipe_downpour  # pylint: disable=protected-access
    after = [v.numpy() for v in model.trainable_variables]
    out["fit_T3"] = {"losses": history.history["loss"], "windows_per_epoch": 5,
                     "update_window": trainer.update_window,
                     "moved": max(float(np.abs(a - b).max()) for a, b in zip(after, before)),
                     "eval_before": eval_loss(before_whole),
                     "eval_after": eval_loss(trainer.global_values())}


def ps_failure(out_dir):
    """30 windows (T=3) with a checkpoint every 5; on the first attempt ps 1 is SIGKILLed after
    the checkpoint of window 10 (the launcher restarts the cluster); the next attempt restores
    and finishes. Writes ps_failure.json: where it resumed and whether the restored values equal
    the saved ones."""
    strategy = tnp.ParameterServerStrategy(variable_partitioner=tnp.FixedShardsPartitioner(2),
                                           update_window=3, local_optimizer=tnp.LocalSGD(0.2))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    trainer = tnp.DownpourTrainer(strategy, coordinator, make_model, loss_fn,
                                  tf_keras.optimizers.Adagrad(0.5))
    ckpt, marker = os.path.join(out_dir, "ckpt"), os.path.join(out_dir, "ps_killed")
    restored = trainer.restore(ckpt)
    result = {"restored_windows": restored}
    if restored:
        saved = np.load(os.path.join(out_dir, "saved_%d.npz" % restored))
        result["restored_max_diff"] = max(float(np.abs(v - saved["arr_%d" % i]).max())
                                          for i, v in enumerate(trainer.global_values()))
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    while trainer.windows < 30:
        for _ in range(5):
            trainer.schedule(iterator)
        trainer.save(ckpt)
        np.savez(os.path.join(out_dir, "saved_%d.npz" % trainer.windows), *trainer.global_values())
        print("saved window", trainer.windows, flush=True)
        if trainer.windows == 10 and not os.path.exists(marker):
            open(marker, "w").close()
            kill_task_soon("ps", 1, 0.0).join()
            for _ in range(30):  # the launcher tears the cluster down before this ends
                trainer.schedule(iterator)
            trainer.join()
    result["windows"] = trainer.windows
    with open(os.path.join(out_dir, "ps_failure.json"), "w") as f:
        json.dump(result, f)
    print("ps failure run done", flush=True)


def main():
    if "--ps-failure" in sys.argv:
        ps_failure(sys.argv[1])
        return
    out = {}
    exact_window(out)
    # Before train(): its last setting kills a worker, and a strategy created while the
    # coordinator is still reconnecting to the restarted worker crashes TensorFlow.
    fit(out)
    train(out)
    with open(os.path.join(sys.argv[1], "downpour.json"), "w") as f:
        json.dump(out, f)
    print("downpour done", flush=True)


if __name__ == "__main__":
    main()
