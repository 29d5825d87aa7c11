"""The scaling model of NestPipe training (offline research, not shipped with the package):
measured per-stage costs -> predicted step time and scaling efficiency for W = 1 ... 1,536
workers with and without DBP / FWP (docs/design/scaling_model.md).

    python -m bench.scaling_model --measure     # measure the stage costs here (~5 min, 2 cores)
    python -m bench.scaling_model               # predict from bench/results/plan_costs.json

The arithmetic (`model`) and the costs file (`costs`) import no TensorFlow; measuring does.
Run from the repository root.
"""
from bench.scaling_model.costs import (CostsError, build_scenarios, datacenter_collectives,
                                       load_costs, validate_costs)
from bench.scaling_model.model import (PIPELINES, CollectiveParams, ModelError, Scenario,
                                       StepModel, collective_ms, overlap, padded_capacity)

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
