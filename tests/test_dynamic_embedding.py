"""DynamicEmbedding trained on 1, 2 and 3 workers (custom loop, fit, fit with the DBP pipeline)
equals the Python-dict reference of the same semantics on as many owners
(tests/dynamic_reference.py); a checkpoint written on 2 workers restores on 3 and on 1 (ids
re-hashed to their new owners, nothing lost) and continues as the reference re-hashed alike;
every pipeline (fwp and nested look a micro-batched batch up as one step of the table);
a strategy.run loop's frozen window is refused."""
import os
import re
import sys

import numpy as np
import pytest

from conftest import PROGRAMS, launch, run_command

sys.path.insert(0, PROGRAMS)
import dynamic_table as program  # noqa: E402

from dynamic_reference import RefDynamicModel, owner  # noqa: E402

TOL = 1e-5
MULTI_WORKER_RUNS = ["loop", "fit", "fit_dbp", "fit_fwp", "fit_nested", "loop_window", "fit_auto",
                     "checkpoint"]
THREE_WORKER_RUNS = ["loop", "fit_dbp", "fit_nested"]  # and the restore of the 2-worker checkpoint
HALF = program.STEPS // 2


def reference(workers, then=None, steps=None):
    """The reference model trained on the program's batches with `workers` owners (the first
    `steps`); `then` = (workers, capacity): its tables re-hash onto those after half the steps,
    as a restore of the half-way checkpoint on another worker count does."""
    from tf_nestpipe.sharding.dynamic_init import initial_rows

    init = program.initializer()
    kernel = program.kernel_initializer()((program.DIM, 1)).numpy()[:, 0]
    table = dict(capacity=program.TABLE["capacity_per_worker"],
                 admit_after=program.TABLE["admission"], policy=program.TABLE["eviction"],
                 ttl=program.TABLE["ttl_steps"], counter_capacity=max(
                     4 * program.TABLE["capacity_per_worker"], 1024))
    model = RefDynamicModel(workers, program.DIM, lambda ids: initial_rows(init, ids, program.DIM)
                            .numpy(), table, kernel, 0.0, program.LR)
    for step, (ids, y) in enumerate(program.make_batches()[:steps]):
        if then and step == HALF:
            model.rehash(*then)
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


@pytest.fixture(scope="session")
def dynamic_three(dynamic_results, tmp_path_factory):
    """One 3-worker launch: THREE_WORKER_RUNS and the restores of the 2-worker half-way
    checkpoints (tf.train.Checkpoint and ShardedCheckpoint, re-hashed onto 3 workers). Returns
    the output prefix."""
    prefix2, _ = dynamic_results
    out = tmp_path_factory.mktemp("dynamic3")
    result = launch(3, [os.path.join(PROGRAMS, "dynamic_table.py"), str(out / "w3")]
                    + THREE_WORKER_RUNS + ["rehash=" + prefix2 + ".ckpt",
                                           "rehash_sharded=" + prefix2 + ".ckpt"], timeout=900)
    assert result.returncode == 0, result.stdout[-6000:]
    return str(out / "w3")


@pytest.mark.parametrize("run", ["loop", "fit"])
def test_one_worker_equals_reference(run):
    strategy, model, emb = program.train(run, program.make_batches())
    ids, rows = emb.full_table()
    kernel, bias = [v.numpy() for v in model.trainable_variables if "rows" not in v.name]
    stats = emb.global_table_stats()
    assert stats["evicted"] > 0 and stats["refused"] > 0 and stats["pending"] > 0  # exercised
    assert_matches(ids, rows, kernel, bias, stats, reference(1))
    del strategy


@pytest.mark.parametrize("run", ["loop", "fit", "fit_dbp", "fit_fwp", "fit_nested", "fit_auto"])
def test_two_workers_equal_reference(dynamic_results, run):
    prefix, _ = dynamic_results
    saved = np.load("%s.%s.npz" % (prefix, run))
    stats = dict(zip(saved["stat_names"].tolist(), saved["stats"].tolist()))
    assert_matches(saved["ids"], saved["rows"], saved["kernel"], saved["bias"], stats,
                   reference(2))


@pytest.mark.parametrize("run", THREE_WORKER_RUNS)
def test_three_workers_equal_reference(dynamic_three, run):
    assert_saved_matches(np.load("%s.%s.npz" % (dynamic_three, run)), reference(3))


def assert_saved_matches(saved, ref):
    stats = dict(zip(saved["stat_names"].tolist(), saved["stats"].tolist()))
    assert_matches(saved["ids"], saved["rows"], saved["kernel"], saved["bias"], stats, ref)


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
                          prefix + ".export", prefix + ".predictions.npz"], cwd=str(tmp_path),
                         fresh=True)
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


def assert_restored_as(saved, ref, workers):
    """The table as restored equals the reference's half-way table: every id with its step,
    frequency, row and optimizer slot, every pending id with its admission count, each at its
    owner on `workers` workers."""
    table, pending = ref.snapshot()
    ids = saved["restored_ids"].tolist()
    assert sorted(ids) == sorted(table) and len(ids) > 0
    for i, k in enumerate(ids):
        last, freq, row, acc, _ = table[k]
        assert saved["restored_entries"][i].tolist() == [last, freq], k
        np.testing.assert_allclose(saved["restored_rows"][i], row, atol=TOL)
        np.testing.assert_allclose(saved["restored_accumulators"][i], acc, atol=TOL)
        assert saved["restored_owners"][i] == owner(k, workers), k
    pending_ids = saved["restored_pending_ids"].tolist()
    assert sorted(pending_ids) == sorted(pending) and len(pending_ids) > 0
    for i, k in enumerate(pending_ids):
        assert saved["restored_pending"][i].tolist() == list(pending[k][:2]), k
        assert saved["restored_pending_owners"][i] == owner(k, workers), k
    stats = dict(zip(saved["stat_names"].tolist(), saved["restored_stats"].tolist()))
    for name, value in ref.stats().items():
        assert stats[name] == value, (name, stats)
    assert stats["step"] == HALF and stats["size"] == len(table)


@pytest.mark.parametrize("kind", ["rehash", "rehash_sharded"])
def test_restore_on_three_workers_rehashes(dynamic_three, kind):
    """The 2-worker half-way checkpoint (tf.train.Checkpoint, ShardedCheckpoint) restored on 3
    workers: every id, row, optimizer slot and admission count at its new owner; the 8 steps
    after it equal the reference whose tables re-hash onto 3 owners half-way."""
    saved = np.load("%s.%s.npz" % (dynamic_three, kind))
    assert_restored_as(saved, reference(2, steps=HALF, then=None), 3)
    assert len(set(saved["restored_owners"].tolist())) == 3
    assert_saved_matches(saved, reference(2, then=(3, None)))


@pytest.mark.parametrize("kind", ["rehash", "rehash_sharded"])
def test_restore_on_one_worker_rehashes(dynamic_results, tmp_path, kind):
    """The same checkpoints restored in one process (capacity 16: their 15 ids fit)."""
    import tf_nestpipe as tnp

    prefix, _ = dynamic_results
    program.rehash_continuation(str(tmp_path / "w1"), prefix + ".ckpt", tnp.NestPipeStrategy(),
                                capacity=16, sharded=kind == "rehash_sharded")
    saved = np.load(str(tmp_path / ("w1.%s.npz" % kind)))
    assert_restored_as(saved, reference(2, steps=HALF), 1)
    assert_saved_matches(saved, reference(2, then=(1, 16)))


def test_positive_control_rehash_reference_differs():
    """The continuation after the re-hash differs from the run that stayed on 2 workers (the
    comparison sees where the ids went)."""
    two, moved = reference(2).full_table(), reference(2, then=(3, None)).full_table()
    assert len(two[0]) != len(moved[0]) or not np.allclose(two[1], moved[1])


@pytest.mark.parametrize("sharded", [False, True])
def test_restore_beyond_capacity_is_refused(dynamic_results, sharded):
    """The 15 ids of the 2-worker checkpoints do not fit one worker of capacity 10: refused
    with the fix (the capacity 16 restores above are the positive control)."""
    import tensorflow as tf
    import tf_nestpipe as tnp

    prefix, _ = dynamic_results
    path = prefix + (".ckpt_sharded" if sharded else ".ckpt/ckpt")
    with pytest.raises(tf.errors.InvalidArgumentError, match="capacity_per_worker=10"):
        program.restore_model(tnp.NestPipeStrategy(pipeline="none"), path, sharded=sharded)


def test_fit_logs_the_counters(dynamic_results):
    """tnp.DynamicTableStats logs every worker's counters summed: the reference's."""
    _, stdout = dynamic_results
    line = re.search(r"\[worker:0\] DynamicEmbedding 'dyn' epoch 1: (.*)", stdout)
    assert line, stdout[-2000:]
    logged = dict(kv.split("=") for kv in line.group(1).strip().split(", "))
    for name, value in reference(2).stats().items():
        assert int(logged[name]) == value, (name, logged)


def test_frozen_window_of_a_strategy_run_loop_is_refused(dynamic_results):
    """fit's frozen window looks a dynamic table up once per batch (fit_fwp, fit_nested above);
    a custom loop's tnp.pipeline.frozen_window() would look it up per micro-batch: refused."""
    _, stdout = dynamic_results
    assert "REFUSED loop_window" in stdout and "without tnp.pipeline.frozen_window()" in stdout
    assert "REFUSED fit_fwp" not in stdout and "REFUSED fit_nested" not in stdout


def test_auto_pipeline_tries_every_mode_on_a_dynamic_table(dynamic_results):
    """pipeline='auto' on a model with a dynamic table probes every mode, micro-batched ones
    too (fit_auto trains and equals the reference above, whichever it chose)."""
    _, stdout = dynamic_results
    assert "done fit_auto" in stdout and "REFUSED fit_auto" not in stdout
    chosen = [line for line in stdout.splitlines() if "pipeline='auto' chose" in line]
    assert len(chosen) == 1, stdout[-3000:]
    for mode in ("none ", "fwp(M=2) ", "dbp ", "nested(M=2) "):
        assert mode in chosen[0], chosen
