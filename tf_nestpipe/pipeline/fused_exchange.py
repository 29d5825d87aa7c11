"""The fused exchange of a step: every row-wise lookup the model makes goes through one exchange
per group of tables and round (docs/design/design.md §10), however the model is written (separate
`ShardedEmbedding` layers, collections, TFRS towers).

A *route pass* traces the model on the batch's features with a `RouteRecorder` installed: each
lookup records its ids and returns zeros, so the dense ops have no consumer and are pruned (the
pass is a function of its own, `run_route_pass`, so its variable reads are pruned too).
`prefetch_lookups` then checks and fuses each group's ids in one op (`FusedTables.fuse_lookups`)
and runs one route + fetch + output exchange per (round, group): a group is the tables of one
dim and dtype (one fused id space), a round the lookups up to a table's next lookup (one round
per micro-batch of a frozen window). The *compute pass* traces the step with a `BufferReader`
installed: a buffer's rows are split into its lookups' pieces in one op, each lookup takes its
piece in the order the route pass recorded, and the backward is one reverse all-to-all per
buffer (per frozen window: one for all its rounds, `dual_buffer.lookup_window_from_buffers`).

In a frozen window (`frozen_window()` inside either pass) the window is kept per group, once per
batch: one route of all the batch's fused ids (one dedup, one keys exchange, `route_rounds`),
round r's rows exchange fetching exactly the ids first seen in round r, and round r's lookups
reading the rows of rounds 0..r. Outside one, each round routes its own ids.

Buffers are kept as `{group key: GroupBuffers}` (tuples and dicts of tensors, so the pipelines
can store them between steps).
"""
import contextlib
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.pipeline import dual_buffer
from tf_nestpipe.sharding.fetch import RowFetcher, installed
from tf_nestpipe.sharding.lookup import route, route_rounds
from tf_nestpipe.sharding.records import RoutingRecord
from tf_nestpipe.tracing import user_function


def round_key(round_index):
    """The key of a round in a group's buffers (sorts in round order)."""
    return "r%03d" % round_index


def buffer_tag(group_key, round_index):
    """The collective tag of one fused exchange."""
    return "nestpipe/fused/%s/%s" % (group_key, round_key(round_index))


def window_tag(group_key):
    """The collective tag of a frozen window's one keys exchange of a group."""
    return "nestpipe/fused/%s/window" % group_key


class GroupBuffers(NamedTuple):
    """The prefetch buffers of one group: `rounds` (round key -> `PrefetchedRows`),
    `lookup_sizes` (round key -> int32 `[lookups]`: the ids of each of the round's lookups, in
    route order) and, for a frozen window, `window_inverse` (round key -> each id the round
    looks up, in route order -> its row among the window's rows of rounds 0..r; {} outside a
    window)."""

    rounds: dict
    lookup_sizes: dict
    window_inverse: dict


def lookup_counts(exchange, lookups):
    """`{(group key, round key): lookups}` of a route pass's recorded `lookups`: how many
    pieces each buffer's rows are split into (the same for every batch of one model)."""
    counts = {}
    for round_index, layer, _ in lookups:
        key = (exchange.group_key(layer), round_key(round_index))
        counts[key] = counts.get(key, 0) + 1
    return counts


class RoundTracker:
    """Assigns a step's lookups to rounds: a round ends where a table it already looked up is
    looked up again (each micro-batch of a frozen window is a round)."""

    def __init__(self):
        self._round = 0
        self._seen = set()

    def place(self, layer):
        """The round of `layer`'s next lookup."""
        if id(layer) in self._seen:
            self._round += 1
            self._seen = set()
        self._seen.add(id(layer))
        return self._round


class _WindowAware(RowFetcher):
    """A fused-exchange fetcher that keeps frozen windows itself (see `frozen_window`)."""

    def __init__(self):
        self.windowed = False
        self._rounds = RoundTracker()

    @contextlib.contextmanager
    def window(self):
        """Lookups inside share one frozen window (one dedup of the batch per group)."""
        self.windowed = True
        yield


class RouteRecorder(_WindowAware):
    """Route pass: records every row-wise lookup (its round, layer and ids) and returns zeros;
    other tables (one worker, ps) look up directly."""

    def __init__(self):
        super().__init__()
        self.lookups = []
        self._dynamic_ids = {}  # DynamicEmbedding name -> its ids, lookup by lookup

    def lookup(self, layer, flat_ids):
        if not layer.exchanged:
            return layer.direct_lookup(flat_ids)
        # Unchecked: `prefetch_lookups` checks and fuses a group's ids in one op.
        self.lookups.append((self._rounds.place(layer), layer, flat_ids))
        return tf.zeros([tf.size(flat_ids), layer.dim], layer.embeddings.dtype)

    def lookup_dynamic(self, layer, flat_ids):
        # Not prefetched: the dynamic table looks up (and admits) in the compute pass only. In
        # a frozen window the ids of every micro-batch are recorded, so the compute pass can
        # look them up as one step of the table (`BufferReader.lookup_dynamic`).
        if self.windowed:
            self._dynamic_ids.setdefault(layer.name, []).append(flat_ids)
        return tf.zeros([tf.size(flat_ids), layer.dim], layer.rows.dtype)

    @property
    def dynamic_ids(self):
        """In a frozen window: {DynamicEmbedding name: the ids all its lookups of the batch
        recorded, in lookup order}; {} outside one."""
        return {name: tf.concat(ids, axis=0) for name, ids in self._dynamic_ids.items()}


class RoutePass(NamedTuple):
    """What a route pass recorded, as tensors of the graph that ran it: `lookups` (round, layer,
    ids) in lookup order, whether they were in a frozen window (`windowed`) and `dynamic_ids`
    (see `RouteRecorder.dynamic_ids`)."""

    lookups: list
    windowed: bool
    dynamic_ids: dict


def run_route_pass(route_fn, batch):
    """`route_fn(batch)` traced with a `RouteRecorder` installed, in a function of its own called
    here: returns its `RoutePass`. `route_fn` is a user function, converted by AutoGraph as the
    enclosing trace asks.

    In its own function only the ops the recorded ids need run. Inline, every dense variable read
    of the model would run on every step for nothing: TF runs each stateful op of a function, a
    variable read is one, and automatic control dependencies order it before the update (in the
    DLRM cell, 12 reads per micro-batch of the model's 12 dense variables)."""
    converted = user_function(route_fn)
    recorders = []

    def route_pass():
        # A trace that creates variables is traced again (tf.function): the last trace's
        # recorder is the one whose ids the call returns.
        recorder = RouteRecorder()
        recorders.append(recorder)
        with installed(recorder):
            converted(batch)
        return [ids for _, _, ids in recorder.lookups], recorder.dynamic_ids

    ids, dynamic_ids = tf.function(route_pass, autograph=False)()
    recorder = recorders[-1]
    lookups = [(round_index, layer, flat_ids)
               for (round_index, layer, _), flat_ids in zip(recorder.lookups, ids)]
    return RoutePass(lookups, recorder.windowed, dynamic_ids)


class PendingSync(NamedTuple):
    """The buffers a step computes from (`{group key: GroupBuffers}`) and their sync `plans`
    (`{group key: {round key: plan}}`, from the `fetch` that filled them while the step before
    updated the tables): what `prefetch_lookups` patches in, fresh, on its keys exchanges."""

    buffers: dict
    plans: dict


def _planned_rounds(buffers, plans, group):
    """`group`'s rounds that have a sync plan, in round order: (their keys, their buffers,
    their plans)."""
    keys = sorted(plans[group])
    return keys, [buffers[group].rounds[k] for k in keys], [plans[group][k] for k in keys]


def _with_rounds(buffers, group, keys, patched):
    """`buffers` with `group`'s rounds `keys` replaced by `patched` (in place)."""
    buffers[group] = buffers[group]._replace(
        rounds={**buffers[group].rounds, **dict(zip(keys, patched))})


def sync_pending(exchange, pending, tag="nestpipe/sync"):
    """`pending` (a `PendingSync`) applied in exchanges of their own (one per group): the
    buffers patched with their fresh rows, and the rows this worker received (int64). For a
    group with no keys exchange of the next batch to ride on."""
    buffers, received = dict(pending.buffers), tf.constant(0, tf.int64)
    for group in sorted(pending.plans):
        keys, rounds, plans = _planned_rounds(buffers, pending.plans, group)
        patched, count = dual_buffer.apply_sync(
            exchange.tables(group), rounds, plans, exchange.collectives,
            "%s/%s" % (tag, group), exchange.wire)
        _with_rounds(buffers, group, keys, patched)
        received += count
    return buffers, received


class _Riders:
    """The sync payloads of a `PendingSync`, one per group, each riding on the group's first
    keys exchange of the next batch (`route`'s rider)."""

    def __init__(self, exchange, pending):
        self._exchange = exchange
        self._pending = pending
        self._payloads = {}
        self.buffers = dict(pending.buffers) if pending else {}
        self.received = tf.constant(0, tf.int64)

    def take(self, group):
        """The int64 rider of `group`'s pending sync (read fresh now), or None (no sync pending,
        or already riding)."""
        if (self._pending is None or group not in self._pending.plans
                or group in self._payloads):
            return None
        _, rounds, plans = _planned_rounds(self.buffers, self._pending.plans, group)
        payload = dual_buffer.sync_payload(self._exchange.tables(group), rounds, plans,
                                           self._exchange.wire)
        self._payloads[group] = payload
        return dual_buffer.sync_rider(payload, self._exchange.collectives, self._exchange.wire)

    def arrived(self, group, received):
        """Patches `group`'s buffers with the rider `received` in its keys exchange."""
        keys, rounds, _ = _planned_rounds(self.buffers, self._pending.plans, group)
        patched, count = dual_buffer.patch_buffers(
            self._exchange.tables(group), rounds,
            dual_buffer.from_sync_rider(received, self._payloads[group]), self._exchange.wire)
        _with_rounds(self.buffers, group, keys, patched)
        self.received += count

    def rest(self):
        """The pending groups no keys exchange carried (none when the batches look up the same
        tables), synced in exchanges of their own."""
        if self._pending is None:
            return
        left = {g: p for g, p in self._pending.plans.items() if g not in self._payloads}
        if left:
            self.buffers, count = sync_pending(
                self._exchange, PendingSync(self.buffers, left))
            self.received += count


def prefetch_lookups(exchange, lookups, windowed=False, updated=None, all_updated=False,
                     share_size=None, pending=None, one_window_exchange=False):
    """One exchange per (round, group) of the recorded `lookups`, in round order (the first
    micro-batch's rows arrive first); returns `(buffers, plans, synced)`.

    `one_window_exchange` (in a frozen window): one exchange per group for all the window's
    rounds instead, a single buffer of the window's distinct ids that every round reads through
    its `window_inverse`. For a look-ahead pipeline: its rows all arrive a step before the
    compute that reads them, so an exchange per round would only add collectives (and a sync
    per round); the window still fetches each id once. With `updated` (group
    -> the local rows the batch computed meanwhile updates), each buffer of those groups comes
    with its sync plan (`dual_buffer.fetch`): `plans[group][round key]`. `share_size` (this
    worker's share of the batch) rides in every keys header (`shares_of` reads it back).

    With `pending` (a `PendingSync`: the buffers of the batch computed next and their plans),
    each group's fresh rows ride on that group's first keys exchange: `synced` is (those buffers
    patched, the rows this worker received); (None, 0) without `pending`. Those buffers' rows
    are read only once every owner block of this prefetch is built (`_after_sent`)."""
    entries = {}
    for round_index, layer, ids in lookups:
        entries.setdefault(exchange.group_key(layer), {}).setdefault(round_index, []).append(
            (layer, ids))
    riders = _Riders(exchange, pending)
    routed = {}  # (round, group) -> its exchange's RoutingRecord, or the fused ids to route
    inverses, lookup_sizes = {}, {}
    for group, rounds in sorted(entries.items()):
        tables = exchange.tables(group)
        dual_buffer.check_dtype(tables, group)
        order = sorted(rounds)
        keys = [round_key(r) for r in order]
        if windowed:
            # One keys exchange for the whole window: one dedup, each id fetched once.
            counts = [len(rounds[r]) for r in order]
            fused, sizes, round_sizes = tables.fuse_lookups(
                [entry for r in order for entry in rounds[r]], np.cumsum(counts))
            lookup_sizes[group] = dict(zip(keys, tf.split(sizes, counts)))
            rider = riders.take(group)
            if one_window_exchange:
                # One buffer of the window's distinct ids: each round reads its own through
                # its part of the route's inverse.
                tag = buffer_tag(group, order[0])
                routed_window = route(fused, tables.layout, exchange.collectives, tag,
                                      exchange.capacity_hint(tag), share_size, exchange.wire,
                                      rider=rider, row_offsets=tables.row_offsets)
                record, received = routed_window if rider is not None else (routed_window, None)
                records, window_inverse = [record], record.inverse
            else:
                # A rows exchange per round, fetching the ids first seen in that round.
                tag = window_tag(group)
                routed_window = route_rounds(
                    fused, round_sizes, tables.layout, exchange.collectives, tag,
                    exchange.capacity_hint(tag), share_size, exchange.wire, rider=rider,
                    row_offsets=tables.row_offsets)
                records, window_inverse = routed_window[:2]
                received = routed_window[2] if rider is not None else None
            inverses[group] = dict(zip(keys, tf.split(window_inverse, round_sizes,
                                                      num=len(order))))
            if rider is not None:
                riders.arrived(group, received)
            routed.update({(r, group): record for r, record in zip(order, records)})
        else:
            for r, key in zip(order, keys):
                routed[(r, group)], sizes, _ = tables.fuse_lookups(rounds[r])
                lookup_sizes.setdefault(group, {})[key] = sizes
    buffers, plans, sent = {}, {}, []
    updated = updated or {}
    for (round_index, group), routing in sorted(routed.items()):
        tag = buffer_tag(group, round_index)
        key = round_key(round_index)
        tables = exchange.tables(group)
        if not isinstance(routing, RoutingRecord):
            rider = riders.take(group)
            routing = route(routing, tables.layout, exchange.collectives, tag,
                            exchange.capacity_hint(tag), share_size, exchange.wire, rider=rider,
                            row_offsets=tables.row_offsets)
            if rider is not None:
                routing, received = routing
                riders.arrived(group, received)
        buffers.setdefault(group, {})[key], plan, blocks = dual_buffer.fetch(
            tables, routing, exchange.collectives, tag, updated_rows=updated.get(group),
            all_updated=all_updated, wire=exchange.wire)
        sent.append(blocks)
        if plan is not None:
            plans.setdefault(group, {})[key] = plan
    riders.rest()
    buffers = {group: GroupBuffers(rounds, lookup_sizes[group], inverses.get(group, {}))
               for group, rounds in buffers.items()}
    synced = ((_after_sent(riders.buffers, sent), riders.received) if pending is not None
              else (None, 0))
    return buffers, plans, synced


def _after_sent(buffers, sent):
    """`buffers` (`{group key: GroupBuffers}`) whose rows are read only once the owner blocks
    `sent` exist. The compute that reads them and the prefetch of the batch after share the
    task's threads; without this order TensorFlow's executor may run the compute's ops first and
    leave the prefetched rows unsent (the link idle) for most of the step, to then compete with
    the step's gradient exchange. The dense ops that read no buffer are not held back."""
    with tf.control_dependencies(sent):
        return {group: group_buffers._replace(rounds={
                    key: rows._replace(rows=tf.identity(rows.rows))
                    for key, rows in group_buffers.rounds.items()})
                for group, group_buffers in buffers.items()}


class BufferReader(_WindowAware):
    """Compute pass: each row-wise lookup takes its rows from its (round, group) buffer, in the
    order the route pass recorded them (in a frozen window: from the rows of rounds 0..r). A
    round's rows are read and cut into its lookups' pieces at its first lookup, so that their
    gradients are summed in one op: `lookup_counts` (`lookup_counts(...)` of the route pass of
    the same model) says how many.

    A `DynamicEmbedding` looks up in the compute pass itself (admission and eviction are a
    step of the table): outside a frozen window each lookup directly; in one, the first lookup
    of a table looks up the ids of all the batch's micro-batches (`dynamic_ids`, recorded by the
    route pass) as one step of the table, in micro-batch order, and every lookup takes its
    part of those rows, as the non-pipelined step's single lookup of the whole batch would."""

    def __init__(self, exchange, buffers, lookup_counts, dynamic_ids=None):
        super().__init__()
        self._exchange = exchange
        self._buffers = buffers
        self._lookup_counts = lookup_counts
        self._dynamic_ids = dynamic_ids or {}
        self._dynamic_rows = {}  # DynamicEmbedding name -> rows of all its recorded ids
        self._window_outputs = {}  # group -> {round key: its rows} (one gradient exchange)
        self._pieces = {}  # (group, round key) -> its lookups' rows, one tensor per lookup
        self._taken = {}  # (group, round key), or ("dynamic", name) -> lookups / ids taken

    def _window_rows(self, group, key):
        """In a frozen window: the distinct rows round `key`'s buffer fetched (a window fetched
        at once: its one buffer's)."""
        if group not in self._window_outputs:
            rounds = self._buffers[group].rounds
            keys = sorted(rounds)
            if len(keys) > 1:
                # One gradient exchange for the window's rounds (each round's rows still
                # arrive by its own exchange).
                outputs = dual_buffer.lookup_window_from_buffers(
                    self._exchange.tables(group), [rounds[k] for k in keys],
                    self._exchange.collectives, "nestpipe/fused/%s" % group,
                    self._exchange.wire)
            else:
                outputs = dual_buffer.lookup_from_buffer(
                    self._exchange.tables(group), rounds[keys[0]], self._exchange.collectives,
                    "nestpipe/fused/%s/%s" % (group, keys[0]), self._exchange.wire,
                    distinct=True)
            self._window_outputs[group] = dict(zip(keys, outputs))
        return self._window_outputs[group][key]

    def _round_pieces(self, group, key):
        """The rows of round `key`'s lookups of `group`, one tensor per lookup (route order)."""
        if (group, key) not in self._pieces:
            buffers = self._buffers[group]
            sizes, num = buffers.lookup_sizes[key], self._lookup_counts[(group, key)]
            if self.windowed:
                # The window's rows up to this round (all of them from a window's one buffer),
                # each lookup's by its window index, read when the round needs them. The
                # gradient is dense, one segment-sum of the round's lookups into the window's
                # rows so far (O(rounds x window) per batch, a few ops; an IndexedSlices split
                # back over the concat costs a dozen; one sum of every round's lookups would
                # have to read all the rounds' rows before the first round's compute).
                upto = [self._window_rows(group, k) for k in sorted(buffers.rounds) if k <= key]
                window_rows = upto[0] if len(upto) == 1 else tf.concat(upto, axis=0)
                self._pieces[(group, key)] = ops.gather_pieces(
                    window_rows, buffers.window_inverse[key], sizes, num)
            else:
                self._pieces[(group, key)] = dual_buffer.lookup_from_buffer(
                    self._exchange.tables(group), buffers.rounds[key],
                    self._exchange.collectives, "nestpipe/fused/%s/%s" % (group, key),
                    self._exchange.wire, sizes=sizes, num=num)
        return self._pieces[(group, key)]

    def lookup(self, layer, flat_ids):
        if not layer.exchanged:
            return layer.direct_lookup(flat_ids)
        key = round_key(self._rounds.place(layer))
        group = self._exchange.group_key(layer)
        buffers = self._buffers.get(group)
        taken = self._taken.get((group, key), 0)
        if (buffers is None or key not in buffers.lookup_sizes
                or taken >= self._lookup_counts.get((group, key), 0)):
            raise ValueError(
                "ShardedEmbedding '%s' has no prefetched rows for this lookup: the training step "
                "looked up the tables more often than the route pass did. The route pass must "
                "call the model on the same inputs (and the same micro-batches); make the "
                "lookups depend only on the inputs." % layer.name)
        self._taken[(group, key)] = taken + 1
        return self._round_pieces(group, key)[taken]

    def lookup_dynamic(self, layer, flat_ids):
        if not self.windowed:
            return layer.direct_lookup(flat_ids)  # synchronous, in the step itself
        if layer.name not in self._dynamic_ids:
            return super().lookup_dynamic(layer, flat_ids)  # refused: no ids were recorded
        if layer.name not in self._dynamic_rows:
            self._dynamic_rows[layer.name] = layer.direct_lookup(self._dynamic_ids[layer.name])
        counter = ("dynamic", layer.name)
        start = self._taken.get(counter, 0)
        self._taken[counter] = end = start + tf.size(flat_ids)
        return self._dynamic_rows[layer.name][start:end]

    def untaken(self):
        """(group, round) of the buffers whose lookups the compute pass did not all make."""
        return sorted((group, r) for group, buffers in self._buffers.items()
                      for r in buffers.lookup_sizes
                      if self._taken.get((group, r), 0) < self._lookup_counts.get((group, r), 0))


def shares_of(buffers):
    """Every worker's share size of the batch the buffers hold (`[W]`, from the first keys
    header), or None when the batch had no row-wise lookup."""
    for group in sorted(buffers):
        for key in sorted(buffers[group].rounds):
            return buffers[group].rounds[key].routing.shares
    return None


def rows_requested(buffers):
    """Distinct rows requested per round (summed over groups): `[rounds]` int64."""
    per_round = {}
    for group_buffers in buffers.values():
        for key, buffer in group_buffers.rounds.items():
            per_round.setdefault(key, []).append(
                tf.reduce_sum(tf.cast(buffer.routing.splits, tf.int64)))
    if not per_round:
        return tf.zeros([0], tf.int64)
    return tf.stack([tf.add_n(per_round[key]) for key in sorted(per_round)])
