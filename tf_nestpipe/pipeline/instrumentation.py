"""Per-stage timing, communication exposure and a Chrome-trace timeline of training steps.

`profile_steps(run_step, steps, logdir)` runs `run_step()` `steps` times under the TensorFlow
profiler, reads the op events of this process back from the trace (XSpace), and returns a
`Timeline`: for each step the wall time, the time each stage was busy (union of its ops'
intervals, so concurrent ops count once) and the exposure ratio

    exposure = (time some collective runs while no other op runs) / (time some collective runs)

— 0 when every collective is hidden behind other work, 1 when none is. `Timeline.to_chrome_trace`
writes a `chrome://tracing` / Perfetto JSON file (one row per executor thread, ops colored by
stage) and `Timeline.write_tensorboard` logs the numbers as TensorBoard scalars.
"""
import dataclasses
import glob
import json
import os
from typing import Dict, List

import tensorflow as tf

STEP_EVENT = "nestpipe_step"
STAGES = ("routing", "retrieval", "communication", "sync", "compute")
_ROUTING_TYPES = {"NestpipeRouteKeys", "NestpipeOwnerDedup", "RaggedTensorToTensor"}
_RETRIEVAL_TYPES = {"ResourceGather", "NestpipeGatherRows"}
_SYNC_TYPES = {"NestpipeSyncPlan", "NestpipeBufferSync"}
# Ops whose duration spans other ops or waits rather than computes: not counted as work.
_CONTAINER_TYPES = {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
                    "PartitionedCall", "StatefulPartitionedCall", "IteratorGetNext",
                    "IteratorGetNextAsOptional", "MultiDeviceIteratorGetNextFromShard",
                    "_Recv", "_Send", "_HostRecv", "_HostSend", "NoOp"}
EMULATED_LATENCY_OP = "nestpipe_emulated_latency"


def is_op_event(name, op_type):
    """Whether a trace event `name:op_type` is a real op execution worth timing."""
    return op_type.isidentifier() and op_type not in _CONTAINER_TYPES and " " not in name


def stage_of(op_type, name=""):
    """The pipeline stage of an op (the benchmark's emulated network latency counts as
    communication; a socket-mesh exchange is asynchronous, so its event covers its sends only)."""
    if (op_type.startswith("Collective") or op_type.startswith("Nccl")
            or op_type.startswith("NestpipeSocket") or EMULATED_LATENCY_OP in name):
        return "communication"
    if op_type in _ROUTING_TYPES:
        return "routing"
    if op_type in _RETRIEVAL_TYPES:
        return "retrieval"
    if op_type in _SYNC_TYPES:
        return "sync"
    return "compute"


@dataclasses.dataclass
class OpEvent:
    """One op execution: `name` is the op's node name, times in microseconds."""

    name: str
    op_type: str
    thread: str
    start_us: float
    duration_us: float

    @property
    def stage(self):
        return stage_of(self.op_type, self.name)

    @property
    def end_us(self):
        return self.start_us + self.duration_us


def _union_length(intervals):
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def _merge(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def exposed_length(communication, other):
    """Length of the union of `communication` intervals not covered by any `other` interval."""
    covered = _merge(other)
    exposed = 0.0
    for start, end in _merge(communication):
        cursor = start
        for c_start, c_end in covered:
            if c_end <= cursor or c_start >= end:
                continue
            if c_start > cursor:
                exposed += c_start - cursor
            cursor = max(cursor, c_end)
            if cursor >= end:
                break
        if cursor < end:
            exposed += end - cursor
    return exposed


@dataclasses.dataclass
class StepProfile:
    """Timing of one training step on this worker (milliseconds)."""

    step_ms: float
    stage_ms: Dict[str, float]
    communication_ms: float
    exposed_communication_ms: float
    ops: int = 0  # ops the executor ran in the step (each a dispatch: ~2-5 us on a CPU core)

    @property
    def exposure_ratio(self):
        """Exposed / total communication time (0 if the step had no communication)."""
        if self.communication_ms <= 0:
            return 0.0
        return self.exposed_communication_ms / self.communication_ms


@dataclasses.dataclass
class Timeline:
    """Op events of profiled steps, grouped by step window."""

    steps: List[List[OpEvent]]
    windows: List[tuple]

    def profiles(self):
        """A `StepProfile` per step."""
        result = []
        for (start, end), events in zip(self.windows, self.steps):
            by_stage = {stage: [] for stage in STAGES}
            for event in events:
                by_stage[event.stage].append((event.start_us, event.end_us))
            other = [i for stage, items in by_stage.items() if stage != "communication" for i in items]
            communication = by_stage["communication"]
            result.append(StepProfile(
                step_ms=(end - start) / 1e3,
                stage_ms={stage: _union_length(items) / 1e3 for stage, items in by_stage.items()},
                communication_ms=_union_length(communication) / 1e3,
                exposed_communication_ms=exposed_length(communication, other) / 1e3,
                ops=len(events)))
        return result

    def to_chrome_trace(self, path):
        """Writes the steps as a Chrome trace (JSON) at `path`."""
        threads = sorted({e.thread for events in self.steps for e in events})
        tid = {name: i + 1 for i, name in enumerate(threads)}
        trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[t], "args": {"name": t}}
                 for t in threads]
        origin = self.windows[0][0] if self.windows else 0.0
        for index, ((start, end), events) in enumerate(zip(self.windows, self.steps)):
            trace.append({"name": "step %d" % index, "ph": "X", "pid": 0, "tid": 0, "cat": "step",
                          "ts": start - origin, "dur": end - start})
            for e in events:
                trace.append({"name": e.name, "ph": "X", "pid": 0, "tid": tid[e.thread],
                              "cat": e.stage, "ts": e.start_us - origin, "dur": e.duration_us,
                              "args": {"op": e.op_type, "stage": e.stage}})
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)

    def write_tensorboard(self, logdir, first_step=0):
        """Logs step time, per-stage time and exposure ratio as TensorBoard scalars."""
        writer = tf.summary.create_file_writer(logdir)
        with writer.as_default():
            for i, profile in enumerate(self.profiles()):
                step = first_step + i
                tf.summary.scalar("nestpipe/step_ms", profile.step_ms, step=step)
                tf.summary.scalar("nestpipe/exposure_ratio", profile.exposure_ratio, step=step)
                for stage, ms in profile.stage_ms.items():
                    tf.summary.scalar("nestpipe/stage_ms/" + stage, ms, step=step)
        writer.flush()


def read_xspace(logdir):
    """Op events and step windows from the newest profiler trace under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel

    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError("no profiler trace (*.xplane.pb) under %s" % logdir)
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    ops, windows = [], []
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                start = line.timestamp_ns / 1e3 + event.offset_ps / 1e6
                duration = event.duration_ps / 1e6
                if name == STEP_EVENT or name.startswith(STEP_EVENT + "#"):
                    windows.append((start, start + duration))
                elif ":" in name and "::" not in name:
                    node, op_type = name.rsplit(":", 1)
                    if is_op_event(node, op_type):
                        ops.append(OpEvent(node, op_type, line.name or str(line.id), start,
                                           duration))
    windows.sort()
    steps = [[e for e in ops if s <= e.start_us < t] for s, t in windows]
    return Timeline(steps=steps, windows=windows)


def profile_steps(run_step, steps, logdir):
    """Runs `run_step()` `steps` times under the TensorFlow profiler; returns their Timeline.

    In a multi-worker job, profile one worker (the others run the same steps unprofiled): TF
    2.21's profiler can abort the process when it stops (`free(): invalid pointer` in tsl's
    `TraceMeRecorder::Consume`, seen with 4 workers and concurrent collectives), and each
    profiled process adds a chance of that."""
    tf.profiler.experimental.start(logdir)
    try:
        for index in range(steps):
            with tf.profiler.experimental.Trace(STEP_EVENT, step_num=index, _r=1):
                result = run_step()
                tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)
    finally:
        tf.profiler.experimental.stop()
    return read_xspace(logdir)
