"""Keras 3 (`import keras`, TensorFlow backend) under NestPipeStrategy: fit / evaluate / predict
on 2 and 3 workers equal to one process (placements, the fused exchange, pipelines none and
dbp, Keras files), and the refusals of what Keras 3 cannot do."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import PROGRAMS, launch, run_command, run_together

import keras  # noqa: E402  (Keras 3, beside the tf_keras the other tests use)
import tensorflow as tf  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe import keras3 as tnpk  # noqa: E402
from tf_nestpipe.keras3 import checks  # noqa: E402

# One launch per worker count, several runs each (see programs/keras3_fit.py); the first run of
# each launch also saves and loads the model's Keras files on every worker. One process trains
# each model once: its placement and pipeline are one worker's whatever the run asks.
RUNS = {1: ["none:rw", "none:front"], 2: ["none:rw", "dbp:mix", "none:front"], 3: ["none:mix"]}


def _reference(results, run):
    return results[(1, "none:front" if run.endswith(":front") else "none:rw")]


@pytest.fixture(scope="session")
def keras3_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras3")
    program = os.path.join(PROGRAMS, "keras3_fit.py")
    single, two, three = run_together(
        (run_command, [sys.executable, program, str(out / "one")] + RUNS[1]),
        (launch, 2, [program, str(out / "two")] + RUNS[2]),
        (launch, 3, [program, str(out / "three")] + RUNS[3]))
    for result in (single, two, three):
        assert result.returncode == 0, result.stdout[-6000:]
    results = {(workers, run): np.load(out / ("%s.%s.npz" % (prefix, run.replace(":", "."))))
               for workers, prefix in ((1, "one"), (2, "two"), (3, "three"))
               for run in RUNS[workers]}
    results["served"] = run_command([sys.executable, "-c", _SERVE, str(out / "three.none:mix")],
                                    fresh=True, timeout=120)
    return results


# Serves the 3-worker run's `tnp.export_saved_model` with plain TensorFlow (tf_nestpipe never
# imported) and prints the largest difference to the predictions the model gave.
_SERVE = """
import sys
import numpy as np
import tensorflow as tf
inputs = dict(np.load(sys.argv[1] + ".export_check.npz"))
expected = inputs.pop("predictions")
served = tf.saved_model.load(sys.argv[1] + ".export").signatures["serving_default"]
got = served(**{k: tf.constant(v) for k, v in inputs.items()})["outputs"].numpy()
assert "tf_nestpipe" not in sys.modules
print("SERVED", got.shape, float(np.max(np.abs(got - expected))))
"""


@pytest.mark.parametrize("workers,run", [(2, "none:rw"), (2, "dbp:mix"), (3, "none:mix"),
                                         (2, "none:front")])
def test_keras3_fit_on_several_workers_equals_one_process(keras3_results, workers, run):
    """50 steps of Keras 3 fit (Adam, a global AUC metric), then evaluate and predict: the whole
    tables, dense weights, history (global AUC, not a per-worker one), evaluation and every
    worker's predictions as one process's. "front": the tables of a `tnpk.DistributedEmbedding`
    configured with keras-rs's TableConfig / FeatureConfig in a subclassed model."""
    single, multi = _reference(keras3_results, run), keras3_results[(workers, run)]
    keys = [k for k in single.files if k.startswith(("table/", "dense/", "history/", "eval/"))]
    assert len([k for k in keys if k.startswith("table/")]) == 3
    assert len([k for k in keys if k.startswith("dense/")]) == 4
    for key in keys + ["predictions"]:
        np.testing.assert_allclose(multi[key], single[key], rtol=0, atol=1e-5, err_msg=key)
    assert single["predictions"].shape == (48, 1)
    assert single["history/loss"][1] < single["history/loss"][0]  # it trained
    assert 0.0 < float(single["eval/auc"]) < 1.0


def test_keras3_tables_are_placed_and_fused(keras3_results):
    """Placement as asked (row_wise, table_wise, data_parallel) and one exchange per group of
    tables of a dim per step: 2 for the three row-wise tables (dims 8, 8, 4), 1 when the dim-4
    table is replicated (the table-wise one rides in the row-wise one's exchange)."""
    rw, mix, mix3 = (keras3_results[(2, "none:rw")], keras3_results[(2, "dbp:mix")],
                     keras3_results[(3, "none:mix")])
    assert {str(rw["placement/table_%s" % t]) for t in "abc"} == {"row_wise"}
    for run in (mix, mix3):
        assert [str(run["placement/table_%s" % t]) for t in "abc"] == [
            "row_wise", "table_wise", "data_parallel"]
    assert int(rw["exchanges"]) == 2 and int(mix["exchanges"]) == 1 and int(mix3["exchanges"]) == 1
    # The front's three tables (two features on table_a): one exchange per dim too.
    front = keras3_results[(2, "none:front")]
    assert {str(front["placement/table_%s" % t]) for t in "abc"} == {"row_wise"}
    assert int(front["exchanges"]) == 2
    assert "exchanges" not in keras3_results[(1, "none:rw")].files  # one process: no exchange


def test_keras3_files_hold_whole_tables_on_every_worker(keras3_results):
    """`model.save(".keras")` + `keras.models.load_model` (no custom_objects) and
    `save_weights` / `load_weights` on 2 and 3 workers: same whole tables and predictions
    (checked inside the program on every worker; a failure fails the launch)."""
    assert int(keras3_results[(2, "none:rw")]["saving_ok"]) == 1
    assert int(keras3_results[(3, "none:mix")]["saving_ok"]) == 1


def test_keras3_export_of_three_workers_is_served_by_plain_tensorflow(keras3_results):
    """`tnp.export_saved_model` of the 3-worker Keras 3 model (row-wise, table-wise and
    replicated tables) loads and serves in a process that never imports tf_nestpipe,
    predicting what the model predicted."""
    served = keras3_results["served"]
    assert served.returncode == 0, served.stdout[-3000:]
    line = [l for l in served.stdout.splitlines() if l.startswith("SERVED")][-1]
    assert line.startswith("SERVED (24, 1) ") and float(line.split()[-1]) < 1e-5, line


# --- in-process: one worker ---------------------------------------------------------------------
def _model(strategy, vocab=20):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        ids = keras.Input((2,), dtype="int64", name="ids")
        out = keras.layers.Dense(1)(tnpk.ShardedEmbedding(vocab, 4, combiner="sum",
                                                          name="t")(ids))
        model = keras.Model(ids, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data(n=16, vocab=20):
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, (n, 2)), rng.normal(size=(n, 1)).astype(np.float32)


@pytest.mark.parametrize("pipeline", ["fwp", "nested"])
def test_keras3_micro_batching_pipelines_are_refused_naming_what_to_use(pipeline):
    strategy = tnp.NestPipeStrategy(pipeline=pipeline)
    model = _model(strategy)
    with pytest.raises(ValueError, match="pipeline='%s'.*Keras 3.*'none'.*'dbp'.*tf_keras" % pipeline):
        model.fit(*_data(), batch_size=8, verbose=0)
    strategy.pipeline = "none"  # positive control: the same model trains
    model.fit(*_data(), batch_size=8, verbose=0)


def test_keras3_under_a_parameter_server_strategy_is_refused_naming_tf_keras(monkeypatch):
    # A ParameterServerStrategy needs a ps cluster; the check reads only its type.
    ps = object.__new__(tnp.ParameterServerStrategy)
    with pytest.raises(ValueError, match="no parameter-server training.*tf_keras.*NestPipeStrategy"):
        checks.refuse_parameter_server(ps, "Keras 3 fit")
    monkeypatch.setattr(tf.distribute, "get_strategy", lambda: ps)
    with pytest.raises(ValueError, match="tnpk.ShardedEmbedding: Keras 3 has no parameter-server"):
        tnpk.ShardedEmbedding(10, 2)
    monkeypatch.undo()
    checks.refuse_parameter_server(tnp.NestPipeStrategy(), "Keras 3 fit")  # positive control
    tnpk.ShardedEmbedding(10, 2)


def test_keras3_mixed_float16_is_refused():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="mixed_float16.*keras.config.set_dtype_policy"):
            tnp.NestPipeStrategy()
    finally:
        keras.config.set_dtype_policy("float32")
    tnp.NestPipeStrategy()


def test_keras3_model_file_loads_without_custom_objects_and_outside_the_strategy(tmp_path):
    strategy = tnp.NestPipeStrategy(pipeline="none")
    model = _model(strategy)
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.get_layer("t")) is tnpk.ShardedEmbedding
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-6)
    config = loaded.get_layer("t").get_config()
    assert (config["vocab_size"], config["dim"], config["combiner"]) == (20, 4, "sum")


_WITHOUT_KERAS3_MODULE = """
import keras
import tf_nestpipe as tnp
strategy = tnp.NestPipeStrategy()
for attempt in ("without", "with"):
    if attempt == "with":
        from tf_nestpipe import keras3
    with strategy.scope():
        try:
            keras.layers.Dense(2).build((None, 3))
            print(attempt, "accepted")
        except RuntimeError as e:
            print(attempt, "refused:", e)
"""


def test_keras3_variables_need_the_keras3_module():
    """A Keras 3 variable in the scope without `tf_nestpipe.keras3` (its hooks) is refused
    naming the import; with it, accepted."""
    result = subprocess.run([sys.executable, "-c", _WITHOUT_KERAS3_MODULE],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = [l for l in result.stdout.splitlines() if l.startswith(("with", "without"))]
    assert len(lines) == 2, result.stdout[-3000:]
    assert lines[0].startswith("without refused:") and "from tf_nestpipe import keras3" in lines[0]
    assert lines[1] == "with accepted"


def test_keras3_adagrad_sparse_update_equals_the_dense_one():
    """Keras 3's Adagrad on a table's IndexedSlices gradient (duplicate ids included) updates
    only the touched rows, to the values its dense update gives (positive control: the dense
    gradient through Keras 3's own arithmetic)."""
    rng = np.random.default_rng(0)
    init = rng.normal(size=(10, 3)).astype(np.float32)
    values = rng.normal(size=(4, 3)).astype(np.float32)
    indices = tf.constant([2, 7, 2, 5])
    results = []
    for sparse in (True, False):
        variable = keras.Variable(init)
        optimizer = keras.optimizers.Adagrad(0.1)
        optimizer.build([variable])
        for _ in range(3):
            grad = tf.IndexedSlices(tf.constant(values), indices, tf.constant([10, 3]))
            optimizer.apply_gradients([(grad if sparse else tf.convert_to_tensor(grad), variable)])
        results.append((variable.numpy(), optimizer.variables[-1].numpy()))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=0, atol=1e-7)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=0, atol=1e-7)
    untouched = [0, 1, 3, 4, 6, 8, 9]
    np.testing.assert_array_equal(results[0][0][untouched], init[untouched])
    assert not np.allclose(results[0][0][[2, 5, 7]], init[[2, 5, 7]])
