"""How long deleting a distributed iterator takes on a 2-worker cluster, ours beside
MultiWorkerMirroredStrategy (TF 2.21 can block there on tf.data's autotuning thread;
docs/guides/reliability.md, "Fewer stalls when an iterator is deleted").

usage: python bench/iterator_teardown.py [--runs N] [--seconds S] [--source-autotune on|off]
                                         [--output NAME]
Each run launches 2 workers that step through a distributed dataset for about S seconds (a
step count they agree on), delete the iterator and print how long the deletion took; the table
gives every worker's time per run. It is printed as the runs finish and written, with the
command, to bench/results/NAME.md."""
import argparse
import datetime
import os
import re
import subprocess
import sys
import time

from runner import write_result


PAUSE_SECONDS = 0.05


def worker(strategy_name, seconds, source_autotune):
    """One task: iterate for about `seconds`, delete the iterator, print the deletion's
    seconds."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf

    if strategy_name == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        import tf_nestpipe as tnp

        strategy = tnp.NestPipeStrategy()

    def dataset_fn(context):
        del context
        dataset = tf.data.Dataset.from_generator(
            lambda: iter(range(10 ** 7)), output_signature=tf.TensorSpec([], tf.int64)).batch(4)
        if source_autotune == "off":
            from tf_nestpipe.data import without_autotuning

            dataset = without_autotuning(dataset)
        return dataset

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    step = tf.function(lambda it: strategy.run(tf.reduce_sum, args=(next(it),)))
    # A step count every worker agrees on (a clock would let one worker take a step more, whose
    # collective the other never joins): a 50 ms pause per step makes it about `seconds`.
    for _ in range(max(1, int(seconds / PAUSE_SECONDS))):
        step(iterator)
        time.sleep(PAUSE_SECONDS)
    start = time.time()
    del iterator
    print("DELETE_SECONDS %.2f" % (time.time() - start), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--source-autotune", choices=("on", "off"), default="on")
    parser.add_argument("--output", default="iterator_teardown",
                        help="the table goes to bench/results/OUTPUT.md")
    parser.add_argument("--worker", choices=("mwms", "nestpipe"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.seconds, args.source_autotune)
    env = dict(os.environ, TF_NESTPIPE_LAUNCH_OUTPUT="all", TF_CPP_MIN_LOG_LEVEL="2")
    lines = ["| strategy | run | deletion, worker 0 / worker 1 (s) |", "|---|---|---|"]
    print("\n".join(lines), flush=True)
    for run in range(args.runs):
        for name in ("mwms", "nestpipe"):
            out = subprocess.run(
                [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", "--", sys.executable,
                 os.path.abspath(__file__), "--worker", name, "--seconds", str(args.seconds),
                 "--source-autotune", args.source_autotune],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                timeout=300).stdout
            times = dict(re.findall(r"\[worker:(\d)\] DELETE_SECONDS ([0-9.]+)", out))
            lines.append("| %s | %d | %s / %s |" % (name, run, times.get("0", "-"),
                                                     times.get("1", "-")))
            print(lines[-1], flush=True)
            if len(times) < 2:
                print(out[-3000:], flush=True)
    write_result(args.output + ".md",
                 "# Deleting a distributed iterator, 2 workers, %g s of steps first (%s)\n\n"
                 "`python bench/iterator_teardown.py %s`\n\n%s\n\n"
                 "\"-\": that worker printed no time (its launch failed; the benchmark printed "
                 "the launch's output).\n"
                 % (args.seconds, datetime.date.today().isoformat(), " ".join(sys.argv[1:]),
                    "\n".join(lines)))


if __name__ == "__main__":
    main()
