"""Compressed exchanges on 2 workers (one launch, tests/programs/wire_dtypes.py): the fp32 wire
equals one process as before; each compressed wire stays within a stated tolerance of one
process after 20 steps and is not bit-equal to it; the bytes each exchange counts shrink by the
codec's ratio (the DBP sync's rows too, its positions exact) and DBP on a compressed wire
equals the unpipelined run on it; a loss-scaled fp16 gradient exchange clamps (and counts)
instead of sending inf.
Also: `NestPipeStrategy(wire_dtype=...)`'s errors."""
import os
import sys

import numpy as np
import pytest

import tf_nestpipe as tnp
from conftest import PROGRAMS, background_fixture, launch, load_run, run_command, run_together

STEPS = 20
DIM = 4  # exactness.py's table dim: an int8 row is ceil((4 + 8) / 4) = 3 words, 12 bytes
RUNS = ["direct:sgd:fp32-fp32", "direct:sgd:bf16-bf16", "direct:sgd:fp16-fp16",
        "direct:sgd:int8-bf16",
        "loop:adagrad:fp32-fp32:dbp", "loop:adagrad:int8-bf16:dbp", "loop:adagrad:int8-fp16:dbp",
        "loop:adagrad:int8-bf16", "loop:adagrad:fp32-fp32:nested", "loop:adagrad:bf16-fp16:nested",
        "loop:adagrad:int8-bf16:nested", "loop:adagrad:int8-bf16:nested:nosync",
        "fit:adam:fp32-fp32", "fit:adam:int8-bf16", "fit:adam:bf16-fp16",
        "direct:sgd:fp32-fp32:scaled", "direct:sgd:fp16-fp16:scaled"]
# Largest parameter difference from one process after 20 steps (parameters up to ~0.9).
# Measured (2 workers): SGD and Adam 1e-4 to 9e-4, Adagrad (lr 0.3: its first steps normalize
# the gradient, so small relative errors move the dense weights most) up to 9.7e-3; fp32 9e-8.
EXACT_TOLERANCE = 1e-5
COMPRESSED_TOLERANCE = 2e-2


@background_fixture
def wire_results(tmp_path_factory):
    """The single-process references (exactness.py) and every RUN in one 2-worker launch."""
    out = tmp_path_factory.mktemp("wire")
    references = sorted({":".join(run.split(":")[:2]) for run in RUNS})
    ref, result = run_together(  # independent: at once
        (run_command, [sys.executable, os.path.join(PROGRAMS, "exactness.py"), str(out / "ref"),
                       str(STEPS)] + references),
        (launch, 2, [os.path.join(PROGRAMS, "wire_dtypes.py"), str(out / "w2"), str(STEPS)]
         + RUNS, 900))
    assert ref.returncode == 0, ref.stdout[-4000:]
    assert result.returncode == 0, result.stdout[-6000:]
    return str(out / "ref"), str(out / "w2")


def _load(results, run):
    ref_prefix, prefix = results
    got = load_run(prefix, run)
    ref = load_run(ref_prefix, ":".join(run.split(":")[:2]))
    return ref, got


def _params(ref):
    names = [n for n in ref.files if not n.startswith("stats/")]
    assert len(names) == 6  # 2 tables + 4 dense
    return names


def _max_difference(ref, got):
    return max(float(np.abs(got[n] - ref[n]).max()) for n in _params(ref))


def _wire(got, kind):
    return int(got["wire/" + kind])


@pytest.mark.parametrize("run", [r for r in RUNS if "fp32-fp32" in r])
def test_fp32_wire_equals_one_process(wire_results, run):
    ref, got = _load(wire_results, run)
    for name in _params(ref):
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=EXACT_TOLERANCE,
                                   err_msg=name)
    assert _wire(got, "forward") > 0 and _wire(got, "backward") > 0 and _wire(got, "keys") > 0
    assert _wire(got, "clamped") == 0


@pytest.mark.parametrize("run", [r for r in RUNS if "fp32-fp32" not in r and "scaled" not in r
                                 and "nosync" not in r])
def test_compressed_wire_stays_close_to_one_process(wire_results, run):
    ref, got = _load(wire_results, run)
    difference = _max_difference(ref, got)
    assert difference <= COMPRESSED_TOLERANCE, difference
    assert difference > 1e-6  # the wire really was compressed: not the fp32 result
    assert _wire(got, "clamped") == 0


@pytest.mark.parametrize("run", [r for r in RUNS if "fp32-fp32" not in r and "scaled" not in r
                                 and "nosync" not in r and r != "loop:adagrad:int8-bf16"])
def test_compressed_wire_sends_fewer_bytes(wire_results, run):
    _, got = _load(wire_results, run)
    mode, optimizer, wire, *options = run.split(":")
    _, fp32 = _load(wire_results, ":".join([mode, optimizer, "fp32-fp32"] + options))
    forward, backward = wire.split("-")
    ratio = {"bf16": 0.5, "fp16": 0.5, "int8": 12 / (4 * DIM)}
    assert _wire(got, "backward") * 2 == _wire(fp32, "backward")
    if "dbp" in options or "nested" in options:
        # The sync plan's header: 2 float rows per block in fp32, 1 word row in int8.
        assert _wire(got, "forward") < ratio[forward] * 1.1 * _wire(fp32, "forward")
        # Sync entries: fp32 dim + 1 floats (20 bytes); int8 3 words + 1 position word (16
        # bytes); 16-bit dim + 2 entries (12 bytes). The plans are the same (routing only).
        sync_bytes = {"int8": 16, "bf16": 12, "fp16": 12}[forward]
        assert _wire(got, "sync") * 20 == _wire(fp32, "sync") * sync_bytes > 0
    else:
        assert _wire(got, "forward") == ratio[forward] * _wire(fp32, "forward")
        assert _wire(got, "sync") == 0


def test_dbp_on_a_compressed_wire_equals_the_unpipelined_run_on_it(wire_results):
    """The sync refreshes the stale prefetched rows with fresh ones in the same encoding: the
    pipeline adds no error of its own to the codec's."""
    _, plain = _load(wire_results, "loop:adagrad:int8-bf16")
    ref, pipelined = _load(wire_results, "loop:adagrad:int8-bf16:dbp")
    for name in _params(ref):
        np.testing.assert_allclose(pipelined[name], plain[name], rtol=0, atol=1e-6, err_msg=name)
    assert _wire(pipelined, "sync") > 0 and _wire(plain, "sync") == 0


def test_nested_on_a_compressed_wire_equals_the_unpipelined_run_on_it(wire_results):
    """The nested pipeline's one sync exchange per window (every micro-batch's fresh rows packed
    behind each other, encoded) patches each micro-batch's buffer as the unpipelined run reads
    its rows; micro-batching only reorders float sums."""
    _, plain = _load(wire_results, "loop:adagrad:int8-bf16")
    ref, nested = _load(wire_results, "loop:adagrad:int8-bf16:nested")
    for name in _params(ref):
        np.testing.assert_allclose(nested[name], plain[name], rtol=0, atol=1e-5, err_msg=name)
    assert _wire(nested, "sync") > 0
    # The positive control: without the sync, stale rows make the parameters differ.
    _, stale = _load(wire_results, "loop:adagrad:int8-bf16:nested:nosync")
    assert max(np.max(np.abs(stale[name] - plain[name])) for name in _params(ref)) > 1e-4


def test_loss_scaled_fp16_gradients_are_clamped_and_counted_not_inf(wire_results):
    ref, exact = _load(wire_results, "direct:sgd:fp32-fp32:scaled")
    for name in _params(ref):  # scaling by 2**24 and back is exact in fp32
        np.testing.assert_allclose(exact[name], ref[name], rtol=0, atol=EXACT_TOLERANCE)
    _, got = _load(wire_results, "direct:sgd:fp16-fp16:scaled")
    assert _wire(got, "clamped") > 0
    assert all(np.isfinite(got[name]).all() for name in _params(ref))
    assert _wire(exact, "clamped") == 0


def test_strategy_takes_and_checks_wire_dtype():
    strategy = tnp.NestPipeStrategy(wire_dtype={"forward": "int8", "backward": "bf16"})
    assert str(strategy.wire_dtype) == "int8/bf16"
    assert strategy.extended.embedding_exchange.wire.forward.name == "int8"
    assert tnp.NestPipeStrategy().wire_dtype.exact
    assert tnp.NestPipeStrategy(wire_dtype="bfloat16").wire_dtype == ("bf16", "bf16")
    with pytest.raises(ValueError, match=r"wire_dtype forward must be one of fp32, bf16, fp16, "
                                         r"int8.*'fp8'"):
        tnp.NestPipeStrategy(wire_dtype="fp8")
    with pytest.raises(ValueError, match=r"backward.*int8 encodes rows only"):
        tnp.NestPipeStrategy(wire_dtype="int8")
