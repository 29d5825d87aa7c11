"""Step time of the natural DLRM cell under Keras 3 against tf_keras, side by side.

The cell of bench/families.py's `natural` (8 separate 100k x 16 tables, one sharded layer per
field, 13 dense features, global batch 1024, Adagrad, a bottom MLP 64-32-16, dot interaction, a
top MLP 64-32-1; `--optimizer sgd` for plain SGD) written once per Keras: `--keras tf_keras`
builds it with `tnp.ShardedEmbedding` and tf_keras layers, `--keras keras3` with
`tnpk.ShardedEmbedding` and Keras 3 layers, both functional models fitted under
`NestPipeStrategy(pipeline=...)`. The compute-only bound is `--workers` Keras 3 processes at
once, each alone (a one-worker strategy: the same layers and sparse updates, no exchange) on its
share of the global batch (plain `keras.layers.Embedding` is no bound: Keras 3's Adagrad
squares an embedding's gradient into a dense update of the whole table). Rank 0 prints `RESULT {json}` with the median step time of the timed steps (after the
warm-up).

    python bench/keras3_step.py --workers 2 --rounds 3

runs the three rows interleaved (round r of every row before round r + 1) on `--workers` local
workers through the launcher, and writes bench/results/keras3_step.md: each row's median step
per round, Keras 3 over tf_keras paired by round (the target: <= 1.10), both over the
compute-only bound, and the machine's load average at the start and the end.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from runner import HERE, write_result

TABLES, ROWS, DIM, DENSE, GLOBAL_BATCH = 8, 100_000, 16, 13, 1024


def build(keras_name, strategy, optimizer="adagrad"):
    """The DLRM cell as a functional model of `keras_name`'s layers, compiled in the scope."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_nestpipe as tnp  # pylint: disable=import-outside-toplevel
    if keras_name == "keras3":
        import keras as k  # pylint: disable=import-outside-toplevel
        from tf_nestpipe import keras3 as tnpk  # pylint: disable=import-outside-toplevel
        embedding, dot = tnpk.ShardedEmbedding, lambda v: k.ops.matmul(v, k.ops.transpose(v, (0, 2, 1)))
        k.utils.set_random_seed(0)
        stack, reshape = (lambda vs: k.ops.stack(vs, axis=1)), k.ops.reshape
    else:
        import tf_keras as k  # pylint: disable=import-outside-toplevel
        embedding, dot = tnp.ShardedEmbedding, lambda v: tf.matmul(v, v, transpose_b=True)
        stack, reshape = (lambda vs: tf.stack(vs, axis=1)), tf.reshape
    with strategy.scope():
        ids = k.Input((TABLES,), dtype="int64", name="sparse")
        dense = k.Input((DENSE,), name="dense_features")
        bottom = dense
        for units in (64, 32, DIM):
            bottom = k.layers.Dense(units, activation="relu")(bottom)
        vectors = [bottom] + [
            embedding(ROWS, DIM, name="table_%d" % t)(k.layers.Lambda(lambda x, t=t: x[:, t])(ids))
            for t in range(TABLES)]
        pairs = k.layers.Lambda(lambda vs: reshape(dot(stack(vs)), (-1, (TABLES + 1) ** 2)))(
            vectors)
        top = k.layers.Concatenate()([bottom, pairs])
        for units in (64, 32):
            top = k.layers.Dense(units, activation="relu")(top)
        model = k.Model({"sparse": ids, "dense_features": dense}, k.layers.Dense(1)(top))
        model.compile(optimizer=(k.optimizers.Adagrad(0.05) if optimizer == "adagrad"
                                 else k.optimizers.SGD(0.05)),
                      loss=k.losses.BinaryCrossentropy(from_logits=True))
    return model, k


def worker(args):
    """One worker's fit; rank 0 prints RESULT."""
    if args.keras in ("keras3", "compute_only"):
        import keras  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_nestpipe as tnp  # pylint: disable=import-outside-toplevel

    steps = args.warmup + args.steps
    context = None
    if args.keras == "compute_only":
        # Each task alone on its share: the launcher's TF_CONFIG only says which share, and a
        # one-worker strategy runs the same layers and sparse updates with no exchange.
        config = json.loads(os.environ.pop("TF_CONFIG", "{}"))
        workers = len(config.get("cluster", {}).get("worker", [None]))
        rank = config.get("task", {}).get("index", 0)
        context = tf.distribute.InputContext(workers, rank, workers)
        strategy = tnp.NestPipeStrategy(pipeline=args.pipeline, placement="row_wise")
        model, k = build("keras3", strategy, args.optimizer)
    else:
        strategy = tnp.NestPipeStrategy(pipeline=args.pipeline, placement="row_wise")
        model, k = build(args.keras, strategy, args.optimizer)
        rank = strategy.worker_index

    def dataset_fn(context):
        rng = np.random.default_rng(context.input_pipeline_id)
        local = context.get_per_replica_batch_size(GLOBAL_BATCH)
        n = local * 8
        x = {"sparse": rng.integers(0, ROWS, (n, TABLES)),
             "dense_features": rng.normal(size=(n, DENSE)).astype(np.float32)}
        y = rng.integers(0, 2, (n, 1)).astype(np.float32)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(local, drop_remainder=True)

    times = []

    class Timer(k.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    data = (dataset_fn(context) if context is not None
            else strategy.distribute_datasets_from_function(dataset_fn))
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Timer()])
    timed = sorted(times[args.warmup:])
    if rank == 0:
        print("RESULT " + json.dumps({"keras": args.keras, "median_ms": 1e3 * timed[len(timed) // 2],
                                      "steps": len(timed)}), flush=True)


ROWS_RUN = ("tf_keras", "keras3", "compute_only")
TARGET = 1.10  # Keras 3's step over tf_keras's, paired by round


def run_row(name, args, env):
    """One launch of row `name`: its rank 0's median step (ms)."""
    argv = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(args.workers),
            "--", sys.executable, os.path.abspath(__file__), "--worker", "--keras", name,
            "--pipeline", args.pipeline, "--optimizer", args.optimizer,
            "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env, check=False).stdout
    lines = [l for l in out.splitlines() if "RESULT " in l]
    if not lines:
        raise SystemExit("%s failed:\n%s" % (name, out[-4000:]))
    return json.loads(lines[-1].split("RESULT ", 1)[1])["median_ms"]


def paired(results, top, bottom):
    """The median over rounds of `top`'s step / `bottom`'s in the same round."""
    return statistics.median(t / b for t, b in zip(results[top], results[bottom]))


def driver(args):
    """The rows, interleaved over `--rounds`, on `--workers` local workers; writes the table."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    results = {name: [] for name in ROWS_RUN}
    started, load_start = time.time(), os.getloadavg()
    for _ in range(args.rounds):
        for name in ROWS_RUN:
            results[name].append(run_row(name, args, env))
    load_end = os.getloadavg()
    ratio = paired(results, "keras3", "tf_keras")
    command = "python bench/keras3_step.py " + " ".join(sys.argv[1:])
    lines = [
        "# keras3_step", "",
        "The natural DLRM cell (8 separate 100k x 16 tables, global batch 1024, %s, pipeline "
        "%r, %d workers) under Keras 3 (`tnpk.ShardedEmbedding`) against tf_keras "
        "(`tnp.ShardedEmbedding`), and the compute-only bound (%d Keras 3 processes at once, "
        "each alone on its share: the same layers, no exchange)." % (args.optimizer, args.pipeline, args.workers,
                                                    args.workers), "",
        "Command: `%s` (%s, %.0f s; load average (1 min) %.2f at the start, %.2f at the end; "
        "%d timed steps after %d warm-up steps per launch, rows interleaved by round)." % (
            command, time.strftime("%Y-%m-%d %H:%M"), time.time() - started, load_start[0],
            load_end[0], args.steps, args.warmup), "",
        "| row | median step (ms) per round | median | vs tf_keras (paired by round) "
        "| vs compute-only (paired) |", "|---|---|---|---|---|"]
    for name in ROWS_RUN:
        values = results[name]
        lines.append("| %s | %s | %.1f | %.3f | %.2f |" % (
            name, ", ".join("%.1f" % v for v in values), statistics.median(values),
            paired(results, name, "tf_keras"), paired(results, name, "compute_only")))
    lines += ["", "Target: Keras 3 <= %.2fx tf_keras: %.3f, %s." % (
        TARGET, ratio, "met" if ratio <= TARGET else "**missed**")]
    write_result(args.output + ".md", "\n".join(lines) + "\n")
    with open(os.path.join(HERE, "results", args.output + ".json"), "w") as f:
        json.dump({"command": command, "ms_rounds": results, "keras3_vs_tf_keras": ratio,
                   "load_start": load_start, "load_end": load_end}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run one worker (the launcher's)")
    parser.add_argument("--keras", choices=list(ROWS_RUN), default="keras3")
    parser.add_argument("--pipeline", default="none")
    parser.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--output", default="keras3_step",
                        help="writes bench/results/OUTPUT.md and .json")
    args = parser.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
