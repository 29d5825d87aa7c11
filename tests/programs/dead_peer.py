"""A synchronous run whose worker 1 stops answering (SIGSTOP: alive but silent, like a hung host)
after step 3; worker 0 must fail fast naming the silent task instead of waiting forever.

usage: dead_peer.py   (run on 2 workers of a TF_CONFIG cluster started without our launcher)
"""
import os
import signal
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import exactness as ex  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe.strategy.coordination import configured_heartbeat_timeout_seconds  # noqa: E402


def main():
    # row_wise: the survivor waits in the tables' exchange, as it did before "auto" (which
    # would replicate these small tables) became the default.
    strategy = tnp.NestPipeStrategy(placement="row_wise")
    rank, workers = strategy.worker_index, strategy.num_workers
    print("heartbeat timeout %s s" % configured_heartbeat_timeout_seconds(), flush=True)
    with strategy.scope():
        model = ex.TinyRanker()
        optimizer = ex.make_optimizer("sgd")
    train_step = ex.synchronous_train_step(strategy, model, optimizer)

    batches = ex.make_batches(4)
    for step in range(100000):
        train_step(*ex.local_slice(batches[step % 4], rank, workers))
        if step == 3 and rank == 1:
            print("worker 1 stops answering", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    main()
