"""The collective costs the placement planner reads, and where they come from.

Two files hold them, in one layout (`SCHEMA`): the defaults that ship with the package
(`default_costs.json`, package data) and this cluster's own, measured by
`python -m tf_nestpipe.plan calibrate` into the user cache (`calibration_path()`:
`$TF_NESTPIPE_CACHE/plan_costs.json`). The planner prefers a calibration of the transport in use
and says which costs it used (`CollectiveCosts.source`, printed with the plan). A calibration
file that cannot be read is refused naming the file and the fix: a run never silently plans with
other costs than it says.

Per transport ("tf": TensorFlow's collectives, also used for Horovod's; "sockets": the socket
mesh), per collective kind: the fit `alpha0 + alpha_step * steps(W) + beta * MB * factor(W)` and
`per_workers`, each measured worker count's own line (intercept ms, ms per MB), which wins at
that worker count. Imports no TensorFlow.
"""
import dataclasses
import datetime
import json
import math
import os
import tempfile
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from tf_nestpipe import settings

SCHEMA = "tf_nestpipe.collective_costs/1"
DEFAULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_costs.json")
# The planner reads these kinds; the costs of Horovod's collectives are not measured apart.
KINDS = ("all_to_all", "all_reduce")
TRANSPORTS = ("tf", "sockets")
TRANSPORT_ALIASES = {"horovod": "tf"}
CALIBRATE_HINT = "python -m tf_nestpipe.plan calibrate"


@dataclasses.dataclass(frozen=True)
class CollectiveParams:
    """Latency-bandwidth cost of one collective kind: `alpha0 + alpha_step * steps(W) +
    beta * bytes * factor(W)` in ms, bytes in MB (10**6); `algorithm` picks steps(W).
    `measured` ({W: (intercept_ms, ms per MB of the tensor)}) overrides the formula at the
    worker counts where it was measured (the testbed scenario)."""

    alpha0_ms: float
    alpha_step_ms: float
    beta_ms_per_mb: float
    algorithm: str = "ring"
    measured: Optional[Dict[int, Tuple[float, float]]] = None


def collective_steps(kind, algorithm, workers):
    """(latency steps, bandwidth factor) of a collective on `workers` workers.

    all_to_all (direct sends): W-1 peers, a fraction (W-1)/W of the send tensor leaves the worker.
    all_gather: ring W-1 steps (tree: ceil(log2 W)); each worker receives W-1 contributions.
    all_reduce: ring 2(W-1) steps (tree: 2 ceil(log2 W)); ring bandwidth factor 2(W-1)/W.
    """
    w = workers
    log_steps = math.ceil(math.log2(w)) if w > 1 else 0
    if kind == "all_to_all":
        return w - 1, (w - 1) / w
    if kind == "all_gather":
        return (w - 1 if algorithm == "ring" else log_steps), w - 1
    if kind == "all_reduce":
        return (2 * (w - 1) if algorithm == "ring" else 2 * log_steps), 2 * (w - 1) / w
    raise ValueError("unknown collective %r (one of all_to_all, all_gather, all_reduce)" % (kind,))


def collective_ms(kind, params: CollectiveParams, workers, nbytes):
    """Time of one collective of `kind` over `workers` workers moving `nbytes` (all_to_all: the
    whole send tensor; all_gather: one worker's contribution; all_reduce: the reduced tensor).
    Zero on one worker (no collective is issued)."""
    if workers <= 1:
        return 0.0
    if params.measured and workers in params.measured:
        intercept, slope = params.measured[workers]
        return intercept + slope * nbytes / 1e6
    steps, factor = collective_steps(kind, params.algorithm, workers)
    return params.alpha0_ms + params.alpha_step_ms * steps + params.beta_ms_per_mb * nbytes / 1e6 * factor



class CostsFileError(ValueError):
    """A costs file that cannot be used; the message names the file and what to do."""


class CollectiveCosts(NamedTuple):
    """The costs the planner uses for one transport, and a line saying where they came from."""

    collectives: Dict[str, CollectiveParams]
    source: str


def calibration_path() -> str:
    """Where `python -m tf_nestpipe.plan calibrate` writes this cluster's costs.

    Returns:
        `$TF_NESTPIPE_PLAN_COSTS`, else `$TF_NESTPIPE_CACHE/plan_costs.json` (default
        `~/.cache/tf_nestpipe/plan_costs.json`).
    """
    return settings.PLAN_COSTS.value()


def transport_section(transport: str) -> str:
    """The section of a costs file that holds `transport`'s costs.

    Raises:
        ValueError: `transport` is not "tf", "sockets" or "horovod".
    """
    section = TRANSPORT_ALIASES.get(transport, transport)
    if section not in TRANSPORTS:
        raise ValueError("transport must be one of %s, got %r"
                         % (", ".join(sorted(TRANSPORTS + tuple(TRANSPORT_ALIASES))), transport))
    return section


def read_costs_file(path: str) -> dict:
    """Reads and checks a costs file.

    Args:
        path: The file, in the `SCHEMA` layout.

    Returns:
        Its content (a dict with "transports").

    Raises:
        CostsFileError: The file is not JSON, not of this layout, or a collective's costs are
            incomplete; the message names the file and how to fix it.
    """
    fix = "delete it or rerun `%s`" % CALIBRATE_HINT
    try:
        with open(path) as f:
            content = json.load(f)
    except (OSError, ValueError) as error:
        raise CostsFileError("collective costs file %s cannot be read (%s): %s"
                             % (path, error, fix)) from None
    if not isinstance(content, dict) or content.get("schema") != SCHEMA:
        raise CostsFileError("collective costs file %s is not of the layout %s: %s"
                             % (path, SCHEMA, fix))
    transports = content.get("transports")
    if not isinstance(transports, dict):
        raise CostsFileError("collective costs file %s has no 'transports': %s" % (path, fix))
    for transport, section in transports.items():
        for kind in KINDS:
            try:
                _params(section[kind])
            except (KeyError, TypeError, ValueError) as error:
                raise CostsFileError("collective costs file %s: transports.%s.%s is incomplete "
                                     "(%s): %s" % (path, transport, kind, error, fix)) from None
    return content


def _params(entry: dict) -> CollectiveParams:
    measured = {int(w): (float(v["intercept_ms"]), float(v["slope_ms_per_mb"]))
                for w, v in entry.get("per_workers", {}).items()}
    return CollectiveParams(float(entry["alpha0_ms"]), float(entry["alpha_step_ms"]),
                            float(entry["beta_ms_per_mb"]), entry.get("algorithm", "ring"),
                            measured or None)


def for_transport(transport: str = "tf", path: Optional[str] = None) -> CollectiveCosts:
    """The planner's costs for `transport`: this cluster's calibration if it has that transport,
    else the shipped defaults.

    Args:
        transport: "tf", "sockets" or "horovod" (Horovod uses TensorFlow's costs).
        path: The calibration file to prefer; `calibration_path()` when None.

    Returns:
        A `CollectiveCosts` with the all-to-all and all-reduce params and their source.

    Raises:
        ValueError: An unknown transport.
        CostsFileError: The calibration file exists but cannot be used.
    """
    section = transport_section(transport)
    path = calibration_path() if path is None else path
    if os.path.exists(path):
        calibrated = read_costs_file(path)["transports"].get(section)
        if calibrated is not None:
            workers = ", ".join("W=%s" % w for w in sorted(calibrated["all_to_all"].get(
                "per_workers", {}), key=int))
            return CollectiveCosts(
                {kind: _params(calibrated[kind]) for kind in KINDS},
                "calibrated on this cluster (%s, %s; %s)"
                % (workers, calibrated.get("measured", "date unknown"), path))
    defaults = read_costs_file(DEFAULTS_PATH)["transports"][section]
    return CollectiveCosts(
        {kind: _params(defaults[kind]) for kind in KINDS},
        "the package's defaults (measured on a shared 2-core CPU machine, %s; `%s` measures "
        "this cluster's)" % (defaults.get("measured", "date unknown"), CALIBRATE_HINT))


def fit_line(points: Sequence[Sequence[float]]) -> Tuple[float, float]:
    """The least-squares line `ms = intercept + slope * MB` through `points` ([bytes, ms]), both
    coefficients >= 0 (a negative one is set to 0 and the other refitted)."""
    xs = [nbytes / 1e6 for nbytes, _ in points]
    ys = [float(ms) for _, ms in points]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
             if spread > 0 else 0.0)
    intercept = mean_y - slope * mean_x
    if slope < 0:
        return max(mean_y, 0.0), 0.0
    if intercept < 0:
        slope = sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-30)
        return 0.0, max(slope, 0.0)
    return intercept, slope


def _fit_kind(kind: str, per_workers: Dict[str, dict]) -> dict:
    """The cost entry of `kind` from each worker count's line: with one worker count, that line
    as the formula (no per-peer term); with more, a least-squares fit of the formula over every
    point (per-peer and per-byte terms >= 0)."""
    rows, ys = [], []
    for workers, line in per_workers.items():
        steps, factor = collective_steps(kind, "ring", int(workers))
        for nbytes, ms in line["points"]:
            rows.append((1.0, steps, nbytes / 1e6 * factor))
            ys.append(ms)
    if len(per_workers) == 1:
        (workers, line), = per_workers.items()
        _, factor = collective_steps(kind, "ring", int(workers))
        alpha0, alpha_step, beta = line["intercept_ms"], 0.0, line["slope_ms_per_mb"] / factor
    else:
        alpha0, alpha_step, beta = nonnegative_lstsq(rows, ys)
    return {"alpha0_ms": alpha0, "alpha_step_ms": alpha_step, "beta_ms_per_mb": beta,
            "algorithm": "ring", "per_workers": per_workers}


def nonnegative_lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> List[float]:
    """Least-squares coefficients >= 0 of ys ~ rows @ coef.

    Args:
        rows: The design matrix, a handful of columns (every subset of them is tried).
        ys: The measured values.

    Returns:
        The coefficients, one per column, each >= 0.
    """
    import itertools  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel

    a, y = np.asarray(rows, float), np.asarray(ys, float)
    best, best_error = [0.0] * a.shape[1], float(np.sum(y ** 2))
    for size in range(1, a.shape[1] + 1):
        for columns in itertools.combinations(range(a.shape[1]), size):
            coef, *_ = np.linalg.lstsq(a[:, columns], y, rcond=None)
            if np.any(coef < 0):
                continue
            error = float(np.sum((a[:, columns] @ coef - y) ** 2))
            if error < best_error:
                best_error, best = error, [0.0] * a.shape[1]
                for column, value in zip(columns, coef):
                    best[column] = float(value)
    return best


def record_calibration(transport: str, workers: int, sweeps: Dict[str, List[List[float]]],
                       how: str, path: Optional[str] = None) -> str:
    """Adds one cluster's measured sweeps to the calibration file (another worker count of the
    same transport is kept beside it and the formula refitted over all of them).

    Args:
        transport: The transport measured ("tf", "sockets"; "horovod" counts as "tf").
        workers: The cluster's worker count (>= 2).
        sweeps: Per kind in `KINDS`, [[bytes, ms], ...] with two or more sizes.
        how: One line saying how they were measured.
        path: The file; `calibration_path()` when None.

    Returns:
        The path written.

    Raises:
        ValueError: Fewer than 2 workers, a kind missing, or fewer than two sizes.
        CostsFileError: An existing file cannot be read (it is not overwritten).
    """
    section = transport_section(transport)
    if int(workers) < 2:
        raise ValueError("calibration needs a cluster of 2 or more workers, got %d" % workers)
    for kind in KINDS:
        if len(sweeps.get(kind, ())) < 2:
            raise ValueError("calibration of %s needs two or more sizes, got %r"
                             % (kind, sweeps.get(kind)))
    path = calibration_path() if path is None else path
    content = (read_costs_file(path) if os.path.exists(path)
               else {"schema": SCHEMA, "transports": {}})
    old = content["transports"].get(section, {})
    entry = {"measured": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "how": how}
    for kind in KINDS:
        per_workers = dict(old.get(kind, {}).get("per_workers", {}))
        intercept, slope = fit_line(sweeps[kind])
        per_workers[str(int(workers))] = {"intercept_ms": intercept, "slope_ms_per_mb": slope,
                                          "points": [list(p) for p in sweeps[kind]]}
        entry[kind] = _fit_kind(kind, per_workers)
    content["transports"][section] = entry
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                         suffix=".json")
    with os.fdopen(handle, "w") as f:
        json.dump(content, f, indent=1, sort_keys=True)
    os.replace(temporary, path)
    return path
