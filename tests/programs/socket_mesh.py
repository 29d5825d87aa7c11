"""The socket mesh's collectives on a real cluster, checked against NumPy on every worker (each
worker rebuilds every worker's inputs from seeds), then an optional fault.

usage: socket_mesh.py [die|stop|skip|cancel|slow]
  (no fault) prints "socket mesh ok W" after the checks, and the mesh's counters;
  die:    worker 1 exits abruptly inside a step; worker 0 must fail at once naming it;
  stop:   worker 1 stops (SIGSTOP) inside a step; worker 0 must fail after the stall timeout;
  skip:   worker 1 skips one call and makes another; every worker must fail within the
          transport's timeout, naming worker 1 and the call it did not make;
  cancel: worker 0's step fails while its exchange waits for worker 1 (which never makes the
          call): TensorFlow cancels the exchange, the step fails at once, and worker 1 is told;
  slow:   every worker sends 10 MB to the other in one all-to-all (on a slow link its transfer
          outlasts the stall and call timeouts: progress keeps it alive), checked against NumPy.
"""
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import tf_nestpipe as tnp
from tf_nestpipe.ops.sockets import socket_stats


def inputs_of(worker, num_workers, dtype, capacity=5, dim=3):
    """Worker `worker`'s padded all-to-all input and its send counts (seeded)."""
    rng = np.random.default_rng(1000 + worker)
    counts = rng.integers(0, capacity + 1, size=num_workers).astype(np.int32)
    values = (rng.standard_normal((num_workers, capacity, dim)) * 100).astype(dtype)
    return values, counts


def expected_all_to_all(me, num_workers, dtype, fill):
    """What worker `me` must receive: row i = worker i's first counts[me] entries of its row me."""
    out, received = [], []
    for worker in range(num_workers):
        values, counts = inputs_of(worker, num_workers, dtype)
        row = np.full_like(values[me], fill)
        row[:counts[me]] = values[me][:counts[me]]
        out.append(row)
        received.append(counts[me])
    return np.stack(out), np.asarray(received, np.int32)


def check_all_to_all(collectives, me, num_workers):
    """Padded all-to-alls of several dtypes, eager and in a function, against NumPy."""
    for dtype, fill in ((np.float32, -1.0), (np.int64, -1), (np.int32, 0), (np.float64, 7.5)):
        values, counts = inputs_of(me, num_workers, dtype)
        want, _ = expected_all_to_all(me, num_workers, dtype, fill)
        got = collectives.all_to_all(tf.constant(values), "mesh/%s" % np.dtype(dtype).name,
                                     send_counts=tf.constant(counts), fill=fill)
        np.testing.assert_array_equal(got.numpy(), want)
        fn = tf.function(lambda v, c, d=dtype, f=fill: collectives.all_to_all(
            v, "mesh/fn/%s" % np.dtype(d).name, send_counts=c, fill=f))
        for _ in range(3):  # the same key called again pairs with the peers' next call
            np.testing.assert_array_equal(fn(tf.constant(values), tf.constant(counts)).numpy(),
                                          want)


def check_gradient(collectives, me, num_workers):
    """The backward of the differentiable all-to-all is the reverse exchange."""
    values, counts = inputs_of(me, num_workers, np.float32)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = collectives.all_to_all_differentiable(x, "mesh/grad", send_counts=counts)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    grad = step(tf.constant(values)).numpy()
    want = np.zeros_like(values)
    for j in range(num_workers):  # entries that travelled get 2x; padding gets nothing back
        want[j, :counts[j]] = 2 * values[j, :counts[j]]
    np.testing.assert_allclose(grad, want, rtol=1e-6)


def check_gather_and_sum(collectives, me, num_workers):
    """all_gather and all_reduce_sum against NumPy; the sum bitwise equal on every worker."""
    rows = collectives.all_gather(tf.constant([[me, 10 * me]], tf.int64), "mesh/gather").numpy()
    np.testing.assert_array_equal(rows, [[w, 10 * w] for w in range(num_workers)])
    parts = [np.random.default_rng(w).standard_normal(1001).astype(np.float32)
             for w in range(num_workers)]
    mine = [tf.constant(parts[me][:1000].reshape(10, 100)), tf.constant(parts[me][1000:]),
            tf.constant([me + 1], tf.int64)]
    summed = collectives.all_reduce_sum(mine, "mesh/sum")
    total = parts[0].copy()
    for p in parts[1:]:
        total = total + p
    np.testing.assert_array_equal(summed[0].numpy().ravel(), total[:1000])
    np.testing.assert_array_equal(summed[1].numpy(), total[1000:])
    assert summed[2].numpy().tolist() == [num_workers * (num_workers + 1) // 2]
    gathered = collectives.all_gather(tf.reshape(summed[0], [1, -1]), "mesh/same").numpy()
    assert (gathered == gathered[0]).all(), "workers computed different sums"


def fault(collectives, me, num_workers, kind):
    """Exchanges in a loop until worker 1 dies or stops inside one."""
    fn = tf.function(lambda v: collectives.all_to_all(v, "mesh/fault"))
    tensor = tf.zeros([num_workers, 4], tf.float32)
    for step in range(1000000):
        if me == 1 and step == 20:
            print("worker 1 %s" % ("dies" if kind == "die" else "stops"), flush=True)
            if kind == "die":
                os._exit(0)  # abruptly, but exit 0: the launcher waits for worker 0's verdict
            os.kill(os.getpid(), signal.SIGSTOP)
        fn(tensor).numpy()


def skip(collectives, me, num_workers):
    """Worker 1 makes call "mesh/other" where every other worker makes "mesh/fault"."""
    fault_fn = tf.function(lambda v: collectives.all_to_all(v, "mesh/fault"))
    other_fn = tf.function(lambda v: collectives.all_to_all(v, "mesh/other"))
    tensor = tf.zeros([num_workers, 4], tf.float32)
    for step in range(10):
        fault_fn(tensor).numpy()
    started = time.time()
    try:
        (other_fn if me == 1 else fault_fn)(tensor).numpy()
    except tf.errors.OpError as error:
        print("worker %d failed after %.1f s: %s: %s" % (
            me, time.time() - started, type(error).__name__, error.message), flush=True)
        if me == 0:
            time.sleep(3)  # the launcher stops the cluster when one task fails: let 1 report
        raise


def cancel(collectives, me, num_workers):
    """Worker 0's step fails (a py_function raises) while its exchange waits for worker 1."""
    tensor = tf.zeros([num_workers, 4], tf.float32)

    def fail_later():
        time.sleep(1.0)
        raise ValueError("the step's other op failed")

    @tf.function
    def step(v):
        out = collectives.all_to_all(v, "mesh/cancel")
        failed = tf.py_function(fail_later, [], tf.float32)
        return out, failed

    if me == 1:
        time.sleep(60)  # never makes the call; the mesh tells it why worker 0 stopped
        tf.function(lambda v: collectives.all_to_all(v, "mesh/after"))(tensor).numpy()
        return
    started = time.time()
    try:
        step(tensor)
    except tf.errors.OpError as error:
        print("worker 0 step failed after %.1f s: %s" % (time.time() - started,
                                                          type(error).__name__), flush=True)
    try:
        tf.function(lambda v: collectives.all_to_all(v, "mesh/after"))(tensor).numpy()
    except tf.errors.OpError as error:
        print("worker 0 later call: %s: %s" % (type(error).__name__, error.message), flush=True)
        raise


def slow(collectives, me, num_workers):
    """One all-to-all of 10 MB per peer, its arrival checked, and how long it took."""
    entries = 10 * 1024 * 1024 // 4
    values = np.stack([np.full(entries, 1000 * me + j, np.float32) for j in range(num_workers)])
    exchange = tf.function(lambda v: collectives.all_to_all(v, "mesh/slow"))
    exchange(tf.zeros([num_workers, 4], tf.float32)).numpy()  # traced, the path is warm
    started = time.time()
    got = exchange(tf.constant(values)).numpy()
    for j in range(num_workers):
        assert (got[j] == 1000 * j + me).all(), (j, got[j][:4])
    print("worker %d slow exchange ok in %.1f s" % (me, time.time() - started), flush=True)


def main():
    strategy = tnp.NestPipeStrategy()
    collectives = strategy.extended.collectives
    me, num_workers = strategy.worker_index, strategy.num_workers
    assert strategy.collectives_backend == "sockets", strategy.collectives_backend
    if len(sys.argv) > 1:
        {"skip": skip, "cancel": cancel, "slow": slow}.get(
            sys.argv[1], lambda *a: fault(*a, sys.argv[1]))(collectives, me, num_workers)
        return
    check_all_to_all(collectives, me, num_workers)
    check_gradient(collectives, me, num_workers)
    check_gather_and_sum(collectives, me, num_workers)
    hosts = collectives.hosts
    print("socket mesh ok %d %s" % (num_workers, "hosts %s" % (hosts,) if hosts else "flat"),
          flush=True)
    print("socket mesh stats %s" % socket_stats(), flush=True)


if __name__ == "__main__":
    main()
