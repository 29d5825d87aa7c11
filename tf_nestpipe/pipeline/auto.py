"""`pipeline="auto"`: the first steps of training try each pipeline on real batches, time them,
and every worker switches to the one that was fastest on the slowest worker.

Every mode is exact (it trains the model a non-pipelined run trains), so the probe *is* training:
no batch is skipped or repeated. Switching away from a look-ahead mode first trains the batches
it holds, one per step, reading nothing (`TrainPipeline.progress_held`). The first
`warmup_steps` of each candidate (tracing, first-call costs) are not timed; the candidate's
time is the median of its next `timed_steps`. The workers agree on one choice by an all-gather
of their medians (the max over workers decides, as a synchronous step waits for the slowest).
The first candidate is the baseline (none): another is chosen only if it is faster by more
than `margin` (a fraction), so timing noise does not trade the baseline for an equal mode.
"""
import statistics
import sys
import time

import tensorflow as tf


class AutoPipeline:
    """Runs training steps through `candidates` (`[(name, pipeline)]`, each with `progress` and
    `progress_held`), then through the fastest. `agree(times)` returns the per-candidate times
    as every worker must judge them (e.g. the max over workers); `log(text)` reports the choice."""

    def __init__(self, candidates, agree, warmup_steps=1, timed_steps=5, log=None, margin=0.05):
        if warmup_steps < 0 or timed_steps < 1 or not 0 <= margin < 1:
            raise ValueError("auto pipeline needs warmup_steps >= 0, timed_steps >= 1 and "
                             "0 <= margin < 1, got %r, %r and %r"
                             % (warmup_steps, timed_steps, margin))
        self._margin = margin
        self._candidates = list(candidates)
        self._agree = agree
        self._warmup = warmup_steps
        self._timed = timed_steps
        self._log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._index = 0  # candidate being probed
        self._steps = 0  # steps the current candidate ran
        self._times = {name: [] for name, _ in self._candidates}
        self._held = None  # a look-ahead pipeline whose held batches are trained first
        self.choice = None  # the chosen candidate's name, once agreed
        self.timings_ms = None  # {name: agreed median ms/step}

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
        start = time.perf_counter()
        outputs = pipeline.progress(iterator)
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, outputs)
        elapsed = time.perf_counter() - start
        self._steps += 1
        if self._steps > self._warmup:
            self._times[name].append(elapsed)
        if self._steps == self._warmup + self._timed:
            self._next_candidate(pipeline)
        return outputs

    def _next_candidate(self, pipeline):
        self._steps = 0
        self._index += 1
        if self._index == len(self._candidates):
            self._choose()
        if self.choice is None or self.pipeline is not pipeline:
            self._held = pipeline  # its look-ahead batches come next

    def _choose(self):
        names = [name for name, _ in self._candidates]
        local = [statistics.median(self._times[name]) for name in names]
        agreed = self._agree(local)
        self.timings_ms = {name: 1e3 * t for name, t in zip(names, agreed)}
        best = min(range(len(names)), key=lambda i: agreed[i])
        if agreed[best] > agreed[0] * (1 - self._margin):
            best = 0  # not clearly faster than the baseline
        self.choice = names[best]
        self._log("tf_nestpipe: pipeline='auto' chose %r: median ms/step over %d timed steps "
                  "(slowest worker) %s; another mode than %r needs to be %.0f%% faster" % (
                      self.choice, self._timed, ", ".join(
                          "%s %.1f" % (name, self.timings_ms[name]) for name in names),
                      names[0], 100 * self._margin))
