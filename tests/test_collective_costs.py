"""The placement planner's collective costs ship with the package (defaults as package data),
a calibration in the user cache is preferred and named, and the package never reads bench/."""
import ast
import glob
import json
import os
import sys

import pytest

from conftest import REPO, run_command
from tf_nestpipe.plan import collective_costs as cc
from tf_nestpipe.plan import placement as pl
from tf_nestpipe.plan import __main__ as cli

PACKAGE = os.path.join(REPO, "tf_nestpipe")
BENCH = os.path.join(REPO, "bench")
SWEEPS = {"all_to_all": [[1024, 0.5], [1 << 20, 2.5]], "all_reduce": [[4096, 0.4], [1 << 20, 4.4]]}


def test_defaults_ship_with_the_package_and_say_so(tmp_path):
    costs = cc.for_transport("sockets", path=str(tmp_path / "absent.json"))
    assert "package's defaults" in costs.source and "calibrate" in costs.source
    assert set(costs.collectives) == {"all_to_all", "all_reduce"}
    assert cc.for_transport("horovod", path=str(tmp_path / "absent.json")) == \
        cc.for_transport("tf", path=str(tmp_path / "absent.json"))
    assert os.path.dirname(cc.DEFAULTS_PATH) == os.path.join(PACKAGE, "plan")


def test_a_calibration_wins_for_its_transport_only(tmp_path):
    path = str(tmp_path / "costs.json")
    assert cc.record_calibration("sockets", 2, SWEEPS, "a test", path) == path
    mesh = cc.for_transport("sockets", path=path)
    assert mesh.source.startswith("calibrated on this cluster (W=2") and path in mesh.source
    # The measured line wins at its worker count: it passes through both sweep points.
    params = mesh.collectives["all_to_all"]
    for nbytes, ms in SWEEPS["all_to_all"]:
        assert cc.collective_ms("all_to_all", params, 2, nbytes) == pytest.approx(ms)
    assert "package's defaults" in cc.for_transport("tf", path=path).source


def test_a_second_worker_count_is_kept_and_the_formula_refitted(tmp_path):
    path = str(tmp_path / "costs.json")
    cc.record_calibration("tf", 2, SWEEPS, "a test", path)
    four = {kind: [[b, 3 * ms] for b, ms in points] for kind, points in SWEEPS.items()}
    cc.record_calibration("horovod", 4, four, "a test", path)  # Horovod's count as TF's
    entry = json.load(open(path))["transports"]["tf"]["all_to_all"]
    assert sorted(entry["per_workers"]) == ["2", "4"] and entry["alpha_step_ms"] > 0
    source = cc.for_transport("tf", path=path).source
    assert "W=2, W=4" in source


@pytest.mark.parametrize("workers, sweeps, message", [
    (1, SWEEPS, "2 or more workers"),
    (2, {"all_to_all": [[1024, 0.5]], "all_reduce": SWEEPS["all_reduce"]}, "two or more sizes"),
])
def test_a_calibration_that_cannot_fit_is_refused(tmp_path, workers, sweeps, message):
    with pytest.raises(ValueError, match=message):
        cc.record_calibration("tf", workers, sweeps, "a test", str(tmp_path / "c.json"))
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("content", ["{not json", json.dumps({"schema": "other"}),
                                     json.dumps({"schema": cc.SCHEMA,
                                                 "transports": {"tf": {"all_to_all": {}}}})])
def test_a_damaged_calibration_is_refused_naming_the_file_and_the_fix(tmp_path, content):
    path = tmp_path / "costs.json"
    path.write_text(content)
    with pytest.raises(cc.CostsFileError, match="%s.*(delete it or rerun `python -m "
                                                "tf_nestpipe.plan calibrate`)" % path):
        cc.for_transport("tf", path=str(path))
    with pytest.raises(cc.CostsFileError):  # never overwritten either
        cc.record_calibration("tf", 2, SWEEPS, "a test", str(path))


def test_the_printed_plan_names_its_costs(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "costs.json")
    monkeypatch.setenv("TF_NESTPIPE_PLAN_COSTS", path)
    assert cli.main(["placement", "--table", "big:2000000:16", "--transport", "tf"]) == 0
    assert "costs: the package's defaults" in capsys.readouterr().out
    cc.record_calibration("tf", 2, SWEEPS, "a test", path)
    assert cli.main(["placement", "--table", "big:2000000:16", "--transport", "tf"]) == 0
    assert "costs: calibrated on this cluster (W=2" in capsys.readouterr().out
    planner = pl.Planner("auto", 2, transport="tf")
    assert planner.costs_source.startswith("calibrated") and planner.collectives
    assert pl.Planner("auto", 2, collectives=planner.collectives).costs_source == "configured"


def _literal_paths(path):
    """The string constants of a module (docstrings aside) that name bench/."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings
            and (node.value in ("bench", "results") or node.value.startswith("bench/"))}


def test_no_module_of_the_package_names_a_path_in_bench():
    named = {os.path.relpath(p, REPO): _literal_paths(p)
             for p in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)}
    assert {p: found for p, found in named.items() if found} == {}


def test_the_bench_path_check_sees_one(tmp_path):
    """Positive control of the static check."""
    module = tmp_path / "m.py"
    module.write_text('"""Reads bench/x."""\nimport os\n'
                      'P = os.path.join("bench", "results", "plan_costs.json")\n')
    assert _literal_paths(str(module)) == {"bench", "results"}


_OPENED = {"on": False, "paths": []}


def _audit(event, args, opened=_OPENED, abspath=os.path.abspath):
    # Bound as defaults: the hook outlives the module's globals at interpreter exit.
    if opened["on"] and event == "open" and isinstance(args[0], str):
        opened["paths"].append(abspath(args[0]))


sys.addaudithook(_audit)  # gated by _OPENED["on"]: costs nothing outside the tests below


def _opened_during(action):
    _OPENED["paths"].clear()
    _OPENED["on"] = True
    try:
        action()
    finally:
        _OPENED["on"] = False
    return list(_OPENED["paths"])


def test_planning_never_opens_a_file_in_bench():
    """The strategy's planning (its costs, a model's tables, the printed plan) opens the
    package's own costs and never a file in bench/."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import tf_nestpipe as tnp  # pylint: disable=import-outside-toplevel

    def plan():
        strategy = tnp.NestPipeStrategy(pipeline="none")
        with strategy.scope():
            layer = tnp.ShardedEmbedding(1000, 4, name="costs_probe")
            layer(tf.constant([1, 2]))
        for transport in ("tf", "sockets", "horovod"):
            pl.render_plan(pl.plan_tables([pl.TableSpec("t", 10 ** 6, 16)], 4,
                                          transport=transport), 4, transport,
                           pl.costs_source(transport))
        return strategy.placement_plan()

    opened = _opened_during(plan)
    assert cc.DEFAULTS_PATH in opened
    assert [p for p in opened if p.startswith(BENCH + os.sep)] == []


def test_the_open_check_sees_a_file_in_bench():
    """Positive control: reading the old costs file in bench/ is seen."""
    costs = os.path.join(BENCH, "results", "plan_costs.json")
    opened = _opened_during(lambda: open(costs).close())
    assert costs in opened


def test_calibrate_measures_a_local_cluster_into_the_file_it_names(tmp_path):
    """`python -m tf_nestpipe.plan calibrate` end to end on 2 local workers (1 round)."""
    path = tmp_path / "costs.json"
    result = run_command([sys.executable, "-m", "tf_nestpipe.plan", "calibrate", "--workers",
                          "2", "--rounds", "1", "--output", str(path)], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "collective costs of 2 workers written to %s" % path in result.stdout
    costs = cc.for_transport("sockets", path=str(path))
    assert costs.source.startswith("calibrated on this cluster (W=2")
    entry = json.load(open(path))["transports"]["sockets"]
    assert [len(entry[k]["per_workers"]["2"]["points"]) for k in cc.KINDS] == [4, 3]
