"""Parameter-server mode on a chief + 2 workers + 2 ps cluster (run on the chief by the launcher
with `--workers 2 --ps 2 --chief`). Writes OUT_DIR/ps_mode.json.

usage: ps_mode.py OUT_DIR [--kill-worker]
  Records the shard layout each partitioner gives a table; trains a model with a sharded table
  through ClusterCoordinator.schedule / join (counting the executed steps on a ps variable) and
  through tf_keras fit with a DatasetCreator. With --kill-worker, worker 1 is SIGKILLed while the
  scheduled steps run (the launcher restarts it).
"""
import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402

VOCAB, DIM, BATCH = 1000, 8, 32
STEPS = 60


def layouts(strategy):
    """Shard shapes and devices of a [VOCAB, DIM] table under each partitioner."""
    cases = {"fixed3": tnp.FixedShardsPartitioner(3), "min_size": tnp.MinSizePartitioner(8 << 10),
             "max_size": tnp.MaxSizePartitioner(max_shard_bytes=12 << 10),
             "mod": tnp.ModShardsPartitioner()}
    result = {}
    for name, partitioner in cases.items():
        if hasattr(partitioner, "bind"):
            partitioner.bind(strategy.num_ps)
        # The strategy reads its partitioner at variable creation.
        strategy.extended._variable_partitioner = partitioner  # pylint: disable=protected-access
        with strategy.scope():
            table = tnp.ShardedEmbedding(VOCAB, DIM, name="layout_" + name,
                                         embeddings_initializer=tf_keras.initializers.RandomUniform(
                                             -1, 1, seed=1))
            table.build((None,))
        shards = table._table_shards()  # pylint: disable=protected-access
        ids = np.array([0, 1, 2, 3, 332, 333, 334, 499, 500, 501, 665, 666, 667, 998, 999])
        order = "mod" if name == "mod" else "contiguous"
        other = "contiguous" if order == "mod" else "mod"
        result[name] = {"shapes": [v.shape.as_list() for v in shards],
                        "devices": [v.device for v in shards],
                        "lookup_ok": lookup_returns_ids(table, shards, order, ids),
                        # Positive control: rows written in the other order are caught.
                        "wrong_order_detected": not lookup_returns_ids(table, shards, other, ids)}
    return result


def shard_ids(order, shard_rows):
    """The ids each shard holds, from the documented layout (written here independently of
    tf_nestpipe): "mod" puts id k on shard k mod n at row k // n, "contiguous" cuts the ids
    into consecutive ranges of the shards' sizes."""
    if order == "mod":
        return [j + len(shard_rows) * np.arange(rows) for j, rows in enumerate(shard_rows)]
    offsets = np.cumsum([0] + list(shard_rows))
    return [offsets[j] + np.arange(rows) for j, rows in enumerate(shard_rows)]


def lookup_returns_ids(table, shards, order, ids):
    """Writes every row as its id under `order`, then checks that looking `ids` up returns
    rows holding those ids."""
    for shard, held in zip(shards, shard_ids(order, [v.shape[0] for v in shards])):
        shard.assign(np.repeat(held[:, None], DIM, axis=1).astype(np.float32))
    looked_up = table(tf.constant(ids, tf.int64)).numpy()
    return bool(np.array_equal(looked_up, np.repeat(ids[:, None], DIM, axis=1).astype(np.float32)))


def make_dataset(_context=None):
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, size=(4096,)) - 1, VOCAB - 1).astype(np.int64)
    labels = (ids % 2).astype(np.float32)[:, None]
    return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)


def build_model(strategy):
    with strategy.scope():
        model = tf_keras.Sequential([tnp.ShardedEmbedding(VOCAB, DIM, name="table"),
                                     tf_keras.layers.Dense(1)])
        model.build((None,))
    return model


def kill_task_soon(role, index, delay):
    """SIGKILLs the server process of task `role`:`index` of this cluster after `delay` seconds;
    the returned thread's `killed` says whether it found it."""
    cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]

    def find_and_kill():
        time.sleep(delay)
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open("/proc/%s/environ" % pid, "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            config = env.get(b"TF_CONFIG")
            if not config:
                continue
            config = json.loads(config)
            if config.get("cluster") == cluster and config["task"] == {"type": role,
                                                                       "index": index}:
                os.kill(int(pid), signal.SIGKILL)
                thread.killed = True
                print("killed %s %d (pid %s)" % (role, index, pid), flush=True)

    thread = threading.Thread(target=find_and_kill, daemon=True)
    thread.killed = False
    thread.start()
    return thread


def scheduled_training(strategy, kill):
    """Schedules STEPS SGD steps; returns the loss trend and the executed-step count."""
    model = build_model(strategy)
    with strategy.scope():
        executed = tf.Variable(0, dtype=tf.int64, name="executed_steps")
    loss_fn = tf_keras.losses.BinaryCrossentropy(from_logits=True,
                                                 reduction=tf_keras.losses.Reduction.NONE)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(make_dataset))

    @tf.function
    def step(iterator):
        def replica_fn(ids, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(labels, model(ids, training=True)))
            variables = model.trainable_variables
            grads = tape.gradient(loss, variables)
            for var, grad in zip(variables, grads):
                var.assign_sub(0.5 * tf.convert_to_tensor(grad))
            executed.assign_add(1)
            return loss
        return strategy.run(replica_fn, args=next(iterator))

    killer = kill_task_soon("worker", 1, 3.0) if kill else None
    losses = []
    for _ in range(STEPS):
        losses.append(coordinator.schedule(step, args=(iterator,)))
        time.sleep(0.05 if kill else 0.0)
    coordinator.join()
    if killer is not None:
        killer.join()
    values = [float(loss.fetch()) for loss in losses]
    return {"executed": int(executed.numpy()), "scheduled": len(losses),
            "first_loss": float(np.mean(values[:10])), "last_loss": float(np.mean(values[-10:])),
            "variables": [v.name for v in model.trainable_variables]}


def fit_training(strategy):
    model = build_model(strategy)
    with strategy.scope():
        model.compile(tf_keras.optimizers.Adagrad(0.5),
                      tf_keras.losses.BinaryCrossentropy(from_logits=True))
    history = model.fit(tf_keras.utils.experimental.DatasetCreator(make_dataset), epochs=2,
                        steps_per_epoch=20, verbose=0)
    slots = [shard.device for v in model.optimizer.variables()
             for shard in getattr(v, "variables", [v])]
    return {"loss": history.history["loss"], "slot_devices": slots}


def main():
    out_dir = sys.argv[1]
    strategy = tnp.ParameterServerStrategy(variable_partitioner=tnp.MinSizePartitioner(4 << 10))
    result = {"num_ps": strategy.num_ps, "num_workers": strategy.num_workers,
              "layouts": layouts(strategy)}
    strategy.extended._variable_partitioner = tnp.MinSizePartitioner(4 << 10, max_shards=2)  # pylint: disable=protected-access
    result["scheduled"] = scheduled_training(strategy, "--kill-worker" in sys.argv)
    result["fit"] = fit_training(strategy)
    with open(os.path.join(out_dir, "ps_mode.json"), "w") as f:
        json.dump(result, f)
    print("ps_mode done", flush=True)


if __name__ == "__main__":
    main()
