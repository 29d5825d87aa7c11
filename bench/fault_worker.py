"""The training job `bench/faults.py` injects faults into (not a benchmark by itself).

usage: fault_worker.py OUT_NPZ CKPT_DIR STEPS [--die-at N] [--step-seconds S]
  Trains a 40-row table + dense layer with Adagrad for STEPS synchronous steps (a custom loop,
  STEP_SECONDS of sleep per step so that a fault lands mid-run), saving a ShardedCheckpoint every
  2 steps and on SIGTERM (PreemptionCheckpointHandler), resuming from CKPT_DIR's latest step.
  --die-at N: worker 1 SIGKILLs itself after step N (once: a marker file in CKPT_DIR). Worker 0
  writes the final table and dense weights to OUT_NPZ and prints "resumed at step K".
"""
import os
import signal
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.strategy.checkpoint import latest_step  # noqa: E402

VOCAB, DIM, GLOBAL_BATCH = 40, 4, 8


def batch(step, rank, workers):
    """This worker's share of global batch `step` (the same at every worker count)."""
    rng = np.random.default_rng(step)
    ids = rng.integers(0, VOCAB, GLOBAL_BATCH).astype(np.int64)
    labels = (ids % 3 == 0).astype(np.float32)[:, None]
    per = GLOBAL_BATCH // workers
    return tf.constant(ids[rank * per:(rank + 1) * per]), tf.constant(labels[rank * per:(rank + 1) * per])


def main():
    out, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    die_at = int(sys.argv[sys.argv.index("--die-at") + 1]) if "--die-at" in sys.argv else None
    pause = (float(sys.argv[sys.argv.index("--step-seconds") + 1])
             if "--step-seconds" in sys.argv else 0.0)
    # row_wise: the faults hit the table's exchange ("auto" would replicate this table).
    strategy = tnp.NestPipeStrategy(placement="row_wise")
    rank, workers = strategy.worker_index, strategy.num_workers
    tf_keras.utils.set_random_seed(1)
    with strategy.scope():
        table = tnp.ShardedEmbedding(VOCAB, DIM, name="table")
        dense = tf_keras.layers.Dense(1)
        optimizer = tf_keras.optimizers.Adagrad(0.3)
        dense(table(batch(0, rank, workers)[0]))
        variables = table.trainable_variables + dense.trainable_variables
        optimizer.build(variables)
    position = tnp.data.InputPosition()
    checkpoint = tnp.ShardedCheckpoint(strategy, table=table, dense=dense, optimizer=optimizer,
                                       input=position)
    first = checkpoint.restore(ckpt) if latest_step(ckpt) is not None else 0
    print("resumed at step", first, flush=True)
    preemption = tnp.PreemptionCheckpointHandler(strategy, checkpoint, ckpt)

    @tf.function
    def step_fn(ids, labels):
        def replica(ids, labels):
            with tf.GradientTape() as tape:
                logits = dense(table(ids))
                loss = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
                loss = loss / GLOBAL_BATCH
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        strategy.run(replica, args=(ids, labels))

    marker = os.path.join(ckpt, ".worker1_died")
    for step in range(first, steps):
        step_fn(*batch(step, rank, workers))
        position.advance()
        time.sleep(pause)
        done = step + 1
        if done % 2 == 0:
            checkpoint.save(ckpt, done)
        if die_at == done and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            print("worker 1 dies after step", done, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        preemption.step_end(done)
    full = table.full_table()
    if rank == 0:
        np.savez(out, table=full, kernel=dense.kernel.numpy(), bias=dense.bias.numpy())
    print("finished", steps, flush=True)


if __name__ == "__main__":
    main()
