"""`pipeline="auto"`: the first steps of training try each pipeline (and micro-batch count) on
real batches, time them, and every worker switches to the one that was fastest on the slowest
worker.

Every mode is exact (it trains the model a non-pipelined run trains), so the probe *is* training:
no batch is skipped or repeated. Switching away from a look-ahead mode first trains the batches
it holds, one per step, reading nothing (`TrainPipeline.progress_held`); those steps are not
timed. The probe runs in `rounds`: each round runs every candidate for `timed_steps` timed
steps, after `warmup_steps` untimed ones in the first round (tracing, first-call costs) and
`settle_steps` in later ones (a look-ahead mode primes again). Interleaving the candidates over
rounds spreads a change of the machine's load (other jobs, a slow start) over all of them
instead of charging it to whichever candidate ran then. The rounds run the candidates in the
orders of a balanced Latin square (`round_order`; the first round starts with the baseline):
over K rounds each candidate runs once in each place of a round and (K even) right after each
other candidate once, so neither its place nor its predecessor (whose held batches, caches and
allocations it inherits) favours one candidate.

A candidate is judged by its speed relative to the baseline *within each round*: its median
timed step over the baseline's in the same round, the median of that ratio over the rounds. A
load that comes and goes (another job, the machine's host) slows a whole round, every candidate
of it alike, and cancels out of the ratio; a median over all steps pooled would let the rounds
it hit decide. With three rounds or more the first is not judged: its steps follow each
candidate's trace, whose allocations and first calls still slow them unevenly. The workers
agree by one all-gather of their ratios (the max over workers decides, as a synchronous step
waits for the slowest). The first candidate is the baseline (none): another is chosen only if
it is faster by more than `margin` (a fraction), so timing noise does not trade the baseline
for an equal mode. `timings_ms` reports each candidate's median over the judged rounds' steps.

`AutoPipeline.probe_log` keeps every probe step's candidate, start, end and whether it was
timed (`ProbeStep`), e.g. to attribute a profiler's samples to the candidates.

The log also gives this worker's process CPU time per timed step of each candidate (every
thread: TensorFlow's pools, the exchange's) and the cores it kept busy (CPU time / wall time):
a worker whose baseline already keeps its cores busy all step has little waiting for a pipeline
to hide, and a pipeline's own work then shows in its step time one for one.

A short job does not pay for the probe: given the first epoch's length (`epoch_steps`, from
`fit`), the probe stops, and keeps the best candidate timed so far (the baseline unless another
was clearly faster), as soon as going on would make its cost exceed `budget` (5%) of that
epoch at the baseline's step time. Its cost is every probe step's time beyond the baseline's
median step, plus, before a candidate's first step, that step's trace (estimated as the largest
first step seen). A model too small to gain from a pipeline thus never traces one, and the
progress bar's step times stay those of the baseline but for that 5%.
"""
import statistics
import sys
import time
from typing import NamedTuple

import tensorflow as tf

from tf_nestpipe.pipeline.modes import AUTO_CANDIDATES, MICRO_BATCHED


class Candidate(NamedTuple):
    """A configuration `auto` tries: a pipeline mode and its micro-batch count (1 for the modes
    that do not micro-batch)."""

    mode: str
    micro_batches: int = 1

    def __str__(self):
        return self.mode if self.micro_batches == 1 else "%s(M=%d)" % (self.mode, self.micro_batches)


class AutoPipeline:
    """Runs training steps through `candidates` (`[(name, pipeline)]`, each pipeline with
    `progress` and `progress_held`; a name is any label, e.g. a `Candidate`), then through the
    fastest. `agree(times)` returns the per-candidate times as every worker must judge them
    (e.g. the max over workers); `log(text)` reports the choice."""

    def __init__(self, candidates, agree, warmup_steps=1, timed_steps=4, log=None, margin=0.05,
                 rounds=6, settle_steps=1, epoch_steps=None, budget=0.05, agree_budget=None):
        if (warmup_steps < 0 or timed_steps < 1 or rounds < 1 or settle_steps < 0
                or not 0 <= margin < 1):
            raise ValueError("auto pipeline needs warmup_steps >= 0, timed_steps >= 1, "
                             "rounds >= 1, settle_steps >= 0 and 0 <= margin < 1, got %r, %r, "
                             "%r, %r and %r" % (warmup_steps, timed_steps, rounds, settle_steps,
                                                margin))
        self._margin = margin
        self._candidates = list(candidates)
        self._agree = agree
        self._warmup = warmup_steps
        self._settle = settle_steps
        self._timed = timed_steps
        self._rounds = rounds
        self._log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._round = 0  # probe round
        self._place = 0  # place in this round's order
        self._index = 0  # candidate being probed (this round's order at its place)
        self._steps = 0  # steps the current candidate ran in this round
        self._times = {name: [] for name, _ in self._candidates}
        self._round_times = {name: {} for name, _ in self._candidates}  # round -> its times
        self._cpu_times = {name: [] for name, _ in self._candidates}  # process CPU seconds
        self._held = None  # a look-ahead pipeline whose held batches are trained first
        self.choice = None  # the chosen candidate's name, once agreed
        self.timings_ms = None  # {str(name): agreed median ms/step}
        self.ratios = None  # {str(name): agreed median over rounds of its step / the baseline's}
        self.cpu = None  # {str(name): CpuUse of this worker's timed steps}
        self.probe_log = []  # a ProbeStep per step a candidate ran while probing
        # The probe's budget (see `_within_budget`): `epoch_steps()` gives the first epoch's
        # steps (None: unknown, no budget); `agree_budget(values)` their max over the workers.
        self._epoch_steps = epoch_steps
        self._budget = budget
        self._agree_budget = agree_budget or agree
        self._extra_seconds = 0.0  # the probe's cost so far: its steps beyond the baseline's
        self._runs = {}  # steps each candidate ran while probing
        self._first_steps = {}  # each candidate's first step (its trace), seconds
        self.stopped_early = None  # why the probe stopped before its rounds, if it did

    @property
    def probe_steps_bound(self):
        """An upper bound on the steps the probe takes before the choice (held batches
        included, two per switch)."""
        per_round = [(self._warmup if r == 0 else self._settle) + self._timed + 2
                     for r in range(self._rounds)]
        return len(self._candidates) * sum(per_round)

    @property
    def pipeline(self):
        """The pipeline steps run through now."""
        if self.choice is not None:
            return dict(self._candidates)[self.choice]
        return self._candidates[self._index][1]

    @property
    def stats(self):
        """The statistics of the pipeline steps run through now."""
        return self.pipeline.stats

    def progress(self, iterator):
        """Trains on the next batch (a held one first, after a switch) and returns the step's
        outputs."""
        if self._held is not None:
            outputs = self._held.progress_held(iterator)
            if outputs is not None:
                return outputs
            self._held = None
        if self.choice is not None:
            return self.pipeline.progress(iterator)
        name, pipeline = self._candidates[self._index]
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = pipeline.progress(iterator)
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, outputs)
        end = time.perf_counter()
        elapsed, cpu = end - start, time.process_time() - cpu_start
        self._steps += 1
        untimed = self._warmup if self._round == 0 else self._settle
        timed = self._steps > untimed
        if timed:
            self._times[name].append(elapsed)
            self._round_times[name].setdefault(self._round, []).append(elapsed)
            self._cpu_times[name].append(cpu)
        self._count_cost(name, elapsed)
        self.probe_log.append(ProbeStep(str(name), start, end, timed))
        if self._steps == untimed + self._timed:
            self._next_candidate(pipeline)
        return outputs

    def _count_cost(self, name, elapsed):
        """Counts a probe step: its time beyond the baseline's median step is the probe's cost
        (a candidate's first step: its trace too)."""
        self._runs[name] = self._runs.get(name, 0) + 1
        if self._runs[name] == 1:
            self._first_steps[name] = elapsed
        baseline = self._candidates[0][0]
        if name != baseline and self._times[baseline]:
            self._extra_seconds += max(elapsed - statistics.median(self._times[baseline]), 0.0)

    def _within_budget(self, next_name):
        """Whether the probe may run `next_name`'s next steps: its cost so far (every probe
        step's time beyond the baseline's median step) plus the next candidate's first step
        if it has not run yet (a trace, estimated as the largest seen: the baseline's own
        first step beyond its median, or another candidate's) stays within `budget` of the
        first epoch (its steps at the baseline's median step). Agreed over the workers (the
        largest cost against the smallest budget), so every worker stops at the same step."""
        steps = self._epoch_steps() if self._epoch_steps is not None else None
        baseline = self._candidates[0][0]
        if not steps or not self._times[baseline]:
            return True
        base = statistics.median(self._times[baseline])
        upcoming = 0.0 if self._runs.get(next_name) else max(
            max(self._first_steps.values()) - base, 0.0)
        cost, negative_budget = self._agree_budget(
            [self._extra_seconds + upcoming, -self._budget * steps * base])
        if cost <= -negative_budget:
            return True
        self.stopped_early = (
            "its cost would exceed %.0f%% of the first epoch (%d steps of %.1f ms: %.0f ms; "
            "spent %.0f ms, next %s's first step ~%.0f ms)" % (
                100 * self._budget, steps, 1e3 * base, -1e3 * negative_budget,
                1e3 * self._extra_seconds, next_name, 1e3 * upcoming))
        return False

    def _next_candidate(self, pipeline):
        self._steps = 0
        self._place += 1
        if self._place == len(self._candidates):
            self._place = 0
            self._round += 1
            if self._round == self._rounds:
                self._choose()
        if self.choice is None:
            index = round_order(len(self._candidates), self._round)[self._place]
            if self._within_budget(self._candidates[index][0]):
                self._index = index
            else:
                self._choose()
        if self.pipeline is not pipeline:
            self._held = pipeline  # its look-ahead batches come next

    def _judged_rounds(self):
        """The rounds whose steps judge the candidates: every round the baseline was timed in,
        but the first when three or more were (see the module docstring)."""
        rounds = sorted(self._round_times[self._candidates[0][0]])
        return rounds[1:] if len(rounds) >= 3 else rounds

    def _local_ratio(self, name, rounds):
        """This worker's median over `rounds` of `name`'s median step / the baseline's in the
        same round (inf where it was timed in none of them)."""
        baseline = self._round_times[self._candidates[0][0]]
        ratios = [statistics.median(self._round_times[name][r])
                  / max(statistics.median(baseline[r]), 1e-9)
                  for r in rounds if self._round_times[name].get(r)]
        return statistics.median(ratios) if ratios else float("inf")

    def _choose(self):
        names = [name for name, _ in self._candidates]
        rounds = self._judged_rounds()
        # A candidate the probe stopped before timing is never chosen.
        local = [statistics.median([t for r in rounds for t in self._round_times[name].get(r, [])]
                                   or [float("inf")]) for name in names]
        ratios = [self._local_ratio(name, rounds) for name in names]
        agreed = self._agree(local + ratios)  # one all-gather for both
        agreed, ratios = agreed[:len(names)], agreed[len(names):]
        self.timings_ms = {str(name): 1e3 * t for name, t in zip(names, agreed)}
        self.ratios = {str(name): r for name, r in zip(names, ratios)}
        self.cpu = {str(name): CpuUse.of(self._cpu_times[name], self._times[name])
                    if self._times[name] else None for name in names}
        best = min(range(len(names)), key=lambda i: ratios[i])
        if ratios[best] > 1 - self._margin:
            best = 0  # not clearly faster than the baseline
        self.choice = names[best]
        stopped = ("" if self.stopped_early is None else
                   " (the probe stopped after %d of %d rounds: %s)" % (
                       self._round, self._rounds, self.stopped_early))
        self._log("tf_nestpipe: pipeline='auto' chose %r: median ms/step over %d judged of %d "
                  "rounds of %d timed steps (slowest worker; in brackets: vs %r in the same "
                  "rounds) %s; another mode than %r needs to be %.0f%% faster; this worker's "
                  "process CPU ms/step (cores busy) %s%s"
                  % (str(self.choice), len(rounds), self._rounds, self._timed, str(names[0]),
                     ", ".join("%s %.1f (%.2fx)" % (name, ms, self.ratios[name])
                               if ms != float("inf") else "%s not run" % name
                               for name, ms in self.timings_ms.items()),
                      str(names[0]), 100 * self._margin, ", ".join(
                          "%s %.1f (%.2f)" % (name, use.ms_per_step, use.cores_busy)
                          for name, use in self.cpu.items() if use is not None), stopped))


def round_order(count, round_index):
    """The order (candidate indices) in which probe round `round_index` runs `count` candidates:
    row `round_index % count` of a Williams balanced Latin square, whose first row is
    0, 1, count-1, 2, count-2, ...; each later row adds 1 (mod count) to the one before."""
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    return [(c + round_index) % count for c in first]


class ProbeStep(NamedTuple):
    """A step of the probe: the candidate that ran it, its start and end (`time.perf_counter`
    seconds: CLOCK_MONOTONIC on Linux, the clock `perf record -k CLOCK_MONOTONIC` stamps
    samples with) and whether it counts in the candidate's time (not a warm-up or settling
    step). The steps that train a look-ahead candidate's held batches are not probe steps."""

    candidate: str
    start: float
    end: float
    timed: bool


class CpuUse(NamedTuple):
    """A candidate's process CPU time over its timed steps on one worker: the median CPU ms per
    step and the cores it kept busy (all its CPU time / all its wall time)."""

    ms_per_step: float
    cores_busy: float

    @classmethod
    def of(cls, cpu_seconds, wall_seconds):
        """From the per-step CPU and wall seconds of the same steps."""
        return cls(1e3 * statistics.median(cpu_seconds),
                   sum(cpu_seconds) / max(sum(wall_seconds), 1e-9))


def auto_candidates(micro_batch_choices, micro_batching=True):
    """The `Candidate`s `auto` tries, in order: `AUTO_CANDIDATES`' modes, the micro-batching
    ones once per count in `micro_batch_choices` (counts below 2 are none's configuration and
    skipped); without `micro_batching` (an overridden train step) only none and dbp."""
    counts = sorted({int(m) for m in micro_batch_choices if int(m) >= 2})
    candidates = []
    for mode in AUTO_CANDIDATES:
        if mode not in MICRO_BATCHED:
            candidates.append(Candidate(mode))
        elif micro_batching:
            candidates.extend(Candidate(mode, m) for m in counts)
    return candidates
