"""Checkpoints under NestPipeStrategy: a run saved on 2 workers and resumed on 2 (after a worker
was killed, or after SIGTERM), or on 3 (whose checkpoint then resumes on 1), ends with the same
tables, slots and dense weights as the uninterrupted run; the exported SavedModel serves the
same predictions without tf_nestpipe; incomplete or missing checkpoints give clear errors."""
import json
import os
import sys

import numpy as np
import pytest

from conftest import UNPINNED, PROGRAMS, launch, run_command, run_together
from tf_nestpipe.sharding import ShardLayout
from tf_nestpipe.strategy.checkpoint import _reshard_rows, latest_step

PROGRAM = os.path.join(PROGRAMS, "checkpoint.py")


@pytest.fixture(scope="session")
def checkpoint_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoint")
    ckpt = str(out / "ckpt")

    def call(workers, *jobs):  # jobs run in turn in one launch (one start-up for all)
        args = [PROGRAM] + [a for i, job in enumerate(jobs) for a in ["+"] * (i > 0) + job]
        return ((launch, workers, args, 600) if workers > 1 else
                (run_command, [sys.executable] + args, 600))

    def restarting(args):  # through the launcher with one restart allowed
        return (run_command, [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2",
                              UNPINNED, "--restarts", "1", "--", sys.executable, PROGRAM] + args,
                600)  # a hang guard: ~100 s beside the background lane's exactness runs

    def stage(*calls):  # independent runs at once; each must succeed
        results = run_together(*calls)
        for result in results:
            assert result.returncode == 0, result.stdout[-5000:]
        return results

    # Stage 1, from scratch: uninterrupted on 2 workers (a checkpoint written at step 5 on the
    # way); every table replicated (ShardedCheckpoint and tf format); table-wise tables
    # (table_a whole on worker 0, table_b on worker 1); the Dual-Buffer Pipeline. At the same
    # time, restarts: worker 1 is SIGKILLed after step 8, the launcher restarts the cluster,
    # which resumes from the checkpoint of step 5; and worker 1 gets SIGTERM in step 7: every
    # worker saves step 7 and exits; the restart resumes.
    _, restarted, preempted = stage(
        call(2, [str(out / "full"), ckpt, "0", "15", "--snapshot-at", "10", "--save-at", "5"],
             [str(out / "dp"), str(out / "ckpt_dp"), "0", "10", "--placement", "data_parallel",
              "--also-tf", "--save-at", "5"],
             [str(out / "tw"), str(out / "ckpt_tw"), "0", "10", "--placement", "table_wise",
              "--save-at", "5"],
             [str(out / "dbp_full"), str(out / "ckpt_dbp"), "0", "15", "--dbp", "--save-at",
              "5"]),
        restarting([str(out / "restarted"), str(out / "ckpt_restart"), "0", "15", "--resume",
                    "--die-at", "8", "--export", str(out / "saved_model"), "--save-at", "5",
                    "10"]),
        restarting([str(out / "preempted"), str(out / "ckpt_preempt"), "0", "15", "--resume",
                    "--sigterm-at", "7"]))
    # Stage 2, resuming stage 1's step 5 on 3 workers: row-wise (ShardedCheckpoint), replicated
    # -> row-wise (tf format), table-wise -> replicated, DBP.
    stage(call(3, [str(out / "three"), ckpt, "5", "10", "--restore", "--save-at", "10"],
               [str(out / "dp_tf_to_rw"), str(out / "ckpt_dp"), "5", "10", "--restore-tf"],
               [str(out / "tw_to_dp"), str(out / "ckpt_tw"), "5", "10", "--restore",
                "--placement", "data_parallel"],
               [str(out / "dbp_resumed"), str(out / "ckpt_dbp"), "5", "15", "--restore",
                "--dbp"]))
    # Stage 3, resuming the 3-worker run's step 10: on 1 worker; table_a replicated on 2 (and
    # its export); table-wise on 2 (and its export); and stage 1's replicated step 5 row-wise
    # on 2 (ShardedCheckpoint). Table placement is issue 15's.
    stage(call(1, [str(out / "one"), ckpt, "10", "15", "--restore"]),
          call(2, [str(out / "dp_to_rw"), str(out / "ckpt_dp"), "5", "10", "--restore"],
               [str(out / "to_mixdp"), ckpt, "10", "15", "--restore", "--placement", "mixdp",
                "--export", str(out / "saved_model_mixdp")],
               [str(out / "to_tw"), ckpt, "10", "15", "--restore", "--placement",
                "table_wise", "--export", str(out / "saved_model_tw")]))
    (out / "restarted.log").write_text(restarted.stdout)
    (out / "preempted.log").write_text(preempted.stdout)
    return out


def _assert_same(a, b):
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 8
    for name in a.files:
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-5, err_msg=name)


def test_two_to_three_workers_reshards_rows_and_slots(checkpoint_runs):
    _assert_same(np.load(checkpoint_runs / "full.10.npz"), np.load(checkpoint_runs / "three.npz"))


def test_three_to_one_worker_reshards_rows_and_slots(checkpoint_runs):
    _assert_same(np.load(checkpoint_runs / "full.npz"), np.load(checkpoint_runs / "one.npz"))
    with open(checkpoint_runs / "ckpt" / "step-10" / "manifest.json") as f:
        assert json.load(f)["num_workers"] == 3


def test_checkpoints_restore_under_another_placement(checkpoint_runs):
    full = np.load(checkpoint_runs / "full.npz")
    full_10 = np.load(checkpoint_runs / "full.10.npz")
    _assert_same(full, np.load(checkpoint_runs / "to_mixdp.npz"))  # row-wise 3 -> mixed 2
    _assert_same(full_10, np.load(checkpoint_runs / "dp.npz"))  # replicated trains the same
    _assert_same(full_10, np.load(checkpoint_runs / "dp_to_rw.npz"))  # ShardedCheckpoint 2 -> 2
    _assert_same(full_10, np.load(checkpoint_runs / "dp_tf_to_rw.npz"))  # tf format 2 -> 3
    _assert_same(full, np.load(checkpoint_runs / "to_tw.npz"))  # row-wise 3 -> table-wise 2
    _assert_same(full_10, np.load(checkpoint_runs / "tw.npz"))  # table-wise trains the same
    _assert_same(full_10, np.load(checkpoint_runs / "tw_to_dp.npz"))  # table-wise 2 -> dp 3


SERVE = """
import sys
import numpy as np
import tensorflow as tf
for export, predictions in zip(sys.argv[1::2], sys.argv[2::2]):
    loaded = tf.saved_model.load(export)
    data = np.load(predictions)
    serve = loaded.signatures["serving_default"]
    out = serve(ids=tf.constant(data["ids"]), dense=tf.constant(data["dense"]),
                bag_values=tf.constant(data["bag_values"]),
                bag_row_splits=tf.constant(data["bag_row_splits"]))["outputs"].numpy()
    print("served", export, "max_diff", float(np.abs(out - data["predictions"]).max()),
          "rows", out.shape[0], flush=True)
assert "tf_nestpipe" not in sys.modules
print("without tf_nestpipe")
"""
EXPORTS = [
    ("saved_model", "restarted"),  # row-wise tables
    ("saved_model_mixdp", "to_mixdp"),  # a replicated table
    ("saved_model_tw", "to_tw"),  # table-wise tables
]


@pytest.fixture(scope="module")
def served_exports(checkpoint_runs):
    """Each export of EXPORTS served in one fresh process that never imports tf_nestpipe (one
    TensorFlow start-up for the three): its output."""
    args = [str(checkpoint_runs / path) for export, predictions in EXPORTS
            for path in (export, predictions + ".predictions.npz")]
    result = run_command([sys.executable, "-c", SERVE] + args, fresh=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "without tf_nestpipe" in result.stdout, result.stdout[-3000:]
    return result.stdout


@pytest.mark.parametrize("export", [export for export, _ in EXPORTS])
def test_exported_saved_model_serves_without_the_plugin(checkpoint_runs, served_exports, export):
    prefix = "served %s max_diff " % (checkpoint_runs / export)
    line = [l for l in served_exports.splitlines() if l.startswith(prefix)][0]
    assert float(line[len(prefix):].split()[0]) < 1e-5 and line.endswith("rows 24"), line


def test_a_killed_worker_stops_the_cluster_and_the_restart_resumes_exactly(checkpoint_runs):
    log = (checkpoint_runs / "restarted.log").read_text()
    assert "worker 1 dies after step 8" in log
    assert "[launch] task worker:1 failed (-9)" in log
    assert "[launch] restarting the cluster (restart 1 of 1)" in log
    assert log.count("restored step 5") == 2  # both workers of the second attempt
    _assert_same(np.load(checkpoint_runs / "full.npz"), np.load(checkpoint_runs / "restarted.npz"))


def test_sigterm_checkpoints_every_worker_and_the_restart_resumes_exactly(checkpoint_runs):
    log = (checkpoint_runs / "preempted.log").read_text()
    assert "worker 1 gets SIGTERM in step 7" in log
    assert log.count("tf_nestpipe: preempted; saved step 7") == 2
    # The launcher waited for both saves (no fail-fast on a preemption exit), then restarted.
    assert "saved on preemption (exit 42); waiting up to" in log
    assert "every training task saved on preemption; the cluster stopped (exit 42)" in log
    assert "killed by the launcher" not in log.split("restarting the cluster")[0]
    assert log.count("restored step 7") == 2
    _assert_same(np.load(checkpoint_runs / "full.npz"), np.load(checkpoint_runs / "preempted.npz"))


def test_a_dual_buffer_run_resumes_exactly_on_other_workers(checkpoint_runs):
    """Pipelines on: the restored run primes a new pipeline from the restored tables."""
    full = np.load(checkpoint_runs / "dbp_full.npz")
    _assert_same(full, np.load(checkpoint_runs / "dbp_resumed.npz"))
    # ... and the pipelined run equals the plain one.
    _assert_same(np.load(checkpoint_runs / "full.npz"), full)


def test_reshard_rows_against_numpy():
    table = np.arange(11 * 2, dtype=np.float32).reshape(11, 2)
    old = [table[k::3] for k in range(3)]  # id k on shard k mod 3 at row k // 3
    written = ShardLayout(11, 1, 3)
    for new_workers in (1, 2, 4):
        for rank in range(new_workers):
            layout = ShardLayout(11, 2, new_workers, rank)
            np.testing.assert_array_equal(_reshard_rows(old, written, layout),
                                          table[rank::new_workers])


def test_reshard_rows_from_and_to_table_wise_against_numpy():
    """A table-wise table's files: every row in its owner's, none in the others'."""
    table = np.arange(11 * 2, dtype=np.float32).reshape(11, 2)
    empty = table[:0]
    for owner in range(3):
        old = [table if k == owner else empty for k in range(3)]
        written = ShardLayout(11, 1, 3, owner_shard=owner)
        for new_workers in (1, 2, 4):
            for rank in range(new_workers):
                layout = ShardLayout(11, 2, new_workers, rank)
                np.testing.assert_array_equal(_reshard_rows(old, written, layout),
                                              table[rank::new_workers])
                whole = ShardLayout(11, 2, new_workers, rank, owner_shard=new_workers - 1)
                np.testing.assert_array_equal(_reshard_rows(old, written, whole),
                                              table if rank == new_workers - 1 else empty)
    row_wise = [table[k::2] for k in range(2)]  # positive control: row-wise files stay row-wise
    np.testing.assert_array_equal(
        _reshard_rows(row_wise, ShardLayout(11, 1, 2), ShardLayout(11, 2, 2, 0, owner_shard=0)),
        table)


def test_missing_and_incomplete_checkpoints_are_reported(tmp_path):
    import tf_nestpipe as tnp

    strategy = tnp.NestPipeStrategy()
    checkpoint = tnp.ShardedCheckpoint(strategy)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.restore(str(tmp_path))
    (tmp_path / "step-3").mkdir()  # a step whose manifest was never written
    assert latest_step(str(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match="incomplete"):
        checkpoint.restore(str(tmp_path), step=3)


def test_input_position_is_checkpointed_and_skips_the_batches_trained_on(tmp_path):
    import tensorflow as tf
    import tf_nestpipe as tnp

    strategy = tnp.NestPipeStrategy()
    position = tnp.data.InputPosition()
    for _ in range(3):
        position.advance()
    path = tf.train.Checkpoint(input=position).write(str(tmp_path / "ckpt"))
    restored = tnp.data.InputPosition()
    tf.train.Checkpoint(input=restored).read(path).assert_consumed()
    assert int(restored.batches.numpy()) == 3
    batches = iter(restored.distribute(strategy, lambda context: tf.data.Dataset.range(10)))
    assert int(next(batches)) == 3  # the first batch not trained on
    assert list(restored.skip(tf.data.Dataset.range(5)).as_numpy_iterator()) == [3, 4]
