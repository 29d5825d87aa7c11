"""Save / restore / reshard checkpoints of a NestPipe training run.

usage: checkpoint.py JOB [+ JOB ...]
  JOB = OUT_PREFIX CKPT_DIR FIRST LAST [--restore | --resume] [--snapshot-at N] [--export DIR]
        [--die-at N] [--sigterm-at N] [--dbp] [--placement P] [--also-tf | --restore-tf]
        [--save-at N ...]
  Each job (in turn, in this process: one launch serves many) trains the exactness model
  (Adagrad: its slots are checkpointed too) on global batches FIRST..LAST-1, after restoring the
  latest checkpoint of CKPT_DIR if --restore (written by any number of workers); saves a
  checkpoint after every step N given by --save-at; worker 0 writes OUT_PREFIX.npz with every
  parameter and slot after the last step.
  --placement P places the tables (row_wise, data_parallel, table_wise: table_a whole on
  worker 0, table_b on worker 1, or mixdp: table_a data_parallel, table_b row_wise); --also-tf
  saves a plain tf.train.Checkpoint (whole tables) in CKPT_DIR/tf-N next to every
  ShardedCheckpoint step, and --restore-tf restores the latest of those instead.
"""
import os
import signal
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import exactness as ex  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402


def main():
    """Runs each job of the command line (jobs separated by '+') in turn, in this process."""
    jobs, job = [], []
    for arg in sys.argv[1:]:
        if arg == "+":
            jobs.append(job)
            job = []
        else:
            job.append(arg)
    jobs.append(job)
    strategy = tnp.NestPipeStrategy(placement=placement_of(jobs[0]))
    for argv in jobs:
        run_job(strategy, argv)


def placement_of(argv):
    """The table placement a job's --placement names (row_wise without)."""
    placement = argv[argv.index("--placement") + 1] if "--placement" in argv else "row_wise"
    if placement == "mixdp":
        placement = {"table_a": "data_parallel", "table_b": "row_wise"}
    return placement


def run_job(strategy, argv):
    """One job: trains a fresh model as `argv` says (the module docstring's arguments)."""
    prefix, ckpt_dir, first, last = argv[0], argv[1], int(argv[2]), int(argv[3])
    save_at = [int(a) for a in argv[argv.index("--save-at") + 1:]] if "--save-at" in argv else []
    strategy.placement = placement_of(argv)  # read when the model's layers are built
    rank, workers = strategy.worker_index, strategy.num_workers
    with strategy.scope():
        model = ex.TinyRanker()
        optimizer = ex.make_optimizer("adagrad")
    batches = ex.make_batches(last)
    with strategy.scope():  # build in the scope: mirrored dense weights, row-shard slots
        model(ex.local_slice(batches[0], rank, workers)[0])
        optimizer.build(model.trainable_variables)
    position = tnp.data.InputPosition()  # global batches trained on: part of the checkpoint
    checkpoint = tnp.ShardedCheckpoint(strategy, model=model, optimizer=optimizer, input=position)
    tf_checkpoint = TFCheckpoint(strategy, model=model, optimizer=optimizer, input=position)
    if "--restore" in argv or "--restore-tf" in argv:
        step = (tf_checkpoint if "--restore-tf" in argv else checkpoint).restore(ckpt_dir)
        assert step == first, "restored step %d, expected %d" % (step, first)
        assert int(position.batches.numpy()) == first, int(position.batches.numpy())
        print("restored step", step, flush=True)
    if "--resume" in argv and tnp.strategy.checkpoint.latest_step(ckpt_dir) is not None:
        first = checkpoint.restore(ckpt_dir)
        print("restored step", first, flush=True)
    die_at = int(argv[argv.index("--die-at") + 1]) if "--die-at" in argv else None
    marker = os.path.join(ckpt_dir, ".worker1_died")
    sigterm_at = (int(argv[argv.index("--sigterm-at") + 1])
                  if "--sigterm-at" in argv else None)
    preemption = tnp.PreemptionCheckpointHandler(strategy, checkpoint, ckpt_dir)
    loss_fn = ex.new_loss_fn()
    train_step = ex.synchronous_train_step(strategy, model, optimizer)

    def run_step(features, labels):
        train_step(features, labels)
        position.advance()

    if "--dbp" in argv:
        # The pipeline reads the same batches from its own iterator, which starts at the
        # restored input position (the batches of the steps before it are skipped).
        pipeline, iterator = dual_buffer_pipeline(strategy, model, optimizer, loss_fn, batches,
                                                  position)

        def run_step(features, labels):  # noqa: F811
            del features, labels
            pipeline.progress(iterator)
            position.advance()

    snapshot = (int(argv[argv.index("--snapshot-at") + 1])
                if "--snapshot-at" in argv else None)
    for step in range(first, last):
        if step + 1 == sigterm_at and rank == 1 and not os.path.exists(marker):
            os.makedirs(ckpt_dir, exist_ok=True)
            open(marker, "w").close()
            print("worker 1 gets SIGTERM in step", step + 1, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        run_step(*ex.local_slice(batches[step], rank, workers))
        preemption.step_end(step + 1)
        if step + 1 in save_at:
            checkpoint.save(ckpt_dir, step + 1)
            if "--also-tf" in argv:
                tf_checkpoint.save(ckpt_dir, step + 1)
            print("saved step", step + 1, flush=True)
        if step + 1 == die_at and rank == 1 and not os.path.exists(marker):
            os.makedirs(ckpt_dir, exist_ok=True)
            open(marker, "w").close()
            print("worker 1 dies after step", step + 1, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step + 1 == snapshot:
            write_parameters(strategy, model, optimizer, "%s.%d.npz" % (prefix, snapshot))
    write_parameters(strategy, model, optimizer, prefix + ".npz")
    if "--export" in argv:
        export(strategy, model, argv[argv.index("--export") + 1], batches[0],
               prefix + ".predictions.npz")
    print("done", first, last, flush=True)


class TFCheckpoint:
    """ShardedCheckpoint's save / restore on plain tf.train.Checkpoints (whole tables), one per
    step in DIRECTORY/tf-STEP (worker 0's file is the checkpoint; the others write to scratch)."""

    def __init__(self, strategy, **objects):
        self.strategy = strategy
        self.checkpoint = tf.train.Checkpoint(**objects)

    def save(self, directory, step):
        rank = self.strategy.worker_index
        prefix = os.path.join(directory, "tf-%d" % step if rank == 0 else
                              ".scratch-%d/tf-%d" % (rank, step))
        self.checkpoint.write(prefix)  # a collective: every worker writes

    def restore(self, directory):
        steps = [int(n[3:].split(".")[0]) for n in os.listdir(directory)
                 if n.startswith("tf-") and n.endswith(".index")]
        self.checkpoint.read(os.path.join(directory, "tf-%d" % max(steps))).assert_consumed()
        return max(steps)


def export(strategy, model, directory, batch, path):
    """Exports a SavedModel and records the model's predictions on the whole `batch`."""
    signature = {"ids": tf.TensorSpec([None, 2], tf.int64),
                 "bag": tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1,
                                            row_splits_dtype=tf.int64),
                 "dense": tf.TensorSpec([None, ex.NUM_DENSE], tf.float32)}
    tnp.export_saved_model(model, directory, signature, strategy)
    features, _ = ex.local_slice(batch, 0, 1)  # the whole global batch
    with strategy.scope():
        predictions = model(features).numpy()  # every worker: the lookups are collectives
    if strategy.worker_index == 0:
        np.savez(path, predictions=predictions, ids=features["ids"], dense=features["dense"],
                 bag_values=features["bag"].values.numpy(),
                 bag_row_splits=features["bag"].row_splits.numpy())


def dual_buffer_pipeline(strategy, model, optimizer, loss_fn, batches, position):
    """A TrainPipeline over this worker's slices of `batches` from the input `position` on,
    and its iterator."""
    dataset_fn = ex.per_worker_dataset_fn(batches)

    def step_fn(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)),
                                              global_batch_size=ex.GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    pipeline = tnp.TrainPipeline(strategy, step_fn, lambda batch: model(batch[0]),
                                 optimizer=optimizer)
    return pipeline, iter(position.distribute(strategy, dataset_fn))


def write_parameters(strategy, model, optimizer, path):
    """Worker 0 writes the full tables, their Adagrad accumulators and the dense weights (every
    worker must call this: it gathers the shards)."""
    rank, workers = strategy.worker_index, strategy.num_workers
    tables = {"table_a": model.table_a.full_table(), "table_b": model.table_b.full_table()}
    # Adagrad accumulators of the tables, assembled like the tables (a collective).
    slots = {}
    for name, layer in (("table_a", model.table_a), ("table_b", model.table_b)):
        slot = [v for v in optimizer.variables()
                if v.name.startswith("accumulator/") and layer.embeddings.name in v.name][0]
        local = tf.convert_to_tensor(slot)
        if layer.layout.num_shards == 1:  # data_parallel (or one worker): the whole slot
            slots["slot/" + name] = local.numpy()
            continue
        pad = layer.layout.max_local_rows - layer.layout.local_rows
        gathered = (strategy.extended.collectives.all_gather(
            tf.pad(local, [[0, pad], [0, 0]]), "test/slots_" + name).numpy()
            if workers > 1 else local.numpy())
        ids = np.arange(layer.vocab_size)  # where the layout (row- or table-wise) put each id
        slots["slot/" + name] = gathered[layer.layout.owner(ids) * layer.layout.max_local_rows
                                         + layer.layout.local_row(ids)]
    dense = {"dense/%d" % i: v.numpy() for i, v in enumerate(model.trainable_variables)
             if "table_" not in v.name}
    if rank == 0:
        np.savez(path, **tables, **slots, **dense)


if __name__ == "__main__":
    main()
