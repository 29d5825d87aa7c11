"""Table placement: the one rule that decides, per embedding table, how it is laid out over the
workers of a `NestPipeStrategy`. Pure arithmetic: imports no TensorFlow.

- `data_parallel`: the table is an ordinary mirrored variable on every worker; lookups are local
  gathers (no all-to-all) and its gradient, made dense, joins the dense gradient all-reduce.
- `row_wise`: the table is row-sharded (id k on worker k mod W) and every step's lookups go
  through the fused exchange (keys, rows and gradient all-to-alls).
- `table_wise`: the whole table lives on one worker (its owner: the worker holding the fewest
  table bytes when it is placed, so tables balance over the workers by bytes); its lookups ride
  on the same fused exchange as the row-wise tables of its dim. Only when requested: on this
  exchange (unique rows sent back, pooled at the requester) a table-wise table sends as many
  bytes as a row-wise one at best (tables balanced exactly) and more otherwise (its owner
  answers every worker), so `auto` has no cost to save by choosing it.
- `column_wise` is not implemented: asking for it is refused.

`placement="auto"` picks per table (`Planner._choose`): replicate when the table's marginal cost
in the dense gradient all-reduce (its dense gradient's bytes) is lower than what it adds to the
fused exchange of its group (tables of one dim: the bytes of its keys, rows and gradient rows
for `ids_per_step` looked-up ids, plus, for the group's first row-wise table, the fixed cost of
the three all-to-alls), and when the replica with its optimizer slots fits the per-worker
`memory_budget_bytes`; row_wise otherwise. The tables placed together (all those constructed
before the first is built, see the strategy) are decided per group at once: all replicated, or
each where it costs less with the exchange paid, whichever costs less in total. Under a budget,
the bytes of every table placed together are reserved first (row-wise for the auto ones), and
the replicas auto chose are then admitted smallest first while they fit: a table whose replica
does not fit is placed row_wise (its reason says so, and the other auto tables of its group are
decided again with its exchange paid); a table that does not fit even so is refused, naming the
table, its bytes, what the worker already holds and what to change.

The plan is a pure function of the tables (in build order), the placement asked, the budget, the
worker count and the collective costs: every worker of a strategy must compute the same one,
since placement decides which variables each worker creates. The strategy makes the costs
agree (`linear_costs` / `collectives_from_linear`: worker 0's, gathered at start-up), so a
worker whose costs file differs or is missing still plans as worker 0 does.

The collective costs depend on the transport the strategy's collectives use (`transport`,
`Collectives.backend`): "tf" (TensorFlow's collectives; also used for Horovod's, not measured
separately) or "sockets" (the socket mesh, the default transport on CPU, whose all-to-alls cost
a fraction of TF's, so on the mesh fewer tables are worth replicating). They come from
`tf_nestpipe.plan.collective_costs`: this cluster's calibration (`python -m tf_nestpipe.plan
calibrate`) where there is one, else the defaults shipped with the package; the printed plan
says which. `Planner(collectives=...)` takes configured costs instead.
"""
import dataclasses
import math
from typing import Dict, Optional

from tf_nestpipe.plan import collective_costs
from tf_nestpipe.plan.collective_costs import CollectiveParams, collective_ms

DATA_PARALLEL = "data_parallel"
ROW_WISE = "row_wise"
TABLE_WISE = "table_wise"
COLUMN_WISE = "column_wise"
AUTO = "auto"
PLACEMENTS = (DATA_PARALLEL, TABLE_WISE, ROW_WISE)
SUPPORTED = PLACEMENTS
# The placements whose lookups go through the fused exchange (and pay its fixed cost).
EXCHANGED = (TABLE_WISE, ROW_WISE)
# Optimizer slots per table element the planner assumes (Adam's two; Adagrad has one, SGD none):
# the optimizer is not known when a table is built, so the budget is checked for the largest.
DEFAULT_OPTIMIZER_SLOTS = 2
# Looked-up ids per worker, step and table the auto rule assumes for a row-wise exchange.
DEFAULT_IDS_PER_STEP = 1024
# The collectives one row-wise exchange issues per step: keys, rows, and the gradient's rows.
ALL_TO_ALLS_PER_EXCHANGE = 3

# The transports whose costs the planner knows (Collectives.backend).
TRANSPORT_SECTIONS = {"tf": "tf", "horovod": "tf", "sockets": "sockets"}


class PlacementError(ValueError):
    """A placement that cannot be used: an unknown placement or table name, an unimplemented
    placement, or tables that do not fit the memory budget. The message says what to change."""


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table as the planner sees it: `rows` x `dim` values of `value_bytes`."""

    name: str
    rows: int
    dim: int
    value_bytes: int = 4


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """The planner's decision for one table: its placement, why, its bytes per worker (table +
    optimizer slots; a table_wise table's on its `owner`, none elsewhere) and the expected
    traffic per step (bytes and modelled ms; a table_wise table's are its owner's)."""

    table: TableSpec
    placement: str
    reason: str
    bytes_per_worker: int
    traffic_bytes: int
    traffic_ms: float
    owner: Optional[int] = None

    def bytes_on(self, worker):
        """Bytes worker `worker` holds for this table."""
        if self.placement == TABLE_WISE and worker != self.owner:
            return 0
        return self.bytes_per_worker

    @property
    def where(self):
        """The placement as the printed plan shows it (a table_wise table with its owner)."""
        if self.placement == TABLE_WISE:
            return "%s@%d" % (self.placement, self.owner)
        return self.placement


def default_collectives(transport="tf"):
    """The planner's collective costs for `transport` when none are configured.

    Args:
        transport: "tf", "horovod" or "sockets".

    Returns:
        `{"all_to_all", "all_reduce"}` CollectiveParams: this cluster's calibration of the
        transport if there is one, else the package's defaults (`costs_source` says which).

    Raises:
        PlacementError: An unknown transport, or a calibration file that cannot be read.
    """
    return _costs(transport).collectives


def costs_source(transport="tf"):
    """One line saying where `default_collectives(transport)` comes from (printed with the plan).

    Raises:
        PlacementError: As `default_collectives`.
    """
    return _costs(transport).source


def _costs(transport):
    if transport not in TRANSPORT_SECTIONS:
        raise PlacementError("transport must be one of %s, got %r"
                             % (", ".join(sorted(TRANSPORT_SECTIONS)), transport))
    try:
        return collective_costs.for_transport(transport)
    except ValueError as error:
        raise PlacementError(str(error)) from None


def linear_costs(collectives, workers):
    """All the planner reads of `collectives` on `workers` workers, as four floats: (intercept
    ms, ms per MB) of the all-to-all, then of the all-reduce (`collective_ms` is linear in the
    bytes). What the strategy gathers from worker 0 so that every worker plans alike."""
    values = []
    for kind in ("all_to_all", "all_reduce"):
        zero = collective_ms(kind, collectives[kind], workers, 0)
        values += [zero, collective_ms(kind, collectives[kind], workers, 1e6) - zero]
    return values


def collectives_from_linear(values, workers):
    """The inverse of `linear_costs`: CollectiveParams costing exactly `values` on `workers`
    workers."""
    if len(values) != 4:
        raise PlacementError("linear collective costs are 4 numbers (all-to-all intercept and "
                             "slope, all-reduce intercept and slope), got %r" % (values,))
    a2a, a2a_slope, reduce, reduce_slope = (float(v) for v in values)
    return {"all_to_all": CollectiveParams(0.0, 0.0, 0.0, "ring", {int(workers): (a2a, a2a_slope)}),
            "all_reduce": CollectiveParams(0.0, 0.0, 0.0, "ring",
                                           {int(workers): (reduce, reduce_slope)})}


def _marginal_ms(params, kind, workers, nbytes):
    """The per-byte part of one collective (what adding `nbytes` to a collective that runs
    anyway costs)."""
    return collective_ms(kind, params, workers, nbytes) - collective_ms(kind, params, workers, 0)


def table_bytes(table, workers, placement, optimizer_slots=DEFAULT_OPTIMIZER_SLOTS):
    """Bytes one worker holds for `table` (its rows and their optimizer slots) under
    `placement`: the whole table replicated or on its owner (table_wise), or the largest row
    shard."""
    rows = table.rows if placement in (DATA_PARALLEL, TABLE_WISE) else -(-table.rows // workers)
    return rows * table.dim * table.value_bytes * (1 + optimizer_slots)


def traffic(table, workers, placement, collectives=None, ids_per_step=DEFAULT_IDS_PER_STEP,
            exchange_paid=False):
    """(bytes a worker sends per step, modelled ms) that `table` adds under `placement`.
    data_parallel: its dense gradient in the dense all-reduce (whose fixed cost the dense
    weights pay anyway); row_wise: its share of the three all-to-alls (keys, rows, gradient
    rows) of up to `ids_per_step` distinct ids, plus their fixed cost unless `exchange_paid`
    (another row-wise table of its group, fused in the same exchange, pays it); table_wise: the
    same all-to-alls as seen by its owner, which answers every worker (keys, the rows of all
    `workers` workers' ids and its own gradient rows)."""
    if workers <= 1:
        return 0, 0.0
    collectives = collectives or default_collectives()
    if placement == DATA_PARALLEL:
        nbytes = table.rows * table.dim * table.value_bytes
        return nbytes, _marginal_ms(collectives["all_reduce"], "all_reduce", workers, nbytes)
    ids = min(int(ids_per_step), table.rows)
    keys = ids * 8
    rows = ids * table.dim * table.value_bytes
    answered = workers * rows if placement == TABLE_WISE else rows
    params = collectives["all_to_all"]
    cost = _marginal_ms if exchange_paid else (
        lambda p, kind, w, n: collective_ms(kind, p, w, n))
    ms = sum(cost(params, "all_to_all", workers, n) for n in (keys, answered, rows))
    return keys + answered + rows, ms


def group_of(table):
    """The exchange group of a row-wise table: tables of one dim and value size share one
    fused exchange (its fixed cost is paid once)."""
    return (table.dim, table.value_bytes)


def check_placement(value, what):
    """`value` if it is a placement tnp implements; PlacementError naming `what` otherwise."""
    if value == COLUMN_WISE:
        raise PlacementError(
            "%s: placement %r is not implemented in tf_nestpipe yet (only %s are): use "
            "'row_wise' for a table too big to replicate or too wide for one worker, "
            "'table_wise' to keep it whole on one worker, 'data_parallel' for a small one, or "
            "'auto'" % (what, value, ", ".join(repr(p) for p in SUPPORTED)))
    if value not in SUPPORTED:
        raise PlacementError("%s: unknown placement %r; use one of %s or 'auto'"
                             % (what, value, ", ".join(repr(p) for p in SUPPORTED)))
    return value


def parse_placement(placement):
    """Checks a strategy's `placement` argument: "auto", one placement for every table, or a
    dict {table name: placement or "auto"}. Returns it (dicts copied)."""
    if isinstance(placement, str):
        return placement if placement == AUTO else check_placement(placement, "placement")
    if isinstance(placement, dict):
        out = {}
        for name, value in placement.items():
            if not isinstance(name, str) or not name:
                raise PlacementError("placement dict keys must be table (layer) names, got %r"
                                     % (name,))
            out[name] = value if value == AUTO else check_placement(
                value, "placement[%r]" % name)
        return out
    raise PlacementError("placement must be 'auto', one of %s, or a dict {table name: "
                         "placement}; got %r" % (", ".join(repr(p) for p in SUPPORTED),
                                                 placement))


class Planner:
    """Places tables as they are built (`place_all`: the tables constructed together; `place`:
    one), in the same order on every worker (the same model), keeping the bytes each worker
    holds under `memory_budget_bytes`; `plans` holds every decision in order."""

    def __init__(self, placement=AUTO, workers=1, memory_budget_bytes=None,
                 optimizer_slots=DEFAULT_OPTIMIZER_SLOTS, ids_per_step=DEFAULT_IDS_PER_STEP,
                 collectives=None, transport="tf", costs_source=None):
        self.placement = parse_placement(placement)
        if transport not in TRANSPORT_SECTIONS:
            raise PlacementError("transport must be one of %s, got %r"
                                 % (", ".join(sorted(TRANSPORT_SECTIONS)), transport))
        self.transport = transport
        self.workers = int(workers)
        if memory_budget_bytes is not None and int(memory_budget_bytes) <= 0:
            raise PlacementError("memory_budget_bytes must be a positive number of bytes per "
                                 "worker or None, got %r" % (memory_budget_bytes,))
        self.memory_budget_bytes = None if memory_budget_bytes is None else int(
            memory_budget_bytes)
        self.optimizer_slots = int(optimizer_slots)
        self.ids_per_step = int(ids_per_step)
        self._collectives = collectives
        self._costs_source = costs_source if collectives is not None else None
        self.plans = []  # TablePlan per table, in placement order

    @property
    def collectives(self):
        """The collective cost parameters the auto rule uses (configured, else the measured
        ones of the planner's transport)."""
        if self._collectives is None:
            costs = _costs(self.transport)
            self._collectives, self._costs_source = costs.collectives, costs.source
        return self._collectives

    @property
    def costs_source(self):
        """Where the costs the auto rule uses came from (configured costs: what the caller said,
        else "configured")."""
        if self._collectives is None:
            return _costs(self.transport).source
        return self._costs_source or "configured"

    def worker_bytes(self, worker):
        """Bytes worker `worker` holds for the tables placed so far."""
        return sum(p.bytes_on(worker) for p in self.plans)

    def used_bytes(self):
        """Bytes per worker of the tables placed so far (the most any worker holds)."""
        return max(self.worker_bytes(w) for w in range(max(self.workers, 1)))

    def _least_loaded(self):
        """The worker holding the fewest table bytes (the lowest index among equals): the
        owner of the next table_wise table."""
        return min(range(self.workers), key=lambda w: (self.worker_bytes(w), w))

    def requested(self, name):
        """What the strategy's `placement` asks for table `name` ("auto" if it does not say)."""
        if isinstance(self.placement, dict):
            return self.placement.get(name, AUTO)
        return self.placement

    def place(self, table):
        """The `TablePlan` of `table` (recorded); PlacementError when it cannot fit."""
        return self.place_all([table])[0]

    def planned(self, name):
        """The TablePlan of table `name` if it was placed, else None."""
        return next((p for p in self.plans if p.table.name == name), None)

    def place_all(self, tables):
        """Places `tables` together (one decision for the tables of one exchange group: the
        exchange's fixed cost is paid once; one memory reservation for all of them); returns
        their TablePlans in order."""
        new = []
        for table in tables:
            previous = self.planned(table.name)
            if previous is not None and previous.table != table:
                # Another table of that name (a model rebuilt with other sizes): planned anew.
                self.plans = [p for p in self.plans if p is not previous]
                previous = None
            if previous is None and all(t.name != table.name for t in new):
                new.append(table)
        forced = {}
        choices = self._choose(new, forced)
        for _ in range(len(new)):  # each round forces at least one more table row-wise
            over = self._replicas_over_budget(new, choices, forced)
            if not over:
                break
            forced.update(over)
            choices = self._choose(new, forced)
        for table in new:
            placement, reason = choices[table.name]
            plan = self._plan(table, placement, reason)
            self._check_budget(plan, self.requested(table.name))
            self.plans.append(plan)
        return [self.planned(t.name) for t in tables]

    def _bytes(self, table, placement):
        return table_bytes(table, self.workers, placement, self.optimizer_slots)

    def _replicas_over_budget(self, tables, choices, forced):
        """{name: (ROW_WISE, reason)} for the replicas auto chose among `tables` that do not fit
        the budget once every table of `tables` has its bytes reserved (row-wise for those
        replicas, the placement chosen for the others; a table_wise table's owner is found when
        it is placed and checked then). Replicas are admitted smallest first (ties in build
        order)."""
        budget = self.memory_budget_bytes
        if budget is None:
            return {}
        optional = [t for t in tables if choices[t.name][0] == DATA_PARALLEL
                    and self.requested(t.name) == AUTO and t.name not in forced]
        names = {t.name for t in optional}
        reserved = sum(self._bytes(t, ROW_WISE if t.name in names else choices[t.name][0])
                       for t in tables if choices[t.name][0] != TABLE_WISE)
        held = self.used_bytes()
        over = {}
        for table in sorted(optional, key=lambda t: self._bytes(t, DATA_PARALLEL)):
            extra = self._bytes(table, DATA_PARALLEL) - self._bytes(table, ROW_WISE)
            if held + reserved + extra <= budget:
                reserved += extra
                continue
            over[table.name] = (ROW_WISE, "replica (%d bytes with %d optimizer slots) does "
                                "not fit memory_budget_bytes=%d (%d held by tables placed "
                                "before, %d reserved for those placed with it, its own row "
                                "shard included)" % (self._bytes(table, DATA_PARALLEL),
                                                     self.optimizer_slots, budget, held,
                                                     reserved))
        return over

    def _paid(self, group):
        return any(p.placement in EXCHANGED and group_of(p.table) == group for p in self.plans)

    def _plan(self, table, placement, reason):
        nbytes, ms = traffic(table, self.workers, placement, self.collectives, self.ids_per_step,
                             exchange_paid=self._paid(group_of(table)))
        owner = self._least_loaded() if placement == TABLE_WISE else None
        return TablePlan(table, placement, reason,
                         table_bytes(table, self.workers, placement, self.optimizer_slots),
                         nbytes, ms, owner)

    def _choose(self, tables, forced):
        """{name: (placement, reason)}: requested placements as asked, `forced` ones ({name:
        (placement, reason)}: replicas over the budget) as given; per exchange group, the other
        auto tables either all replicated, or each placed where it costs less with the group's
        exchange paid, whichever costs less in total (the exchange's fixed cost counted once)."""
        choices = {}
        auto = {}
        for table in tables:
            requested = self.requested(table.name)
            if self.workers <= 1:
                choices[table.name] = (ROW_WISE, "one worker: nothing to place")
            elif requested != AUTO:
                choices[table.name] = (requested, "requested" if requested != TABLE_WISE else
                                       "requested (auto never chooses table_wise)")
            elif table.name in forced:
                choices[table.name] = forced[table.name]
            else:
                auto.setdefault(group_of(table), []).append(table)
        for group, members in auto.items():
            paid = self._paid(group) or any(
                choices.get(t.name, ("",))[0] in EXCHANGED and group_of(t) == group
                for t in tables)
            dp = {t.name: traffic(t, self.workers, DATA_PARALLEL, self.collectives)[1]
                  for t in members}
            rw = {t.name: traffic(t, self.workers, ROW_WISE, self.collectives,
                                  self.ids_per_step, exchange_paid=True)[1] for t in members}
            fixed = 0.0 if paid else (traffic(members[0], self.workers, ROW_WISE,
                                              self.collectives, 0)[1])
            mixed = {t.name: ROW_WISE if rw[t.name] < dp[t.name] else DATA_PARALLEL
                     for t in members}
            mixed_ms = sum(min(rw[n], dp[n]) for n in mixed) + (
                fixed if ROW_WISE in mixed.values() else 0.0)
            all_dp_ms = sum(dp.values())
            replicate_all = all_dp_ms <= mixed_ms
            for t in members:
                n = t.name
                if replicate_all and mixed[n] == ROW_WISE:
                    choices[n] = (DATA_PARALLEL, "group: all-reduce +%.3g ms <= exchange "
                                  "+%.3g ms" % (all_dp_ms, mixed_ms))
                elif replicate_all or mixed[n] == DATA_PARALLEL:
                    choices[n] = (DATA_PARALLEL, "all-reduce +%.3g ms <= all-to-all +%.3g ms"
                                  % (dp[n], rw[n] + (0.0 if paid else fixed)))
                else:
                    reason = "all-to-all +%.3g ms < all-reduce +%.3g ms" % (rw[n], dp[n])
                    if not paid:  # this table's traffic includes the group's fixed cost
                        reason += (", and the group's exchange +%.3g ms once (group: %.3g ms < "
                                   "all replicated %.3g ms)" % (fixed, mixed_ms, all_dp_ms))
                    choices[n] = (ROW_WISE, reason)
                    paid = True  # the first row-wise table pays the exchange
        return choices

    def _check_budget(self, plan, requested):
        budget = self.memory_budget_bytes
        worker = plan.owner if plan.placement == TABLE_WISE else None
        held = self.used_bytes() if worker is None else self.worker_bytes(worker)
        if budget is None or held + plan.bytes_per_worker <= budget:
            return
        t = plan.table
        fixes = ["raise memory_budget_bytes (now %d) to at least %d"
                 % (budget, held + plan.bytes_per_worker)]
        if plan.placement in (DATA_PARALLEL, TABLE_WISE):
            fixes.append("place it 'row_wise' (%d bytes per worker)" % table_bytes(
                t, self.workers, ROW_WISE, self.optimizer_slots))
        replicas = [p for p in self.plans if p.placement == DATA_PARALLEL]
        if replicas and worker is None:
            fixes.append("place the replicated table(s) %s 'row_wise' (%d bytes per worker "
                         "now; tables constructed together in the scope are planned together, "
                         "the budget reserved for all of them)" % (
                             ", ".join(repr(p.table.name) for p in replicas),
                             sum(p.bytes_per_worker for p in replicas)))
        fixes.append("train on more workers")
        raise PlacementError(
            "table %r (%d rows x %d, %s%s) needs %d bytes per worker (table + %d optimizer "
            "slots), but %s already holds %d of its memory_budget_bytes=%d for the "
            "tables placed before it (%s): %s"
            % (t.name, t.rows, t.dim, plan.where,
               "" if requested == plan.placement else ", chosen by auto", plan.bytes_per_worker,
               self.optimizer_slots, "every worker" if worker is None else "worker %d" % worker,
               held, budget,
               ", ".join(p.table.name for p in self.plans) or "none", "; or ".join(fixes)))

    def unknown_names(self, names):
        """The table names the placement dict gives that are not among `names`."""
        if not isinstance(self.placement, dict):
            return []
        return sorted(set(self.placement) - set(names))

    def check_names(self):
        """Refuses a placement dict naming a table the model does not have (checked once all
        tables are built: at the first gradient aggregation)."""
        unknown = self.unknown_names([p.table.name for p in self.plans])
        if unknown:
            raise PlacementError(
                "placement names table(s) %s, but the model's tables are %s: fix the names "
                "(a table's name is its ShardedEmbedding layer's name; a "
                "ShardedEmbeddingCollection's table is '<name>_fused')"
                % (", ".join(repr(n) for n in unknown),
                   ", ".join(repr(p.table.name) for p in self.plans) or "none"))


def render_plan(plans, workers, transport=None, costs=None):
    """The plan as text.

    Args:
        plans: The TablePlans, in placement order.
        workers: The worker count.
        transport: The transport whose costs were used, for the heading (None: not named).
        costs: Where those costs came from (`Planner.costs_source`), a line below the heading.

    Returns:
        A table of table, rows, dim, placement (a table_wise table's as `table_wise@OWNER`),
        bytes per worker, traffic per step, modelled ms and why; the total's bytes are those
        of the worker holding the most.
    """
    header = ("table", "rows", "dim", "placement", "bytes/worker", "traffic/step", "model ms",
              "why")
    lines = [header]
    for p in plans:
        lines.append((p.table.name, str(p.table.rows), str(p.table.dim), p.where,
                      _human(p.bytes_per_worker), _human(p.traffic_bytes),
                      "%.2f" % p.traffic_ms, p.reason))
    held = max(sum(p.bytes_on(w) for p in plans) for w in range(max(int(workers), 1)))
    lines.append(("total", "", "", "", _human(held),
                  _human(sum(p.traffic_bytes for p in plans)),
                  "%.2f" % sum(p.traffic_ms for p in plans), ""))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = ["tf_nestpipe placement on %d worker(s)%s:" % (
        workers, "" if transport is None else ", %s collectives' costs" % transport)]
    if costs:
        text.append("  costs: %s" % costs)
    for k, row in enumerate(lines):
        text.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            text.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(text)


def _human(nbytes):
    if nbytes < 1024:
        return "%d B" % nbytes
    exponent = min(int(math.log(nbytes, 1024)), 3)
    return "%.1f %s" % (nbytes / 1024 ** exponent, ("B", "KiB", "MiB", "GiB")[exponent])


def plan_tables(tables, workers, placement=AUTO, memory_budget_bytes=None,
                optimizer_slots=DEFAULT_OPTIMIZER_SLOTS, ids_per_step=DEFAULT_IDS_PER_STEP,
                collectives=None, transport="tf"):
    """Plans `tables` (TableSpecs, in build order) at once; returns the list of TablePlans."""
    planner = Planner(placement, workers, memory_budget_bytes, optimizer_slots, ids_per_step,
                      collectives, transport)
    planner.place_all(list(tables))
    planner.check_names()
    return planner.plans


def model_tables(model) -> Dict[str, TableSpec]:
    """The TableSpecs of every `ShardedEmbedding` of a tf_keras model (built or not), by name
    (imports tf_nestpipe's layers: only for `python -m tf_nestpipe.plan placement --model`)."""
    from tf_nestpipe import tf_private
    from tf_nestpipe.sharding.embedding import ShardedTableLayer

    found = {}
    for layer in tf_private.flatten_layers(model):
        if isinstance(layer, ShardedTableLayer):
            found[layer.name] = TableSpec(layer.name, layer.vocab_size, layer.dim)
    return found


def parse_table_arg(text) -> Optional[TableSpec]:
    """'name:rows:dim' -> TableSpec (PlacementError for anything else)."""
    parts = text.split(":")
    try:
        name, rows, dim = parts
        return TableSpec(name, int(rows), int(dim))
    except ValueError:
        raise PlacementError("--table takes NAME:ROWS:DIM, got %r" % text) from None
