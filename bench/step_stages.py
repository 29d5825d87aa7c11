"""Where a profiled step of ours spends its time, stage by stage, and what it waits on.

The profiler sees every op a step runs (`tf_nestpipe.pipeline.profile_steps`), but a
socket-mesh exchange is an asynchronous op: it records no event for the time its data is on
the wire. That time shows as a gap in which no op of the step runs at all. So:

- a stage's time is the union of its ops' intervals: route (dedup, owner buckets, counts),
  rows (owner gather, the requester's gather of received rows), dense forward, dense backward,
  embedding backward (segment sums of the row gradients), optimizer (dense and sparse), other;
- a wait is a gap of at least `MIN_GAP_US` with no op running; it is charged to the exchange
  whose result the op that ends the gap consumes (the keys exchange, with the sync riding on it,
  ends at the owner's reading of its counts or at its gather, the rows exchange at the
  requester's gather of received rows, the gradient exchange at the owner's sum of received
  gradients, the dense all-reduce at the first op of the socket mesh's sum (its name scope) or
  at the optimizer), else to "other".

The names are the op types and node names of tf_nestpipe's sharders and tf_keras' fit, which
is why this lives with the benchmarks: a renamed op moves its time to "other", visibly.
"""
import re
import statistics

from tf_nestpipe.collectives.sockets import ALL_REDUCE_SCOPE

MIN_GAP_US = 50.0
STAGES = ("route", "rows", "dense_forward", "dense_backward", "embedding_backward", "optimizer",
          "other")
WAITS = ("keys_exchange", "rows_exchange", "gradient_exchange", "dense_allreduce", "other")
_ROUTE = {"NestpipeFuseIds", "NestpipeRouteKeys", "NestpipeKeysBlock", "NestpipeRouteCounts",
          "NestpipeCapacityBucket", "NestpipeOwnerRounds", "NestpipeOwnerDedup", "Unique",
          "NestpipeSyncPlan"}
_OWNER_GATHER = {"NestpipeReadTableRows", "NestpipeGatherBlocks", "NestpipeBucketSlots"}
_REQUESTER_GATHER = {"NestpipeGatherFromBlocks", "NestpipeGatherRows", "NestpipeBufferSync"}
# TensorFlow numbers a scope's later uses within a graph: nestpipe_all_reduce_1/...
_DENSE_SUM = re.compile(r"(^|/)%s(_\d+)?/" % re.escape(ALL_REDUCE_SCOPE))


def _in_dense_sum(name):
    """Whether an op is one of the socket mesh's dense sum that read what the peers sent."""
    return _DENSE_SUM.search(name) is not None


def stage_of(name, op_type):
    """The stage of one op event (see the module docstring)."""
    if _in_dense_sum(name):
        return "other"
    if op_type in _ROUTE:
        return "route"
    if op_type in _OWNER_GATHER or op_type in _REQUESTER_GATHER:
        return "rows"
    if op_type == "NestpipeSegmentSum":
        return "embedding_backward"
    if name.startswith(("Adagrad", "SGD", "Adam")) or op_type.startswith("ResourceApply"):
        return "optimizer"
    if name.startswith("gradient_tape/") or op_type.endswith("Grad"):
        return "dense_backward"
    if "/" in name and not name.startswith(("Identity", "Read/")):
        return "dense_forward"
    return "other"


def wait_of(name, op_type):
    """The exchange a gap ending at this op waited for."""
    if op_type in _OWNER_GATHER or op_type == "NestpipeRouteCounts":
        return "keys_exchange"
    if op_type in _REQUESTER_GATHER:
        return "rows_exchange"
    if op_type == "NestpipeSegmentSum" and not name.startswith("gradient_tape/"):
        return "gradient_exchange"
    # A gap ending where the sum's all-to-all starts waited for what it sends, not for peers.
    if ((_in_dense_sum(name) and op_type != "NestpipeSocketAllToAll")
            or name.startswith(("Adagrad", "SGD", "Adam"))):
        return "dense_allreduce"
    return "other"


def _union_ms(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def step_breakdown(events, window):
    """One step's stage and wait times (ms).

    Args:
      events: the step's `OpEvent`s (name, op_type, start_us, end_us).
      window: (start_us, end_us) of the step.

    Returns:
      dict(step_ms, stage_ms {stage: ms}, wait_ms {exchange: ms}, waiting_ms: all gaps).
    """
    by_stage = {s: [] for s in STAGES}
    for e in events:
        by_stage[stage_of(e.name, e.op_type)].append((e.start_us, e.end_us))
    waits = {w: 0.0 for w in WAITS}
    cursor = window[0]
    for e in sorted(events, key=lambda e: e.start_us):
        if e.start_us - cursor >= MIN_GAP_US:
            waits[wait_of(e.name, e.op_type)] += (e.start_us - cursor) / 1e3
        cursor = max(cursor, e.end_us)
    if window[1] - cursor >= MIN_GAP_US:
        waits["other"] += (window[1] - cursor) / 1e3
    return {"step_ms": (window[1] - window[0]) / 1e3,
            "stage_ms": {s: _union_ms(v) for s, v in by_stage.items()},
            "wait_ms": waits, "waiting_ms": sum(waits.values())}


def breakdown(timeline):
    """The medians over a `Timeline`'s steps of `step_breakdown` (same keys)."""
    steps = [step_breakdown(events, window)
             for events, window in zip(timeline.steps, timeline.windows)]
    if not steps:
        return {}
    median = statistics.median
    return {"step_ms": median(s["step_ms"] for s in steps),
            "stage_ms": {k: median(s["stage_ms"][k] for s in steps) for k in STAGES},
            "wait_ms": {k: median(s["wait_ms"][k] for s in steps) for k in WAITS},
            "waiting_ms": median(s["waiting_ms"] for s in steps)}
