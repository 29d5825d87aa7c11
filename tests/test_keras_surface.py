"""The tf_keras / TFRS surface: Keras files, predict, returned values, SavedModels, refusals.

One one-process run and one 2-worker launch of tests/programs/keras_surface.py (the 2-worker
run also loads the one-process run's .h5), then tests/programs/load_saved.py loads the 2-worker
run's SavedModels and .h5 in a process that never imports tf_nestpipe.
"""
import os
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_nestpipe as tnp
from conftest import PROGRAMS, background_fixture, launch, run_command, run_together
from tf_nestpipe.pipeline import keras_outputs
from tf_nestpipe.strategy.keras_checks import ReplicatedEmbeddingWarning

VOCAB_A, VOCAB_B, DIM = 37, 23, 4


@background_fixture
def surface(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_surface")
    ref, two = out / "ref", out / "two"
    ref.mkdir()
    two.mkdir()
    program = os.path.join(PROGRAMS, "keras_surface.py")
    # At once: the cluster reads the one-process run's .h5 once it is written (w0.h5.done).
    single, cluster = run_together((run_command, [sys.executable, program, str(ref)], 600),
                                   (launch, 2, [program, str(two), str(ref)], 600))
    assert single.returncode == 0, single.stdout[-4000:]
    assert cluster.returncode == 0, cluster.stdout[-6000:]
    # A fresh process without tf_nestpipe on its path loads the 2-worker run's files.
    env = {"PYTHONPATH": ""}
    loader = run_command([sys.executable, os.path.join(PROGRAMS, "load_saved.py"), str(two),
                          str(out / "loaded.npz")], env=env, cwd=str(out), fresh=True)
    assert loader.returncode == 0, loader.stdout[-4000:]
    return {"ref": np.load(ref / "rank0.npz"), 0: np.load(two / "rank0.npz"),
            1: np.load(two / "rank1.npz"), "loaded": np.load(out / "loaded.npz")}


def _state_keys(run, prefix):
    keys = [k for k in run.files if k.startswith(prefix) and not k.endswith("predict")
            and "/slot/" not in k]
    assert len(keys) == 6, keys  # two tables, two dense layers' kernel and bias
    return keys


def test_h5_file_holds_whole_tables(surface):
    loaded, trained = surface["loaded"], surface[0]
    for table, vocab in (("table_a", VOCAB_A), ("table_b", VOCAB_B)):
        saved = loaded["h5/%s/%s/embeddings:0" % (table, table)]
        # Worker 0's own rows alone (the old file) would be 19 / 12 rows.
        assert saved.shape == (vocab, DIM)
        np.testing.assert_array_equal(saved, trained["trained/" + table])


def test_every_worker_saves_to_one_path_and_only_the_chiefs_copy_lands_there(surface):
    # Worker 0 lists after its own saves; worker 1's copies went to scratch paths, removed.
    assert list(surface[0]["files"]) == ["export", "m0.keras", "saved0", "tf_saved", "w0.h5",
                                         "w0.weights.h5", "x_predict.npz"]


@pytest.mark.parametrize("prefix", ["h5_own/", "weights_h5_own/", "keras_own/"])
def test_h5_and_keras_files_load_back_on_two_workers(surface, prefix):
    for rank in (0, 1):
        run = surface[rank]
        for key in _state_keys(run, prefix):
            np.testing.assert_array_equal(run[key], run["trained/" + key[len(prefix):]], key)
        np.testing.assert_allclose(run[prefix + "predict"], run["predict"], atol=1e-6)


def test_keras_file_restores_the_tables_optimizer_slots_whole(surface):
    for rank in (0, 1):
        run = surface[rank]
        for i in (0, 1):
            trained = run["trained/slot/%d" % i]
            assert trained.shape[0] in (VOCAB_A, VOCAB_B) and np.std(trained) > 0
            np.testing.assert_array_equal(run["keras_own/slot/%d" % i], trained)


def test_h5_written_by_one_process_loads_on_two_workers(surface):
    ref = surface["ref"]
    for rank in (0, 1):
        for key in _state_keys(surface[rank], "h5_ref/"):
            np.testing.assert_array_equal(surface[rank][key], ref["trained/" + key[7:]], key)


def test_h5_of_another_table_size_is_refused_naming_both_sizes(surface):
    message = str(surface[0]["wrong_size_error"])
    assert "has 37 rows, but the whole table has 41" in message, message


def test_h5_load_by_name_is_refused_on_two_workers_naming_the_fix(surface):
    """tf_keras compares a row shard's own shape with the file's whole table (a generic shape
    error, or with skip_mismatch=True every table skipped silently): refused, naming the fix.
    On one process (tables not sharded) tf_keras' own by-name load works: the positive control."""
    message = str(surface[0]["by_name_error"])
    assert "by_name=True) is not supported for row-sharded tables" in message, message
    assert "by_name=False" in message and "tnp.ShardedCheckpoint" in message
    assert str(surface["ref"]["by_name_error"]) == "no error"
    for key in _state_keys(surface["ref"], "by_name/"):
        np.testing.assert_allclose(surface["ref"][key], surface["ref"]["h5_own/" + key[8:]],
                                   atol=0, err_msg=key)


def test_two_worker_training_equals_one_process(surface):
    for key in _state_keys(surface["ref"], "trained/"):
        np.testing.assert_allclose(surface[0][key], surface["ref"][key], atol=1e-6, err_msg=key)


def test_fit_history_is_global_and_equals_one_process(surface):
    for key in ("loss", "auc"):
        assert surface["ref"]["history/" + key].shape == (2,)
        for rank in (0, 1):
            np.testing.assert_allclose(surface[rank]["history/" + key],
                                       surface["ref"]["history/" + key], atol=1e-5, err_msg=key)


def test_metric_results_read_every_state_in_one_packed_all_reduce(surface):
    """A step's metric results (loss Mean: 2 state variables, AUC: 4) read their states'
    global sums through one packed all-reduce, equal to tf_keras' own reads, one all-reduce per
    variable read (the positive control: 8 here, AUC's result reads two states twice), and to
    one process."""
    for rank in (0, 1):
        run = surface[rank]
        assert int(run["metric_reads/packed_collectives"]) == 1
        assert int(run["metric_reads/original_collectives"]) >= 6
        for key in ("loss", "auc"):
            packed = run["metric_reads/packed/" + key]
            np.testing.assert_array_equal(packed, run["metric_reads/original/" + key])
            np.testing.assert_allclose(packed, surface["ref"]["metric_reads/packed/" + key],
                                       atol=1e-5, err_msg=key)
    assert int(surface["ref"]["metric_reads/packed_collectives"]) == 0  # one process


def test_a_metric_written_after_the_packed_sums_is_read_fresh(surface):
    """Within a step's packed reads, the loss tracker read, updated and read again: the second
    read finds the pack stale and packs again (1 fresh read, 2 collectives in the step) and
    equals the unpacked read of the next step; the update changed the loss (so a stale answer
    from the first pack would fail), and the AUC reads equal the unpacked ones."""
    for rank in (0, 1):
        run = surface[rank]
        assert int(run["write_after_read/fresh_reads"]) == 1
        assert int(run["write_after_read/collectives"]) == 2
        assert abs(float(run["write_after_read/after"]) - float(run["write_after_read/before"])) > 1e-3
        np.testing.assert_array_equal(run["write_after_read/after"],
                                      run["write_after_read/loss_unpacked"])
        np.testing.assert_array_equal(run["write_after_read/auc"],
                                      run["write_after_read/auc_unpacked"])


def test_fit_metrics_ride_on_the_gradient_all_reduce(surface):
    """The ranker's fit (loss and AUC, every pipeline auto probed) sums its metric states in the
    dense gradients' all-reduce: its steps' metric results need no collective of their own
    (none read fresh). Positive control: a model with its own compute_metrics keeps tf_keras'
    order (metrics updated after the optimizer update), so the AUC's reads find the riding sums
    stale and pack again."""
    for rank in (0, 1):
        run = surface[rank]
        assert int(run["fit_metric_reads/riding"]) >= 1
        assert int(run["fit_metric_reads/packed"]) >= 6  # the loss Mean's 2 and AUC's 4 states
        assert int(run["fit_metric_reads/fresh"]) == 0
        assert int(run["own_compute_metrics_reads/riding"]) >= 1
        assert int(run["own_compute_metrics_reads/fresh"]) >= 1
    assert int(surface["ref"]["fit_metric_reads/packs"]) == 0  # one process


def test_a_tfrs_train_step_reads_its_metrics_from_packed_sums(surface):
    """TFRS's own train_step reads `m.result()` for every metric (not get_metrics_result): on 2
    workers its reads (and evaluate's) come from packed sums, none fresh; the train step's pack
    rides on the dense gradients' all-reduce (TFRS updates its metrics in compute_loss, before
    the update); one process packs nothing (no collectives to save)."""
    for rank in (0, 1):
        run = surface[rank]
        assert int(run["tfrs_metric_reads/riding"]) >= 1
        assert int(run["tfrs_metric_reads/packs"]) > int(run["tfrs_metric_reads/riding"])  # evaluate
        assert int(run["tfrs_metric_reads/packed"]) >= 4  # AUC's 4 state variables at least
        assert int(run["tfrs_metric_reads/fresh"]) == 0
    assert int(surface["ref"]["tfrs_metric_reads/packed"]) == 0


def test_predict_returns_every_row_in_input_order_on_every_worker(surface):
    ref = surface["ref"]["predict"]
    assert ref.shape == (100, 1) and np.std(ref) > 1e-3  # 7 batches of 16, the last partial
    for rank in (0, 1):
        np.testing.assert_allclose(surface[rank]["predict"], ref, atol=1e-5)


@pytest.mark.parametrize("key", ["loss", "regularization_loss", "total_loss", "auc"])
def test_values_a_tfrs_step_returns_are_global_on_every_worker(surface, key):
    ref = surface["ref"]
    for rank in (0, 1):
        np.testing.assert_allclose(surface[rank]["tfrs/" + key], ref["tfrs/" + key], atol=1e-5)
        np.testing.assert_allclose(surface[rank]["tfrs/val_" + key], ref["tfrs/val_" + key],
                                   atol=1e-5)
        np.testing.assert_allclose(surface[rank]["tfrs_eval/" + key], ref["tfrs_eval/" + key],
                                   atol=1e-5)
    np.testing.assert_array_equal(surface[0]["tfrs/" + key], surface[1]["tfrs/" + key])


def test_reduce_lr_on_plateau_decides_alike_on_every_worker(surface):
    ref = surface["ref"]["tfrs_lr"]
    assert ref.min() < ref.max()  # the callback did reduce the learning rate
    for rank in (0, 1):
        np.testing.assert_array_equal(surface[rank]["tfrs_lr"], ref)


def test_per_worker_values_positive_control(surface):
    """With distribute_reduction_method="first" the values stay per-worker: about half the
    global loss, different per worker, and ReduceLROnPlateau then decides differently per
    worker. The tests above would catch it."""
    first = [surface[rank]["tfrs_first/loss"] for rank in (0, 1)]
    ref = surface["ref"]["tfrs/loss"]
    assert np.all(np.abs(first[0] - ref) > 0.1) and np.all(np.abs(first[1] - ref) > 0.1)
    assert not np.array_equal(first[0], first[1])
    assert not np.array_equal(surface[0]["tfrs_first/lr"], surface[1]["tfrs_first/lr"])


@pytest.mark.parametrize("key", ["saved_model/predict", "export/predict", "tf_saved/predict"])
def test_saved_model_and_export_serve_without_tf_nestpipe(surface, key):
    np.testing.assert_allclose(surface["loaded"][key], surface[0]["predict"], atol=1e-5)


# --- in one process --------------------------------------------------------------------------

class _RecordingStrategy:
    """Counts `reduce` calls; sums over 2 pretend workers with equal values."""

    num_workers = 2

    def __init__(self):
        self.reduced = []

    def reduce(self, op, value, axis):
        self.reduced.append(value)
        return value * 2


def test_raw_values_take_one_packed_all_reduce_and_metrics_none():
    model = tf_keras.Sequential([tf_keras.layers.Dense(1)])
    model.compile(loss="mse", metrics=[tf_keras.metrics.AUC(name="auc")])
    model(tf.zeros([1, 2]))
    model.evaluate(tf.zeros([2, 2]), tf.zeros([2, 1]), verbose=0)  # builds the metrics
    strategy = _RecordingStrategy()
    outputs = {"auc": tf.constant(0.7), "loss": tf.constant(1.0),
               "total_loss": tf.constant(1.5), "regularization_loss": tf.constant(0.5)}
    # "loss" is the name of the compiled loss tracker: a metric, global already.
    reduced = keras_outputs.reduce_step_outputs(model, strategy, outputs)
    assert len(strategy.reduced) == 1 and strategy.reduced[0].shape == (2,)
    assert float(reduced["total_loss"]) == 3.0 and float(reduced["regularization_loss"]) == 1.0
    assert float(reduced["auc"]) == pytest.approx(0.7) and float(reduced["loss"]) == 1.0
    metrics_only = {"auc": tf.constant(0.7), "loss": tf.constant(1.0)}
    assert keras_outputs.reduce_step_outputs(model, strategy, metrics_only) is metrics_only
    assert len(strategy.reduced) == 1  # no collective for a step returning metrics only


def test_raw_tensors_of_known_shape_are_summed_element_wise_in_the_same_pack():
    """Non-scalar raw values (e.g. a per-class loss vector) are summed over the workers too, as
    MultiWorkerMirroredStrategy sums them, in the one packed all-reduce; a value whose shape is
    known only at run time stays this worker's (its packing could differ per worker)."""
    model = tf_keras.Sequential([tf_keras.layers.Dense(1)])
    model.compile(loss="mse")
    model(tf.zeros([1, 2]))
    strategy = _RecordingStrategy()
    outputs = {"total_loss": tf.constant(1.5), "per_class": tf.constant([[1.0, 2.0], [3.0, 4.0]]),
               "ids": tf.constant([1, 2])}  # ints are not raw float values
    reduced = keras_outputs.reduce_step_outputs(model, strategy, outputs)
    assert len(strategy.reduced) == 1 and strategy.reduced[0].shape == (5,)
    assert float(reduced["total_loss"]) == 3.0
    np.testing.assert_array_equal(reduced["per_class"].numpy(), [[2.0, 4.0], [6.0, 8.0]])
    assert reduced["per_class"].dtype == tf.float32 and reduced["ids"] is outputs["ids"]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def step(per_example):
        return keras_outputs.reduce_step_outputs(model, strategy, {"total_loss": tf.constant(1.0),
                                                                   "per_example": per_example})
    result = step(tf.constant([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(result["per_example"].numpy(), [1.0, 2.0, 3.0])  # unchanged
    assert float(result["total_loss"]) == 2.0


def test_tf_keras_embedding_in_the_scope_warns_with_its_name_size_and_the_fix():
    strategy = tnp.NestPipeStrategy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedEmbeddingWarning)
        tf_keras.layers.Embedding(1000, 8, name="outside").build((None,))  # outside: no warning
        with strategy.scope():
            tnp.ShardedEmbedding(1000, 8, name="sharded").build((None,))  # no warning
    with strategy.scope():
        with pytest.warns(ReplicatedEmbeddingWarning,
                          match=r"'movie' \(1000 x 8 = 8000 parameters.*tnp.ShardedEmbedding"
                                r"\(1000, 8, name='movie'\)"):
            tf_keras.layers.Embedding(1000, 8, name="movie").build((None,))


def test_mixed_float16_is_refused_with_the_reason():
    strategy = tnp.NestPipeStrategy()
    with strategy.scope():
        tf_keras.layers.Dense(1).build((None, 2))  # float32: accepted
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="mixed_float16.*loss scaling.*float32"):
            tnp.NestPipeStrategy()
        with pytest.raises(ValueError, match="mixed_float16"):
            strategy.scope()
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    with strategy.scope():
        pass


def _retrieval_keys(run, negatives):
    keys = [k for k in run.files if k.startswith("retrieval_%s/" % negatives)]
    assert len(keys) == 4, keys  # two tables, the item tower's kernel and bias
    return keys


def test_tfrs_retrieval_with_global_in_batch_negatives_equals_one_process(surface):
    ref = surface["ref"]
    for rank in (0, 1):
        for key in _retrieval_keys(surface[rank], "global"):
            np.testing.assert_allclose(surface[rank][key], ref[key], atol=1e-6, err_msg=key)
        assert list(surface[rank]["retrieval_global_warnings"]) == [""]  # no warning


def test_tfrs_retrieval_with_local_negatives_differs_and_warns(surface):
    """The positive control of the test above, and the warning."""
    ref = surface["ref"]
    for rank in (0, 1):
        differences = [np.abs(surface[rank][k] - ref[k.replace("local", "global")]).max()
                       for k in _retrieval_keys(surface[rank], "local")]
        assert max(differences) > 1e-3, differences
        warned = [w for w in surface[rank]["retrieval_local_warnings"] if w]
        assert len(warned) == 1 and "tnp.global_in_batch_candidates" in warned[0], warned
        assert "on 2 workers" in warned[0]
    assert list(ref["retrieval_local_warnings"]) == [""]  # one process: nothing to warn about


def test_check_exactness_reports_dbp_equal_to_the_reference(surface):
    for rank in (0, 1):
        assert float(surface[rank]["exactness_dbp"]) <= 1e-6
        assert str(surface[rank]["exactness_dbp_pipeline_after"]) == "dbp"  # setting restored


def test_check_exactness_catches_stale_buffers_positive_control(surface):
    for rank in (0, 1):
        assert float(surface[rank]["exactness_dbp_nosync"]) > 1e-5


class _Subclassed(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.table = tnp.ShardedEmbedding(11, 3, name="ids")
        self.out = tf_keras.layers.Dense(1)

    def call(self, features):
        return self.out(tf.concat([self.table(features["ids"]), features["x"]], axis=1))


def test_export_infers_the_signature_of_a_subclassed_model_from_its_calls(tmp_path):
    strategy = tnp.NestPipeStrategy()
    with strategy.scope():
        model = _Subclassed()
    with pytest.raises(TypeError, match="no known inputs.*Call the model on a batch first"):
        tnp.export_saved_model(model, str(tmp_path / "never_called"))
    batch = {"ids": tf.constant([1, 5, 10], tf.int64), "x": tf.ones([3, 2])}
    expected = model(batch).numpy()
    tnp.export_saved_model(model, str(tmp_path / "export"))
    served = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    np.testing.assert_allclose(served(**batch)["outputs"].numpy(), expected, atol=1e-6)


def test_check_exactness_refuses_other_strategies():
    with pytest.raises(ValueError, match="needs a tnp.NestPipeStrategy"):
        tnp.check_exactness(lambda: None, lambda context: None, steps=1,
                            strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))


def test_mixed_bfloat16_with_row_sharded_tables_fits_as_one_process(surface):
    """mixed_bfloat16 with row-sharded tables trains on 2 workers as in one process: the
    float32 tables within bfloat16 rounding of their updates, the bfloat16 loss within one
    bfloat16 rounding of its reduction. TensorFlow's oneDNN bfloat16 matmuls (on by default on
    AVX-512 CPUs) round a worker's half batch differently from the whole one, so the dense
    gradients, and through them the tables' updates, agree to bfloat16's precision, not bitwise
    (with TF_ENABLE_ONEDNN_OPTS=0 the tables are equal within 1e-6)."""
    for rank in (0, 1):
        run = surface[rank]
        assert str(run["bf16/output_dtype"]) == "bfloat16"
        np.testing.assert_allclose(run["bf16/loss"], surface["ref"]["bf16/loss"], atol=4e-3)
        for table in ("table_a", "table_b"):
            assert run["bf16/" + table].dtype == np.float32
            expected = surface["ref"]["bf16/" + table]
            moved = np.abs(expected - surface["ref"]["bf16/initial/" + table]).max()
            # Two bfloat16 roundings (2 ** -8 each) of the largest update.
            np.testing.assert_allclose(run["bf16/" + table], expected, rtol=0,
                                       atol=2.0 ** -7 * moved)
            # Positive control: the fit moved the tables well beyond that tolerance.
            assert np.abs(run["bf16/" + table] - run["bf16/initial/" + table]).max() > 5e-3


def test_export_of_a_model_with_lookup_layers_serves_on_every_worker(surface):
    """StringLookup / IntegerLookup hash tables go into the export: it serves the model's
    predictions (unknown strings and ids included) and returns normally on every worker."""
    for rank in (0, 1):
        assert str(surface[rank]["string_export"]) == "ok", str(surface[rank]["string_export"])
    assert float(surface[0]["string_export/served_diff"]) < 1e-6


def test_an_export_that_fails_to_write_fails_on_every_worker(surface):
    assert "Error" in str(surface[0]["failed_export"])  # the writer's own error
    assert str(surface[1]["failed_export"]).startswith(
        "RuntimeError: export_saved_model: worker 0 failed to write the SavedModel")


def test_metrics_updated_inside_call_train_as_one_process(surface):
    """`self.add_metric(...)` and a metric's `update_state` inside call() (the route pass
    traces call(): its metric updates must neither run twice nor merge_call in a nested
    function): the loss and the batch-mean metric equal one process's. The max metric is a
    per-worker statistic (the mean of each worker's batch max, as under MultiWorkerMirrored)."""
    ref = surface["ref"]
    for rank in (0, 1):
        run = surface[rank]
        for key in ("loss", "mean_logit"):
            np.testing.assert_allclose(run["call_metrics/" + key], ref["call_metrics/" + key],
                                       rtol=1e-5, atol=1e-6, err_msg=key)
        assert "call_metrics/largest_logit" in run.files
    assert ref["call_metrics/mean_logit"][0] != ref["call_metrics/mean_logit"][1]  # it moved


def test_a_table_built_outside_the_scope_of_two_workers_is_refused(surface):
    for rank in (0, 1):
        message = str(surface[rank]["outside_scope"])
        assert "outside the scope of the 2-worker NestPipeStrategy" in message, message
        assert "inside `with strategy.scope():`" in message
    assert str(surface["ref"]["outside_scope"]) == "built"  # one process: an ordinary embedding


def test_get_and_set_weights_hold_whole_tables(surface):
    """get_weights() gives whole tables on every worker (as one process), set_weights() takes
    them: the copy predicts as the trained model; a table of another size is refused."""
    for run in (surface[0], surface[1], surface["ref"]):
        assert list(run["get_weights/shapes"]) == [VOCAB_A, VOCAB_B]
        np.testing.assert_allclose(run["set_weights/predict"], run["predict"], rtol=0, atol=1e-6)
        assert str(run["set_weights/wrong"]) != "no error"
    for rank in (0, 1):
        message = str(surface[rank]["set_weights/wrong"])
        assert "whole table, %d rows" % (VOCAB_A + 2) in message, message


def test_a_worker_loads_the_path_it_just_saved_to(surface):
    """A shared disk: every worker loads the chief's complete file right after the save. A
    disk of its own: the non-chief's load says why the file is not there (positive control:
    the chief loads its own)."""
    for rank in (0, 1):
        assert str(surface[rank]["load_after_save/shared"]) == "ok"
    assert str(surface[0]["load_after_save/own"]) == "ok"
    message = str(surface[1]["load_after_save/own"])
    assert message.startswith("FileNotFoundError") and "only the chief (worker 0) writes" in message


def test_a_loop_over_a_distributed_iterator_inside_a_tf_function_trains_as_one_process(surface):
    """TensorFlow's ctl_correctness pattern (next(iterator) inside a tf.function, a nested
    tf.function step, a synchronized batch norm) under the launcher's default thread split:
    with one inter-op thread per task it hung (MultiWorkerMirrored too); the launcher now gives
    every task at least two, and the run equals one process's."""
    ref = surface["ref"]
    keys = [k for k in ref.files if k.startswith("loop_in_function/") and "threads" not in k]
    assert len(keys) == 8, keys  # the first dense layer's kernel, the norm's 4, the second
    # dense layer's kernel and bias, the loss
    for rank in (0, 1):
        run = surface[rank]
        assert int(run["loop_in_function/inter_op_threads"]) >= 2
        for key in keys:
            np.testing.assert_allclose(run[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
