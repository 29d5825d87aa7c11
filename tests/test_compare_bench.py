"""Fast checks of bench/compare.py's pure-Python parts (the matrix, ratios, targets, report);
no cluster is started."""
import argparse
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import compare  # noqa: E402


def test_expand_systems_names_every_row_of_ours():
    rows = compare.expand_systems(["single", "mwms", "nestpipe"], ["none", "dbp"], ["tf", "horovod"])
    assert rows[:2] == [("single", "-", "-"), ("mwms", "-", "tf")]
    assert ("nestpipe", "dbp", "horovod") in rows and len(rows) == 6
    assert compare.expand_systems(["nestpipe:fwp:tf", "hvd_alltoall"], [], []) == [
        ("nestpipe", "fwp", "tf"), ("hvd_alltoall", "-", "horovod")]
    with pytest.raises(ValueError):
        compare.expand_systems(["nestpipe:bogus:tf"], [], [])
    with pytest.raises(ValueError):
        compare.expand_systems(["tpu"], [], [])


def test_default_plan_has_every_system_at_two_workers_and_singles_first():
    args = compare.parse_args([])
    rows = compare.plan_rows(compare.plan_from_args(args), args.pipelines, args.collectives)
    singles = [r for r in rows if r["system"] == "single"]
    assert rows[:len(singles)] == singles
    assert {(r["model"], r["data"]) for r in singles} == {
        ("dlrm", "synthetic"), ("dcn", "synthetic"), ("dlrm", "movielens-1m")}
    two = {compare.row_label(r) for r in rows if r["workers"] == 2 and r["model"] == "dlrm"
           and r["data"] == "synthetic" and r["network"] == "loopback"}
    assert {"mwms", "psv2", "hvd_replicated", "hvd_alltoall"} <= two
    assert {"nestpipe %s/%s" % (p, c) for p in compare.PIPELINES for c in compare.COLLECTIVES} <= two
    assert {r["workers"] for r in rows} == {1, 2, 4}
    assert any(r["network"] != "loopback" for r in rows if r["system"] != "single")
    assert len({tuple(sorted(r.items())) for r in rows}) == len(rows)


def test_product_flags_and_no_single_worker_on_an_emulated_network():
    args = compare.parse_args(["--workers", "1", "2", "--networks", "loopback", "1ms:200mbit",
                               "--systems", "mwms", "nestpipe:none:tf"])
    rows = compare.plan_rows(compare.plan_from_args(args), args.pipelines, args.collectives)
    assert [(r["system"], r["network"], r["workers"]) for r in rows] == [
        ("single", "-", 1),
        ("mwms", "loopback", 1), ("nestpipe", "loopback", 1),
        ("mwms", "loopback", 2), ("nestpipe", "loopback", 2),
        ("mwms", "1ms:200mbit", 2), ("nestpipe", "1ms:200mbit", 2)]


def _row(system, ms, workers=2, pipeline="-", collectives="tf", network="loopback"):
    row = compare.make_row(system, pipeline, collectives, "dlrm", "synthetic", network, workers)
    args = argparse.Namespace(global_batch=512, steps=10)
    out = compare.empty_result(row, args, "", "ok")
    if ms is not None:
        out.update(ms_median=ms, ms_p90=ms * 1.1, samples_per_s=512 / ms * 1e3)
    return out


def test_ratios_targets_and_report():
    rows = [_row("single", 5.0, workers=1, network="-"), _row("mwms", 100.0), _row("psv2", 40.0),
            _row("hvd_replicated", None, collectives="horovod"),
            _row("nestpipe", 16.0, pipeline="none")]
    rows[3].update(status="not run", note="not run: horovod not installed",
                   details="not run: horovod not installed")
    rows[4].update(exposure=0.9, stage_ms={"compute": 4.0, "communication": 12.0},
                   profiled_step_ms=17.0, exposed_ms=11.0)
    compare.add_ratios(rows)
    ours = rows[4]
    assert ours["efficiency"] == pytest.approx(5.0 / 16.0)
    assert ours["vs_mwms"] == pytest.approx(100.0 / 16.0)
    assert ours["vs_psv2"] == pytest.approx(40.0 / 16.0)
    assert ours["vs_hvd_replicated"] is None
    assert compare.verdict(ours["vs_mwms"], 5.0).startswith("6.25 (met")
    assert compare.verdict(ours["vs_psv2"], 3.0).startswith("2.50 (missed")
    assert compare.verdict(None, 2.0) == "n/a"
    args = compare.parse_args(["--steps", "10"])
    env = {"load": 0.5, "horovod": False, "horovod_version": None,
           "horovod_text": "no Horovod rows"}
    text = compare.markdown(rows, args, env, 12.0)
    assert "## Targets (ours on 2 workers)" in text
    assert "0.31 (missed, target >= 0.8)" in text and "6.25 (met, target >= 5)" in text
    assert "missed targets need <= 6.2 ms/step (E), 13.3 ms/step (PSv2)" in text
    assert "communication 12.0" in text and "compute alone" not in text
    ours["stage_ms"]["compute"] = 7.0  # more than E's 6.2 ms: unreachable on these cores
    assert "compute alone (7.0 ms, each worker's share of the same cores) exceeds the need of E" in (
        compare.bound_text(ours, 5.0))
    assert "not run: horovod not installed" in text
    stored = json.loads(json.dumps(compare.json_rows(rows)))
    for row in stored:
        assert list(row)[:len(compare.JSON_KEYS)] == compare.JSON_KEYS
    assert stored[3]["samples_per_s"] is None and stored[3]["note"].startswith("not run")


def test_pipelined_rows_are_compared_with_ours_none_and_show_their_collectives():
    rows = [_row("nestpipe", 20.0, pipeline="none"), _row("nestpipe", 18.0, pipeline="auto"),
            _row("nestpipe", 30.0, pipeline="fwp"), _row("nestpipe", 25.0, pipeline="none",
                                                        collectives="horovod"),
            _row("mwms", 100.0)]
    rows[1].update(collectives_per_step=6, exchanges=1, auto_choice="dbp")
    compare.add_ratios(rows)
    assert rows[0]["vs_none"] == pytest.approx(1.0)
    assert rows[1]["vs_none"] == pytest.approx(0.9) and rows[2]["vs_none"] == pytest.approx(1.5)
    assert rows[3]["vs_none"] == pytest.approx(1.0)  # against ours none with its own collectives
    # ... and its own placement.
    placed = [dict(_row("nestpipe", 20.0, pipeline="none"), placement="row_wise"),
              dict(_row("nestpipe", 10.0, pipeline="none"), placement="auto"),
              dict(_row("nestpipe", 12.0, pipeline="dbp"), placement="auto")]
    compare.add_ratios(placed)
    assert placed[2]["vs_none"] == pytest.approx(1.2)
    assert "vs_none" not in rows[4]
    assert compare.collectives_text(rows[1]) == "6 (1), auto chose dbp"
    assert compare.collectives_text(rows[4]) == "-"
    profiled = dict(rows[1], ops_per_step=713)
    assert compare.collectives_text(profiled) == "6 (1), 713 ops executed (profiled), auto chose dbp"
    text = compare.markdown(rows, compare.parse_args(["--steps", "10"]),
                            {"load": 0.5, "horovod": False, "horovod_version": None,
                             "horovod_text": "no Horovod rows"}, 1.0)
    assert "| 0.90x | - | 6 (1), auto chose dbp |" in text  # no compute-only row: "-"


def test_rounds_give_a_ratio_to_none_paired_by_round():
    """With rounds, each row's ratio to none is also taken within each round (the median of
    those): a round where the machine ran slow for both rows cancels out."""
    none = dict(_row("nestpipe", 4.0, pipeline="none"), ms_rounds=[4.0, 4.4, 3.6])
    dbp = dict(_row("nestpipe", 4.3, pipeline="dbp"), ms_rounds=[4.2, 4.3, 6.2])
    rows = [none, dbp]
    compare.add_ratios(rows)
    assert dbp["vs_none"] == pytest.approx(4.3 / 4.0)
    assert dbp["vs_none_paired"] == pytest.approx(4.2 / 4.0)  # 1.05, 0.977, 1.72: the median
    assert "vs_none_paired" not in none
    assert compare.vs_none_cell(dbp) == "1.07x (per round 1.05x)"
    # Positive control: one round (or rounds that do not pair up) gives no per-round ratio.
    single = [dict(_row("nestpipe", 4.0, pipeline="none"), ms_rounds=[4.0]),
              dict(_row("nestpipe", 4.3, pipeline="dbp"), ms_rounds=[4.2])]
    compare.add_ratios(single)
    assert "vs_none_paired" not in single[1] and compare.vs_none_cell(single[1]) == "1.07x"
    assert compare.paired_ratio([1.0, 2.0], [1.0]) is None


def test_auto_rows_report_every_mode_against_none_timed_in_the_same_processes():
    """The probe's timings of each launch (round) give same-process ratios to none: the median
    over launches of each launch's ratio, judged against the loopback target only on loopback."""
    auto = _row("nestpipe", 8.0, pipeline="auto")
    results = [{"ms_median": 8.0, "ms_p90": 9.0, "steps": 10, "auto_choice": "none",
                "auto_timings_ms": {"none": 10.0, "dbp": 10.2, "fwp(M=2)": 11.0}},
               {"ms_median": 8.0, "ms_p90": 9.0, "steps": 10, "auto_choice": "none",
                "auto_timings_ms": {"none": 5.0, "dbp": 5.0, "fwp(M=2)": 6.0}},
               {"ms_median": 8.0, "ms_p90": 9.0, "steps": 10, "auto_choice": "dbp",
                "auto_timings_ms": {"none": 8.0, "dbp": 8.8, "fwp(M=2)": 8.0}}]
    args = argparse.Namespace(global_batch=512, steps=10, profile_steps=0)
    compare.summarize_rounds(auto, args, auto, results)
    assert len(auto["auto_timings_ms_rounds"]) == 3
    ratios = compare.same_process_ratios(auto["auto_timings_ms_rounds"])
    # Per launch: dbp 1.02, 1.00, 1.10 -> 1.02; fwp 1.10, 1.20, 1.00 -> 1.10.
    assert ratios["none"] == 1.0
    assert ratios["dbp"] == pytest.approx(1.02) and ratios["fwp(M=2)"] == pytest.approx(1.10)
    text = "\n".join(compare.same_process_lines([_row("nestpipe", 9.0, pipeline="none"), auto]))
    assert "## Same-process comparison (auto's probe)" in text
    assert "| dbp | 10.2 / 5.0 / 8.8 | 1.02x (met, target <= 1.05x) |" in text
    assert "| fwp(M=2) | 11.0 / 6.0 / 8.0 | 1.10x (missed, target <= 1.05x) |" in text
    # Off loopback there is no such target; rows without a probe give no section.
    auto["network"] = "0.2ms:1gbit"
    assert "| fwp(M=2) | 11.0 / 6.0 / 8.0 | 1.10x |" in "\n".join(
        compare.same_process_lines([auto]))
    assert compare.same_process_lines([_row("nestpipe", 9.0, pipeline="none")]) == []
    assert "auto_timings_ms_rounds" in compare.json_rows([auto])[0]
    # Without the probe's CPU (older workers) the CPU column says so.
    assert "auto_cpu_rounds" not in auto and "| 1.02x (met, target <= 1.05x) | - |" in text


def test_modes_the_probe_budget_skipped_are_not_timed_not_missed():
    """A mode auto's probe never reached (its budget of the first epoch ran out: inf in the
    worker's timings) is reported as not timed, not as an infinitely slow missed target."""
    auto = _row("nestpipe", 8.0, pipeline="auto")
    auto["auto_timings_ms_rounds"] = [{"none": 10.0, "dbp": float("inf")}]
    assert compare.same_process_ratios(auto["auto_timings_ms_rounds"]) == {"none": 1.0}
    text = "\n".join(compare.same_process_lines([auto]))
    assert "| dbp | not timed (probe budget) | - |" in text and "inf" not in text
    # Positive control: a timed mode still gets its ratio and verdict.
    auto["auto_timings_ms_rounds"] = [{"none": 10.0, "dbp": 12.0}]
    assert "| dbp | 12.0 | 1.20x (missed, target <= 1.05x) |" in "\n".join(
        compare.same_process_lines([auto]))


def test_auto_rows_report_the_probes_process_cpu_per_mode_and_launch():
    auto = _row("nestpipe", 8.0, pipeline="auto")
    results = [{"ms_median": 8.0, "ms_p90": 9.0, "steps": 10, "auto_choice": "none",
                "auto_timings_ms": {"none": 10.0, "dbp": 10.2},
                "auto_cpu": {"none": [9.5, 0.95], "dbp": [10.1, 0.99]}},
               {"ms_median": 8.0, "ms_p90": 9.0, "steps": 10, "auto_choice": "none",
                "auto_timings_ms": {"none": 5.0, "dbp": 5.0},
                "auto_cpu": {"none": [4.0, 0.8], "dbp": [4.6, 0.92]}}]
    args = argparse.Namespace(global_batch=512, steps=10, profile_steps=0)
    compare.summarize_rounds(auto, args, auto, results)
    assert auto["auto_cpu_rounds"] == [results[0]["auto_cpu"], results[1]["auto_cpu"]]
    text = "\n".join(compare.same_process_lines([auto]))
    assert "| none | 10.0 / 5.0 | 1.00x | 9.5 (0.95) / 4.0 (0.80) |" in text
    assert "| dbp | 10.2 / 5.0 | 1.01x (met, target <= 1.05x) | 10.1 (0.99) / 4.6 (0.92) |" in text
    assert "auto_cpu_rounds" in compare.json_rows([auto])[0]
    # One launch without it: no column values (they would not line up with the timings).
    del results[1]["auto_cpu"]
    compare.summarize_rounds(auto := _row("nestpipe", 8.0, pipeline="auto"), args, auto, results)
    assert "auto_cpu_rounds" not in auto


def test_a_run_without_the_buffer_sync_is_labelled_a_diagnostic_and_judges_nothing():
    """--skip-buffer-sync (pricing dbp's and nested's sync: inexact training) reaches ours'
    workers only, and its report says so first and judges no target; without it (the positive
    control) the same rows are judged."""
    env = {"load": 0.5, "horovod": False, "horovod_version": None,
           "horovod_text": "no Horovod rows"}
    auto = dict(_row("nestpipe", 8.0, pipeline="auto"), auto_timings_ms_rounds=[
        {"none": 10.0, "dbp": 9.0}, {"none": 8.0, "dbp": 7.6}])
    rows = [_row("nestpipe", 9.0, pipeline="none"), auto, _row("mwms", 100.0)]
    compare.add_ratios(rows)
    diagnostic = compare.parse_args(["--steps", "10", "--skip-buffer-sync"])
    assert "--skip-buffer-sync" in compare.worker_argv(rows[1], diagnostic)
    assert "--skip-buffer-sync" not in compare.worker_argv(rows[2], diagnostic)
    assert "--skip-buffer-sync" not in compare.worker_argv(rows[1], compare.parse_args([]))
    text = compare.markdown(rows, diagnostic, env, 1.0)
    assert text.index(compare.SKIPPED_SYNC_TEXT) < text.index("Cluster:")
    assert "| dbp | 9.0 / 7.6 | 0.93x |" in text
    assert "target" not in text.split("## Same-process")[1]
    assert "(met" not in text and "## Targets" not in text
    judged = compare.markdown(rows, compare.parse_args(["--steps", "10"]), env, 1.0)
    assert compare.SKIPPED_SYNC_TEXT not in judged and "## Targets" in judged
    assert "| dbp | 9.0 / 7.6 | 0.93x (met, target <= 1.05x) |" in judged
    # The JSON marks ours' rows of the diagnostic run alone.
    stored = compare.json_rows(rows, diagnostic)
    assert [r.get("skip_buffer_sync") for r in stored] == [True, True, None]
    assert not any("skip_buffer_sync" in r for r in compare.json_rows(rows))
    assert not any("skip_buffer_sync" in r
                   for r in compare.json_rows(rows, compare.parse_args(["--steps", "10"])))


def test_rows_are_compared_with_the_compute_only_bound_of_their_cluster_size():
    """compute_only (W processes each on its share, no communication) is one row per model,
    data and W whatever the network; every other row of that size is divided by it."""
    rows = compare.plan_rows([(["dlrm"], ["synthetic"], [2], ["loopback", "1ms:200mbit"],
                               ["compute_only", "nestpipe:none:sockets"])], ["none"], ["sockets"])
    assert [(r["system"], r["network"]) for r in rows] == [
        ("single", "-"), ("compute_only", "-"), ("nestpipe", "loopback"),
        ("nestpipe", "1ms:200mbit")]
    measured = [_row("compute_only", 40.0, network="-"), _row("nestpipe", 50.0, pipeline="none"),
                _row("nestpipe", 60.0, pipeline="none", workers=4), _row("mwms", 100.0)]
    compare.add_ratios(measured)
    assert measured[1]["vs_compute_only"] == pytest.approx(1.25)
    assert measured[3]["vs_compute_only"] == pytest.approx(2.5)
    assert "vs_compute_only" not in measured[0] and "vs_compute_only" not in measured[2]


def test_error_summary_names_the_last_error_line():
    output = "starting\nTraceback (most recent call last):\n  File x\nValueError: bad table\n[launch] done"
    assert compare.error_summary(output, 1) == "failed (rc=1): ValueError: bad table"
    assert compare.error_summary("", "timeout after 5 s") == "failed (rc=timeout after 5 s): no output"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row("single", 5.0, workers=1, network="-"), _row("mwms", 100.0),
            _row("mwms", 60.0, workers=1), _row("nestpipe", 16.0, pipeline="none")]
    path = tmp_path / "c.png"
    assert compare.plot(rows, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


class FakeNetwork:
    """Stands for bench/netem.EmulatedNetwork in row commands."""

    def launcher_flags(self, horovod=False):
        return ["--cluster-spec", "{}"] + (["--horovod", "--horovod-address", "10.0.0.9"]
                                           if horovod else [])

    def relay_env(self):
        return {"NESTPIPE_RELAY_PORT": "9"}


def test_horovod_rows_run_with_horovod_and_on_the_emulated_network_through_our_launcher():
    args = compare.parse_args(["--steps", "5"])
    env = {"horovod": False, "launcher_horovod": True}
    for system, pipeline, coll in [("hvd_replicated", "-", "horovod"),
                                   ("nestpipe", "dbp", "horovod")]:
        row = compare.make_row(system, pipeline, coll, "dlrm", "synthetic", "loopback", 2)
        with pytest.raises(compare.NotRun, match="not run: horovod not installed"):
            compare.row_command(row, args, None, env)
    env["horovod"] = True
    row = compare.make_row("hvd_alltoall", "-", "horovod", "dlrm", "synthetic", "loopback", 2)
    command = compare.row_command(row, args, None, env)
    assert command[command.index("--workers") + 1] == "2" and "--horovod" in command
    assert command[command.index("--system") + 1] == "hvd_alltoall"
    # On the emulated network: the launcher in the namespaces, Gloo's connections relayed.
    command = compare.row_command(row, args, FakeNetwork(), env)
    assert command[:2] == ["env", "NESTPIPE_RELAY_PORT=9"]
    assert "--horovod-address" in command and "--cluster-spec" in command
    env["launcher_horovod"] = False
    assert "--gloo" in compare.row_command(row, args, None, env)
    with pytest.raises(compare.NotRun, match="emulated network"):
        compare.row_command(row, args, FakeNetwork(), env)
    ps = compare.make_row("psv2", "-", "tf", "dlrm", "synthetic", "loopback", 2)
    command = compare.row_command(ps, args, None, env)
    assert command[command.index("--ps") + 1] == "2" and "--chief" in command
    assert compare.cluster_tasks(ps) == {"chief": 1, "worker": 2, "ps": 2}


def test_timing_survives_a_profiling_pass_that_aborts(monkeypatch):
    timing = '[worker:0] RESULT {"ms_median": 50.0}\n'
    profiled = timing + '[worker:0] PROFILE {"exposure_ratio": 0.5}\n'
    assert compare.parse_output(profiled) == ({"ms_median": 50.0}, {"exposure_ratio": 0.5})
    assert compare.parse_output("no result\n") == (None, None)

    runs = iter([{"ms_median": 50.0, "profile_aborted": "failed (rc=-6): free(): invalid pointer"},
                 {"ms_median": 51.0, "exposure_ratio": 0.5}])
    assert compare.run_profiled_round(lambda: next(runs)) == {"ms_median": 51.0,
                                                              "exposure_ratio": 0.5}
    aborted = {"ms_median": 50.0, "profile_aborted": "failed (rc=-6): free(): invalid pointer"}
    twice = iter([dict(aborted), dict(aborted, ms_median=52.0)])
    result = compare.run_profiled_round(lambda: next(twice))
    assert result["ms_median"] == 50.0 and "profile_aborted" not in result
    assert "aborted twice" in result["profile_error"]
    assert "invalid pointer" in result["profile_error"]


@pytest.mark.parametrize("output, profiled, expected", [
    ('RESULT {"ms_median": 5.0}\nPROFILE {"exposure_ratio": 0.25}\n', True,
     {"ms_median": 5.0, "exposure_ratio": 0.25}),
    ('RESULT {"ms_median": 5.0}\n', False, {"ms_median": 5.0}),
    ('RESULT {"ms_median": 5.0}\nfree(): invalid pointer\n', True,
     {"ms_median": 5.0, "profile_aborted": "failed (rc=1): free(): invalid pointer"}),
])
def test_run_command_reads_result_and_profile(tmp_path, monkeypatch, output, profiled, expected):
    monkeypatch.setattr(compare.tempfile, "tempdir", str(tmp_path))  # the kept log goes there
    script = tmp_path / "row.py"
    script.write_text("import sys\nsys.stdout.write(%r)\nsys.exit(%d)\n"
                      % (output, 1 if "invalid" in output else 0))
    result = compare.run_command([sys.executable, str(script)], 30, profiled)
    steal = result.pop("steal", None)  # the machine's, while the row ran (where /proc/stat tells)
    assert steal is None or 0.0 <= steal <= 1.0
    assert result == expected


def test_run_command_without_result_names_the_error(tmp_path, monkeypatch):
    monkeypatch.setattr(compare.tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "row.py"
    script.write_text("raise ValueError('bad table')\n")
    with pytest.raises(RuntimeError, match="bad table"):
        compare.run_command([sys.executable, str(script)], 30, True)


def test_interleave_runs_round_r_of_every_row_before_round_r_plus_1(monkeypatch):
    args = compare.parse_args(["--rounds", "3", "--steps", "5", "--warmup", "1",
                               "--profile-steps", "0", "--interleave"])
    rows = [dict(system="nestpipe", pipeline=p, collectives="sockets", model="dlrm",
                 data="synthetic", network="loopback", workers=2, placement="row_wise")
            for p in ("none", "dbp", "fwp")]
    order = []

    def fake_runner(row, args, env):
        calls = []

        def run_once():
            calls.append(1)
            order.append(row["pipeline"])
            if row["pipeline"] == "fwp" and len(calls) == 2:
                raise RuntimeError("worker 1 died")
            return {"ms_median": {"none": 10.0, "dbp": 12.0}.get(row["pipeline"], 9.0) + len(calls),
                    "ms_p90": 20.0, "steps": 5}

        return compare.empty_result(row, args, "", "ok"), run_once

    monkeypatch.setattr(compare, "row_runner", fake_runner)
    done = compare.run_interleaved(rows, args, {})
    # Rounds interleave; the row that failed its second round runs no third.
    assert order == ["none", "dbp", "fwp", "none", "dbp", "fwp", "none", "dbp"]
    assert [r["ms_median"] for r in done[:2]] == [12.0, 14.0]  # median of 3 rounds each
    assert done[2]["status"] == "failed" and "worker 1 died" in done[2]["note"]
    # Positive control: without --interleave each row runs its rounds back to back.
    order.clear()
    args.interleave = False
    compare.run_row(rows[0], args, {})
    assert order == ["none"] * 3


# --- memory budget (issue 15: a cell whose tables do not fit replicated) ---------------------
def test_ours_runs_with_auto_by_default_and_gets_the_memory_budget():
    args = compare.parse_args(["--steps", "5"])
    assert args.placement == ["auto"] and args.memory_budget_bytes is None
    row = dict(compare.make_row("nestpipe", "none", "sockets", "dlrm", "synthetic", "loopback", 2),
               placement="auto")
    argv = compare.worker_argv(row, args)
    assert argv[argv.index("--placement") + 1] == "auto"
    assert argv[argv.index("--memory-budget-bytes") + 1] == "0"  # none
    args = compare.parse_args(["--memory-budget-bytes", "700000000", "--placement", "row_wise",
                               "table_wise"])
    assert args.memory_budget_bytes == 700_000_000 and args.placement == ["row_wise", "table_wise"]
    argv = compare.worker_argv(dict(row, placement="row_wise"), args)
    assert argv[argv.index("--memory-budget-bytes") + 1] == "700000000"
    assert argv[argv.index("--placement") + 1] == "row_wise"
    with pytest.raises(SystemExit):
        compare.parse_args(["--placement", "column_wise"])


def _verdicts(fits_by_system):
    calls = []

    def check(row, args):
        calls.append((row["system"], row["workers"]))
        fits = fits_by_system[row["system"]]
        if fits is None:
            return {"computed": False, "note": "memory not computed for %s" % row["system"]}
        if fits == "error":
            raise RuntimeError("memory check: failed (rc=1): OSError: no data")
        return {"computed": True, "fits": fits, "bytes": 9 << 30 if not fits else 1 << 20,
                "note": ("does not fit: 9.00 GiB > budget 1.00 GiB" if not fits
                         else "fits: 1.0 MiB <= budget 1.00 GiB")}
    return check, calls


def test_baselines_whose_tables_do_not_fit_are_not_run_and_ours_is():
    args = compare.parse_args(["--memory-budget-bytes", str(1 << 30), "--steps", "5"])
    rows = [compare.make_row(s, "-", "tf", "dlrm", "synthetic", "loopback", 2)
            for s in ("mwms", "hvd_replicated", "psv2", "hvd_alltoall")]
    rows.append(dict(compare.make_row("nestpipe", "none", "sockets", "dlrm", "synthetic",
                                      "loopback", 2), placement="auto"))
    rows.append(compare.make_row("mwms", "-", "tf", "dcn", "synthetic", "loopback", 2))
    rows.append(compare.make_row("single", "-", "-", "dlrm", "synthetic", "-", 1))
    check, calls = _verdicts({"mwms": False, "hvd_replicated": False, "psv2": None,
                              "hvd_alltoall": True, "single": "error"})
    skipped, verdicts = compare.checked_rows(rows, args, exclude={6}, check=check)
    assert sorted(skipped) == [0, 1, 5]  # mwms (both models), hvd_replicated
    assert all(skipped[i]["status"] == "does not fit" for i in skipped)
    assert skipped[0]["note"] == "does not fit: 9.00 GiB > budget 1.00 GiB"
    assert skipped[0]["table_bytes_per_process"] == 9 << 30 and skipped[0]["samples_per_s"] is None
    assert 4 not in verdicts and 6 not in verdicts  # ours: its planner checks; excluded row
    # One check per system, data and cluster size (the model does not change the tables).
    assert calls == [("mwms", 2), ("hvd_replicated", 2), ("psv2", 2), ("hvd_alltoall", 2)]
    # Without a budget nothing is checked (positive control of the skip).
    assert compare.checked_rows(rows, compare.parse_args([]), check=check) == ({}, {})
    # A check that fails leaves its row to run, with the reason.
    _, failed = compare.checked_rows(rows[6:], args, check=check)
    assert failed[0] == {"computed": False, "note": "memory check: failed (rc=1): OSError: no data"}


def test_the_report_says_which_baseline_does_not_fit_and_shows_ours_plan():
    args = compare.parse_args(["--memory-budget-bytes", str(1 << 30), "--steps", "10"])
    ours = _row("nestpipe", 20.0, pipeline="none", collectives="sockets")
    ours["placement"] = "auto"
    summarized = compare.summarize_rounds(
        ours, args, dict(ours, note="ours", details=""),
        [{"ms_median": 20.0, "ms_p90": 22.0, "steps": 10,
          "placements": {"row_wise": 20, "data_parallel": 6},
          "table_bytes_per_worker": 700 << 20}])
    assert "plan: 6 data_parallel, 20 row_wise; tables 700.0 MiB/worker" in summarized["details"]
    hvd = compare.empty_result(compare.make_row("hvd_replicated", "-", "horovod", "dlrm",
                                                "synthetic", "loopback", 2),
                               args, "does not fit: 1.61 GiB > budget 1.00 GiB", "does not fit")
    hvd["table_bytes_per_process"] = 1 << 31  # as checked_rows leaves it
    mwms = _row("mwms", 100.0)
    psv2 = _row("psv2", 40.0)
    rows = [summarized, hvd, mwms, psv2]
    compare.add_memory_notes(rows, {2: {"computed": True, "fits": True, "bytes": 5 << 20,
                                        "note": "fits: 5.0 MiB <= budget 1.00 GiB"},
                                    1: {"computed": True, "fits": False, "bytes": 1 << 31,
                                        "note": "does not fit"}}, args)
    assert all(r["memory_budget_bytes"] == 1 << 30 for r in rows)
    assert mwms["table_bytes_per_process"] == 5 << 20 and "fits: 5.0 MiB" in mwms["details"]
    assert hvd["note"] == "does not fit: 1.61 GiB > budget 1.00 GiB"  # its own note, once
    compare.add_ratios(rows)
    assert summarized["vs_hvd_replicated"] is None
    assert summarized["baselines_not_fitting"] == ["hvd_replicated"]
    assert summarized["vs_mwms"] == pytest.approx(5.0)
    text = compare.markdown(rows, args, {"load": 0.5, "horovod": True, "horovod_version": "x",
                                         "horovod_text": "Horovod x"}, 1.0)
    assert "hvd_replicated does not fit |" in text
    assert "Memory budget: 1073741824 bytes (1.00 GiB)" in text and "not measured" in text
    assert "does not fit: 1.61 GiB > budget 1.00 GiB" in text  # in the rows without numbers
    stored = compare.json_rows(rows)
    assert stored[0]["placements"] == {"row_wise": 20, "data_parallel": 6}
    assert stored[1]["table_bytes_per_process"] == 1 << 31
    # Positive control: without a budget no paragraph and no "does not fit" cell.
    plain = compare.markdown([_row("nestpipe", 20.0, pipeline="none"), _row("mwms", 100.0)],
                             compare.parse_args(["--steps", "10"]),
                             {"load": 0.5, "horovod": False, "horovod_version": None,
                              "horovod_text": "no Horovod rows"}, 1.0)
    assert "Memory budget" not in plain and "does not fit" not in plain


def test_table_memory_of_each_baseline_by_hand():
    import compare_memory as cm

    sizes, bags = [10, 20, 30], {"g": 5}
    # dim 4, fp32, table + 1 Adagrad slot: 32 bytes per row.
    assert cm.process_table_bytes("mwms", sizes, bags, 4, 2) == (
        65 * 32, "4 tables whole in every process")
    assert cm.process_table_bytes("single", sizes, bags, 4, 1)[0] == 65 * 32
    # hvd_alltoall: rank 0 holds tables 0 and 2, rank 1 table 1; both hold the bag.
    assert cm.process_table_bytes("hvd_alltoall", sizes, bags, 4, 2)[0] == (10 + 30 + 5) * 32
    assert cm.process_table_bytes("psv2", sizes, bags, 4, 2) is None
    assert cm.process_table_bytes("nestpipe", sizes, bags, 4, 2) is None
    over = cm.memory_verdict("hvd_replicated", sizes, bags, 4, 2, 2000)
    assert over == {"system": "hvd_replicated", "budget": 2000, "computed": True, "bytes": 2080,
                    "fits": False, "note": "does not fit: 2.0 KiB (2080 bytes) > budget 2.0 KiB "
                                           "(2000 bytes) per process (4 tables whole in every "
                                           "process, table + 1 Adagrad slot; computed, not run)"}
    assert cm.memory_verdict("hvd_replicated", sizes, bags, 4, 2, 2080)["fits"]  # just fits
    assert cm.memory_verdict("psv2", sizes, bags, 4, 2, 2000)["computed"] is False
    with pytest.raises(ValueError, match="positive number of bytes"):
        cm.memory_verdict("mwms", sizes, bags, 4, 2, 0)


def test_memory_check_runs_the_worker_without_a_cluster():
    """The large-table cell (dim 64, table scale 0.05, 2 workers) under a 700 MB budget: MWMS's
    replicated tables + Adagrad slot (864,333,824 bytes) do not fit; ours row-wise with 2 slots
    (648 MB per worker, the planner's count) does."""
    from tf_nestpipe.plan import placement as pl

    args = compare.parse_args(["--memory-budget-bytes", "700000000", "--dim", "64",
                               "--table-scale", "0.05"])
    row = compare.make_row("mwms", "-", "tf", "dlrm", "synthetic", "loopback", 2)
    verdict = compare.memory_check(row, args)
    assert verdict["computed"] and not verdict["fits"] and verdict["bytes"] == 864_333_824
    assert verdict["note"].startswith("does not fit: 824.3 MiB (864333824 bytes) > budget "
                                      "667.6 MiB (700000000 bytes) per process (26 tables")
    from tf_nestpipe.data import criteo_kaggle_table_sizes

    tables = [pl.TableSpec("t%d" % i, n, 64)
              for i, n in enumerate(criteo_kaggle_table_sizes(0.05))]
    plans = pl.plan_tables(tables, 2, memory_budget_bytes=700_000_000, transport="sockets")
    held = max(sum(p.bytes_on(w) for p in plans) for w in range(2))
    assert held <= 700_000_000 < verdict["bytes"]
    assert any(p.placement == pl.ROW_WISE for p in plans)


def test_cpu_steal_is_measured_and_flags_a_row_run_on_stolen_cores():
    before = [100, 0, 20, 800, 0, 0, 0, 80]
    # 100 ticks passed: 40 user, 20 idle, 40 stolen by the hypervisor
    assert compare.steal_share(before, [140, 0, 20, 820, 0, 0, 0, 120]) == pytest.approx(0.4)
    assert compare.steal_share(before, [190, 0, 30, 880, 0, 0, 0, 80]) == 0.0
    assert compare.steal_share(None, before) is None and compare.steal_share(before, before) is None
    times = compare.cpu_times()
    assert times is None or (len(times) >= 8 and all(t >= 0 for t in times))
    args = compare.parse_args(["--steps", "10"])
    ours = _row("nestpipe", 20.0, pipeline="none", collectives="sockets")
    rounds = [{"ms_median": 20.0, "ms_p90": 22.0, "steps": 10, "steal": s} for s in (0.01, 0.37)]
    stolen = compare.summarize_rounds(ours, args, dict(ours, note="ours", details=""), rounds)
    assert stolen["steal"] == 0.37 and "CPU steal 37%" in stolen["note"]
    assert "unreliable" in stolen["details"]
    # Positive control: a row below the flag keeps a clean note.
    quiet = compare.summarize_rounds(ours, args, dict(ours, note="ours", details=""),
                                     [dict(rounds[0])])
    assert quiet["note"] == "ours" and "steal" not in quiet["details"]
