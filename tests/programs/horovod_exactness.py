"""The exactness model of `exactness.py`, trained with NestPipeStrategy(collectives="horovod").

Launched with `python -m tf_nestpipe.launch --workers N --horovod -- python horovod_exactness.py`
or `horovodrun --gloo -np N python horovod_exactness.py`; compare its .npz files with the
single-process reference of `exactness.py` (same model, same global batches).

usage: horovod_exactness.py OUT_PREFIX STEPS PIPELINE/MODE:OPTIMIZER [...] [--check-splits]
  e.g. none/loop:sgd dbp/loop:adagrad none/fit:adam:mixdp (a table placement option of
  exactness.py); writes OUT_PREFIX.PIPELINE.MODE.OPTIMIZER[.OPTION].npz (worker 0).
  --check-splits first sends uneven counts through the strategy's all-to-all and checks that
  only the data entries travel (prints "variable splits ok").
"""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import exactness  # noqa: E402  (the shared model, batches and training modes)
import tf_nestpipe as tnp  # noqa: E402


def check_variable_splits(strategy, capacity=4):
    """Worker r sends `(r + j) % capacity + 1` entries of a padded `[W, capacity]` block to
    worker j: the received blocks hold exactly those entries, then the fill value, and the
    tensor handed to hvd.alltoall holds the data entries only."""
    collectives = strategy.extended.collectives
    rank, workers = strategy.worker_index, strategy.num_workers

    def count(sender, receiver):
        return (sender + receiver) % capacity + 1

    block = np.full([workers, capacity], -7, np.int64)  # -7: padding that must not travel
    for j in range(workers):
        block[j, :count(rank, j)] = 100 * rank + 10 * j + np.arange(count(rank, j))
    sent = []
    original = collectives._alltoall  # pylint: disable=protected-access

    def recording(flat, splits, name):
        sent.append(int(flat.shape[0]))
        return original(flat, splits, name)

    collectives._alltoall = recording  # pylint: disable=protected-access
    try:
        got = collectives.all_to_all(tf.constant(block), "check/splits",
                                     send_counts=tf.constant([count(rank, j) for j in range(workers)]),
                                     fill=-1).numpy()
    finally:
        del collectives._alltoall  # back to the class's method
    for i in range(workers):
        n = count(i, rank)
        expected = np.concatenate([100 * i + 10 * rank + np.arange(n), -np.ones(capacity - n)])
        assert (got[i] == expected).all(), (i, got[i], expected)
    assert sent == [sum(count(rank, j) for j in range(workers))], sent
    print("variable splits ok: sent %d of %d slots" % (sent[0], workers * capacity), flush=True)


def main():
    """Trains each PIPELINE/MODE:OPTIMIZER run with Horovod collectives and saves it."""
    prefix, steps = sys.argv[1], int(sys.argv[2])
    batches = exactness.make_batches(steps)
    check_splits = "--check-splits" in sys.argv
    strategies = {}
    surface_dir = sys.argv[sys.argv.index("--surface") + 1] if "--surface" in sys.argv else None
    for spec in [a for a in sys.argv[3:] if not a.startswith("--") and a != surface_dir]:
        pipeline, run = spec.split("/")
        mode, opt_name, *options = run.split(":")  # options: a placement (exactness.py)
        if pipeline not in strategies:
            strategies[pipeline] = tnp.NestPipeStrategy(transport="horovod", pipeline=pipeline,
                                                        micro_batches=3)
        strategy = strategies[pipeline]
        print("collectives %s rank %d of %d" % (strategy.collectives_backend,
                                                strategy.worker_index, strategy.num_workers),
              flush=True)
        if check_splits:
            check_variable_splits(strategy)
            check_splits = False
        strategy.placement = exactness.placement_of_run(options)
        exactness.train(strategy, batches, mode, opt_name,
                        "%s.%s.%s.npz" % (prefix, pipeline, ".".join([mode, opt_name] + options)))
    if "--surface" in sys.argv:  # the tf_keras surface paths on the "none" strategy
        import horovod_surface  # pylint: disable=import-outside-toplevel

        horovod_surface.surface(strategies["none"], sys.argv[sys.argv.index("--surface") + 1])


if __name__ == "__main__":
    main()
