"""Table placement (issue 15): the planner's rule by hand (costs, memory budget), its errors, the
strategy's checks, the CLI, the default ("auto") planned alike on every worker for a lazily built
model, and data-parallel / mixed / auto placements on 2 and 3 workers equal to one process (runs
of the shared exactness launches, see conftest.PLACEMENT_RUNS)."""
import json
import os
import sys

import numpy as np
import pytest

from conftest import PLACEMENT_RUNS, PROGRAMS, launch, load_run, run_command
from tf_nestpipe.plan import __main__ as cli
from tf_nestpipe.plan import placement as pl
from tf_nestpipe.plan.collective_costs import CollectiveParams

# Hand-sized costs: every all-to-all costs 1 ms + 1 ms per MB, an all-reduce 5 ms + 2 ms per MB
# (the 5 ms are paid by the dense weights anyway: a replicated table adds only its bytes).
COSTS = {"all_to_all": CollectiveParams(0.0, 0.0, 0.0, "ring", {2: (1.0, 1.0)}),
         "all_reduce": CollectiveParams(0.0, 0.0, 0.0, "ring", {2: (5.0, 2.0)})}


def planner(placement="auto", budget=None, slots=2, ids=1000):
    return pl.Planner(placement, 2, budget, slots, ids, COSTS)


def test_traffic_and_bytes_by_hand():
    table = pl.TableSpec("t", 10_000, 16)  # 640,000 bytes
    assert pl.traffic(table, 2, pl.DATA_PARALLEL, COSTS) == (640_000, pytest.approx(2 * 0.64))
    # 1000 ids: keys 8,000 B, rows and gradient rows 64,000 B each; three 1 ms all-to-alls.
    nbytes, ms = pl.traffic(table, 2, pl.ROW_WISE, COSTS, ids_per_step=1000)
    assert nbytes == 8_000 + 2 * 64_000
    assert ms == pytest.approx(3 * 1.0 + (8_000 + 2 * 64_000) / 1e6)
    assert pl.table_bytes(table, 2, pl.DATA_PARALLEL, 2) == 640_000 * 3
    assert pl.table_bytes(table, 2, pl.ROW_WISE, 1) == 320_000 * 2
    assert pl.traffic(table, 1, pl.ROW_WISE, COSTS) == (0, 0.0)  # one worker: no collective


def test_auto_replicates_where_the_all_reduce_is_cheaper():
    plan = planner()
    small = plan.place(pl.TableSpec("small", 7, 16))
    edge = plan.place(pl.TableSpec("edge", 20_000, 16))    # 1.28 MB: 2.56 ms < 3 + 0.136 ms
    mid = plan.place(pl.TableSpec("mid", 50_000, 16))      # 3.2 MB: 6.4 ms > 3.136 ms
    # The exchange of dim 16 is paid now: a table joining it adds only its bytes (0.136 ms).
    late = plan.place(pl.TableSpec("late", 20_000, 16))
    other_dim = plan.place(pl.TableSpec("other_dim", 20_000, 8))  # its own exchange: 3.07 ms
    assert [p.placement for p in (small, edge, mid, late, other_dim)] == [
        pl.DATA_PARALLEL, pl.DATA_PARALLEL, pl.ROW_WISE, pl.ROW_WISE, pl.DATA_PARALLEL]
    assert "all-reduce" in small.reason
    assert mid.traffic_ms == pytest.approx(3.136) and late.traffic_ms == pytest.approx(0.136)
    text = pl.render_plan(plan.plans, 2)
    for word in ("table", "rows", "dim", "placement", "bytes/worker", "traffic/step", "small",
                 "data_parallel", "row_wise", "total"):
        assert word in text


def test_tables_placed_together_share_one_exchange_decision():
    """Placed at once, the group's cheapest plan: 20 mid tables replicated cost 20 x 2.56 ms,
    row-wise 3 ms once + 20 x 0.136 ms (so do two: 5.12 > 3.27 ms; one alone is replicated,
    above); tiny tables all replicated."""
    plan = planner()
    plans = plan.place_all([pl.TableSpec("m%d" % i, 20_000, 16) for i in range(20)])
    assert {p.placement for p in plans} == {pl.ROW_WISE}
    two = planner().place_all([pl.TableSpec("m%d" % i, 20_000, 16) for i in range(2)])
    assert {p.placement for p in two} == {pl.ROW_WISE}
    tiny = planner().place_all([pl.TableSpec("t%d" % i, 100, 16) for i in range(20)])
    assert {p.placement for p in tiny} == {pl.DATA_PARALLEL}


def test_requested_placements_override_auto_and_one_worker_keeps_one_shard():
    plan = planner({"small": "row_wise", "mid": "data_parallel"})
    assert plan.place(pl.TableSpec("small", 7, 16)).placement == pl.ROW_WISE
    assert plan.place(pl.TableSpec("mid", 50_000, 16)).placement == pl.DATA_PARALLEL
    assert plan.place(pl.TableSpec("other", 7, 16)).placement == pl.DATA_PARALLEL  # auto
    one = pl.Planner("data_parallel", 1, collectives=COSTS)
    assert one.place(pl.TableSpec("t", 7, 4)).placement == pl.ROW_WISE


def test_a_table_placed_again_keeps_its_plan_unless_its_size_changed():
    plan = planner()
    first = plan.place(pl.TableSpec("t", 7, 16))
    assert plan.place(pl.TableSpec("t", 7, 16)) is first and len(plan.plans) == 1
    bigger = plan.place(pl.TableSpec("t", 500_000, 16))
    assert bigger.placement == pl.ROW_WISE and plan.plans == [bigger]


def test_auto_falls_back_to_row_wise_when_the_replica_does_not_fit():
    plan = planner(budget=150_000)
    t = plan.place(pl.TableSpec("t", 2_000, 4))  # replica 96,000 B fits
    u = plan.place(pl.TableSpec("u", 2_000, 4))  # a second replica would not; its shard does
    assert (t.placement, u.placement) == (pl.DATA_PARALLEL, pl.ROW_WISE)
    assert u.reason == ("replica (96000 bytes with 2 optimizer slots) does not fit "
                        "memory_budget_bytes=150000 (96000 held by tables placed before, 48000 "
                        "reserved for those placed with it, its own row shard included)")
    assert plan.used_bytes() == 96_000 + 48_000


def test_under_a_budget_tables_that_do_not_fit_replicated_are_row_wise():
    """Placed together: every table's row-wise bytes reserved (small 2,400 B, big 240,000 B),
    then the replicas admitted smallest first; big's replica (480,000 B) does not fit, small's
    (4,800 B) does, and stays replicated with big's exchange paid (0.0032 ms < 0.004 ms)."""
    small, big = pl.TableSpec("small", 100, 4), pl.TableSpec("big", 10_000, 4)
    unlimited = planner().place_all([small, big])
    assert [p.placement for p in unlimited] == [pl.DATA_PARALLEL, pl.DATA_PARALLEL]
    plan = planner(budget=300_000)
    placed = plan.place_all([small, big])
    assert [p.placement for p in placed] == [pl.DATA_PARALLEL, pl.ROW_WISE]
    assert placed[1].reason.startswith("replica (480000 bytes with 2 optimizer slots) does not "
                                       "fit memory_budget_bytes=300000")
    assert plan.used_bytes() == 4_800 + 240_000
    text = pl.render_plan(plan.plans, 2)
    assert "does not fit memory_budget_bytes=300000" in text


def test_placed_together_the_budget_is_reserved_for_every_table():
    """Budget 244,000 B: small's replica (4,800 B) and big's row shard (240,000 B) do not both
    fit, so placed together small is row-wise too; placed one by one (small built first, its
    replica taken), big is refused, and the message says to place small row-wise."""
    small, big = pl.TableSpec("small", 100, 4), pl.TableSpec("big", 10_000, 4)
    together = planner(budget=244_000)
    assert [p.placement for p in together.place_all([small, big])] == [pl.ROW_WISE, pl.ROW_WISE]
    assert together.used_bytes() == 2_400 + 240_000
    apart = planner(budget=244_000)
    assert apart.place(small).placement == pl.DATA_PARALLEL
    with pytest.raises(pl.PlacementError) as error:
        apart.place(big)
    message = str(error.value)
    for part in ("'big'", "10000 rows x 4", "row_wise, chosen by auto",
                 "240000 bytes per worker", "already holds 4800 of its memory_budget_bytes=244000",
                 "at least 244800", "place the replicated table(s) 'small' 'row_wise'",
                 "more workers"):
        assert part in message, (part, message)


def test_a_plan_is_refused_when_a_table_does_not_fit_even_row_wise():
    small, big = pl.TableSpec("small", 100, 4), pl.TableSpec("big", 10_000, 4)
    with pytest.raises(pl.PlacementError) as error:
        planner(budget=200_000).place_all([small, big])
    message = str(error.value)
    for part in ("'big'", "row_wise, chosen by auto", "240000 bytes per worker",
                 "already holds 2400 of its memory_budget_bytes=200000", "at least 242400",
                 "more workers"):
        assert part in message, (part, message)
    assert "replicated table(s)" not in message  # small was made row-wise: nothing to free
    with pytest.raises(pl.PlacementError, match="'big'.*240000 bytes per worker"):
        pl.plan_tables([small, big], 2, memory_budget_bytes=200_000, collectives=COSTS)
    # Positive control: the budget that holds both shards.
    assert [p.placement for p in pl.plan_tables([small, big], 2, memory_budget_bytes=242_400,
                                                collectives=COSTS)] == [pl.ROW_WISE] * 2


def test_linear_costs_carry_everything_the_planner_reads():
    """The strategy plans with worker 0's costs (gathered as `linear_costs`): rebuilt from them,
    every collective costs the same, so every plan is the same."""
    for transport in ("tf", "sockets"):
        costs = pl.default_collectives(transport)
        for workers in (2, 3, 4):
            again = pl.collectives_from_linear(pl.linear_costs(costs, workers), workers)
            for kind in ("all_to_all", "all_reduce"):
                for nbytes in (0, 1234, 5e6):
                    assert pl.collective_ms(kind, again[kind], workers, nbytes) == pytest.approx(
                        pl.collective_ms(kind, costs[kind], workers, nbytes), rel=1e-12)
            tables = [pl.TableSpec("t%d" % i, rows, dim) for i, (rows, dim) in enumerate(
                [(7, 16), (20_000, 16), (3_000, 8), (500_000, 16)])]
            assert ([p.placement for p in pl.plan_tables(tables, workers, collectives=again)]
                    == [p.placement for p in pl.plan_tables(tables, workers, collectives=costs)])
    assert pl.linear_costs(COSTS, 2) == [1.0, 1.0, 5.0, 2.0]
    with pytest.raises(pl.PlacementError, match="4 numbers"):
        pl.collectives_from_linear([1.0, 2.0], 2)


def test_a_table_that_does_not_fit_is_refused_with_the_fix():
    plan = planner("data_parallel", budget=50_000)
    with pytest.raises(pl.PlacementError) as error:
        plan.place(pl.TableSpec("big", 2_000, 4))
    message = str(error.value)
    for part in ("'big'", "2000 rows x 4", "96000 bytes per worker", "memory_budget_bytes=50000",
                 "at least 96000", "'row_wise' (48000 bytes per worker)", "more workers"):
        assert part in message
    with pytest.raises(pl.PlacementError, match="'huge'.*chosen by auto"):
        planner(budget=50_000).place(pl.TableSpec("huge", 100_000, 4))


def test_a_budget_that_fits_is_no_error():
    """Positive control of the budget check: the same table under a budget just large enough."""
    assert planner("data_parallel", budget=96_000).place(
        pl.TableSpec("big", 2_000, 4)).placement == pl.DATA_PARALLEL


@pytest.mark.parametrize("placement,match", [
    ("bogus", "unknown placement 'bogus'"),
    ("column_wise", "'column_wise' is not implemented"),
    ({"t": "replicated"}, r"placement\['t'\]: unknown placement 'replicated'"),
    ({"t": "column_wise"}, r"placement\['t'\]: placement 'column_wise' is not implemented"),
    (3, "placement must be 'auto'"),
    ({"": "row_wise"}, "keys must be table"),
])
def test_bad_placements_are_refused(placement, match):
    with pytest.raises(pl.PlacementError, match=match):
        pl.parse_placement(placement)


def test_every_implemented_placement_is_accepted():
    """Positive control of the refusals above."""
    for placement in ("data_parallel", "table_wise", "row_wise", "auto"):
        assert pl.parse_placement(placement) == placement
    assert pl.parse_placement({"t": "table_wise"}) == {"t": "table_wise"}


def test_table_wise_tables_balance_over_the_workers_by_bytes():
    plan = pl.Planner("table_wise", 3, collectives=COSTS)
    sizes = {"a": 1000, "b": 600, "c": 500, "d": 300, "e": 100}
    plans = [plan.place(pl.TableSpec(n, rows, 4)) for n, rows in sizes.items()]
    # Each on the worker holding the fewest bytes so far (lowest index among equals).
    assert [p.owner for p in plans] == [0, 1, 2, 2, 1]
    assert [plan.worker_bytes(w) for w in range(3)] == [48_000, 33_600, 38_400]
    assert plan.used_bytes() == 48_000  # the most any worker holds
    assert all(p.placement == pl.TABLE_WISE and p.bytes_per_worker == p.table.rows * 48
               for p in plans)
    text = pl.render_plan(plan.plans, 3)
    assert "table_wise@0" in text and "table_wise@2" in text and "46.9 KiB" in text


def test_table_wise_traffic_is_its_owners_by_hand():
    table = pl.TableSpec("t", 10_000, 16)
    # 1000 ids: keys 8,000 B; the owner answers both workers' ids (128,000 B) and sends back
    # its own gradient rows (64,000 B).
    nbytes, ms = pl.traffic(table, 2, pl.TABLE_WISE, COSTS, ids_per_step=1000)
    assert nbytes == 8_000 + 128_000 + 64_000
    assert ms == pytest.approx(3 * 1.0 + nbytes / 1e6)
    assert pl.table_bytes(table, 2, pl.TABLE_WISE, 2) == 640_000 * 3


def test_a_table_wise_table_over_its_owners_budget_is_refused_with_the_fix():
    plan = pl.Planner("table_wise", 2, memory_budget_bytes=100_000, collectives=COSTS)
    plan.place(pl.TableSpec("a", 800, 4))   # 38,400 B on worker 0
    plan.place(pl.TableSpec("b", 1000, 4))  # 48,000 B on worker 1
    with pytest.raises(pl.PlacementError) as error:
        plan.place(pl.TableSpec("c", 1500, 4))  # 72,000 B: worker 0 would hold 110,400
    message = str(error.value)
    for part in ("'c'", "table_wise@0", "worker 0 already holds 38400", "at least 110400",
                 "'row_wise' (36000 bytes per worker)"):
        assert part in message
    assert plan.place(pl.TableSpec("d", 1200, 4)).owner == 0  # positive control: 96,000 fits


def test_bad_budget_is_refused():
    with pytest.raises(pl.PlacementError, match="memory_budget_bytes must be a positive"):
        pl.Planner("auto", 2, memory_budget_bytes=0)


def test_unknown_table_names_are_refused_once_tables_are_known():
    plan = planner({"table_a": "data_parallel", "tabel_b": "row_wise"})
    plan.place(pl.TableSpec("table_a", 7, 4))
    plan.place(pl.TableSpec("table_b", 7, 4))
    with pytest.raises(pl.PlacementError, match="'tabel_b'.*tables are 'table_a', 'table_b'"):
        plan.check_names()
    good = planner({"table_a": "data_parallel"})  # positive control
    good.place(pl.TableSpec("table_a", 7, 4))
    good.check_names()


def test_default_collectives_come_from_the_cost_model():
    costs = pl.default_collectives()
    assert set(costs) == {"all_to_all", "all_reduce"}
    assert costs["all_to_all"].measured and 2 in costs["all_to_all"].measured


def test_collective_costs_follow_the_transport_in_use():
    """The socket mesh's measured all-to-all is cheaper than TF's (plan_costs.json's
    collectives_sockets vs collectives), so a mid-size table TF's costs replicate stays
    row-wise on the mesh; Horovod's are costed as TF's."""
    tf_costs, mesh = pl.default_collectives("tf"), pl.default_collectives("sockets")
    assert pl.default_collectives("horovod") == tf_costs
    for costs in (tf_costs, mesh):
        assert costs["all_to_all"].measured and 2 in costs["all_to_all"].measured
    tf_fixed = pl.traffic(pl.TableSpec("t", 10, 16), 2, pl.ROW_WISE, tf_costs, 0)[1]
    mesh_fixed = pl.traffic(pl.TableSpec("t", 10, 16), 2, pl.ROW_WISE, mesh, 0)[1]
    assert mesh_fixed < tf_fixed
    table = pl.TableSpec("mid", 10_000, 16)  # 640 KB
    on_tf = pl.Planner("auto", 2, transport="tf").place(table)
    on_mesh = pl.Planner("auto", 2, transport="sockets").place(table)
    assert (on_tf.placement, on_mesh.placement) == (pl.DATA_PARALLEL, pl.ROW_WISE)
    assert pl.Planner("auto", 2, transport="sockets", collectives=COSTS).collectives is COSTS
    with pytest.raises(pl.PlacementError, match="transport must be one of"):
        pl.Planner("auto", 2, transport="nccl")
    text = pl.render_plan([on_mesh], 2, "sockets")
    assert "sockets collectives' costs" in text and "group's exchange" in text


def test_cli_shows_a_plan_without_training(capsys):
    assert cli.main(["placement", "--table", "small:7:16", "--table", "big:2000000:16",
                     "--workers", "2", "--transport", "tf"]) == 0
    out = capsys.readouterr().out
    assert "small" in out and "data_parallel" in out and "big" in out and "row_wise" in out
    assert cli.main(["placement", "--table", "big:2000000:16", "--placement", "big=data_parallel",
                     "--memory-budget-bytes", "1000000"]) == 2
    assert "'big'" in capsys.readouterr().err
    assert cli.main(["placement", "--table", "bad"]) == 2
    assert "NAME:ROWS:DIM" in capsys.readouterr().err


def test_cli_gives_each_tables_reason_and_refuses_column_wise(capsys):
    assert cli.main(["placement", "--table", "small:7:4", "--table", "big:2000000:16",
                     "--table", "whole:5000:8", "--placement", "whole=table_wise",
                     "--workers", "2", "--transport", "sockets"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
             if line.strip().startswith(("small ", "big ", "whole "))}
    assert "all-reduce +" in lines["small"] and "data_parallel" in lines["small"]
    assert "all-to-all +" in lines["big"] and "row_wise" in lines["big"]
    assert "requested (auto never chooses table_wise)" in lines["whole"]
    for placement in ("column_wise", "big=column_wise"):
        assert cli.main(["placement", "--table", "big:2000000:16", "--placement",
                         placement]) == 2
        err = capsys.readouterr().err
        assert "'column_wise' is not implemented" in err and "use 'row_wise'" in err, err


def _tiny_model():
    import tf_keras

    import tf_nestpipe as tnp

    inputs = tf_keras.Input([2], dtype="int64")
    out = tnp.ShardedEmbedding(30, 4, name="cli_table")(inputs)
    return tf_keras.Model(inputs, out)


def test_cli_plans_a_models_tables(capsys):
    assert cli.main(["placement", "--model", "test_placement:_tiny_model", "--workers", "3"]) == 0
    out = capsys.readouterr().out
    assert "cli_table" in out and "30" in out and "data_parallel" in out


def test_the_strategy_refuses_bad_placements_before_starting():
    import tf_nestpipe as tnp

    with pytest.raises(pl.PlacementError, match="'column_wise' is not implemented"):
        tnp.NestPipeStrategy(placement="column_wise")
    with pytest.raises(pl.PlacementError, match="memory_budget_bytes"):
        tnp.NestPipeStrategy(placement="auto", memory_budget_bytes=-1)
    assert tnp.NestPipeStrategy().placement == "auto"  # the default (positive control)


def test_the_strategy_refuses_a_table_over_the_memory_budget_when_it_is_built():
    import tensorflow as tf

    import tf_nestpipe as tnp

    strategy = tnp.NestPipeStrategy(memory_budget_bytes=1000)
    with strategy.scope():
        small = tnp.ShardedEmbedding(10, 2, name="fits_budget")  # 10 x 2 x 4 x 3 = 240 bytes
    small(tf.constant([1], tf.int64))
    with strategy.scope():
        big = tnp.ShardedEmbedding(1000, 2, name="over_budget")
    with pytest.raises(pl.PlacementError, match="'over_budget'.*24000 bytes per worker.*holds "
                                                "240 of its memory_budget_bytes=1000"):
        big(tf.constant([1], tf.int64))


def test_the_strategy_refuses_an_unknown_table_name_at_the_first_step():
    import tensorflow as tf
    import tf_keras

    import tf_nestpipe as tnp

    strategy = tnp.NestPipeStrategy(placement={"no_such_table": "data_parallel"})
    with strategy.scope():
        table = tnp.ShardedEmbedding(10, 2, name="known_table")
        optimizer = tf_keras.optimizers.SGD(0.1)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(table(tf.constant([1, 2], tf.int64)))
        optimizer.apply_gradients(zip(tape.gradient(loss, table.trainable_variables),
                                      table.trainable_variables))

    # Raised while the step is traced (tf.function reports it as its StagingError).
    with pytest.raises(Exception, match="'no_such_table'.*'known_table'"):
        strategy.run(tf.function(step))
    strategy.placement = {"known_table": "data_parallel"}  # positive control
    with strategy.scope():
        table = tnp.ShardedEmbedding(10, 2, name="known_table")
    strategy.run(tf.function(step))
    assert [p.table.name for p in strategy.placement_plan()] == ["known_table"]


# --- the default ("auto") on 2 workers: one plan on every worker ---------------------------
@pytest.mark.cluster
def test_the_default_auto_plan_is_worker_0s_on_every_worker_for_a_lazily_built_model(tmp_path):
    """tests/programs/placement_default.py: tables constructed in a layer's build (the model's
    first call, inside fit), placement and pipeline left at their defaults ("auto"); worker 1's
    own all-reduce costs made 1000 times dearer. Both workers plan with worker 0's costs (placed
    together: both tables replicated), worker 0 prints the plan once, and the model equals one
    process's."""
    program = os.path.join(PROGRAMS, "placement_default.py")
    one = run_command([sys.executable, program, str(tmp_path / "one"), "12"])
    assert one.returncode == 0, one.stdout[-4000:]
    two = launch(2, [program, str(tmp_path / "two"), "12", "--disagree"], timeout=900)
    assert two.returncode == 0, two.stdout[-6000:]
    reports = [json.loads((tmp_path / "two" / ("rank%d.json" % r)).read_text()) for r in (0, 1)]
    assert all(r["placement"] == "auto" for r in reports)  # the default
    assert reports[0]["plan"] == reports[1]["plan"]
    assert reports[1]["agreed_costs"] == reports[0]["agreed_costs"] == reports[0]["own_costs"]
    assert reports[1]["own_costs"] != reports[0]["own_costs"]  # the disagreement took effect
    tables = [pl.TableSpec(n, *reports[0]["tables"][n]) for n, *_ in reports[0]["plan"]]
    placed = lambda costs: [[p.table.name, p.placement, p.owner, p.reason] for p in  # noqa: E731
                            pl.plan_tables(tables, 2, collectives=pl.collectives_from_linear(
                                costs, 2))]
    assert reports[0]["plan"] == placed(reports[0]["own_costs"])  # placed together
    assert {p for _, p, _, _ in reports[0]["plan"]} == {pl.DATA_PARALLEL}
    # Positive control: worker 1's own costs would have placed the tables otherwise.
    assert {p for _, p, _, _ in placed(reports[1]["own_costs"])} == {pl.ROW_WISE}
    assert two.stdout.count("tf_nestpipe placement on 2 worker(s)") == 1
    assert "[worker:0] tf_nestpipe placement on 2 worker(s)" in two.stdout
    ref, got = np.load(tmp_path / "one" / "params.npz"), np.load(tmp_path / "two" / "params.npz")
    assert sorted(ref.files) == sorted(got.files) and "table_a" in ref.files
    for name in ref.files:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)


# --- exactness on 2 and 3 workers (the shared exactness launches) --------------------------
CASES = [(w, run) for w, runs in sorted(PLACEMENT_RUNS.items()) for run in runs]


def expected_placements(run, workers):
    """The placement each table of a run on `workers` workers must have had (see
    exactness.placement_of_run), with the owner of each table_wise one ("table_wise@OWNER")."""
    options = run.split(":")[2:]
    names = ["table_a", "table_b"] + (["fields_fused"] if "mixed" in options else [])
    if "alltw" in options:  # by bytes: table_a 976 B, table_b 752 B, fields 240 B (x 3 slots)
        owners = {"table_a": 0, "table_b": 1, "fields_fused": 2 if workers == 3 else 1}
        return {n: "table_wise@%d" % owners[n] for n in names}
    if "tw" in options:
        return {"table_a": "table_wise@0", "table_b": "row_wise", "fields_fused": "data_parallel"}

    if "mixdp" in options:
        return {n: ("data_parallel" if n == "table_a" else "row_wise") for n in names}
    return {n: "data_parallel" for n in names}  # dp, and auto for these tiny tables


@pytest.mark.parametrize("workers,run", CASES, ids=["%dw-%s" % c for c in CASES])
def test_placements_match_single_process(exactness_results, workers, run):
    from conftest import reference_of

    ref = load_run(exactness_results[1], reference_of(run))
    got = load_run(exactness_results[workers], run)
    params = [n for n in ref.files if not n.startswith("stats/")]
    assert sorted(params) == sorted(n for n in got.files if not n.startswith("stats/"))
    for name in params:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)
    placed = {k[len("stats/placement/"):]: str(got[k]) for k in got.files
              if k.startswith("stats/placement/")}
    for k in got.files:
        if k.startswith("stats/owner/"):
            placed[k[len("stats/owner/"):]] += "@%d" % int(got[k])
    assert placed == expected_placements(run, workers)
    if run.split(":")[0] in ("loop", "fit"):
        # Replicated tables never enter the fused exchange: one per group of row-wise and
        # table-wise tables (both ride on it).
        groups = {"d4" if n != "fields_fused" else "d3" for n, p in placed.items()
                  if p != "data_parallel"}
        # fwp: a round per micro-batch; nested fetches its window a step ahead in one.
        micro = 3 if "fwp" in run.split(":") else 1
        assert int(got["stats/exchanges"]) == micro * len(groups)
