"""What micro-batching alone costs: the CPU of examples/dlrm.py's DLRM forward + backward on one
batch, run whole and as M micro-batches on one tape (as FWP and nested run the model), with no
exchange, no window and no pipeline.

    taskset -c 1 python bench/dense_split.py --output dense_split_natural [--batch 512]
        [--fields 8] [--dim 16] [--micro-batches 1 2 4] [--rounds 7] [--calls 300]

One process, TensorFlow's pools at one thread each (a worker of the 2-core testbed gets one
core); the embeddings are a local tf_keras `Embedding` (its gather and IndexedSlices gradient are
the same for every M). Each configuration is one `tf.function` (forward, loss, gradients of every
variable); the rounds alternate the configurations and each times `--calls` calls by process CPU.
Prints and writes (bench/results/OUTPUT.md, .json) the median CPU us per call of each M and its
difference to M=1: the part of a micro-batching pipeline's extra cost that is the dense model run
M times on smaller batches (more executed ops, smaller matrix kernels), whatever the exchange does.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from dlrm import DLRM  # noqa: E402
from runner import write_result  # noqa: E402


def make_step(model, variables, batch, micro_batches):
    """The tf.function of one training step's forward + backward over `micro_batches` parts of
    `batch` on one tape (the summed loss, as a frozen window sums its micro-batches')."""
    features, labels = batch

    def loss_of(part_features, part_labels):
        logits = tf.reshape(model(part_features), [-1])
        return tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(part_labels, logits))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            if micro_batches == 1:
                loss = loss_of(features, labels)
            else:
                parts = [tf.split(t, micro_batches) for t in
                         (features["dense"], features["sparse"], labels)]
                loss = tf.add_n([loss_of({"dense": d, "sparse": s}, y)
                                 for d, s, y in zip(*parts)])
        gradients = tape.gradient(loss, variables)
        # The table's gradient stays sparse (its rows only), as a sparse update takes it.
        return [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients]

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="bench/results/OUTPUT.md and .json")
    parser.add_argument("--batch", type=int, default=512, help="one worker's batch")
    parser.add_argument("--fields", type=int, default=8, help="single-hot tables")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=100000, help="rows of the local table")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300, help="timed calls per round")
    args = parser.parse_args()
    if 1 not in args.micro_batches:
        parser.error("--micro-batches must include 1 (the baseline)")
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    features = {"dense": tf.constant(rng.normal(size=(args.batch, 13)), tf.float32),
                "sparse": tf.constant(rng.integers(0, args.vocab, (args.batch, args.fields)))}
    labels = tf.constant(rng.integers(0, 2, args.batch), tf.float32)
    model = DLRM(tf_keras.layers.Embedding(args.vocab, args.dim), dim=args.dim)
    model(features)
    steps = {m: make_step(model, model.trainable_variables, (features, labels), m)
             for m in args.micro_batches}
    for step in steps.values():
        step()  # trace and warm up
    cpu_us = {m: [] for m in steps}
    for _ in range(args.rounds):
        for m, step in steps.items():
            start = time.process_time()
            for _ in range(args.calls):
                step()
            cpu_us[m].append(1e6 * (time.process_time() - start) / args.calls)
    median = {m: statistics.median(v) for m, v in cpu_us.items()}
    command = "python bench/dense_split.py " + " ".join(sys.argv[1:])
    lines = ["# The dense model run as M micro-batches: CPU per step", "",
             "Command: `%s` (batch %d, %d fields, dim %d; one thread per pool)" % (
                 command, args.batch, args.fields, args.dim), "",
             "| M | CPU us per step (median of %d rounds x %d calls) | vs M=1 |" % (
                 args.rounds, args.calls), "|---|---|---|"]
    for m in sorted(median):
        lines.append("| %d | %.0f | %+.0f us (%.3fx) |" % (m, median[m], median[m] - median[1],
                                                          median[m] / median[1]))
    write_result(args.output + ".md", "\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, args.output + ".json"), "w") as f:
        json.dump({"command": command, "cpu_us_rounds": {str(m): v for m, v in cpu_us.items()},
                   "cpu_us_median": {str(m): v for m, v in median.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
