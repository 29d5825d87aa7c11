"""bench/bound_profile.py's analysis: call stacks from `perf script`, each sample given to the
op kernel it ran under and to the timed step it fell in; no cluster and no perf are started."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import bound_profile  # noqa: E402

CONCAT = ("tensorflow::ConcatBaseOp<Eigen::ThreadPoolDevice, float, "
          "(tensorflow::AxisArgumentName)0>::Compute(tensorflow::OpKernelContext*)")
PERF_SCRIPT = """\
tf_Compute   100.0005:    1000000 
\t7f00 __memmove_avx_unaligned_erms (/lib/x86_64-linux-gnu/libc.so.6)
\t7f01 tensorflow::Shard (/x/libtensorflow_framework.so.2)
\t7f02 %s (/x/libtensorflow_cc.so.2)
\t7f03 tensorflow::ThreadPoolDevice::Compute (/x/libtensorflow_framework.so.2)

tf_Compute   100.0015:    2000000 
\t7f10 tensorflow::nestpipe::SegmentSumOp<float, int>::Compute (/w/_nestpipe_ops.so)

nestpipe_send   100.0025:    1000000 
\t7f20 __memmove_avx_unaligned_erms (/lib/x86_64-linux-gnu/libc.so.6)
\t7f21 [unknown] ([unknown])

python   100.0035:    1000000 
\t7f30 [unknown] (/tmp/perf-4242.map)

python   100.0200:    1000000 
\t7f40 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
""" % CONCAT
# One timed step of ours [100.000, 100.010], the last sample outside it; the bound's timed
# step holds no sample.
STEPS = [{"candidate": "compute_only", "start": 99.0, "end": 99.5, "timed": True},
         {"candidate": "none", "start": 100.000, "end": 100.010, "timed": True}]


def test_parse_stacks_reads_each_sample_with_its_frames_and_thread():
    samples = bound_profile.parse_stacks(PERF_SCRIPT)
    assert [s[0] for s in samples] == [100.0005, 100.0015, 100.0025, 100.0035, 100.02]
    assert samples[1][1] == 2000000 and samples[2][3] == "nestpipe_send"
    assert samples[0][2][0] == ("libc.so.6", "__memmove_avx_unaligned_erms")
    assert len(samples[0][2]) == 4
    assert samples[3][2] == [("perf-PID.map", "[unknown]")]  # the pid dropped


def test_a_sample_goes_to_the_innermost_op_kernel_it_ran_under():
    samples = bound_profile.parse_stacks(PERF_SCRIPT)
    assert bound_profile.op_kernel(samples[0][2], samples[0][3]) == "ConcatBaseOp"
    assert bound_profile.op_kernel(samples[1][2], samples[1][3]) == "nestpipe::SegmentSumOp"
    assert (bound_profile.op_kernel(samples[2][2], samples[2][3])
            == "no op kernel: copies (memcpy / memset) [nestpipe_send]")
    # Positive control: without the kernel's frame the same copy is nobody's kernel (the
    # device's dispatch is not a kernel).
    assert bound_profile.op_kernel(samples[0][2][:2] + samples[0][2][3:], "tf_Compute") == (
        "no op kernel: copies (memcpy / memset) [tf_Compute]")
    # A sample in our library named after another method of a kernel's class.
    destructor = "tensorflow::nestpipe::GradientCarrierOp::~GradientCarrierOp()"
    misnamed = [("libc.so.6", "__memset_avx2_unaligned_erms"), ("[unknown]", "[unknown]"),
                ("_nestpipe_ops.so", destructor)]
    assert bound_profile.op_kernel(misnamed, "tf_Compute") == "nestpipe::GradientCarrierOp"


def test_op_cpu_is_per_timed_step_and_drops_samples_outside_them():
    ops = bound_profile.op_cpu(bound_profile.parse_stacks(PERF_SCRIPT), STEPS)
    assert set(ops) == {"none"}
    assert ops["none"] == {
        "ConcatBaseOp": pytest.approx(1000),
        "nestpipe::SegmentSumOp": pytest.approx(2000),
        "no op kernel: copies (memcpy / memset) [nestpipe_send]": pytest.approx(1000),
        "no op kernel: JIT code (oneDNN) [python]": pytest.approx(1000)}
    # Positive control: a second timed step of ours halves the per-step CPU.
    two = STEPS + [{"candidate": "none", "start": 101.0, "end": 101.1, "timed": True}]
    assert bound_profile.op_cpu(bound_profile.parse_stacks(PERF_SCRIPT), two)["none"][
        "nestpipe::SegmentSumOp"] == pytest.approx(1000)


def test_op_lines_list_the_differences_from_the_bound():
    ops = {"compute_only": {"ResourceGatherOp": 1500.0, "PackOp": 100.0},
           "none": {"ResourceGatherOp": 100.0, "PackOp": 600.0, "ConcatBaseOp": 800.0}}
    lines = bound_profile.op_lines(ops, ["compute_only", "none"], top=2)
    rows = [line for line in lines if line.startswith("| `")]
    assert rows[0] == "| `ConcatBaseOp` | 0 | 800 (+800) |"
    assert rows[1] == "| `PackOp` | 100 | 600 (+500) |"
    assert rows[-1] == "| `ResourceGatherOp` | 1500 | 100 (-1400) |"  # the largest below
