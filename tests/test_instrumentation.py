"""Per-stage timing, exposure ratio, Chrome trace and TensorBoard output of profiled steps."""
import glob
import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_nestpipe.pipeline.instrumentation import (OpEvent, Timeline, exposed_length, is_op_event,
                                                  profile_steps, stage_of)


def test_stage_classification():
    assert stage_of("CollectiveAllToAllV2") == "communication"
    assert stage_of("PyFuncStateless", "x/nestpipe_emulated_latency") == "communication"
    assert stage_of("NestpipeRouteKeys") == "routing"
    assert stage_of("NestpipeGatherRows") == "retrieval"
    assert stage_of("NestpipeBufferSync") == "sync"
    assert stage_of("_MklMatMul") == "compute"
    assert is_op_event("dense/MatMul", "_MklMatMul")
    assert not is_op_event("EagerLocalExecute", " __inference_step_12")
    assert not is_op_event("cond", "StatelessIf")


@pytest.mark.parametrize("communication,other,expected", [
    ([(0, 10)], [], 10.0),
    ([(0, 10)], [(2, 4), (6, 8)], 6.0),
    ([(0, 10)], [(-5, 20)], 0.0),
    ([(0, 4), (3, 6), (10, 12)], [(5, 11)], 6.0),
])
def test_exposed_length(communication, other, expected):
    assert exposed_length(communication, other) == pytest.approx(expected)


def test_step_profile_from_events():
    events = [OpEvent("a2a", "CollectiveAllToAllV2", "t1", 0.0, 4000.0),
              OpEvent("mm", "_MklMatMul", "t2", 1000.0, 2000.0),
              OpEvent("route", "NestpipeRouteKeys", "t2", 3500.0, 1000.0)]
    profile = Timeline(steps=[events], windows=[(0.0, 6000.0)]).profiles()[0]
    assert profile.step_ms == pytest.approx(6.0)
    assert profile.communication_ms == pytest.approx(4.0)
    assert profile.exposed_communication_ms == pytest.approx(1.5)
    assert profile.exposure_ratio == pytest.approx(0.375)
    assert profile.stage_ms["compute"] == pytest.approx(2.0)
    assert profile.stage_ms["routing"] == pytest.approx(1.0)
    assert profile.ops == 3


def test_profile_real_steps_writes_chrome_trace_and_tensorboard(tmp_path):
    model = tf_keras.Sequential([tf_keras.layers.Dense(16, activation="relu"), tf_keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices(
        (np.random.rand(64, 8).astype("float32"), np.random.rand(64, 1).astype("float32")))
    iterator = iter(data.batch(16).repeat())
    train_function = model.make_train_function()
    train_function(iterator)
    timeline = profile_steps(lambda: train_function(iterator), 2, str(tmp_path / "profile"))
    profiles = timeline.profiles()
    assert len(profiles) == 2
    assert all(p.step_ms > 0 and p.stage_ms["compute"] > 0 for p in profiles)
    assert all(p.communication_ms == 0 and p.exposure_ratio == 0 for p in profiles)
    # Two Dense layers' forward, backward and SGD update: a few dozen executed ops per step.
    assert all(10 < p.ops < 500 for p in profiles)
    trace_path = tmp_path / "trace.json"
    timeline.to_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())["traceEvents"]
    assert any(e.get("cat") == "step" for e in trace)
    assert any(e.get("cat") == "compute" and "MatMul" in e["args"]["op"] for e in trace if "args" in e and "op" in e["args"])
    timeline.write_tensorboard(str(tmp_path / "tb"))
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
