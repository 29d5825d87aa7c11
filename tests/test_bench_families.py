"""The benchmark families (bench/families.py) and their one runner (bench/run.py): every family
names a script that exists and arguments that script accepts, results go to
bench/results/<family>.*, and the README's performance table is the natural family's file."""
import json
import os
import re
import sys

import pytest

from conftest import REPO

BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, BENCH)
import compare  # noqa: E402  pylint: disable=wrong-import-position
import families  # noqa: E402  pylint: disable=wrong-import-position
import family_report  # noqa: E402  pylint: disable=wrong-import-position
import run  # noqa: E402  pylint: disable=wrong-import-position
import step_stages  # noqa: E402  pylint: disable=wrong-import-position
from tf_nestpipe.collectives import sockets  # noqa: E402  pylint: disable=wrong-import-position


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_every_family_runs_an_existing_script_into_its_own_file(name):
    family = families.FAMILIES[name]
    assert os.path.exists(os.path.join(BENCH, family.script)), family.script
    argv = run.command(name)
    assert os.path.join("bench", family.script) in argv
    if family.cell is not None:  # compare.py accepts the cell as given
        args = compare.parse_args(family.argv(name))
        assert args.output == name
        assert args.systems == list(family.cell.systems)
    elif family.output_flag:
        assert argv[-2:] == [family.output_flag, name]


@pytest.mark.parametrize("name", sorted(n for n, f in families.FAMILIES.items() if f.cells))
def test_every_cell_of_a_family_of_cells_is_a_compare_run_into_its_own_file(name):
    family = families.FAMILIES[name]
    names = [c for c, _ in family.cells]
    assert len(set(names)) == len(names) and set(family.quick) <= set(names)
    for cell, argv in run.cell_commands(name):
        args = compare.parse_args(argv[2:])
        assert args.output == family_report.cell_output(name, cell)
        assert args.systems == list(dict(family.cells)[cell].systems)
    assert [c for c, _ in run.cell_commands(name, quick=True)] == list(family.quick)
    with pytest.raises(KeyError, match="has no cell nope; its cells are"):
        run.cell_commands(name, cells=["nope"])


def test_the_bandwidth_family_spans_the_declared_factors():
    cells = [c for _, c in families.FAMILIES["bandwidth_family"].cells]
    assert {c.synthetic_tables.split(":")[0] for c in cells} == {"8", "26"}
    assert {c.dim for c in cells} == {32, 64, 128}
    assert {c.zipf for c in cells} == {1.05, 1.2}
    assert {c.global_batch for c in cells} == {2048, 4096, 8192}
    assert {n.split(":")[1] for c in cells for n in c.networks} == {"200mbit", "1gbit",
                                                                      "2500mbit"}
    assert {n.split(":")[0] for c in cells for n in c.networks} == {"0ms", "1ms"}
    assert {w for c in cells for w in c.workers} == {2, 4}
    for cell in cells:
        assert {"compute_only", "nestpipe:none:sockets", "nestpipe:auto:sockets",
                "torchrec", "torchrec_pipelined"} <= set(cell.systems)
        assert cell.profile_steps > 0


def _torchrec_installed(monkeypatch, installed):
    """Makes compare see torchrec installed or not, whatever this machine has (CI installs
    only requirements.txt)."""
    real = compare.importlib.util.find_spec
    monkeypatch.setattr(compare.importlib.util, "find_spec", lambda name, *rest: (
        (object() if installed else None) if name == "torchrec" else real(name, *rest)))


def test_torchrec_rows_run_its_worker_on_per_table_cells_only(monkeypatch):
    _torchrec_installed(monkeypatch, True)
    args = compare.parse_args(families.FAMILIES["bandwidth_family"].cells[0][1].argv("x"))
    row = compare.make_row("torchrec_pipelined", "-", "gloo", "dlrm", "synthetic", "0ms:1gbit", 2)
    argv = compare.worker_argv(row, args)
    assert argv[2].endswith("torchrec_worker.py") and "sparse_dist" in argv
    assert argv[argv.index("--synthetic-tables") + 1] == "8:200000"
    fused = compare.parse_args(families.FAMILIES["bandwidth"].argv("x"))
    with pytest.raises(compare.NotRun, match="synthetic-tables COUNT:ROWS only"):
        compare.worker_argv(row, fused)


def test_a_torchrec_row_without_torchrec_is_not_run_naming_the_install(monkeypatch):
    _torchrec_installed(monkeypatch, False)
    args = compare.parse_args(families.FAMILIES["bandwidth_family"].cells[0][1].argv("x"))
    row = compare.make_row("torchrec", "-", "gloo", "dlrm", "synthetic", "0ms:1gbit", 2)
    with pytest.raises(compare.NotRun, match="pip install -r bench/requirements.txt"):
        compare.worker_argv(row, args)


class _Event:
    def __init__(self, name, op_type, start_us, end_us):
        self.name, self.op_type, self.start_us, self.end_us = name, op_type, start_us, end_us


def test_a_gap_is_charged_to_the_exchange_the_op_ending_it_consumes():
    events = [_Event("NestpipeRouteKeys", "NestpipeRouteKeys", 0, 100),
              _Event("NestpipeReadTableRows", "NestpipeReadTableRows", 400, 500),
              _Event("NestpipeGatherFromBlocks", "NestpipeGatherFromBlocks", 1500, 1600),
              _Event("model/dense/MatMul", "MatMul", 1600, 2600),
              _Event("gradient_tape/model/dense/MatMul", "MatMul", 2600, 3600),
              _Event("NestpipeSegmentSum_1", "NestpipeSegmentSum", 5600, 5700),
              _Event("Adagrad/update/ResourceApplyAdagradV2", "ResourceApplyAdagradV2",
                     6700, 7000)]
    out = step_stages.step_breakdown(events, (0, 7000))
    assert out["wait_ms"] == {"keys_exchange": 0.3, "rows_exchange": 1.0,
                              "gradient_exchange": 2.0, "dense_allreduce": 1.0, "other": 0.0}
    assert out["stage_ms"]["route"] == 0.1 and out["stage_ms"]["rows"] == 0.2
    assert out["stage_ms"]["dense_forward"] == 1.0 and out["stage_ms"]["dense_backward"] == 1.0
    assert out["stage_ms"]["embedding_backward"] == 0.1 and out["stage_ms"]["optimizer"] == 0.3
    # Positive control: without the gaps there is nothing to charge.
    packed = step_stages.step_breakdown([_Event("a/b", "MatMul", 0, 7000)], (0, 7000))
    assert packed["waiting_ms"] == 0.0


def test_a_gap_ending_at_the_socket_meshs_dense_sum_is_the_dense_all_reduce():
    def waits(name):
        events = [_Event("NestpipeSegmentSum_4", "NestpipeSegmentSum", 0, 100),
                  _Event(name, "StridedSlice", 8100, 8140)]
        return step_stages.step_breakdown(events, (0, 8140))["wait_ms"]

    scope = sockets.ALL_REDUCE_SCOPE
    assert waits(scope + "/strided_slice")["dense_allreduce"] == 8.0
    assert waits("replica/%s/strided_slice" % scope)["dense_allreduce"] == 8.0
    assert waits(scope + "_1/split")["dense_allreduce"] == 8.0
    assert waits("x" + scope + "/strided_slice")["dense_allreduce"] == 0.0
    assert step_stages.stage_of(scope + "/add", "AddV2") == "other"
    # Control: the same slice outside the scope is charged to "other".
    plain = waits("strided_slice_18")
    assert plain["other"] == 8.0 and plain["dense_allreduce"] == 0.0
    # The sum's own all-to-all starting after a gap waited for its inputs, not for the peers.
    events = [_Event("a/b", "MatMul", 0, 100),
              _Event(scope + "/NestpipeSocketAllToAll", "NestpipeSocketAllToAll", 2100, 2150)]
    assert step_stages.step_breakdown(events, (0, 2150))["wait_ms"]["other"] == 2.0


def test_a_gap_ending_at_the_received_keys_counts_is_the_keys_exchange():
    events = [_Event("Sum_6", "Sum", 0, 100),
              _Event("NestpipeRouteCounts", "NestpipeRouteCounts", 2100, 2200)]
    assert step_stages.step_breakdown(events, (0, 2200))["wait_ms"]["keys_exchange"] == 2.0
    # Control: the same gap ending at an op of no exchange is charged to "other".
    events[1] = _Event("Cast_5", "Cast", 2100, 2200)
    assert step_stages.step_breakdown(events, (0, 2200))["wait_ms"]["other"] == 2.0


def _row(system, pipeline, ms, **extra):
    return dict(system=system, pipeline=pipeline, ms_median=ms, ms_rounds=[ms, ms], **extra)


def test_a_cells_summary_prices_the_exposure_and_what_each_mode_hides():
    rows = [_row("compute_only", "-", 30.0), _row("nestpipe", "none", 50.0),
            _row("nestpipe", "dbp", 45.0), _row("nestpipe", "fwp", 40.0),
            _row("nestpipe", "nested", 42.0),
            _row("nestpipe", "auto", 41.0, auto_choice="fwp",
                 stages={"wait_ms": {"rows_exchange": 1.0}}),
            _row("torchrec", "-", 80.0), _row("torchrec_pipelined", "-", 44.0)]
    rows[3]["stages"] = {"wait_ms": {"rows_exchange": 2.0, "gradient_exchange": 5.0}}
    out = family_report.summarize_cell(rows)
    assert out["exposed_share"] == pytest.approx(0.4) and out["best"] == "fwp"
    assert out["best_vs_none"] == pytest.approx(0.8) and out["hidden"] == pytest.approx(0.5)
    assert out["best_vs_bound"] == pytest.approx(40 / 30)
    assert out["auto_vs_best"] == pytest.approx(41 / 40)
    assert out["torchrec_vs_ours"] == pytest.approx(2.0)
    assert out["torchrec_pipelined_vs_ours"] == pytest.approx(1.1)
    assert out["bounding"] == "waits on gradient_exchange 5.0 ms"
    table = "\n".join(family_report.summary_lines([("c", out)]))
    assert "fwp 0.80x met" in table and "1.33x **missed**" in table
    assert "1.10x **missed**" in table  # TorchRec pipelined within 1.2x of ours


def test_a_mode_that_keeps_its_cores_as_busy_as_the_bound_is_named_cpu_bound():
    bound = _row("compute_only", "-", 30.0, cpu_busy=0.98, cpu_ms_per_step=29.5)
    waits = {"wait_ms": {"rows_exchange": 2.0}}
    busy = _row("nestpipe", "nested", 36.0, cpu_busy=0.9, cpu_ms_per_step=33.0, stages=waits)
    assert family_report.bounding_text(busy, bound).startswith("its own CPU: 33.0 ms/step")
    # The kernel's part of each process's CPU, where the rows measured it.
    busy["cpu_sys_ms_per_step"], bound["cpu_sys_ms_per_step"] = 6.5, 0.5
    assert family_report.bounding_text(busy, bound).startswith(
        "its own CPU: 33.0 ms/step (6.5 in the kernel), 0.90 cores busy (compute-only: 29.5 ms"
        " (0.5 in the kernel), 0.98)")
    # Control: a mode that idles on its exchange is named by its largest wait.
    idle = _row("nestpipe", "nested", 36.0, cpu_busy=0.5, cpu_ms_per_step=18.0, stages=waits)
    assert family_report.bounding_text(idle, bound) == "waits on rows_exchange 2.0 ms"


def test_a_mode_whose_bytes_fill_its_step_on_the_link_is_named_link_bound():
    assert family_report.link_bytes_per_second("0ms:200mbit") == 25e6
    assert family_report.link_bytes_per_second("1ms:2.5gbit") == 312.5e6
    assert family_report.link_bytes_per_second("loopback") is None
    bound = _row("compute_only", "-", 25.0, cpu_busy=1.0, cpu_ms_per_step=25.0)
    # 1.5 MB of exchanges + 2 (W - 1) / W of 0.5 MB dense on 25 MB/s, of which 1448 / 1514
    # carries data (TCP segments in Ethernet frames): 83.6 ms of an 88 ms step.
    sent = {"rows": 1.0e6, "grads": 0.5e6}
    full = _row("nestpipe", "fwp", 88.0, network="0ms:200mbit", workers=2, cpu_busy=0.95,
                cpu_ms_per_step=30.0, wire_bytes_per_step=sent, dense_bytes=0.5e6)
    assert family_report.wire_bound_ms(full) == pytest.approx(80.0 * 1514 / 1448)
    assert family_report.bounding_text(full, bound).startswith("the link: 83.6 ms/step")
    # Control: the same bytes on a 1 Gbit/s link fill a sixth of the step: CPU names it.
    fast = dict(full, network="0ms:1gbit")
    assert family_report.bounding_text(fast, bound).startswith("its own CPU")


def test_a_target_the_best_modes_bytes_alone_exceed_says_so():
    sent = {"rows": 1.0e6, "grads": 0.5e6}
    none = _row("nestpipe", "none", 100.0, network="0ms:200mbit", workers=2,
                wire_bytes_per_step=sent, dense_bytes=0.5e6)
    rows = [_row("compute_only", "-", 25.0), none,
            dict(none, pipeline="nested", ms_median=88.0, ms_rounds=[88.0, 88.0])]
    out = family_report.summarize_cell(rows)
    assert out["link_vs_bound"] == pytest.approx(83.6 / 25.0, rel=1e-3)
    table = "\n".join(family_report.summary_lines([("c", out)]))
    assert "3.52x **missed** (its bytes alone 3.35x)" in table
    # Control: bytes that fit in 1.15x the bound leave the verdict alone.
    fast = [dict(r, network="0ms:1gbit") if r["system"] == "nestpipe" else r for r in rows]
    table = "\n".join(family_report.summary_lines([("c", family_report.summarize_cell(fast))]))
    assert "3.52x **missed** |" in table and "bytes alone" not in table


def test_the_in_step_bound_is_the_compute_then_the_exchanges_after_the_last_backward():
    bound = _row("compute_only", "-", 25.0, cpu_busy=1.0, cpu_ms_per_step=25.0)
    # 0.5 MB of row gradients and 2 (W - 1) / W of 50 kB dense on 125 MB/s in TCP frames:
    # 4.6 ms after the last backward, so no step that updates before it ends beats 29.6 ms.
    sent = {"keys": 0.1e6, "forward": 0.4e6, "sync": 0.1e6, "backward": 0.5e6}
    waits = {"wait_ms": {"gradient_exchange": 4.0, "rows_exchange": 1.0}}
    best = _row("nestpipe", "nested", 30.0, network="0ms:1gbit", workers=2, cpu_busy=0.6,
                cpu_ms_per_step=20.0, wire_bytes_per_step=sent, dense_bytes=50e3, stages=waits)
    after = 1e3 * 0.55e6 / 125e6 * 1514 / 1448
    assert family_report.after_backward_ms(best) == pytest.approx(after)
    assert family_report.in_step_bound_ms(best, bound) == pytest.approx(25.0 + after)
    assert family_report.bounding_text(best, bound) == (
        "the exchanges after its last backward: 4.6 ms of gradient bytes on the link, which "
        "nothing of its step overlaps (compute-only + them: 29.6 ms, the step 1.01x of it)")
    rows = [bound, dict(best, pipeline="none", ms_median=40.0, ms_rounds=[40.0, 40.0]), best]
    table = "\n".join(family_report.summary_lines([("c", family_report.summarize_cell(rows))]))
    assert "| 1.01x (29.6) |" in table
    # Controls: a step well above its in-step bound is named by its largest wait; a link that
    # all its bytes take longer on than compute + gradients sets the bound; no counters, none.
    slow = dict(best, ms_median=36.0)
    assert family_report.bounding_text(slow, bound) == "waits on gradient_exchange 4.0 ms"
    heavy = dict(best, wire_bytes_per_step=dict(sent, forward=4.0e6))
    assert family_report.in_step_bound_ms(heavy, bound) == pytest.approx(
        family_report.wire_bound_ms(heavy))
    assert family_report.in_step_bound_ms(dict(best, wire_bytes_per_step=None), bound) is None


def test_an_unknown_family_is_refused_listing_the_families(capsys):
    assert run.main(["nope"]) == 2
    assert "unknown benchmark family 'nope'; the families are" in capsys.readouterr().err
    assert run.main(["natural", "--dry-run"]) == 0
    assert "--output natural" in capsys.readouterr().out


def test_no_dated_copies_in_results():
    dated = [f for f in os.listdir(os.path.join(BENCH, "results"))
             if re.search(r"_(11|12)\d\d[a-z]?(_|\.)", f) and not f.startswith("plan_costs")]
    assert dated == []


def _table_cells(text, first_column):
    rows = [line for line in text.splitlines() if line.startswith("| " + first_column)]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_the_readmes_numbers_are_the_natural_familys():
    """Every ms/step and samples/s of the README's table is in bench/results/natural.md, the
    file its caption names (what would catch a README left behind by a rerun)."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Performance"):readme.index("## Documentation")]
    assert "bench/results/natural.md" in section and "python bench/run.py natural" in section
    with open(os.path.join(BENCH, "results", "natural.md")) as f:
        results = f.read()
    measured = set(re.findall(r"\| (\d+\.\d) \| [\d.]+ \| (\d+) \|", results))
    quoted = re.findall(r"\| ([\d.]+) \| ([\d,]+) \| [\d.]+ \|", section)
    assert len(quoted) == 4, quoted
    for ms, samples in quoted:
        assert (ms, samples.replace(",", "")) in measured, (ms, samples, measured)


def test_the_readme_check_sees_a_stale_number(tmp_path):
    """Positive control of the pattern: a row of the results table is found, and another
    number is not."""
    results = "| single | dlrm | synthetic | - | 1 | 5.6 | 7.9 | 184422 | 1.00 |"
    measured = set(re.findall(r"\| (\d+\.\d) \| [\d.]+ \| (\d+) \|", results))
    assert ("5.6", "184422") in measured and ("5.7", "184422") not in measured


def test_a_subset_run_updates_the_familys_one_file_and_keeps_its_other_cells(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(family_report, "RESULTS", str(tmp_path))
    rows = [_row("compute_only", "-", 30.0), _row("nestpipe", "none", 50.0),
            _row("nestpipe", "fwp", 40.0)]

    def measured(cell, markdown):
        base = tmp_path / family_report.cell_output("fam", cell)
        base.with_suffix(".json").write_text(__import__("json").dumps(rows))
        base.with_suffix(".md").write_text(markdown)

    measured("a", "# cell a table\n")
    family_report.join("fam", "about", ["a"], "run a", 0.0, 1.0, 1.0, declared=["a", "b"])
    text = (tmp_path / "fam.md").read_text()
    assert "not measured yet: b" in text and "### cell a table" in text
    measured("b", "# cell b table\n")
    family_report.join("fam", "about", ["b"], "run b", 0.0, 1.0, 1.0, declared=["a", "b"])
    text = (tmp_path / "fam.md").read_text()
    assert "### cell a table" in text and "### cell b table" in text
    assert "`run a`" in text and "`run b`" in text and "not measured yet" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fam.json", "fam.md"]


def test_report_only_rewrites_a_familys_report_from_its_stored_cells(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(family_report, "RESULTS", str(tmp_path))
    cells = [name for name, _ in families.FAMILIES["bandwidth_family"].cells]
    rows = [_row("compute_only", "-", 30.0), _row("nestpipe", "none", 50.0),
            _row("nestpipe", "fwp", 40.0)]
    stored = {"family": "bandwidth_family", "command": "run x",
              "cells": {cells[0]: {"run": "`run x` (then)", "rows": rows,
                                   "summary": {}, "markdown": "# its table\n"}}}
    (tmp_path / "bandwidth_family.json").write_text(json.dumps(stored))
    assert run.main(["bandwidth_family", "--report-only"]) == 0
    text = (tmp_path / "bandwidth_family.md").read_text()
    assert "Measured by `run x` (then)." in text and "### its table" in text
    assert "fwp 0.80x met" in text  # the summary, recomputed from the stored rows
    assert "`python bench/run.py bandwidth_family --report-only`" in text
    assert json.loads((tmp_path / "bandwidth_family.json").read_text())["cells"][cells[0]][
        "rows"] == rows
    # A family that is not a family of cells has no report to rewrite.
    assert run.main(["natural", "--report-only"]) == 2
    assert "natural has none" in capsys.readouterr().err
    assert run.main(["bandwidth_family", "--report-only", "--quick"]) == 2
    assert "measures nothing" in capsys.readouterr().err


def test_exposed_exchange_prices_the_bytes_a_halved_direction_took_off_the_link():
    import exposed_exchange  # pylint: disable=import-outside-toplevel
    reference = {"ms": 20.0, "bytes": {"keys": 1e4, "forward": 6e5, "backward": 8e5,
                                       "sync": 2e5}}
    gradients = {"ms": 16.0, "bytes": {"keys": 1e4, "forward": 6e5, "backward": 4e5,
                                       "sync": 2e5}}
    rows = {"ms": 19.6, "bytes": {"keys": 1e4, "forward": 3e5, "backward": 8e5,
                                  "sync": 1e5}}
    # 400 KB at 1 Gbit/s is 3.2 ms; the step fell by 4.0 ms: exposed (above 1: fewer bytes
    # saved more than their time at the rate).
    fell, removed, share = exposed_exchange.exposed_share(reference, gradients, "fp32-bf16",
                                                          "0ms:1gbit")
    assert (fell, round(removed, 6), round(share, 4)) == (4.0, 3.2, 1.25)
    # Halving the forward direction takes the rows and the sync (400 KB): 0.4 ms of 3.2, hidden.
    fell, removed, share = exposed_exchange.exposed_share(reference, rows, "bf16-fp32",
                                                          "0ms:1gbit")
    assert round(removed, 6) == 3.2 and round(share, 3) == 0.125
    # Nothing removed: no share to give.
    assert exposed_exchange.exposed_share(reference, reference, "fp32-bf16",
                                          "0ms:1gbit")[2] is None


def test_exposed_exchange_runs_the_family_cells_shape_and_refuses_a_loopback_cell(monkeypatch):
    import exposed_exchange  # pylint: disable=import-outside-toplevel
    args, cells = exposed_exchange.parse_args(["--cells", "8x200k_d64_zipf1.05_b4096_1gbit_w2",
                                               "--modes", "nested", "--steps", "5"])
    [(name, cell)] = cells
    argv = exposed_exchange.worker_argv(cell, "nested", "fp32-bf16", args)
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--zipf"] == "1.05" and flags["--synthetic-tables"] == "8:200000"
    assert flags["--wire-dtype"] == "fp32-bf16" and flags["--pipeline"] == "nested"
    with pytest.raises(SystemExit):
        exposed_exchange.parse_args(["--cells", "no_such_cell"])
    with pytest.raises(SystemExit):
        exposed_exchange.parse_args(["--rounds", "0"])
    # A loopback cell has no link rate to price bytes at: refused by name.
    monkeypatch.setattr(exposed_exchange, "BANDWIDTH_CELLS",
                        (("on_loopback", families.dataclasses.replace(
                            families.BANDWIDTH_BASE, networks=("loopback",))),))
    with pytest.raises(SystemExit):
        exposed_exchange.parse_args(["--cells", "on_loopback"])


def test_exposed_exchange_writes_a_table_per_cell_with_each_modes_shares():
    import exposed_exchange  # pylint: disable=import-outside-toplevel
    args, cells = exposed_exchange.parse_args(["--modes", "nested", "--rounds", "1"])
    sent = {"keys": 1e4, "forward": 6e5, "backward": 8e5, "sync": 2e5}
    rows = {"fp32": (20.0, sent), "bf16-fp32": (20.0, dict(sent, forward=3e5, sync=1e5)),
            "fp32-bf16": (16.0, dict(sent, backward=4e5))}
    results = {("nested", wire): [{"ms_median": ms, "cpu_ms_per_step": 9.0,
                                   "wire_bytes_per_step": kinds}]
               for wire, (ms, kinds) in rows.items()}
    summary = exposed_exchange.summarize(results)
    text = exposed_exchange.markdown(args, [(name, cell, burst, summary)
                                            for name, cell in cells for burst in args.bursts],
                                     "cmd", "now", 1.0, (0.5, 1.5))
    assert "load average 0.50 at the start, 1.50 at the end" in text
    assert args.bursts == ["256kb", "64kb"]
    for name, _ in cells:
        for burst in args.bursts:
            assert "## %s, link bucket %s" % (name, burst) in text
    assert "| nested | gradients bf16 | 16.0 (16.0) | 9.0 | 10/600/400/200 | 4.0 | 3.2 | 1.25 |" \
        in text
    assert "| nested | forward bf16 | 20.0 (20.0) | 9.0 | 10/300/800/100 | 0.0 | 3.2 | 0.00 |" \
        in text
    failed = dict(results)
    failed[("nested", "fp32-bf16")] = [{"error": "boom"}]
    assert "| nested | gradients bf16 | failed: boom |" in exposed_exchange.markdown(
        args, [(cells[0][0], cells[0][1], "64kb", exposed_exchange.summarize(failed))], "cmd",
        "now", 1.0)
