"""Trains a small model with a DynamicEmbedding (eviction, admission after 2 steps, TTL) and
saves its table (`full_table()`), dense weights and table counters.

Run in one process (no TF_CONFIG) or on a cluster through the launcher; both see the same global
batches (each worker takes its contiguous slice). Worker 0 writes OUT_PREFIX.RUN.npz.

usage: dynamic_table.py OUT_PREFIX RUN [RUN ...]
  RUN: loop (custom loop: strategy.run), fit (pipeline "none"), fit_dbp (pipeline "dbp": the
  dynamic table looks up in the step itself), fit_fwp / fit_nested (pipelines "fwp" / "nested",
  2 micro-batches: the frozen window looks the batch up as one step of the table),
  loop_window (a strategy.run loop inside tnp.pipeline.frozen_window(): must be refused, prints
  REFUSED), fit_auto (pipeline "auto"),
  checkpoint (save after half the steps, continue; a restored fresh model continues alike),
  rehash=DIR[:CAPACITY] (restore the tf.train.Checkpoint DIR/ckpt another worker count wrote
  after half the steps, into a model of CAPACITY per worker; save the table as restored, with
  each id's owner, then continue: OUT_PREFIX.rehash.npz), rehash_sharded=DIR[:CAPACITY] (the
  same from the ShardedCheckpoint DIR_sharded: OUT_PREFIX.rehash_sharded.npz).
"""
import contextlib
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402

DIM, GLOBAL_BATCH, STEPS, LR = 4, 12, 16, 0.1
TABLE = dict(capacity_per_worker=10, admission=2, eviction="lru", ttl_steps=5)
SEED, KERNEL_SEED = 3, 5


def make_batches(steps=STEPS, seed=0):
    """Global batches of raw int64 ids (negative and large) `[GLOBAL_BATCH, 2]` and targets."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ranks = np.minimum(rng.zipf(1.4, size=(GLOBAL_BATCH, 2)), 60).astype(np.int64)
        ids = ranks * np.int64(1000003) - np.int64(40 * 1000003) + (ranks % 3) * (1 << 50)
        y = rng.normal(size=GLOBAL_BATCH).astype(np.float32)
        out.append((ids, y))
    return out


def initializer():
    return tf_keras.initializers.RandomUniform(-0.5, 0.5, seed=SEED)


def kernel_initializer():
    return tf_keras.initializers.GlorotUniform(seed=KERNEL_SEED)


def build_model(capacity=None):
    ids = tf_keras.Input([2], dtype=tf.int64)
    table = dict(TABLE, capacity_per_worker=capacity or TABLE["capacity_per_worker"])
    emb = tnp.DynamicEmbedding(DIM, combiner="sum", embeddings_initializer=initializer(),
                               name="dyn", **table)
    out = tf_keras.layers.Dense(1, kernel_initializer=kernel_initializer())(emb(ids))
    return tf_keras.Model(ids, tf.squeeze(out, -1)), emb


def dataset_fn(batches):
    def fn(context):
        per = GLOBAL_BATCH // context.num_input_pipelines
        lo = context.input_pipeline_id * per
        local = [(ids[lo:lo + per], y[lo:lo + per]) for ids, y in batches]
        return tnp.data.without_autotuning(tf.data.Dataset.from_generator(
            lambda: iter(local), output_signature=(tf.TensorSpec([None, 2], tf.int64),
                                                   tf.TensorSpec([None], tf.float32))))
    return fn


def run_loop(strategy, model, optimizer, batches, window=False):
    """Trains `model` on `batches` with a strategy.run custom loop (`window`: its forward in a
    frozen window, which a dynamic table refuses)."""
    @tf.function
    def step(ids, y):
        def fn(ids, y):
            with tf.GradientTape() as tape, (
                    tnp.pipeline.frozen_window() if window else contextlib.nullcontext()):
                err = tf.square(model(ids, training=True) - y)
                loss = tf.nn.compute_average_loss(err, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(fn, args=(ids, y))

    for ids, y in strategy.distribute_datasets_from_function(dataset_fn(batches)):
        step(ids, y)


def checkpoint_continuation(prefix, directory, strategy=None):
    """Trains half the batches, saves a tf.train.Checkpoint, trains the rest; a fresh model
    restored from the checkpoint trains the rest too. Saves both tables."""
    batches = make_batches()
    first, rest = batches[:STEPS // 2], batches[STEPS // 2:]
    strategy = strategy or tnp.NestPipeStrategy()
    strategy.pipeline = "none"
    with strategy.scope():
        model, emb = build_model()
        optimizer = tf_keras.optimizers.Adagrad(LR)
    run_loop(strategy, model, optimizer, first)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    path = os.path.join(directory if strategy.worker_index == 0 else directory + "_w%d"
                        % strategy.worker_index, "ckpt")
    path = checkpoint.write(path)
    chief_path = os.path.join(directory, "ckpt")
    tnp.ShardedCheckpoint(strategy, model=model, optimizer=optimizer).save(
        directory + "_sharded", step=STEPS // 2)  # per-worker files
    strategy.extended.collectives.all_gather(tf.constant([1], tf.int32), "dynamic/saved")
    run_loop(strategy, model, optimizer, rest)
    continued = emb.full_table()
    results = {"ids": continued[0], "rows": continued[1]}
    for kind in ("whole", "sharded"):
        with strategy.scope():
            model2, emb2 = build_model()
            optimizer2 = tf_keras.optimizers.Adagrad(LR)
        model2(tf.constant(first[0][0][:1]))  # builds the rows before the restore
        with strategy.scope():
            optimizer2.build(model2.trainable_variables)  # and the slots (assert_consumed)
        if kind == "whole":
            tf.train.Checkpoint(model=model2, optimizer=optimizer2).read(chief_path)
        else:
            tnp.ShardedCheckpoint(strategy, model=model2, optimizer=optimizer2).restore(
                directory + "_sharded")
        results[kind + "_step"] = emb2.global_table_stats()["step"]
        run_loop(strategy, model2, optimizer2, rest)
        results[kind + "_ids"], results[kind + "_rows"] = emb2.full_table()
    if strategy.worker_index == 0:
        np.savez(prefix + ".checkpoint.npz", **results)
    del path


def table_snapshot(emb):
    """Every worker's table, gathered: ids with their (last step, frequency), row, optimizer
    slot rows and owner; pending ids with their (steps seen, last step) and owner."""
    from tf_nestpipe.sharding.dynamic_state import all_gather_ragged

    state = emb.table.export()
    me = emb.worker_index
    slots = state.entries[:, 0]
    (ids, entries, rows, accumulators, owners), _ = all_gather_ragged(
        [state.ids, state.entries[:, 1:], tf.gather(emb.rows, slots),
         tf.gather(emb._fresh._companions[0][0], slots),  # pylint: disable=protected-access
         tf.fill(tf.shape(state.ids), me)], emb.collectives(), emb.num_workers,
        "snapshot/map")
    (pending_ids, pending, pending_owners), _ = all_gather_ragged(
        [state.pending_ids, state.pending, tf.fill(tf.shape(state.pending_ids), me)],
        emb.collectives(), emb.num_workers, "snapshot/pending")
    return {"ids": ids, "entries": entries, "rows": rows, "accumulators": accumulators,
            "owners": owners, "pending_ids": pending_ids, "pending": pending,
            "pending_owners": pending_owners}


def restore_model(strategy, path, capacity=None, sharded=False):
    """A fresh model and optimizer (built) restored from the tf.train.Checkpoint `path` (or the
    ShardedCheckpoint directory `path`)."""
    with strategy.scope():
        model, emb = build_model(capacity)
        optimizer = tf_keras.optimizers.Adagrad(LR)
    model(tf.constant(make_batches()[0][0][:1]))  # builds the rows before the restore
    with strategy.scope():
        optimizer.build(model.trainable_variables)  # and the slots
    if sharded:
        tnp.ShardedCheckpoint(strategy, model=model, optimizer=optimizer).restore(path)
    else:
        tf.train.Checkpoint(model=model, optimizer=optimizer).read(path)
    return model, emb, optimizer


def rehash_continuation(prefix, directory, strategy, capacity=None, sharded=False):
    """Restores the half-way checkpoint of another worker count (`directory`/ckpt, or the
    ShardedCheckpoint `directory`_sharded), saves the table as restored, trains the rest and
    saves the result (OUT_PREFIX.rehash.npz / .rehash_sharded.npz)."""
    strategy.pipeline = "none"
    path = directory + "_sharded" if sharded else os.path.join(directory, "ckpt")
    model, emb, optimizer = restore_model(strategy, path, capacity, sharded)
    results = {"restored_" + k: v for k, v in table_snapshot(emb).items()}
    stats = emb.global_table_stats()
    results["restored_stats"] = np.array([stats[k] for k in sorted(stats)])
    run_loop(strategy, model, optimizer, make_batches()[STEPS // 2:])
    results["ids"], results["rows"] = emb.full_table()
    results["kernel"], results["bias"] = [v.numpy() for v in model.trainable_variables
                                          if "rows" not in v.name]
    stats = emb.global_table_stats()
    results["stats"] = np.array([stats[k] for k in sorted(stats)])
    results["stat_names"] = np.array(sorted(stats))
    if strategy.worker_index == 0:
        np.savez(prefix + (".rehash_sharded.npz" if sharded else ".rehash.npz"), **results)


def train(run, batches, strategy=None):
    """Trains a fresh model with `run` (on `strategy`, one process has one: its pipeline is set
    per run, as tests/programs/exactness.py does); returns (strategy, model, layer)."""
    strategy = strategy or tnp.NestPipeStrategy()
    strategy.pipeline = {"fit_dbp": "dbp", "fit_fwp": "fwp", "fit_nested": "nested",
                         "fit_auto": "auto"}.get(run, "none")
    with strategy.scope():
        model, emb = build_model()
        optimizer = tf_keras.optimizers.Adagrad(LR)
    dataset = strategy.distribute_datasets_from_function(dataset_fn(batches))
    if run in ("loop", "loop_window"):
        run_loop(strategy, model, optimizer, batches, window=run == "loop_window")
    else:
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(dataset, epochs=1, steps_per_epoch=len(batches), verbose=0,
                  callbacks=[tnp.DynamicTableStats()])  # logs the counters summed over workers
    return strategy, model, emb


def save(strategy, model, emb, path):
    ids, rows = emb.full_table()
    stats = emb.global_table_stats()
    dense = model.layers[-1] if not isinstance(model.layers[-1], tf_keras.layers.Lambda) else None
    kernel, bias = [v.numpy() for v in model.trainable_variables if "rows" not in v.name]
    if strategy.worker_index == 0:
        np.savez(path, ids=ids, rows=rows, kernel=kernel, bias=bias,
                 stats=np.array([stats[k] for k in sorted(stats)]),
                 stat_names=np.array(sorted(stats)))
    del dense


def probe_ids():
    """Known ids of the batches and unknown ones (zero rows when served)."""
    ids = make_batches()[-1][0]
    return np.concatenate([ids, [[12345, -9], [ids[0, 0], 777]]]).astype(np.int64)


def export(strategy, model, emb, prefix):
    """Exports with tnp.export_saved_model; saves the model's own inference predictions."""
    predictions = model(tf.constant(probe_ids()), training=False).numpy()
    tnp.export_saved_model(model, prefix + ".export")
    if strategy.worker_index == 0:
        np.savez(prefix + ".predictions.npz", ids=probe_ids(), predictions=predictions)
    # Worker 0 writes alone: every worker waits for it before the next run's strategy starts.
    strategy.extended.collectives.all_gather(tf.constant([1], tf.int32), "dynamic/exported")


def main(argv):
    prefix, runs = argv[1], argv[2:]
    batches = make_batches()
    # fit_fwp / fit_nested: 2 micro-batches; fit_auto: none, fwp, dbp and nested (M=2) in one
    # probe round of 1 timed step each, so that the probe and its choice fit in the STEPS steps.
    strategy = tnp.NestPipeStrategy(micro_batches=2, auto_timed_steps=1, auto_probe_rounds=1,
                                    auto_micro_batches=(2,))
    strategy.auto_probe_budget = None  # every candidate probed, however short the run
    for run in runs:
        if run.startswith(("rehash=", "rehash_sharded=")):
            kind, _, target = run.partition("=")
            directory, _, capacity = target.partition(":")
            rehash_continuation(prefix, directory, strategy, int(capacity) if capacity else None,
                                sharded=kind == "rehash_sharded")
            print("done", kind, flush=True)
            continue
        if run == "checkpoint":
            checkpoint_continuation(prefix, prefix + ".ckpt", strategy)
            print("done checkpoint", flush=True)
            continue
        try:
            _, model, emb = train(run, batches, strategy)
        except ValueError as e:
            if run != "loop_window":
                raise
            reason = [line for line in str(e).splitlines() if "cannot look up under" in line]
            print("REFUSED", run, reason[0].strip() if reason else str(e), flush=True)
            continue
        save(strategy, model, emb, "%s.%s.npz" % (prefix, run))
        if run == "loop":
            export(strategy, model, emb, prefix)
        print("done", run, emb.table_stats(), flush=True)


if __name__ == "__main__":
    main(sys.argv)
