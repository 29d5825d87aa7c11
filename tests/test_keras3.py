"""Keras 3 (`import keras`, TensorFlow backend) under NestPipeStrategy: fit / evaluate / predict
on 2 and 3 workers equal to one process (placements, the fused exchange, pipelines none and
dbp, Keras files), and the refusals of what Keras 3 cannot do."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import PROGRAMS, background_fixture, launch, run_command, run_together

import keras  # noqa: E402  (Keras 3, beside the tf_keras the other tests use)
import keras_rs  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402
from tf_nestpipe import keras3 as tnpk  # noqa: E402
from tf_nestpipe import ops as nestpipe_ops, tf_private  # noqa: E402
from tf_nestpipe.keras3 import checks  # noqa: E402

# One launch per worker count, several runs each (see programs/keras3_fit.py); the first run of
# each launch also saves and loads the model's Keras files on every worker. One process trains
# each model once: its placement and pipeline are one worker's whatever the run asks.
RUNS = {1: ["none:rw", "none:front"], 2: ["none:rw", "dbp:mix", "none:front"], 3: ["none:mix"]}


def _reference(results, run):
    return results[(1, "none:front" if run.endswith(":front") else "none:rw")]


@background_fixture
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


# Serves the 3-worker run's `tnp.export_saved_model` and Keras 3 `model.export` with plain
# TensorFlow (tf_nestpipe never imported) and prints, for each, the largest difference to the
# predictions the model gave.
_SERVE = """
import sys
import numpy as np
import tensorflow as tf
inputs = dict(np.load(sys.argv[1] + ".export_check.npz"))
expected = inputs.pop("predictions")
for export in ("export", "keras_export"):
    served = tf.saved_model.load(sys.argv[1] + "." + export).signatures["serving_default"]
    (got,) = served(**{k: tf.constant(v) for k, v in inputs.items()}).values()
    got = got.numpy()
    print("SERVED", export, got.shape, float(np.max(np.abs(got - expected))))
assert "tf_nestpipe" not in sys.modules
"""


@pytest.mark.parametrize("workers,run", [(2, "none:rw"), (2, "dbp:mix"), (3, "none:mix"),
                                         (2, "none:front")])
def test_keras3_fit_on_several_workers_equals_one_process(keras3_results, workers, run):
    """50 steps of Keras 3 fit (Adam, a global AUC metric), then evaluate and predict: the whole
    tables, dense weights, history (global AUC, not a per-worker one), evaluation and every
    worker's predictions as one process's. "front": a subclassed model written for keras-rs
    (TableConfig / FeatureConfig, keras-rs's own `DistributedEmbedding` unchanged, and a
    `tnpk.DistributedEmbedding`), sharded because it is built in the strategy's scope."""
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
    # The front's three tables (keras-rs's layer: table_a, two features, and table_b; tnpk's:
    # table_c): one exchange per dim too.
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


@pytest.mark.parametrize("export", ["export", "keras_export"])
def test_keras3_export_of_three_workers_is_served_by_plain_tensorflow(keras3_results, export):
    """`tnp.export_saved_model` and Keras 3's own `model.export` of the 3-worker Keras 3 model
    (row-wise, table-wise and replicated tables) load and serve in a process that never imports
    tf_nestpipe, predicting what the model predicted."""
    served = keras3_results["served"]
    assert served.returncode == 0, served.stdout[-3000:]
    lines = [l for l in served.stdout.splitlines() if l.startswith("SERVED %s " % export)]
    assert len(lines) == 1, served.stdout[-3000:]
    assert lines[0].startswith("SERVED %s (24, 1) " % export), lines[0]
    assert float(lines[0].split()[-1]) < 1e-5, lines[0]


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


# keras-rs user code plus the strategy line only (tf_nestpipe.keras3 never imported by hand).
_STRATEGY_LINE_ONLY = """
import sys
import keras
import keras_rs
import tf_nestpipe as tnp
print("imported", "tf_nestpipe.keras3" in sys.modules)
strategy = tnp.NestPipeStrategy()
print("strategy", "tf_nestpipe.keras3" in sys.modules)
table = keras_rs.layers.TableConfig(name="t", vocabulary_size=10, embedding_dim=2)
features = {"f": keras_rs.layers.FeatureConfig(name="f", table=table, input_shape=(4, 3),
                                               output_shape=(4, 2))}
for where in ("outside", "inside"):
    if where == "inside":
        with strategy.scope():
            layer = keras_rs.layers.DistributedEmbedding(features)
    else:
        layer = keras_rs.layers.DistributedEmbedding(features)
    out = layer({"f": keras.ops.ones((4, 3), dtype="int32")})
    table = layer._default_device_embedding_layers["f"]
    print(where, type(table).__name__, type(table).__module__.split(".")[0],
          tuple(out["f"].shape))
"""


def test_keras_rs_code_needs_only_the_strategy_line():
    """keras-rs's `DistributedEmbedding` made in a NestPipeStrategy scope has sharded tables
    with no tf_nestpipe import but the strategy's (the strategy loads tf_nestpipe.keras3 when
    keras-rs is imported); outside the scope it keeps keras-rs's EmbedReduce tables."""
    result = subprocess.run([sys.executable, "-c", _STRATEGY_LINE_ONLY],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = [l for l in result.stdout.splitlines()
             if l.startswith(("imported", "strategy", "outside", "inside"))]
    assert lines == ["imported False", "strategy True", "outside EmbedReduce keras_rs (4, 2)",
                     "inside EmbedReduce tf_nestpipe (4, 2)"], result.stdout[-3000:]


def test_a_keras3_variable_in_the_scope_loads_the_keras3_support(monkeypatch):
    """A Keras 3 variable created in a NestPipeStrategy scope loads tf_nestpipe.keras3 (its
    hooks) when it is not loaded; one created outside any scope does not (positive control)."""
    from tf_nestpipe.strategy import keras_checks

    loads = []
    monkeypatch.delitem(sys.modules, "tf_nestpipe.keras3")
    monkeypatch.setattr(keras_checks, "_keras3_support", [lambda: loads.append(1)])
    keras.layers.Dense(2).build((None, 3))
    assert loads == []
    with tnp.NestPipeStrategy().scope():
        keras.layers.Dense(2).build((None, 3))
    assert loads and set(loads) == {1}


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


# --- keras-rs's DistributedEmbedding and tnpk.DistributedEmbedding, in one process -------------
def _rs_features(combiners=("sum", "mean", "sqrtn")):
    """keras-rs configs: one table per combiner, each looked up by a [batch, 3] feature, and the
    first table also by a [batch] feature (two features sharing a table)."""
    tables = [keras_rs.layers.TableConfig(name="t_%s" % c, vocabulary_size=11, embedding_dim=3,
                                          combiner=c, initializer="uniform") for c in combiners]
    features = {"f_%s" % t.combiner: keras_rs.layers.FeatureConfig(
        name="f_%s" % t.combiner, table=t, input_shape=(5, 3), output_shape=(5, 3))
        for t in tables}
    features["one"] = keras_rs.layers.FeatureConfig(name="one", table=tables[0],
                                                    input_shape=(5,), output_shape=(5, 3))
    return features


def _rs_inputs(features):
    rng = np.random.default_rng(1)
    ids = {k: rng.integers(0, 11, f.input_shape) for k, f in features.items()}
    weights = {k: rng.random(f.input_shape).astype(np.float32) for k, f in features.items()}
    return ids, weights


def _same_tables(source, layers):
    for layer in layers:
        layer.set_weights([source[layer.name]])


def test_keras_rs_layer_under_the_strategy_pools_as_keras_rs_and_is_untouched_outside():
    """keras-rs's DistributedEmbedding made in a NestPipeStrategy scope gets tnpk tables and,
    from the same tables, gives keras-rs's own outputs (EmbedReduce: sum / mean / sqrtn, with and
    without weights, [batch] and [batch, k] ids); so does tnpk.DistributedEmbedding.
    `get_embedding_tables` reads the tables."""
    features = _rs_features()
    ids, weights = _rs_inputs(features)
    keras.utils.set_random_seed(0)
    plain = keras_rs.layers.DistributedEmbedding(features)  # outside: keras-rs's own layer
    with tnp.NestPipeStrategy(pipeline="none").scope():
        ours = keras_rs.layers.DistributedEmbedding(features)
        front = tnpk.DistributedEmbedding(features)
    expected = [plain(ids), plain(ids, weights)]
    plain_tables = {k: np.asarray(v) for k, v in plain.get_embedding_tables().items()}
    assert {type(l) for l in plain._default_device_embedding_layers.values()} == {
        keras_rs.layers.EmbedReduce}
    ours(ids)  # builds its tables
    front(ids)
    ours_layers = set(ours._default_device_embedding_layers.values())
    assert {type(l) for l in ours_layers} == {tnpk.EmbedReduce}
    assert len(ours_layers) == 3  # "one" shares t_sum's table
    _same_tables(plain_tables, ours_layers)
    _same_tables(plain_tables, front.tables.values())
    for layer in (ours, front):
        for want, got in zip(expected, [layer(ids), layer(ids, weights)]):
            assert sorted(got) == sorted(want)
            for key in want:
                np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]),
                                           rtol=1e-6, atol=1e-6, err_msg=key)
        read = layer.get_embedding_tables()
        assert sorted(read) == sorted(plain_tables)
        for name, table in read.items():
            np.testing.assert_array_equal(np.asarray(table), plain_tables[name])


def test_keras_rs_layer_ragged_ids_pool_as_dense_ones():
    """Ragged [batch, None] ids pool as the dense ids of the same rows (mean)."""
    features = _rs_features(("mean",))
    del features["one"]
    with tnp.NestPipeStrategy(pipeline="none").scope():
        layer = keras_rs.layers.DistributedEmbedding(features)
    dense = np.array([[1, 2, 3], [4, 5, 6]])
    ragged = tf.RaggedTensor.from_row_lengths([1, 2, 3, 4, 5, 6, 7], [3, 4])
    got = layer({"f_mean": ragged})["f_mean"].numpy()
    want = layer({"f_mean": dense})["f_mean"].numpy()
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)
    table = layer.get_embedding_tables()["t_mean"].numpy()
    np.testing.assert_allclose(got[1], table[[4, 5, 6, 7]].mean(axis=0), atol=1e-6)


def test_keras_rs_sparsecore_tables_are_sharded_by_the_strategy_with_a_warning():
    """keras-rs's TPU-style model (tables with placement="sparsecore" and a per-table optimizer,
    a subclassed ranking model, `compile(optimizer="adagrad")`) made and fitted under the
    strategy: the tables are tnpk tables, a warning says that the per-table optimizer is not
    used, and it trains. Outside the scope keras-rs refuses "sparsecore" itself (untouched);
    tf.tpu.experimental.embedding configs are refused under the strategy, naming the fix."""
    tables = {name: keras_rs.layers.TableConfig(name=name, vocabulary_size=30, embedding_dim=4,
                                                optimizer="adam", placement="sparsecore")
              for name in ("movie_table", "user_table")}
    features = {key: keras_rs.layers.FeatureConfig(name=key, table=tables[key + "_table"],
                                                   input_shape=(8,), output_shape=(8, 4))
                for key in ("movie", "user")}

    class Ranking(keras.Model):
        def __init__(self):
            super().__init__()
            self.embedding = keras_rs.layers.DistributedEmbedding(feature_configs=features)
            self.tower = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                           keras.layers.Dense(1)])

        def call(self, x):
            out = self.embedding(x)
            return self.tower(keras.ops.concatenate([out["user"], out["movie"]], axis=1))

    with pytest.raises(ValueError, match="not running under a TPU strategy"):
        keras_rs.layers.DistributedEmbedding(features)  # keras-rs's own refusal off TPU
    with tnp.NestPipeStrategy(pipeline="none").scope():
        with pytest.warns(UserWarning, match="movie_table.*placement='sparsecore'.*compile"):
            model = Ranking()
        model.compile(loss="mse", optimizer="adagrad")
    rng = np.random.default_rng(0)
    x = {k: rng.integers(0, 30, (16,)).astype(np.int32) for k in features}
    history = model.fit(x, rng.random((16, 1)).astype(np.float32), batch_size=8, epochs=2,
                        verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert {type(l) for l in model.embedding._default_device_embedding_layers.values()} == {
        tnpk.EmbedReduce}
    tpu_table = tf.tpu.experimental.embedding.TableConfig(vocabulary_size=10, dim=2, name="t")
    tpu_features = {"f": tf.tpu.experimental.embedding.FeatureConfig(table=tpu_table, name="f")}
    with tnp.NestPipeStrategy().scope():
        with pytest.raises(ValueError, match="tf.tpu.experimental.embedding.*keras_rs.layers"
                                             r".*NestPipeStrategy\(placement=\.\.\.\)"):
            keras_rs.layers.DistributedEmbedding(tpu_features)


def test_two_different_tables_of_one_name_are_refused():
    a = keras_rs.layers.TableConfig(name="t", vocabulary_size=10, embedding_dim=2)
    b = keras_rs.layers.TableConfig(name="t", vocabulary_size=12, embedding_dim=2)
    features = {k: keras_rs.layers.FeatureConfig(name=k, table=t, input_shape=(4,),
                                                 output_shape=(4, 2))
                for k, t in (("x", a), ("y", b))}
    with tnp.NestPipeStrategy().scope():
        for make in (keras_rs.layers.DistributedEmbedding, tnpk.DistributedEmbedding):
            with pytest.raises(ValueError, match="two different tables are named 't'"):
                make(features)
        features["y"].table = a  # positive control: one table shared
        tnpk.DistributedEmbedding(features)


def _front_model(strategy, layer_class):
    keras.utils.set_random_seed(5)
    features = _rs_features(("sum", "sqrtn"))
    with strategy.scope():
        inputs = {k: keras.Input(f.input_shape[1:], dtype="int64", name=k)
                  for k, f in features.items()}
        out = layer_class(features)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(
            keras.layers.Concatenate()([out[k] for k in sorted(out)])))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model, _rs_inputs(features)[0]


@pytest.mark.parametrize("layer_class", ["tnpk", "keras_rs"])
def test_distributed_embedding_model_round_trips_through_a_keras_file(tmp_path, layer_class):
    """`model.save(".keras")` + `keras.models.load_model` (no custom_objects) of a model with
    tnpk.DistributedEmbedding, or keras-rs's made under the strategy: the same predictions and
    configs. keras-rs's file loads outside the strategy too (keras-rs's own tables, the same
    predictions), and a file keras-rs wrote without the strategy loads under it (tnpk tables)."""
    make = tnpk.DistributedEmbedding if layer_class == "tnpk" else (
        keras_rs.layers.DistributedEmbedding)
    strategy = tnp.NestPipeStrategy(pipeline="none")
    model, ids = _front_model(strategy, make)
    model.fit(ids, np.ones((5, 1), np.float32), batch_size=5, verbose=0)
    want = model.predict(ids, verbose=0)
    model.save(tmp_path / "m.keras")
    with strategy.scope():
        loaded = keras.models.load_model(tmp_path / "m.keras")
    (layer,) = [l for l in loaded.layers if isinstance(l, make)]
    assert type(layer) is make
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), want, atol=1e-6)
    config = layer.get_config()
    features = config["feature_configs"]
    assert len(config["tables"]) == 2 and features["one"]["table"] == features["f_sum"]["table"]
    if layer_class == "keras_rs":
        plain = keras.models.load_model(tmp_path / "m.keras")  # outside: keras-rs's tables
        (plain_layer,) = [l for l in plain.layers if isinstance(l, make)]
        assert {type(l) for l in plain_layer._default_device_embedding_layers.values()} == {
            keras_rs.layers.EmbedReduce}
        np.testing.assert_allclose(plain.predict(ids, verbose=0), want, atol=1e-6)
        plain.save(tmp_path / "plain.keras")
        with strategy.scope():
            again = keras.models.load_model(tmp_path / "plain.keras")
        np.testing.assert_allclose(again.predict(ids, verbose=0), want, atol=1e-6)


def test_tnpk_distributed_embedding_config_needs_keras_rs_configs():
    """Configs without `get_config` (duck-typed, not keras-rs's) cannot go in a .keras config:
    refused naming keras-rs's classes and save_weights; keras-rs's configs serialize."""
    class Table:
        name, vocabulary_size, embedding_dim, initializer, combiner = "t", 5, 2, "uniform", "sum"

    class Feature:
        name, table, input_shape, output_shape = "f", Table(), (3,), (3, 2)

    with tnp.NestPipeStrategy().scope():
        layer = tnpk.DistributedEmbedding({"f": Feature()})
    with pytest.raises(TypeError, match="keras_rs.layers.FeatureConfig.*save_weights"):
        layer.get_config()
    with tnp.NestPipeStrategy().scope():
        layer = tnpk.DistributedEmbedding(_rs_features(("sum",)))
    again = tnpk.DistributedEmbedding.from_config(layer.get_config())
    assert sorted(again.tables) == ["t_sum"]


# --- Keras 3's own export ------------------------------------------------------------------------
def test_keras3_model_export_serves_and_other_formats_are_refused(tmp_path):
    """`model.export(path)` (Keras 3's) of a model with a tnpk table: a SavedModel without
    tf_nestpipe ops that predicts as the model; formats other than tf_saved_model are refused
    naming what to use; an ExportArchive endpoint traced before `write_out` with tf_nestpipe's
    ops is refused, an endpoint given an input_signature (traced by write_out) is served."""
    model = _model(tnp.NestPipeStrategy(pipeline="none"))
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0)
    want = model.predict(x, verbose=0)
    model.export(str(tmp_path / "e"), verbose=False)
    assert not any(t.startswith("Nestpipe")
                   for t in tf_private.saved_model_op_types(str(tmp_path / "e")))
    served = tf.saved_model.load(str(tmp_path / "e"))
    np.testing.assert_allclose(served.serve(tf.constant(x)).numpy(), want, atol=1e-6)
    with pytest.raises(ValueError, match="format='onnx'.*tf_saved_model.*tnp.export_saved_model"):
        model.export(str(tmp_path / "o"), format="onnx")
    # An endpoint traced before write_out with one of tf_nestpipe's ops (as a lookup traced
    # under several workers has): its SavedModel is refused.
    traced = tf.function(lambda ids: model(nestpipe_ops.check_ids(ids, 20, "t")))
    traced(tf.constant(x))
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", traced)
    with pytest.raises(ValueError, match="needs tf_nestpipe to load.*NestpipeCheckIds.*"
                                         "input_signature"):
        archive.write_out(str(tmp_path / "pre"), verbose=False)
    archive = keras.export.ExportArchive()  # positive control: write_out traces the endpoint
    archive.track(model)
    archive.add_endpoint("serve", model.__call__,
                         input_signature=[tf.TensorSpec([None, 2], tf.int64)])
    archive.write_out(str(tmp_path / "sig"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "sig"))
    np.testing.assert_allclose(served.serve(tf.constant(x)).numpy(), want, atol=1e-6)
