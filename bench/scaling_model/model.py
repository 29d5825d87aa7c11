"""The scaling model: step time of the DLRM example's NestPipe step on W workers from stage costs.

One step of a worker holding `b` samples (weak scaling: `b` fixed, global batch W*b):

    none    T = cpu_fetch + comm_fetch + compute + grad_a2a + all_reduce (dense + metric scalars)
    dbp     T = ov(P, K) + overhead      P = cpu_fetch + comm_fetch + sync (batch i+1)
                                         K = compute + grad_a2a + all_reduce (batch i)
    fwp     T = R + F_1 + sum_j ov(k, F_j+1) + k + G + all_reduce,  k = (compute + overhead) / M
              R = the window's route (one dedup of the batch, one keys all-to-all), F_j = micro-
              batch j's retrieval + rows all-to-all (the ids the window first sees in it),
              G = one gradient all-to-all for the whole window
    nested  T = dbp's formula with nested's overhead: a look-ahead window is fetched in one
              exchange (the batch's distinct ids, as dbp), only the compute is micro-batched

cpu_fetch = routing (dedup + bucketing + owner dedup) + retrieval (gathers and their adjoints);
comm_fetch = keys all-to-all + rows all-to-all, the per-owner key counts riding in the keys
all-to-all as a small header (padded to a capacity hint known ahead; the overflow second exchange
when a hint is exceeded is rare in steady state and not modelled); G = the gradient rows'
all-to-all. sync = the Dual-Buffer re-sync of one prefetch buffer: its plan's counts ride on the
rows all-to-all and its fresh rows on the next keys all-to-all, so it pays no collective latency,
only the bandwidth of its padded rows block (`collective_bandwidth_ms`), on the prefetch side.
`ov(a, b) = max(a, b) + (1 - eta) * min(a, b)`: eta = 1 is perfect overlap (a separate
communication engine), eta = 0 none (everything competes for the same cores).
Collectives follow `collective_ms`; key counts, padded capacities and re-sync rows come from
the sampled key statistics (`bench.scaling_model.keys`), interpolated in log(samples), log(W).
"""
import dataclasses
import math
from typing import Dict, NamedTuple, Optional, Tuple

# The collectives' cost formula is the placement planner's (shipped in the package).
from tf_nestpipe.plan.collective_costs import (  # noqa: F401  (re-exported)
    CollectiveParams, collective_ms, collective_steps)

PIPELINES = ("none", "dbp", "fwp", "nested")
COLLECTIVES = ("all_to_all", "all_gather", "all_reduce")
KEY_BYTES = 8  # int64 keys
HEADER_BYTES = 8  # the keys all-to-all's header: W + 1 int64 entries per block
# The padded exchange's capacities, as tf_nestpipe.collectives.communication buckets them.
_CAPACITIES = sorted({int(math.ceil(1.19 ** k)) for k in range(0, 124)})


class ModelError(ValueError):
    """A question the model cannot answer from the costs it was given (e.g. a worker count
    outside the sampled key statistics, or an unknown pipeline)."""


def padded_capacity(count):
    """The capacity the padded all-to-all uses for `count` keys to one owner: the smallest
    bucket ceil(1.19**k) >= count (at least 1), as `capacity_bucket` picks it."""
    need = max(1, int(math.ceil(count - 1e-9)))
    for capacity in _CAPACITIES:
        if capacity >= need:
            return capacity
    raise ModelError("padded capacity for %d keys is beyond the largest bucket" % need)


def collective_bandwidth_ms(kind, params: CollectiveParams, workers, nbytes):
    """The bandwidth part of `collective_ms`: the time `nbytes` add to a collective of `kind` that
    is issued anyway (bytes riding on another exchange pay none of its latency). With `measured`
    params that is slope * MB; with the formula the beta term."""
    return collective_ms(kind, params, workers, nbytes) - collective_ms(kind, params, workers, 0)


def overlap(a, b, eta):
    """Time of two overlapped activities of `a` and `b` ms: max + (1 - eta) * min."""
    return max(a, b) + (1.0 - eta) * min(a, b)


class KeyStats:
    """The sampled key statistics grid (see `bench.scaling_model.keys`), interpolated bilinearly in
    (log samples, log workers); raises ModelError outside the sampled cells."""

    def __init__(self, grid):
        self.samples = [float(n) for n in grid["samples"]]
        self.workers = [float(w) for w in grid["workers"]]
        self.grid = grid

    @staticmethod
    def _bracket(values, x, what):
        if x < values[0] - 1e-9 or x > values[-1] + 1e-9:
            raise ModelError("key statistics cover %s %g..%g, not %g (rerun `python -m "
                             "bench.scaling_model --measure` with a wider grid)"
                             % (what, values[0], values[-1], x))
        for i in range(len(values) - 1):
            if values[i] <= x <= values[i + 1]:
                lo, hi = values[i], values[i + 1]
                t = 0.0 if hi == lo else (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return i, min(max(t, 0.0), 1.0)
        return len(values) - 1, 0.0

    def at(self, name, samples, workers):
        """Statistic `name` for `samples` per worker on `workers` workers."""
        i, ti = self._bracket(self.samples, samples, "samples per worker")
        j, tj = self._bracket(self.workers, workers, "worker counts")
        table = self.grid[name]
        value = 0.0
        for di, wi in ((0, 1 - ti), (1, ti)):
            for dj, wj in ((0, 1 - tj), (1, tj)):
                if wi * wj == 0:
                    continue
                cell = table[i + di][j + dj]
                if cell is None:
                    raise ModelError("key statistic %r not sampled for %g samples x %g workers "
                                     "(samples * workers above the sampled maximum)"
                                     % (name, self.samples[i + di], self.workers[j + dj]))
                value += wi * wj * cell
        return value


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Where the stage costs run: collective parameters per kind, the overlap efficiency `eta`,
    and (testbed only) CPU contention factors by worker count (W processes on shared cores)."""

    name: str
    label: str
    collectives: Dict[str, CollectiveParams]
    eta: float
    contention: Optional[Dict[int, float]] = None
    notes: Tuple[str, ...] = ()

    def cpu_factor(self, workers):
        """Slowdown of CPU stages with `workers` workers (1 without contention)."""
        if self.contention is None:
            return 1.0
        if workers not in self.contention:
            raise ModelError("scenario %r has CPU contention factors for %s workers only, not %d"
                             % (self.name, sorted(self.contention), workers))
        return self.contention[workers]


class Window(NamedTuple):
    """The modelled exchanges of one frozen window (ms; `rounds`: per micro-batch (retrieval
    cpu, rows all-to-all, padded slots))."""

    route_cpu: float
    keys: float
    rounds: Tuple[Tuple[float, float, float], ...]
    grad: float


class StepModel:
    """Predicts one step's time for a pipeline, worker count and per-worker batch from a costs
    dict (the plan_costs.json layout, see `bench.scaling_model.costs`) under a Scenario."""

    def __init__(self, costs, scenario: Scenario, overheads=True):
        self.costs = costs
        self.scenario = scenario
        self.keys = KeyStats(costs["keys"])
        workload = costs["workload"]
        self.fields = int(workload["fields"])
        self.row_bytes = 4 * int(workload["dim"])
        self.dense_bytes = 4 * int(workload["dense_params"])
        # tf_keras fit all-reduces the loss mean's total and count every step (two scalars).
        self.metric_all_reduces = int(workload.get("metric_all_reduces", 0))
        self.overheads = overheads

    # --- stage costs ------------------------------------------------------------------------
    def routing_ms(self, ids, slots):
        """Dedup + bucket-by-owner of `ids` ids and the owner-side dedup over `slots` slots."""
        r = self.costs["routing"]
        return r["base_ms"] + (r["per_id_us"] * ids + r["per_slot_us"] * slots) / 1e3

    def retrieval_ms(self, rows):
        """Owner gather + slot gather + inverse rebuild (and adjoints) touching `rows` rows."""
        r = self.costs["retrieval"]
        return r["base_ms"] + r["per_row_us"] * rows / 1e3

    def compute_ms(self, batch):
        """Dense forward/backward + optimizer update + step overhead of `batch` samples."""
        c = self.costs["compute"]
        return c["base_ms"] + c["per_sample_us"] * batch / 1e3

    def overhead_ms(self, pipeline, batch):
        """Extra op overhead of running `pipeline` (measured on one worker), 0 for none."""
        if pipeline == "none" or not self.overheads:
            return 0.0
        o = self.costs["pipeline_overhead"][pipeline]
        return max(0.0, o["base_ms"] + o["per_sample_us"] * batch / 1e3)

    def _coll(self, kind, workers, nbytes):
        return collective_ms(kind, self.scenario.collectives[kind], workers, nbytes)

    def lookup(self, samples, workers):
        """(cpu_fetch, comm_fetch, grad_a2a, exchanged slots) of one lookup of `samples` samples
        per worker (none, dbp, and nested's one window exchange). comm_fetch = keys all-to-all
        (the per-owner counts ride in it: a W x (W + 1) int64 header) + rows all-to-all."""
        window = self.window(samples, workers, 1)
        (retrieval, rows, slots), = window.rounds
        return window.route_cpu + retrieval, window.keys + rows, window.grad, slots

    def _round_slots(self, samples, workers, share):
        """(padded slots, owner rows) of one round's rows exchange: the ids of `samples`
        samples, a fraction `share` of them new to the window."""
        if workers == 1:
            unique = self.keys.at("unique", samples, workers) * share
            return unique, unique
        slots = workers * padded_capacity(self.keys.at("capacity", samples, workers) * share)
        return slots, self.keys.at("owner_rows", samples, workers) * share

    def window(self, samples, workers, micro_batches):
        """The exchanges of a frozen window of `micro_batches` rounds over `samples` samples per
        worker, as the implementation runs them (`route_rounds`): one route of the whole batch
        (one dedup, one keys all-to-all padded to the batch's per-owner capacity, with a
        W x (W x M + 1) header), then round j's retrieval and rows all-to-all fetching only the
        ids first seen in micro-batch j, and one gradient all-to-all for all rounds' rows.
        One round is the plain lookup."""
        m = int(micro_batches)
        micro = samples / m
        shares = [1.0]
        if m > 1:
            # The first micro-batch fetches all its distinct ids; the later ones share the ids
            # the batch adds beyond them.
            unique_batch = self.keys.at("unique", samples, workers)
            unique_micro = self.keys.at("unique", micro, workers)
            shares += [max(unique_batch - unique_micro, 0.0) / (m - 1) / unique_micro] * (m - 1)
        rounds = []
        for share in shares:
            slots, owner_rows = self._round_slots(micro, workers, share)
            retrieval = self.retrieval_ms(owner_rows + slots + micro * self.fields)
            rows = self._coll("all_to_all", workers, slots * self.row_bytes)
            rounds.append((retrieval, rows, slots))
        route_slots, _ = self._round_slots(samples, workers, 1.0)
        header = workers * (workers * m + 1) * HEADER_BYTES
        return Window(
            route_cpu=self.routing_ms(samples * self.fields, route_slots),
            keys=self._coll("all_to_all", workers, route_slots * KEY_BYTES + header),
            rounds=tuple(rounds),
            grad=self._coll("all_to_all", workers,
                            sum(slots for _, _, slots in rounds) * self.row_bytes))

    def sync(self, samples, workers):
        """(plan, send) ms of the Dual-Buffer re-sync of one buffer. The plan's counts ride on the
        rows all-to-all (no collective of their own: plan = 0); the fresh rows ride on the next
        keys all-to-all as int64 bit copies of the padded block (W x capacity x (row bytes + 4)),
        so send is only the bandwidth of those bytes on an all-to-all, no latency."""
        if workers == 1:
            return 0.0, 0.0
        capacity = padded_capacity(self.keys.at("sync_capacity", samples, workers))
        send = collective_bandwidth_ms("all_to_all", self.scenario.collectives["all_to_all"],
                                       workers, workers * capacity * (self.row_bytes + 4))
        return 0.0, send

    # --- one step -------------------------------------------------------------------------
    def step(self, pipeline, workers, batch, micro_batches=4):
        """Predicted step time and its parts (ms) for `batch` samples per worker."""
        if pipeline not in PIPELINES:
            raise ModelError("unknown pipeline %r (one of %s)" % (pipeline, ", ".join(PIPELINES)))
        workers, m = int(workers), int(micro_batches)
        if workers < 1 or m < 1 or batch <= 0:
            raise ModelError("need workers >= 1, micro_batches >= 1 and batch > 0")
        eta, kappa = self.scenario.eta, self.scenario.cpu_factor(workers)
        compute = kappa * self.compute_ms(batch)
        overhead = kappa * self.overhead_ms(pipeline, batch)
        all_reduce = (self._coll("all_reduce", workers, self.dense_bytes)
                      + self.metric_all_reduces * self._coll("all_reduce", workers, 4))
        parts = {"compute": compute, "overhead": overhead, "all_reduce": all_reduce}
        if pipeline in ("none", "dbp", "nested"):
            # nested fetches its window as dbp fetches its batch (one exchange of the batch's
            # distinct ids); only its compute is micro-batched (in its overhead).
            cpu, comm, grad, _ = self.lookup(batch, workers)
            parts.update(cpu_fetch=kappa * cpu, comm_fetch=comm, grad_a2a=grad)
            if pipeline == "none":
                total = kappa * cpu + comm + compute + grad + all_reduce
            else:
                plan, send = self.sync(batch, workers)  # rides on the next keys exchange
                prefetch = kappa * cpu + comm + plan + send
                critical = compute + grad + all_reduce
                parts.update(sync=plan + send)
                total = overlap(prefetch, critical, eta) + overhead
        else:
            window = self.window(batch, workers, m)
            fetches = [kappa * retrieval + rows for retrieval, rows, _ in window.rounds]
            slot = (compute + overhead) / m
            parts.update(cpu_fetch=kappa * (window.route_cpu + sum(r for r, _, _ in window.rounds)),
                         comm_fetch=window.keys + sum(rows for _, rows, _ in window.rounds),
                         grad_a2a=window.grad)
            total = kappa * window.route_cpu + window.keys + fetches[0]
            for j in range(m - 1):
                total += overlap(slot, fetches[j + 1], eta)
            total += slot + window.grad + all_reduce
        parts["total_ms"] = total
        return parts

    def step_ms(self, pipeline, workers, batch, micro_batches=4):
        """Predicted step time in ms."""
        return self.step(pipeline, workers, batch, micro_batches)["total_ms"]

    def efficiency(self, pipeline, workers, batch, micro_batches=4):
        """Scaling efficiency T(1 worker, b) / T(W workers, b) of `pipeline` at a fixed per-worker
        batch b (weak scaling; each pipeline against itself on one worker): 1.0 at W = 1."""
        return self.step_ms(pipeline, 1, batch, micro_batches) / self.step_ms(
            pipeline, workers, batch, micro_batches)
