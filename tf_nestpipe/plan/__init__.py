"""Table placement: the planner that decides per embedding table how it is laid out over the
workers (`placement`), and the collective costs it decides with (`collective_costs`: the
package's defaults, or this cluster's calibration; `for_transport`).

    python -m tf_nestpipe.plan placement --table item:2000000:16 --workers 4   # show a plan
    python -m tf_nestpipe.plan calibrate --workers 2                            # measure costs

Imports no TensorFlow (calibrating does, in the processes it starts).
"""
from tf_nestpipe.plan.collective_costs import (CollectiveCosts, CollectiveParams, CostsFileError,
                                               calibration_path, collective_ms, for_transport)
from tf_nestpipe.plan.placement import (PlacementError, Planner, TablePlan, TableSpec,
                                        plan_tables, render_plan)

__all__ = [
    "CollectiveCosts",
    "CollectiveParams",
    "CostsFileError",
    "PlacementError",
    "Planner",
    "TablePlan",
    "TableSpec",
    "calibration_path",
    "collective_ms",
    "for_transport",
    "plan_tables",
    "render_plan",
]
