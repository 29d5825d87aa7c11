"""Step time of the natural DLRM cell under Keras 3 against tf_keras, side by side.

The cell of bench/families.py's `natural` (8 separate 100k x 16 tables, one sharded layer per
field, 13 dense features, global batch 1024, Adagrad, a bottom MLP 64-32-16, dot interaction, a
top MLP 64-32-1; `--optimizer sgd` for plain SGD) written once per Keras: `--keras tf_keras` builds it with `tnp.ShardedEmbedding`
and tf_keras layers, `--keras keras3` with `tnpk.ShardedEmbedding` and Keras 3 layers, both
functional models fitted under `NestPipeStrategy(pipeline=...)`. Rank 0 prints
`RESULT {json}` with the median step time of the timed steps (after the warm-up).

    python bench/keras3_step.py --workers 2 --rounds 3

runs both Kerases (alternating, `--rounds` times each) on `--workers` local workers through the
launcher and prints a table with the machine's load average at the start and the end.
"""
import argparse
import json
import os
import subprocess
import sys
import time

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
    if args.keras == "keras3":
        import keras  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_nestpipe as tnp  # pylint: disable=import-outside-toplevel

    strategy = tnp.NestPipeStrategy(pipeline=args.pipeline, placement="row_wise")
    model, k = build(args.keras, strategy, args.optimizer)
    steps = args.warmup + args.steps

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

    model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=1,
              steps_per_epoch=steps, verbose=0, callbacks=[Timer()])
    timed = sorted(times[args.warmup:])
    if strategy.worker_index == 0:
        print("RESULT " + json.dumps({"keras": args.keras, "median_ms": 1e3 * timed[len(timed) // 2],
                                      "steps": len(timed)}), flush=True)


def driver(args):
    """Both Kerases, alternating, on `--workers` local workers; prints the table."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    results = {"tf_keras": [], "keras3": []}
    load_start = os.getloadavg()
    for _ in range(args.rounds):
        for name in ("tf_keras", "keras3"):
            argv = [sys.executable, "-m", "tf_nestpipe.launch", "--workers", str(args.workers),
                    "--", sys.executable, os.path.abspath(__file__), "--worker", "--keras", name,
                    "--pipeline", args.pipeline, "--optimizer", args.optimizer,
                    "--steps", str(args.steps),
                    "--warmup", str(args.warmup)]
            out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env, check=False).stdout
            lines = [l for l in out.splitlines() if "RESULT " in l]
            if not lines:
                raise SystemExit("%s failed:\n%s" % (name, out[-4000:]))
            results[name].append(json.loads(lines[-1].split("RESULT ", 1)[1])["median_ms"])
    load_end = os.getloadavg()
    print("| Keras | median step (ms) per round | best |")
    print("|---|---|---|")
    for name, values in results.items():
        print("| %s | %s | %.1f |" % (name, ", ".join("%.1f" % v for v in values), min(values)))
    print("ratio keras3/tf_keras (best): %.3f" % (min(results["keras3"]) / min(results["tf_keras"])))
    print("load average (1, 5, 15 min) at start %s, at end %s" % (
        tuple(round(x, 2) for x in load_start), tuple(round(x, 2) for x in load_end)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run one worker (the launcher's)")
    parser.add_argument("--keras", choices=["tf_keras", "keras3"], default="keras3")
    parser.add_argument("--pipeline", default="none")
    parser.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
