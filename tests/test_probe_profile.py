"""bench/probe_profile.py's analysis: perf samples given to the probe steps they fell in, per
candidate; no cluster and no perf are started."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import probe_profile  # noqa: E402

PERF_SCRIPT = """\
  100.0005:    1000000      7f00 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
  100.0015:    1000000      7f01 tensorflow::MatMulOp::Compute (/x/libtensorflow_cc.so.2)
  100.0025:    2000000      7f02 malloc (/lib/x86_64-linux-gnu/libc.so.6)
  100.0035:    1000000      7f03 tensorflow::nestpipe::SyncPlanOp::Compute (/x/_nestpipe_ops.so)
  100.0045:    1000000      7f04 __memmove_avx_unaligned_erms (/lib/x86_64-linux-gnu/libc.so.6)
  100.0065:    1000000      7f05 [unknown] ([unknown])
  not a sample line
"""
# none's timed step [100.000, 100.002], dbp's untimed [100.002, 100.003] and timed
# [100.003, 100.005]; the last sample falls in no step.
STEPS = [{"candidate": "none", "start": 100.000, "end": 100.002, "timed": True},
         {"candidate": "dbp", "start": 100.002, "end": 100.003, "timed": False},
         {"candidate": "dbp", "start": 100.003, "end": 100.005, "timed": True}]


def test_parse_samples_reads_time_period_dso_and_symbol():
    samples = probe_profile.parse_samples(PERF_SCRIPT)
    assert len(samples) == 6
    assert samples[2] == (100.0025, 2000000, "libc.so.6", "malloc")
    assert samples[5][2:] == ("[unknown]", "[unknown]")


def test_samples_go_to_the_timed_step_they_fell_in():
    cpu = probe_profile.attribute(probe_profile.parse_samples(PERF_SCRIPT), STEPS)
    assert set(cpu) == {"none", "dbp"}
    assert sum(cpu["none"].values()) == pytest.approx(0.002)  # Python + MatMul, 1 ms each
    # dbp: its untimed step's malloc sample is dropped; SyncPlan and the memmove count.
    assert cpu["dbp"] == {("_nestpipe_ops.so", "tensorflow::nestpipe::SyncPlanOp::Compute"):
                          pytest.approx(0.001),
                          ("libc.so.6", "__memmove_avx_unaligned_erms"): pytest.approx(0.001)}
    # Positive control: counted as timed, the untimed step's sample would be dbp's.
    every = [dict(s, timed=True) for s in STEPS]
    assert ("libc.so.6", "malloc") in probe_profile.attribute(
        probe_profile.parse_samples(PERF_SCRIPT), every)["dbp"]


def test_summary_per_timed_step_with_categories_and_differences():
    summary = probe_profile.summarize(probe_profile.parse_samples(PERF_SCRIPT), STEPS)
    assert list(summary) == ["none", "dbp"]
    none, dbp = summary["none"], summary["dbp"]
    assert none["steps"] == dbp["steps"] == 1
    assert none["wall_ms"] == pytest.approx(2.0) and none["cpu_ms"] == pytest.approx(2.0)
    assert none["categories_us"] == {"Python": pytest.approx(1000), "TensorFlow kernels":
                                     pytest.approx(1000)}
    assert dbp["categories_us"] == {"our ops": pytest.approx(1000),
                                    "copies (memcpy / memset)": pytest.approx(1000)}
    top = dbp["top_symbols_over_base"]
    assert top[0][2] - top[0][1] == pytest.approx(1000) and top[-1][2] - top[-1][1] < 0
    lines = probe_profile.report_lines(summary, "cmd")
    assert "| dbp | 1 | 2.000 | 2.000 | 1.000x / 1.000x |" in lines
    assert any(line.startswith("| our ops | 0 | 1000 (+1000) |") for line in lines)


def test_categories():
    assert probe_profile.category("libc.so.6", "_int_free") == "allocation"
    assert probe_profile.category("libtensorflow_framework.so.2", "tsl::CPUAllocator::"
                                  "AllocateRaw") == "allocation"
    assert probe_profile.category("libtensorflow_framework.so.2", "ExecutorState::Process") == (
        "TensorFlow executor and framework")
    assert probe_profile.category("perf-123.map", "0x7f") == "JIT code (oneDNN)"
    assert probe_profile.category("[kernel.kallsyms]", "futex_wake") == (
        "OS kernel (scheduling, sockets)")
    assert probe_profile.category("libc.so.6", "pthread_mutex_lock") == "libc, other"
    assert probe_profile.category("libfoo.so", "bar") == "other: libfoo.so"
