"""Table memory per process of bench/compare.py's systems, against a per-worker memory budget
(issue 15: a cell whose tables do not fit replicated).

The bytes are computed, not measured: a table's values and its optimizer slots, by the planner's
own rule (`tf_nestpipe.plan.placement.table_bytes`), for the layout each baseline builds
(bench/compare_worker.py), with Adagrad's one slot (every system trains with Adagrad):

- `single`, `mwms`, `hvd_replicated`: every table (and multi-hot bag) whole in every process;
- `hvd_alltoall`: rank r holds the tables t with t mod W == r whole, and every bag;
- `psv2`: not computed (its tables are split by TensorFlow's partitioner over its ps tasks, none
  on the workers);
- `nestpipe` (ours): not computed here; `NestPipeStrategy(memory_budget_bytes=...)` plans within
  the budget itself (row-wise what does not fit replicated, 2 slots assumed) or refuses the
  model naming the table that does not fit.

Runtime memory (TensorFlow, dense weights, input pipeline, gradients in flight) is not counted:
the budget bounds tables + slots, as the planner's does. Imports the planner only.
"""
from tf_nestpipe.plan.placement import DATA_PARALLEL, TABLE_WISE, TableSpec, table_bytes

ADAGRAD_SLOTS = 1  # Adagrad's accumulator: one slot value per table value
REPLICATED = ("single", "mwms", "hvd_replicated")
# The systems whose table bytes per process this module computes.
COMPUTED = REPLICATED + ("hvd_alltoall",)


def table_specs(table_sizes, bag_sizes, dim):
    """TableSpecs of a data set's tables: the single-hot fields in order, then the multi-hot
    bags by name."""
    return ([TableSpec("table_%d" % i, int(rows), int(dim)) for i, rows in enumerate(table_sizes)]
            + [TableSpec("bag_" + name, int(bag_sizes[name]), int(dim))
               for name in sorted(bag_sizes)])


def process_table_bytes(system, table_sizes, bag_sizes, dim, workers):
    """(bytes of tables + Adagrad slots the fullest process of `system` holds on `workers`
    workers, how they are laid out), or None for a system not computed here (see above)."""
    fields = len(table_sizes)
    specs = table_specs(table_sizes, bag_sizes, dim)
    whole = lambda spec: table_bytes(spec, workers, DATA_PARALLEL, ADAGRAD_SLOTS)  # noqa: E731
    if system in REPLICATED:
        return (sum(whole(s) for s in specs),
                "%d tables whole in every process" % len(specs) if system != "single" else
                "%d tables in the one process" % len(specs))
    if system == "hvd_alltoall":
        bags = sum(whole(s) for s in specs[fields:])
        ranks = [bags + sum(table_bytes(specs[t], workers, TABLE_WISE, ADAGRAD_SLOTS)
                            for t in range(rank, fields, workers)) for rank in range(workers)]
        return max(ranks), "whole tables on their rank (t mod %d), bags in every process" % workers
    return None


def human(nbytes):
    """`nbytes` as text in the largest binary unit it reaches, e.g. "1.50 GiB", "640.0 KiB"."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return "%.*f %s" % (2 if unit == "GiB" else 1, nbytes / size, unit)
    return "%d B" % nbytes


def memory_verdict(system, table_sizes, bag_sizes, dim, workers, budget):
    """{"system", "budget", "computed", and when computed: "bytes", "fits", "note"} for `system`
    under a per-process budget of `budget` bytes of tables + slots."""
    if budget is None or int(budget) <= 0:
        raise ValueError("the memory budget is a positive number of bytes, got %r" % (budget,))
    computed = process_table_bytes(system, table_sizes, bag_sizes, dim, workers)
    verdict = {"system": system, "budget": int(budget), "computed": computed is not None}
    if computed is None:
        verdict["note"] = ("memory not computed for %s (%s)" % (
            system, "its own planner checks the budget" if system == "nestpipe" else
            "its tables are partitioned over its ps tasks"))
        return verdict
    nbytes, layout = computed
    fits = nbytes <= int(budget)
    verdict.update(bytes=int(nbytes), fits=fits)
    verdict["note"] = ("%s: %s (%d bytes) %s budget %s (%d bytes) per process (%s, table + %d "
                       "Adagrad slot; computed%s)" % (
                           "fits" if fits else "does not fit", human(nbytes), nbytes,
                           "<=" if fits else ">", human(budget), int(budget), layout,
                           ADAGRAD_SLOTS, "" if fits else ", not run"))
    return verdict
