"""Scaling model of NestPipe training: measured per-stage costs -> predicted step time and
scaling efficiency for W = 1 ... 1,536 workers with and without DBP / FWP.

    python -m tf_nestpipe.plan --measure     # measure the stage costs here (~5 min, 2 cores)
    python -m tf_nestpipe.plan               # predict from bench/results/plan_costs.json

The arithmetic (`model`) and the costs file (`costs`) import no TensorFlow; measuring does.
"""
from tf_nestpipe.plan.costs import (CostsError, build_scenarios, datacenter_collectives,
                                    load_costs, validate_costs)
from tf_nestpipe.plan.model import (PIPELINES, CollectiveParams, ModelError, Scenario, StepModel,
                                    collective_ms, overlap, padded_capacity)

__all__ = [
    "PIPELINES",
    "CollectiveParams",
    "CostsError",
    "ModelError",
    "Scenario",
    "StepModel",
    "build_scenarios",
    "collective_ms",
    "datacenter_collectives",
    "load_costs",
    "overlap",
    "padded_capacity",
    "validate_costs",
]
