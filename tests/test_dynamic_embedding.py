"""DynamicEmbedding trained on 1 and 2 workers (custom loop, fit, fit with the DBP pipeline)
equals the Python-dict reference of the same semantics on as many owners
(tests/dynamic_reference.py); frozen-window pipelines are refused."""
import os
import re
import sys

import numpy as np
import pytest

from conftest import PROGRAMS, launch, run_command

sys.path.insert(0, PROGRAMS)
import dynamic_table as program  # noqa: E402

from dynamic_reference import RefDynamicModel  # noqa: E402

TOL = 1e-5
MULTI_WORKER_RUNS = ["loop", "fit", "fit_dbp", "fit_fwp", "checkpoint"]


def reference(workers):
    """The reference model trained on the program's batches with `workers` owners."""
    from tf_nestpipe.sharding.dynamic_init import initial_rows

    init = program.initializer()
    kernel = program.kernel_initializer()((program.DIM, 1)).numpy()[:, 0]
    table = dict(capacity=program.TABLE["capacity_per_worker"],
                 admit_after=program.TABLE["admission"], policy=program.TABLE["eviction"],
                 ttl=program.TABLE["ttl_steps"], counter_capacity=max(
                     4 * program.TABLE["capacity_per_worker"], 1024))
    model = RefDynamicModel(workers, program.DIM, lambda ids: initial_rows(init, ids, program.DIM)
                            .numpy(), table, kernel, 0.0, program.LR)
    for ids, y in program.make_batches():
        model.step(ids, y)
    return model


def assert_matches(ids, rows, kernel, bias, stats, ref):
    ref_ids, ref_rows = ref.full_table()
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(rows, ref_rows, atol=TOL)
    np.testing.assert_allclose(kernel[:, 0], ref.w, atol=TOL)
    np.testing.assert_allclose(bias[0], ref.b, atol=TOL)
    for name, value in ref.stats().items():
        assert stats[name] == value, (name, stats, ref.stats())


@pytest.fixture(scope="session")
def dynamic_results(tmp_path_factory):
    """One 2-worker launch of every run; returns the output prefix and the launch's output."""
    out = tmp_path_factory.mktemp("dynamic")
    result = launch(2, [os.path.join(PROGRAMS, "dynamic_table.py"), str(out / "w2")]
                    + MULTI_WORKER_RUNS, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:]
    return str(out / "w2"), result.stdout


@pytest.mark.parametrize("run", ["loop", "fit"])
def test_one_worker_equals_reference(run):
    strategy, model, emb = program.train(run, program.make_batches())
    ids, rows = emb.full_table()
    kernel, bias = [v.numpy() for v in model.trainable_variables if "rows" not in v.name]
    stats = emb.global_table_stats()
    assert stats["evicted"] > 0 and stats["refused"] > 0 and stats["pending"] > 0  # exercised
    assert_matches(ids, rows, kernel, bias, stats, reference(1))
    del strategy


@pytest.mark.parametrize("run", ["loop", "fit", "fit_dbp"])
def test_two_workers_equal_reference(dynamic_results, run):
    prefix, _ = dynamic_results
    saved = np.load("%s.%s.npz" % (prefix, run))
    stats = dict(zip(saved["stat_names"].tolist(), saved["stats"].tolist()))
    assert_matches(saved["ids"], saved["rows"], saved["kernel"], saved["bias"], stats,
                   reference(2))


def test_positive_control_stale_optimizer_slots_are_caught(monkeypatch):
    """Without the reset of reused slots' optimizer state the comparison fails."""
    from tf_nestpipe.sharding.dynamic_slots import FreshSlots

    monkeypatch.setattr(FreshSlots, "reset_ops", lambda self: [])
    _, model, emb = program.train("loop", program.make_batches())
    ids, rows = emb.full_table()
    kernel, bias = [v.numpy() for v in model.trainable_variables if "rows" not in v.name]
    with pytest.raises(AssertionError):
        assert_matches(ids, rows, kernel, bias, emb.global_table_stats(), reference(1))


def test_reference_differs_across_worker_counts_under_eviction():
    """Positive control: the comparison sees the owners' capacities (1 vs 2 workers differ)."""
    one, two = reference(1).full_table(), reference(2).full_table()
    assert len(one[0]) != len(two[0]) or not np.allclose(one[1], two[1])


def test_export_serves_without_tf_nestpipe(dynamic_results, tmp_path):
    """The 2-worker export, served in a fresh process that never imports tf_nestpipe, gives the
    trained model's predictions; unknown ids embed to the zero row (prediction = bias)."""
    prefix, _ = dynamic_results
    result = run_command([sys.executable, os.path.join(PROGRAMS, "load_dynamic_export.py"),
                          prefix + ".export", prefix + ".predictions.npz"], cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:]
    found = re.search(r"max_diff (\S+)", result.stdout)
    assert found and float(found.group(1)) <= 1e-6, result.stdout[-500:]
    saved = np.load(prefix + ".predictions.npz")
    bias = np.load(prefix + ".loop.npz")["bias"][0]
    np.testing.assert_allclose(saved["predictions"][-2], bias, atol=1e-6)  # ids 12345, -9


def test_checkpoint_restores_table_state_and_rows(dynamic_results):
    """Saved after 8 steps on 2 workers, restored into a fresh model: the next 8 steps give the
    table the uninterrupted run has (ids, rows, counters, optimizer slots all restored)."""
    prefix, _ = dynamic_results
    assert_resumed(np.load(prefix + ".checkpoint.npz"), reference(2))


def assert_resumed(saved, ref):
    """Both restores (tf.train.Checkpoint, ShardedCheckpoint) resumed at step 8 and continued
    to the uninterrupted table, which is the reference's."""
    for kind in ("whole", "sharded"):
        assert int(saved[kind + "_step"]) == program.STEPS // 2, kind
        np.testing.assert_array_equal(saved["ids"], saved[kind + "_ids"])
        np.testing.assert_allclose(saved["rows"], saved[kind + "_rows"], atol=TOL)
    ref_ids, ref_rows = ref.full_table()
    np.testing.assert_array_equal(saved["ids"], ref_ids)
    np.testing.assert_allclose(saved["rows"], ref_rows, atol=TOL)


def test_one_worker_checkpoint_restores(tmp_path):
    program.checkpoint_continuation(str(tmp_path / "w1"), str(tmp_path / "ckpt"))
    assert_resumed(np.load(str(tmp_path / "w1.checkpoint.npz")), reference(1))


def test_restore_on_another_worker_count_is_refused(dynamic_results):
    """The 2-worker checkpoint, restored on one worker: refused (never a wrong table)."""
    import tensorflow as tf
    import tf_keras
    import tf_nestpipe as tnp

    prefix, _ = dynamic_results
    strategy = tnp.NestPipeStrategy(pipeline="none")
    with strategy.scope():
        model, _ = program.build_model()
        optimizer = tf_keras.optimizers.Adagrad(program.LR)
    model(tf.constant([[1, 2]], tf.int64))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="another number of workers"):
        tf.train.Checkpoint(model=model, optimizer=optimizer).read(
            prefix + ".ckpt/ckpt").assert_existing_objects_matched()
    with pytest.raises(ValueError, match="dynamic tables"):
        tnp.ShardedCheckpoint(strategy, model=model, optimizer=optimizer).restore(
            prefix + ".ckpt_sharded")


def test_fit_logs_the_counters(dynamic_results):
    """tnp.DynamicTableStats logs every worker's counters summed: the reference's."""
    _, stdout = dynamic_results
    line = re.search(r"\[worker:0\] DynamicEmbedding 'dyn' epoch 1: (.*)", stdout)
    assert line, stdout[-2000:]
    logged = dict(kv.split("=") for kv in line.group(1).strip().split(", "))
    for name, value in reference(2).stats().items():
        assert int(logged[name]) == value, (name, logged)


def test_frozen_window_pipeline_is_refused(dynamic_results):
    _, stdout = dynamic_results
    assert "REFUSED fit_fwp" in stdout and "pipeline='none' or 'dbp'" in stdout
