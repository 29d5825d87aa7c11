"""The fused exchange's single-process pieces: the id check op, the fused id space of a table
group, the frozen window's dedup, round assignment, the collective counter and `auto`'s choice."""
import collections
import contextlib
import statistics

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from tf_nestpipe import ops
from tf_nestpipe.collectives.counting import collective_issuers, count_collectives
from tf_nestpipe.pipeline.auto import AutoPipeline
from tf_nestpipe.pipeline.fused_exchange import (BufferReader, GroupBuffers, PendingSync,
                                                 RouteRecorder, RoundTracker, lookup_counts,
                                                 prefetch_lookups, run_route_pass)
from tf_nestpipe.pipeline.frozen_window import frozen_window
from tf_nestpipe.pipeline.instrumentation import profile_steps
from tf_nestpipe.sharding.exchange import CapacityHint
from tf_nestpipe.sharding.fetch import current_fetcher, installed
from tf_nestpipe.sharding.layout import ShardLayout
from tf_nestpipe.sharding.tables import FusedTables


def test_check_ids_passes_valid_ids_and_names_table_id_and_position():
    ids = tf.constant([0, 4, 2], tf.int64)
    np.testing.assert_array_equal(ops.check_ids(ids, 5, "t").numpy(), [0, 4, 2])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"ShardedEmbedding 'users': id 5 at position 1 is out of range "
                             r"\[0, 5\).*invalid_id_policy='zero'"):
        ops.check_ids(tf.constant([1, 5, -1], tf.int64), 5, "users")
    with pytest.raises(tf.errors.InvalidArgumentError, match="id -1 at position 0"):
        ops.check_ids(tf.constant([-1], tf.int64), 5, "users")


class _FakeTable:
    """What FusedTables reads of a layer: vocab_size, dim and this worker's shard variable."""

    def __init__(self, full, num_shards, shard_index, name):
        self.name = name
        self.vocab_size, self.dim = full.shape
        layout = ShardLayout(self.vocab_size, self.dim, num_shards, shard_index)
        self.embeddings = tf.Variable(full[layout.global_ids()])


def _tables(num_shards, shard_index, sizes=(7, 10, 4), dim=3):
    rng = np.random.default_rng(0)
    fulls = [rng.normal(size=(size, dim)).astype(np.float32) for size in sizes]
    return fulls, [_FakeTable(f, num_shards, shard_index, "t%d" % i) for i, f in enumerate(fulls)]


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_fused_ids_keep_each_ids_owner_and_local_row(num_shards):
    for shard in range(num_shards):
        fulls, layers = _tables(num_shards, shard)
        group = FusedTables(layers, num_shards, shard)
        for layer, full in zip(layers, fulls):
            ids = tf.range(layer.vocab_size, dtype=tf.int64)
            fused = group.fuse(layer, ids)
            np.testing.assert_array_equal(group.layout.owner(fused).numpy(), ids.numpy() % num_shards)
            assert int(tf.reduce_max(fused)) < group.layout.vocab_size
            # This shard's ids, gathered through the fused local rows, are the table's rows.
            mine = ids.numpy()[ids.numpy() % num_shards == shard]
            rows = group.gather(group.layout.local_row(tf.constant(mine) + group.offset(layer)))
            np.testing.assert_array_equal(rows.numpy(), full[mine])


class _PlacedTable(_FakeTable):
    """A fake table with its own layout (row-wise, or table_wise on `owner`)."""

    def __init__(self, full, num_shards, shard_index, name, owner=None):  # pylint: disable=super-init-not-called
        self.name = name
        self.vocab_size, self.dim = full.shape
        self.layout = ShardLayout(self.vocab_size, self.dim, num_shards, shard_index, owner)
        self.embeddings = tf.Variable(full[self.layout.global_ids()].reshape(-1, self.dim))


@pytest.mark.parametrize("num_shards", [2, 3])
def test_table_wise_and_row_wise_tables_share_one_fused_id_space(num_shards):
    """Table-wise tables (whole on one worker) fused with row-wise ones: every fused id is
    unique, owned where its table's layout says, and gathers its table's row there."""
    sizes = [(7, None), (10, 1), (4, None), (5, 0), (9, None)]  # (rows, table-wise owner)
    rng = np.random.default_rng(1)
    fulls = [rng.normal(size=(rows, 3)).astype(np.float32) for rows, _ in sizes]
    every = []
    for shard in range(num_shards):
        layers = [_PlacedTable(full, num_shards, shard, "t%d" % i, owner)
                  for i, (full, (_, owner)) in enumerate(zip(fulls, sizes))]
        group = FusedTables(layers, num_shards, shard)
        for layer, full in zip(layers, fulls):
            ids = np.arange(layer.vocab_size, dtype=np.int64)
            fused = group.fuse(layer, tf.constant(ids)).numpy()
            np.testing.assert_array_equal(group.layout.owner(fused), layer.layout.owner(ids))
            assert 0 <= fused.min() and fused.max() < group.layout.vocab_size
            mine = layer.layout.owner(ids) == shard
            rows = group.gather(tf.constant(group.layout.local_row(fused[mine])))
            np.testing.assert_array_equal(rows.numpy(), full[mine])
            if shard == 0:
                every.append(fused)
    every = np.concatenate(every)
    assert len(np.unique(every)) == len(every)
    with pytest.raises(ValueError, match="no single fused offset"):
        group.offset(layers[1])
    assert group.offset(layers[0]) == 0  # positive control: the first table starts at 0


class _CheckedTable(_PlacedTable):
    """A placed fake table that checks its ids (invalid_id_policy="error") or not ("zero")."""

    def __init__(self, *args, checked=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.checked_vocab_size = self.vocab_size if checked else 0

    def checked_ids(self, flat_ids):
        if not self.checked_vocab_size:
            return flat_ids
        return ops.check_ids(flat_ids, self.vocab_size, self.name)


def test_fuse_lookups_is_each_lookups_fuse_in_one_op_checked_per_table():
    sizes = [(7, None), (10, 1), (4, None), (5, 0)]  # (rows, table-wise owner)
    fulls = [np.zeros((rows, 3), np.float32) for rows, _ in sizes]
    layers = [_CheckedTable(full, 2, 0, "t%d" % i, owner)
              for i, (full, (_, owner)) in enumerate(zip(fulls, sizes))]
    group = FusedTables(layers, 2, 0)
    lookups = [(layers[0], [6, 0]), (layers[1], [9, 3, 3]), (layers[2], [1]),
               (layers[3], [4, 2]), (layers[0], [5])]
    lookups = [(layer, tf.constant(ids, tf.int64)) for layer, ids in lookups]
    fused, lookup_sizes, sizes_out = group.fuse_lookups(lookups, [3, 5])
    expected = np.concatenate([group.fuse(layer, ids).numpy() for layer, ids in lookups])
    np.testing.assert_array_equal(fused.numpy(), expected)
    assert sizes_out.numpy().tolist() == [6, 3]
    assert lookup_sizes.numpy().tolist() == [2, 3, 1, 2, 1]
    # Row-wise and table-wise tables alike name themselves when an id is out of range...
    for bad in (0, 1):
        broken = list(lookups)
        broken[bad] = (layers[bad], tf.constant([layers[bad].vocab_size], tf.int64))
        with pytest.raises(tf.errors.InvalidArgumentError, match="'t%d': id" % bad):
            group.fuse_lookups(broken)
    # ... unless the table maps invalid ids itself (positive control: no check, offset only).
    free = _CheckedTable(fulls[0], 2, 0, "free", None, checked=False)
    group = FusedTables([free], 2, 0)
    fused, _, _ = group.fuse_lookups([(free, tf.constant([99], tf.int64))])
    assert fused.numpy().tolist() == [99]


def test_fused_gather_sends_each_table_its_own_sparse_gradient():
    fulls, layers = _tables(2, 1)
    group = FusedTables(layers, 2, 1)
    picks = [(0, 3), (2, 1), (1, 9), (0, 3), (2, 3)]  # (table, id), all owned by shard 1
    local = tf.constant([group.layout.local_row(k + group.offset(layers[t])) for t, k in picks],
                        tf.int64)
    with tf.GradientTape() as tape:
        rows = group.gather(local)
        loss = tf.reduce_sum(rows * tf.constant(np.arange(15, dtype=np.float32).reshape(5, 3)))
    grads = tape.gradient(loss, [layer.embeddings for layer in layers])
    for t, (layer, grad) in enumerate(zip(layers, grads)):
        assert isinstance(grad, tf.IndexedSlices)
        dense = tf.convert_to_tensor(grad).numpy()
        expected = np.zeros_like(layer.embeddings.numpy())
        for i, (table, k) in enumerate(picks):
            if table == t:
                expected[k // 2] += np.arange(15, dtype=np.float32).reshape(5, 3)[i]
        np.testing.assert_array_equal(dense, expected)


def test_fused_tables_refuse_mixed_dims():
    _, layers = _tables(2, 0)
    _, other = _tables(2, 0, sizes=(5,), dim=4)
    with pytest.raises(ValueError, match="share dim and dtype"):
        FusedTables(layers + other, 2, 0)


@pytest.mark.parametrize("num_shards", [2, 3])
def test_window_layout_fetches_each_id_once_in_the_round_that_first_reads_it(num_shards):
    """A frozen window routed as one (`route_rounds`): each distinct id is asked of its owner in
    the first round that reads it (the counts per owner and round), and each looked-up id's
    window row, in the rounds' buffers laid one after another (each round's keys in owner
    order), holds that id."""
    rounds = [np.array([5, 3, 5]), np.array([3, 8, 1, 8, 4]), np.array([], np.int64),
              np.array([1, 9, 5, 12])]
    ids = tf.constant(np.concatenate(rounds), tf.int64)
    keys, splits, inverse = ops.route_keys(ids, num_shards, 100)
    counts, window_inverse = ops.window_layout(inverse, splits, [len(r) for r in rounds])
    seen, fresh = set(), []
    for r in rounds:
        fresh.append([k for k in dict.fromkeys(r.tolist()) if k not in seen])
        seen.update(fresh[-1])
    expected_counts = [[sum(1 for k in f if k % num_shards == j) for f in fresh]
                       for j in range(num_shards)]
    assert counts.numpy().tolist() == expected_counts
    # The window: round by round, that round's new ids in owner order (first-seen per owner).
    window = np.array([k for f in fresh for j in range(num_shards) for k in f if k % num_shards == j])
    rows = window_inverse.numpy()
    np.testing.assert_array_equal(window[rows], np.concatenate(rounds))
    # Every id is read from a row its round (or an earlier one) fetched.
    ends = np.cumsum([len(f) for f in fresh])
    for r, start, stop in zip(range(len(rounds)), np.cumsum([0] + [len(x) for x in rounds]),
                              np.cumsum([len(x) for x in rounds])):
        assert (rows[start:stop] < ends[r]).all()


def test_window_layout_refuses_inconsistent_sizes():
    inverse = tf.constant([0, 1, 0], tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="sum to 4 but there are 3 ids"):
        ops.window_layout(inverse, [1, 1], [2, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"inverse\[1\] = 5 outside"):
        ops.window_layout(tf.constant([0, 5], tf.int32), [1, 1], [2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="key 1 is read by no id"):
        ops.window_layout(tf.constant([0, 0], tf.int32), [1, 1], [2])


def test_rounds_end_where_a_table_is_looked_up_again():
    a, b = object(), object()
    tracker = RoundTracker()
    assert [tracker.place(x) for x in (a, b, a, b, b, a)] == [0, 0, 1, 1, 2, 2]


def test_collective_counter_counts_branches_as_conditional_and_has_a_zero_control():
    @tf.function
    def with_collectives(x):
        total = collective_ops.all_reduce_v2(x, 1, 7, 1)
        gathered = tf.cond(tf.reduce_sum(x) > 0,
                           lambda: collective_ops.all_gather_v2(x, 1, 7, 2),
                           lambda: tf.identity(x))
        return total + tf.reduce_sum(gathered)

    @tf.function
    def without(x):
        return x * 2

    spec = tf.TensorSpec([2], tf.float32)
    count = count_collectives(with_collectives.get_concrete_function(spec).graph)
    assert count.always == {"CollectiveReduceV2": 1}
    assert count.conditional == {"CollectiveGatherV2": 1}
    assert count.total == 1 and "1 conditional" in count.describe()
    assert count_collectives(without.get_concrete_function(spec).graph).total == 0


def test_collective_issuers_names_collectives_and_the_calls_and_branches_that_run_one():
    @tf.function
    def inner(x):
        return collective_ops.all_reduce_v2(x, 1, 7, 1)

    @tf.function
    def step(x):
        called = inner(x)  # a call of a function that issues one
        branched = tf.cond(tf.reduce_sum(x) > 0, lambda: collective_ops.all_gather_v2(x, 1, 7, 2),
                           lambda: tf.identity(x))
        quiet = tf.cond(tf.reduce_sum(x) > 1, lambda: x * 3, lambda: x)  # control: none
        return called + tf.reduce_sum(branched) + quiet

    graph_def = step.get_concrete_function(tf.TensorSpec([2], tf.float32)).graph.as_graph_def()
    issues = collective_issuers(graph_def)
    by_op = collections.Counter(n.op for n in graph_def.node if issues(n))
    assert by_op == {"StatefulPartitionedCall": 1, "If": 1}, by_op
    assert sum(n.op in ("If", "StatelessIf") for n in graph_def.node) == 2  # the quiet one left


class _FakePipeline:
    """Trains batches from a Python iterator (records which); `lookahead` batches are held."""

    def __init__(self, name, trained, lookahead=0, seconds=0.0):
        self.name, self.trained, self.lookahead, self.seconds = name, trained, lookahead, seconds
        self.held = collections.deque()
        self.stats = name

    def progress(self, iterator):
        while len(self.held) < self.lookahead + 1:
            self.held.append(next(iterator))
        batch = self.held.popleft()
        self.trained.append((self.name, batch))
        if self.seconds:
            import time
            time.sleep(self.seconds)
        return batch

    def progress_held(self, iterator):
        del iterator
        if not self.held:
            return None
        batch = self.held.popleft()
        self.trained.append((self.name, batch))
        return batch


def test_auto_trains_every_batch_once_in_order_and_keeps_the_agreed_fastest():
    trained, logged = [], []
    candidates = [("slow", _FakePipeline("slow", trained, seconds=0.02)),
                  ("ahead", _FakePipeline("ahead", trained, lookahead=1, seconds=0.001)),
                  ("slower", _FakePipeline("slower", trained, lookahead=1, seconds=0.03))]
    agreed = []

    def agree(times):
        agreed.append(times)
        return [t * 1.0 for t in times]  # one worker: its own times

    auto = AutoPipeline(candidates, agree, warmup_steps=1, timed_steps=2, log=logged.append,
                        rounds=1)
    iterator = iter(range(100))
    outputs = [auto.progress(iterator) for _ in range(20)]
    assert outputs == list(range(20))  # no batch skipped or repeated, in order
    assert [b for _, b in trained] == list(range(20))
    assert auto.choice == "ahead" and len(agreed) == 1 and "chose 'ahead'" in logged[0]
    # 3 steps each; "ahead"'s held batch was trained before "slower", "slower"'s before "ahead".
    assert [n for n, _ in trained][:11] == ["slow"] * 3 + ["ahead"] * 4 + ["slower"] * 4
    assert all(n == "ahead" for n, _ in trained[11:])
    assert auto.stats == "ahead"


def test_auto_reports_each_candidates_process_cpu_per_step():
    """The probe times each candidate's process CPU as well as its wall time: a candidate that
    computes through its step keeps a core busy, one that waits (sleeps) does not."""
    import time

    class Computing(_FakePipeline):
        def progress(self, iterator):
            end = time.perf_counter() + 0.02
            while time.perf_counter() < end:
                pass
            return super().progress(iterator)

    trained, logged = [], []
    candidates = [("waits", _FakePipeline("waits", trained, seconds=0.02)),
                  ("computes", Computing("computes", trained))]
    auto = AutoPipeline(candidates, lambda times: times, warmup_steps=0, timed_steps=3,
                        log=logged.append, rounds=1)
    iterator = iter(range(20))
    for _ in range(7):
        auto.progress(iterator)
    assert auto.choice is not None and set(auto.cpu) == {"waits", "computes"}
    # Relative bounds only: the suite's background clusters, or a host that lends this machine
    # less than its cores (seen: a busy loop got 0.24 of a core), may leave the computing
    # candidate well under a core; the waiting one uses next to none. CPU read as wall time
    # (both ~1 core) or the candidates swapped would fail them.
    computes, waits = auto.cpu["computes"], auto.cpu["waits"]
    assert computes.cores_busy > 10 * waits.cores_busy
    assert computes.ms_per_step > 10 * waits.ms_per_step
    assert waits.cores_busy < 0.3 and waits.ms_per_step < 6
    assert "process CPU ms/step (cores busy) waits " in logged[0]


def test_auto_takes_the_slowest_workers_view():
    trained = []
    candidates = [("a", _FakePipeline("a", trained)), ("b", _FakePipeline("b", trained))]
    # Locally "a" looks fastest, but another worker was slow with it: the agreed times and
    # ratios (one all-gather: the medians, then the ratios to the baseline) decide.
    seen = []

    def agree(values):
        seen.append(len(values))
        return [1.0, 0.5, 1.0, 0.5]

    auto = AutoPipeline(candidates, agree, warmup_steps=0, timed_steps=1,
                        log=lambda text: None, rounds=1)
    iterator = iter(range(10))
    for _ in range(3):
        auto.progress(iterator)
    assert auto.choice == "b" and auto.timings_ms == {"a": 1000.0, "b": 500.0}
    assert auto.ratios == {"a": 1.0, "b": 0.5} and seen == [4]


def test_auto_keeps_the_baseline_unless_another_mode_is_clearly_faster():
    for agreed, choice in (([1.0, 0.97], "a"), ([1.0, 0.94], "b"), ([1.0, 1.2], "a")):
        trained = []
        auto = AutoPipeline([("a", _FakePipeline("a", trained)), ("b", _FakePipeline("b", trained))],
                            lambda times, agreed=agreed: agreed + agreed, warmup_steps=0,
                            timed_steps=1,
                            log=lambda text: None, margin=0.05, rounds=1)
        iterator = iter(range(10))
        auto.progress(iterator)
        auto.progress(iterator)
        assert auto.choice == choice, agreed


class _LoadDrift:
    """A machine whose load falls after `busy_steps` steps: every step before is `extra`
    seconds slower, whichever candidate runs it."""

    def __init__(self, busy_steps, extra):
        self.steps, self.busy_steps, self.extra = 0, busy_steps, extra

    def pipeline(self, name, trained, seconds, lookahead=0):
        drift = self

        class Drifting(_FakePipeline):
            def progress(self, iterator):
                drift.steps += 1
                slow = drift.extra if drift.steps <= drift.busy_steps else 0.0
                self.seconds = seconds + slow
                return super().progress(iterator)

        return Drifting(name, trained, lookahead, seconds)


def _drift_probe(rounds):
    """auto over a fast baseline and a slower look-ahead mode, while the machine is busy
    during the first round's baseline steps only."""
    trained = []
    drift = _LoadDrift(busy_steps=3, extra=0.03)
    candidates = [("none", drift.pipeline("none", trained, 0.002)),
                  ("ahead", drift.pipeline("ahead", trained, 0.01, lookahead=1))]
    auto = AutoPipeline(candidates, lambda times: times, warmup_steps=0, timed_steps=3,
                        log=lambda text: None, rounds=rounds, settle_steps=1)
    iterator = iter(range(1000))
    outputs = [auto.progress(iterator) for _ in range(auto.probe_steps_bound + 5)]
    assert outputs == list(range(len(outputs)))  # interleaving skips and repeats nothing
    assert [b for _, b in trained] == outputs
    return auto, trained


def test_auto_interleaves_rounds_so_a_load_change_does_not_decide():
    # Positive control: one round charges the busy start to the baseline, and auto picks the
    # slower mode.
    auto, _ = _drift_probe(rounds=1)
    assert auto.choice == "ahead"
    # Three rounds: the baseline's median is of its later, quiet steps too.
    auto, trained = _drift_probe(rounds=3)
    assert auto.choice == "none"
    # Round two re-enters the look-ahead mode after its held batches were drained.
    names = [n for n, _ in trained]
    assert names.count("ahead") > 2 * (1 + 3)
    assert sorted(auto.timings_ms) == ["ahead", "none"]


class _FakeClock:
    """`time` for the auto module: steps advance it by what the fake pipelines say."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def process_time(self):
        return self.now


def _round_load_probe(monkeypatch, paired):
    """auto over a baseline of 20 ms and a look-ahead mode of 14 ms, 4 rounds, while another
    job adds 230 ms to every step of rounds 0 and 3 (the first round also follows the traces):
    with `paired`, as auto judges; without, judged by each candidate's median over all its
    steps pooled (what the rounds alone would give)."""
    from tf_nestpipe.pipeline import auto as auto_module
    clock = _FakeClock()
    monkeypatch.setattr(auto_module, "time", clock)
    trained, holder = [], []

    class Timed(_FakePipeline):
        def progress(self, iterator):
            load = 0.23 if holder[0]._round in (0, 3) else 0.0
            clock.now += self.seconds + load
            seconds, self.seconds = self.seconds, 0.0
            try:
                return super().progress(iterator)
            finally:
                self.seconds = seconds

    candidates = [("none", Timed("none", trained, seconds=0.020)),
                  ("ahead", Timed("ahead", trained, lookahead=1, seconds=0.014))]
    auto = AutoPipeline(candidates, lambda values: values, warmup_steps=0, timed_steps=3,
                        log=lambda text: None, rounds=4, settle_steps=1)
    holder.append(auto)
    if not paired:
        auto._judged_rounds = lambda: [0, 1, 2, 3]
        auto._local_ratio = lambda name, rounds: statistics.median(
            t for r in rounds for t in auto._round_times[name][r]) / statistics.median(
            t for r in rounds for t in auto._round_times["none"][r])
    iterator = iter(range(1000))
    outputs = [auto.progress(iterator) for _ in range(auto.probe_steps_bound + 3)]
    assert outputs == list(range(len(outputs))) and auto.choice is not None
    return auto


def test_auto_judges_each_mode_against_the_baseline_in_the_same_rounds(monkeypatch):
    auto = _round_load_probe(monkeypatch, paired=True)
    assert auto.choice == "ahead" and auto.ratios["ahead"] == pytest.approx(0.7)
    # Positive control: medians of all rounds pooled let the loaded rounds decide.
    assert _round_load_probe(monkeypatch, paired=False).choice == "none"


@pytest.mark.parametrize("count", [1, 2, 3, 4, 6])
def test_round_order_is_a_balanced_latin_square(count):
    from tf_nestpipe.pipeline.auto import round_order
    rows = [round_order(count, r) for r in range(count)]
    assert rows[0][0] == 0 and round_order(count, count) == rows[0]
    assert all(sorted(row) == list(range(count)) for row in rows)  # each round runs every one
    for place in range(count):  # each candidate once in each place
        assert sorted(row[place] for row in rows) == list(range(count))
    if count % 2 == 0:  # and right after each other candidate once
        pairs = [(row[i], row[i + 1]) for row in rows for i in range(count - 1)]
        assert len(set(pairs)) == len(pairs) == count * (count - 1)


def test_auto_rounds_follow_round_order_and_train_every_batch_once():
    """Four candidates (two look-ahead) over five rounds: each round's candidates run in
    `round_order`'s order, every candidate's timed steps are its own, and no batch is skipped
    or repeated across the switches (held batches included). Positive control: the fixed order
    of the first round would not give the later rounds' sequences."""
    from tf_nestpipe.pipeline.auto import round_order
    trained = []
    names = ["none", "fwp", "dbp", "nested"]
    candidates = [(n, _FakePipeline(n, trained, lookahead=int(n in ("dbp", "nested"))))
                  for n in names]
    auto = AutoPipeline(candidates, lambda times: times, warmup_steps=1, timed_steps=2,
                        log=lambda text: None, rounds=5, settle_steps=1)
    iterator = iter(range(1000))
    outputs = [auto.progress(iterator) for _ in range(auto.probe_steps_bound + 3)]
    assert outputs == list(range(len(outputs)))
    assert [b for _, b in trained] == outputs
    assert auto.choice is not None and sorted(auto.timings_ms) == sorted(names)
    # The runs of each candidate (a held batch trains on its own pipeline, so runs may merge).
    runs = [n for i, (n, _) in enumerate(trained) if i == 0 or trained[i - 1][0] != n]
    expected = [names[c] for r in range(5) for c in round_order(4, r)]
    merged = [n for i, n in enumerate(expected) if i == 0 or expected[i - 1] != n]
    assert runs[:len(merged)] == merged
    fixed = [n for r in range(5) for n in names]
    assert merged != [n for i, n in enumerate(fixed) if i == 0 or fixed[i - 1] != n]
    # The probe log: every probe step once, in time order; per candidate 5 rounds x 2 timed
    # steps and 1 warm-up or settling step per round.
    log = auto.probe_log
    assert all(a.end <= b.start for a, b in zip(log, log[1:]))
    for name in names:
        steps = [p for p in log if p.candidate == name]
        assert sum(p.timed for p in steps) == 10 and sum(not p.timed for p in steps) == 5
    assert len(log) == 4 * 15  # the held batches' steps are not probe steps


def test_auto_candidates_micro_batch_counts_and_labels():
    from tf_nestpipe.pipeline.auto import Candidate, auto_candidates
    assert [str(c) for c in auto_candidates((4, 2, 1, 2))] == [
        "none", "fwp(M=2)", "fwp(M=4)", "dbp", "nested(M=2)", "nested(M=4)"]
    assert auto_candidates((2, 4), micro_batching=False) == [Candidate("none"), Candidate("dbp")]


def test_auto_refuses_empty_probes():
    with pytest.raises(ValueError, match="timed_steps >= 1"):
        AutoPipeline([], lambda t: t, timed_steps=0)
    with pytest.raises(ValueError, match="margin < 1"):
        AutoPipeline([], lambda t: t, margin=1.5)
    with pytest.raises(ValueError, match="rounds >= 1"):
        AutoPipeline([], lambda t: t, rounds=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_read_rows_equals_gather_in_one_op(dtype):
    """`FusedTables.read_rows` (the prefetch's and the sync's read) gives `gather`'s values with
    one `NestpipeReadTableRows` op for a group, including a table that reserves no rows here."""
    rng = np.random.default_rng(2)
    fulls = [rng.normal(size=(n, 3)).astype(dtype) for n in (7, 10, 4)]
    layers = [_FakeTable(f, 2, 1, "t%d" % i) for i, f in enumerate(fulls)]
    group = FusedTables(layers, 2, 1)
    # Spans 4, 5 and 2 rows (shard 1 holds 3, 5 and 2 of them): rows of all three, repeated.
    local = tf.constant([0, 2, 4, 8, 9, 10, 2], tf.int64)
    np.testing.assert_array_equal(group.read_rows(local).numpy(), group.gather(local).numpy())
    graph = tf.function(group.read_rows).get_concrete_function(local).graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("NestpipeReadTableRows") == 1 and "ResourceGather" not in types
    # The op on its own: a zero-span table (offset 3 twice) hands its rows to the next table.
    handles = [layer.embeddings.handle for layer in layers]
    out = ops.read_table_rows(handles, [3, 0, 4], [0, 3, 3], tf.as_dtype(dtype), 3)
    np.testing.assert_array_equal(out.numpy(), np.stack([layers[2].embeddings.numpy()[0],
                                                         layers[0].embeddings.numpy()[0],
                                                         layers[2].embeddings.numpy()[1]]))


@pytest.mark.parametrize("dim", [3, 40])
def test_read_table_rows_matches_numpy_for_many_rows_in_any_order(dim):
    """NestpipeReadTableRows reads each table in one pass over its positions (rows asked for a
    few reads ahead): many rows of three tables, interleaved and repeated, each land at their
    own position, as NumPy's gather of the concatenated tables puts them."""
    rng = np.random.default_rng(dim)
    tables = [rng.normal(size=(n, dim)).astype(np.float32) for n in (50, 1, 300)]
    variables = [tf.Variable(t) for t in tables]
    offsets = np.array([0, 50, 51], np.int64)
    local = rng.integers(0, 351, 2000).astype(np.int64)
    out = ops.read_table_rows([v.handle for v in variables], local, offsets, tf.float32, dim)
    np.testing.assert_array_equal(out.numpy(), np.concatenate(tables)[local])


@pytest.mark.parametrize("sizes", [(7,), (7, 10, 4)])
def test_gradient_carrier_gets_gathers_gradient_and_reads_no_row(sizes):
    """`FusedTables.gradient_carrier` (the buffers' gradient path): zeros whose gradient is, per
    table, the `IndexedSlices` `gather` gets (the same values, indices and dense shape, in the
    same order), from one op that reads no row (no ResourceGather or variable read; the gather,
    the positive control, has them)."""
    rng = np.random.default_rng(3)
    fulls = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
    # With three tables, a zero-span table (4 rows, 2 shards: shard 1 of (7, 10, 4) holds 3, 5, 2).
    layers = [_FakeTable(f, 2, 1, "t%d" % i) for i, f in enumerate(fulls)]
    group = FusedTables(layers, 2, 1)
    local = tf.constant([0, 2, 1, 0] if len(sizes) == 1 else [0, 2, 4, 8, 9, 10, 2, 4], tf.int64)
    weights = tf.constant(rng.normal(size=(int(local.shape[0]), 3)).astype(np.float32))

    def gradients(read):
        with tf.GradientTape() as tape:
            rows = read(local)
            loss = tf.reduce_sum((rows + 1.0) * weights)
        return rows, tape.gradient(loss, [layer.embeddings for layer in layers])

    for run in (lambda f: f(), lambda f: tf.function(f)()):
        rows, carried = run(lambda: gradients(group.gradient_carrier))
        _, gathered = run(lambda: gradients(group.gather))
        np.testing.assert_array_equal(rows.numpy(), np.zeros([int(local.shape[0]), 3]))
        for ours, theirs in zip(carried, gathered):
            assert isinstance(ours, tf.IndexedSlices) and isinstance(theirs, tf.IndexedSlices)
            np.testing.assert_array_equal(ours.values.numpy(), theirs.values.numpy())
            np.testing.assert_array_equal(ours.indices.numpy(), theirs.indices.numpy())
            np.testing.assert_array_equal(ours.dense_shape.numpy(), theirs.dense_shape.numpy())
    for read, reads_rows in ((group.gradient_carrier, False), (group.gather, True)):
        types = [op.type for op in tf.function(read).get_concrete_function(local).graph
                 .get_operations()]
        assert (types.count("NestpipeGradientCarrier") == 1) != reads_rows
        assert any(t in types for t in ("ResourceGather", "ReadVariableOp")) == reads_rows


def test_gradient_carrier_of_rows_grouped_by_table_splits_without_a_partition():
    """Rows grouped by table (`owner_rounds`' order) with their `table_sizes`: the same
    per-table `IndexedSlices` as a gather, cut by a split (no `DynamicPartition`; the ungrouped
    carrier, the positive control, has one); sizes that do not match the rows raise."""
    rng = np.random.default_rng(5)
    fulls = [rng.normal(size=(n, 3)).astype(np.float32) for n in (7, 10, 4)]
    layers = [_FakeTable(f, 2, 1, "t%d" % i) for i, f in enumerate(fulls)]
    group = FusedTables(layers, 2, 1)  # shard 1's tables start at local rows 0, 4, 9
    np.testing.assert_array_equal(group.row_offsets, [0, 4, 9])
    local = tf.constant([2, 0, 4, 7, 5, 9], tf.int64)
    sizes = tf.constant([2, 3, 1], tf.int32)
    weights = tf.constant(rng.normal(size=(6, 3)).astype(np.float32))

    def gradients(read):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((read(local) + 1.0) * weights)
        return tape.gradient(loss, [layer.embeddings for layer in layers])

    def grouped(rows):
        return group.gradient_carrier(rows, table_sizes=sizes)

    for run in (lambda f: f(), lambda f: tf.function(f)()):
        ours, theirs = run(lambda: gradients(grouped)), run(lambda: gradients(group.gather))
        for mine, gathered in zip(ours, theirs):
            np.testing.assert_array_equal(mine.values.numpy(), gathered.values.numpy())
            np.testing.assert_array_equal(mine.indices.numpy(), gathered.indices.numpy())
    for read, partitions in ((grouped, False), (group.gradient_carrier, True)):
        graph = tf.function(lambda: gradients(read)).get_concrete_function().graph
        types = [op.type for op in graph.get_operations()]
        assert ("DynamicPartition" in types) == partitions
    for bad in ([3, 2, 1], [2, 3, 0], [2, 3, 2]):
        with pytest.raises(tf.errors.InvalidArgumentError, match="table_sizes|not grouped"):
            group.gradient_carrier(local, table_sizes=tf.constant(bad, tf.int32))


def test_table_reads_are_not_ordered_against_each_other():
    """The prefetch's `NestpipeReadTableRows` and the compute pass's carrier are both reads for
    `tf.function`'s automatic control dependencies: neither waits for the other, while a read
    after an update still waits for it and an update after them waits for both (the positive
    controls: a prefetch reads the tables before the step's update)."""
    _, layers = _tables(2, 1)
    group = FusedTables(layers, 2, 1)
    local = tf.constant([0, 4, 9], tf.int64)

    def update():
        layers[0].embeddings.assign_add(tf.ones_like(layers[0].embeddings))

    def control_edges(update_first):
        def step():
            if update_first:
                update()
            rows = group.read_rows(local)
            out = rows + group.gradient_carrier(local)
            if not update_first:
                update()
            return out

        graph = tf.function(step).get_concrete_function().graph
        ops_by_type = {op.type: op for op in graph.get_operations()}
        waits = {name: {op.type for op in ops_by_type[name].control_inputs}
                 for name in ("NestpipeGradientCarrier", "NestpipeReadTableRows",
                              "AssignAddVariableOp")}
        return waits["NestpipeGradientCarrier"], waits["NestpipeReadTableRows"], waits[
            "AssignAddVariableOp"]

    carrier_waits, read_waits, update_waits = control_edges(update_first=False)
    assert "NestpipeReadTableRows" not in carrier_waits and not read_waits
    assert {"NestpipeReadTableRows", "NestpipeGradientCarrier"} <= update_waits
    carrier_waits, read_waits, _ = control_edges(update_first=True)
    assert "AssignAddVariableOp" in carrier_waits and "AssignAddVariableOp" in read_waits


def test_read_table_rows_errors():
    _, layers = _tables(2, 1, sizes=(7, 10))
    handles = [layer.embeddings.handle for layer in layers]  # 4 and 5 local rows
    with pytest.raises(tf.errors.InvalidArgumentError, match="row 5 of table 1, which has 5"):
        ops.read_table_rows(handles, [9], [0, 4], tf.float32, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="below the first table's start"):
        ops.read_table_rows(handles, [-1], [0, 4], tf.float32, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="row_offsets has 1 entries"):
        ops.read_table_rows(handles, [0], [0], tf.float32, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="expected a matrix of 4 columns"):
        ops.read_table_rows(handles, [0], [0, 4], tf.float32, 4)


class _Layer:
    """What the fused exchange reads of a row-wise layer."""

    exchanged = True

    def __init__(self, name):
        self.name = name


class _Exchange:
    """Every layer in group "g"."""

    @staticmethod
    def group_key(layer):
        del layer
        return "g"


def test_lookup_counts_count_each_groups_lookups_per_round():
    a, b = _Layer("a"), _Layer("b")
    counts = lookup_counts(_Exchange(), [(0, a, None), (0, b, None), (1, a, None), (1, b, None),
                                         (2, a, None)])
    assert counts == {("g", "r000"): 2, ("g", "r001"): 2, ("g", "r002"): 1}


def test_buffer_reader_refuses_lookups_the_route_pass_did_not_record():
    buffers = {"g": GroupBuffers(rounds={"r000": None}, lookup_sizes={"r000": None},
                                 window_inverse={})}
    # The route pass recorded no lookup of round 0: the compute pass's lookup is one too many.
    reader = BufferReader(_Exchange(), buffers, {})
    with pytest.raises(ValueError, match="'a' has no prefetched rows.*more often than the route"):
        reader.lookup(_Layer("a"), tf.zeros([2], tf.int64))
    # A round whose recorded lookups the compute pass did not all make is reported...
    reader = BufferReader(_Exchange(), buffers, {("g", "r000"): 2})
    assert reader.untaken() == [("g", "r000")]
    # ... and none when the route pass recorded none (positive control).
    assert BufferReader(_Exchange(), buffers, {}).untaken() == []


class _RowLayer(_Layer):
    """A row-wise layer as a route pass records it."""

    dim = 3
    embeddings = tf.zeros([1, 3])


def test_route_pass_records_each_lookup_and_runs_none_of_its_dense_reads(tmp_path):
    """`run_route_pass` returns each lookup's ids (as tensors of the calling graph) with its
    round, and the model's variable reads it traced do not run; the positive control traces
    the same route pass inline, as a `RouteRecorder` installed in the step does, and its read
    runs every step."""
    a, b = _RowLayer("a"), _RowLayer("b")
    kernel = tf.Variable(tf.ones([2, 4]))

    def route_fn(batch):
        tf.matmul(batch["dense"], kernel)  # the dense part: its output unused, as in a route pass
        with frozen_window():
            for part in (batch["ids"][:2], batch["ids"][2:]):
                current_fetcher().lookup(a, part)
                current_fetcher().lookup(b, part * 10)

    batch = {"dense": tf.ones([4, 2]), "ids": tf.constant([1, 2, 3, 4], tf.int64)}

    def step_own_function():
        recorded = run_route_pass(route_fn, batch)
        assert recorded.windowed and recorded.dynamic_ids == {}
        assert [(r, layer.name) for r, layer, _ in recorded.lookups] == [
            (0, "a"), (0, "b"), (1, "a"), (1, "b")]
        kernel.assign_add(tf.ones_like(kernel))
        return [ids for _, _, ids in recorded.lookups]

    def step_inline():
        with installed(RouteRecorder()):
            route_fn(batch)
        kernel.assign_add(tf.ones_like(kernel))
        return tf.constant(0)

    own = tf.function(step_own_function)
    assert [t.numpy().tolist() for t in own()] == [[1, 2], [10, 20], [3, 4], [30, 40]]
    inline = tf.function(step_inline)
    inline()

    def executed(step, name):
        timeline = profile_steps(step, 3, str(tmp_path / name))
        return collections.Counter(event.op_type for events in timeline.steps
                                   for event in events)

    assert executed(own, "own")["ReadVariableOp"] == 0
    assert executed(inline, "inline")["ReadVariableOp"] == 3


class _TracingPipeline(_FakePipeline):
    """A candidate whose first step also traces (sleeps `trace` seconds more)."""

    def __init__(self, name, trained, seconds, trace):
        super().__init__(name, trained, seconds=seconds)
        self.trace = trace

    def progress(self, iterator):
        if self.trace:
            import time
            time.sleep(self.trace)
            self.trace = 0
        return super().progress(iterator)


def _budgeted_probe(epoch_steps, steps):
    trained, logged, budget_agreements = [], [], []
    candidates = [("none", _TracingPipeline("none", trained, 0.002, 0.05)),
                  ("dbp", _TracingPipeline("dbp", trained, 0.001, 0.05)),
                  ("fwp", _TracingPipeline("fwp", trained, 0.001, 0.05))]

    def agree_budget(values):
        budget_agreements.append(values)
        return values

    auto = AutoPipeline(candidates, lambda times: times, warmup_steps=1, timed_steps=2,
                        log=logged.append, rounds=2, epoch_steps=lambda: epoch_steps,
                        agree_budget=agree_budget)
    iterator = iter(range(1000))
    outputs = [auto.progress(iterator) for _ in range(steps)]
    assert outputs == list(range(steps))  # every batch trained once, in order
    return auto, trained, logged, budget_agreements


def test_auto_probe_of_a_short_job_stops_within_its_budget():
    """A 40-step epoch of ~2 ms steps: tracing another candidate (~50 ms) would cost more than
    5% of it, so the probe stops after the baseline and keeps it; the workers agreed on it."""
    auto, trained, logged, agreements = _budgeted_probe(40, 40)
    assert auto.choice == "none" and [n for n, _ in trained] == ["none"] * 40
    assert auto.stopped_early and "5% of the first epoch (40 steps" in auto.stopped_early
    assert "the probe stopped after 0 of 2 rounds" in logged[0]
    assert len(agreements) == 1


def test_auto_probe_of_a_long_job_runs_every_round():
    """Positive control: a 100,000-step epoch affords the probe; it runs every round and
    picks a faster candidate."""
    auto, trained, logged, agreements = _budgeted_probe(100_000, 30)
    assert auto.stopped_early is None and auto.choice is not None
    assert {n for n, _ in trained[:18]} == {"none", "dbp", "fwp"}
    assert "stopped" not in logged[0] and len(agreements) >= 4


def test_auto_probe_without_a_known_epoch_length_is_not_budgeted():
    auto, _, _, agreements = _budgeted_probe(None, 30)
    assert auto.stopped_early is None and auto.choice is not None and not agreements


class _EchoExchange:
    """A one-group fused exchange whose collectives echo (every peer sends this worker what it
    sends itself): enough for `prefetch_lookups` to build and run a look-ahead step."""

    def __init__(self, group):
        self.wire = None
        self._group = group
        self.collectives = self

    def all_to_all(self, tensor, tag, bucket=None, send_counts=None, fill=0):
        del tag, bucket, send_counts, fill
        return tf.repeat(tensor[:1], tf.shape(tensor)[0], axis=0)

    def stream(self, name):
        del name
        return contextlib.nullcontext()

    def group_key(self, layer):
        del layer
        return "g"

    def tables(self, group):
        del group
        return self._group

    def capacity_hint(self, tag):
        return CapacityHint("/cpu:0", "test/%d/%s" % (id(self), tag))


def _ancestors(op):
    """Every op `op` waits for, through its inputs and control inputs."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def test_the_current_buffers_are_read_only_after_the_next_batchs_blocks_are_built():
    """Under a look-ahead pipeline the compute of batch i reads its buffers only once the owner
    blocks of batch i+1's rows exist (built, handed to the rows exchange), so those rows are on
    the link while batch i computes; the buffers' values are unchanged. Positive control: the
    buffers of a prefetch without a pending batch wait for no block."""
    rng = np.random.default_rng(0)
    layers = [_CheckedTable(rng.normal(size=(rows, 3)).astype(np.float32), 2, 0, "t%d" % i)
              for i, rows in enumerate([7, 10])]
    exchange = _EchoExchange(FusedTables(layers, 2, 0))
    # Ids this worker owns (row-wise: the even rows), so the echo's blocks agree.
    lookups = [(0, layers[0], tf.constant([0, 4, 6, 4], tf.int64)),
               (0, layers[1], tf.constant([8, 2], tf.int64))]

    def rows_of(buffers):
        (rows,) = [prefetched.rows for prefetched in buffers["g"].rounds.values()]
        return rows

    def step():
        current, _, _ = prefetch_lookups(exchange, lookups)
        _, _, (synced, _) = prefetch_lookups(exchange, lookups,
                                             pending=PendingSync(current, {}))
        return rows_of(current), rows_of(synced)

    traced = tf.function(step).get_concrete_function()
    first, second = [op for op in traced.graph.get_operations()
                     if op.type == "NestpipeGatherBlocks"]  # one per prefetch, in order
    current, synced = traced.structured_outputs
    assert second in _ancestors(synced.op) and first in _ancestors(synced.op)
    assert second not in _ancestors(current.op) and first in _ancestors(current.op)
    current, synced = traced()
    np.testing.assert_array_equal(synced.numpy(), current.numpy())


def test_a_windows_gradient_reaches_each_table_once_per_distinct_row_cut_by_a_split():
    """A frozen window of two rounds (fwp: a rows exchange each, one gradient exchange): each
    table's gradient is an `IndexedSlices` of distinct rows, marked so (no optimizer sums
    duplicates again), cut from the window's by a split (no `DynamicPartition`), and equal to the
    gradient the same lookups give the tables; through the echo every requester asks for the
    same rows, so each owner gets it twice."""
    rng = np.random.default_rng(1)
    layers = [_CheckedTable(rng.normal(size=(rows, 3)).astype(np.float32), 2, 0, "t%d" % i)
              for i, rows in enumerate([7, 10])]
    for layer in layers:
        layer.exchanged = True
    exchange = _EchoExchange(FusedTables(layers, 2, 0))
    # Ids this worker owns (the even ones); round 1 reads 4 again (fetched by round 0).
    rounds = [[(layers[0], [0, 4, 6, 4]), (layers[1], [8, 2])],
              [(layers[0], [4, 2]), (layers[1], [2, 0])]]
    weights = [rng.normal(size=(len(ids), 3)).astype(np.float32)
               for part in rounds for _, ids in part]
    marks = []

    def step():
        lookups = [(r, layer, tf.constant(ids, tf.int64))
                   for r, part in enumerate(rounds) for layer, ids in part]
        buffers, _, _ = prefetch_lookups(exchange, lookups, windowed=True)
        reader = BufferReader(exchange, buffers, lookup_counts(exchange, lookups))
        with tf.GradientTape() as tape:
            with installed(reader), frozen_window():
                outputs = [reader.lookup(layer, ids) for _, layer, ids in lookups]
            loss = tf.add_n([tf.reduce_sum(out * w) for out, w in zip(outputs, weights)])
        grads = tape.gradient(loss, [layer.embeddings for layer in layers])
        marks.append([ops.has_distinct_indices(g) for g in grads])
        return [g.indices for g in grads], [tf.convert_to_tensor(g) for g in grads]

    traced = tf.function(step).get_concrete_function()
    types = {op.type for op in traced.graph.get_operations()}
    assert "NestpipeWindowGradIndex" in types  # the window's one gradient exchange
    assert "DynamicPartition" not in types and "Unique" not in types, sorted(types)
    assert marks[-1] == [True, True]
    indices, dense = traced()
    for table, (layer, rows) in enumerate(zip(layers, indices)):
        assert len(set(rows.numpy().tolist())) == len(rows.numpy())
        expected = np.zeros(layer.embeddings.shape, np.float32)
        for (looked_up, ids), w in zip([entry for part in rounds for entry in part], weights):
            if looked_up is layer:
                for i, k in enumerate(ids):
                    expected[k // 2] += 2 * w[i]  # the owner's local row of id k; two requesters
        np.testing.assert_allclose(dense[table].numpy(), expected, rtol=1e-6)
