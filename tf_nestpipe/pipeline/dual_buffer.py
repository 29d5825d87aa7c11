"""Dual-Buffer Pipeline stages for one row-sharded table (DESIGN.md section 3).

- `prefetch`: routing (stage 3) and retrieval (stage 4) of the *next* batch, reading the table
  before the current batch's update. The result is the prefetch buffer: the next batch's unique
  rows plus the routing metadata its backward pass needs.
- `plan_sync`: the owner finds which prefetched slots hold rows that the current batch updates
  (keys updated ∩ keys prefetched) and agrees a padded size with the others; this needs only
  routing data, so it runs before the update finishes.
- `apply_sync`: after the update, the owner sends just those rows, fresh; the requester copies
  them into its prefetch buffer (the `NestpipeBufferSync` op).
- `lookup_from_buffer`: the compute stage reads the active buffer; its gradient goes back to the
  owners by the reverse all-to-all, as in the synchronous lookup.
"""
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.sharding.lookup import exchange_rows, route
from tf_nestpipe.strategy.communication import capacity_bucket

# Float32 carries the slot position next to each synced row; exact below 2**24.
_MAX_EXACT_POSITION = 1 << 24


@tf.autograph.experimental.do_not_convert  # graph ops only: no autograph pass needed
def prefetch(table, ids, layout, collectives, table_name):
    """Routes `ids` and retrieves their rows; returns the prefetch state (a dict of tensors)."""
    if table.dtype not in (tf.float32, tf.float64):
        raise ValueError("the Dual-Buffer Pipeline needs float32 or float64 tables; '%s' is %s"
                         % (table_name, table.dtype.name))
    state = route(ids, layout, collectives, table_name)
    owned = tf.stop_gradient(tf.gather(table, state["local_rows"]))
    incoming = exchange_rows(owned, state, layout, collectives, table_name, differentiable=False)
    state["rows"] = ops.gather_rows(incoming, state["slot_of_bucket_pos"])
    return state


@tf.autograph.experimental.do_not_convert  # graph ops only: no autograph pass needed
def plan_sync(current_state, next_state, layout, collectives, table_name, all_updated):
    """Owner side, before the update: which of each requester's prefetched slots the current
    batch will update. Returns the plan (compacted slot positions, padded size)."""
    slots, counts = ops.sync_plan(next_state["slot_to_unique"], next_state["local_rows"],
                                  current_state["local_rows"], layout.num_shards,
                                  all_updated=all_updated)
    everyone = collectives.all_gather(counts, table_name + "/sync_counts")
    bucket, capacity = capacity_bucket(tf.maximum(tf.reduce_max(everyone), 1))
    tf.debugging.assert_less(next_state["capacity"], _MAX_EXACT_POSITION,
                             message="prefetch capacity too large for the float position column")
    width = tf.minimum(capacity, tf.shape(slots)[1])
    plan = tf.pad(slots[:, :width], [[0, 0], [0, capacity - width]], constant_values=-1)
    return {"slots": plan, "bucket": bucket, "capacity": capacity,
            "rows_sent": tf.reduce_sum(counts)}


@tf.autograph.experimental.do_not_convert  # graph ops only: no autograph pass needed
def apply_sync(table, next_state, plan, layout, collectives, table_name):
    """After the update: owners send the planned rows, fresh; returns the patched prefetch rows
    and the number of rows this worker received."""
    num_shards, dim = layout.num_shards, layout.dim
    slots = plan["slots"]  # [W, cap_s]: positions within each requester's prefetch slots
    valid = slots >= 0
    flat_slot = tf.where(valid, tf.range(num_shards)[:, None] * next_state["capacity"] + slots, 0)
    # Only the planned positions are read (a lookup may own no rows at all: gather nothing).
    planned = tf.where(valid)
    unique = tf.gather(next_state["slot_to_unique"], tf.gather_nd(flat_slot, planned))
    fresh = tf.scatter_nd(planned, tf.gather(table, tf.gather(next_state["local_rows"], unique)),
                          tf.cast(tf.concat([tf.shape(slots), [dim]], 0), tf.int64))
    payload = tf.concat([fresh, tf.cast(slots, fresh.dtype)[..., None]], axis=-1)
    received = collectives.all_to_all(payload, table_name + "/sync", plan["bucket"],
                                      send_counts=tf.reduce_sum(tf.cast(valid, tf.int32), 1),
                                      fill=-1)  # the position column's padding is -1
    position = tf.cast(received[..., dim], tf.int32)  # [W, cap_s], -1 = padding
    offsets = tf.cumsum(next_state["splits"], exclusive=True)
    target = tf.where(position >= 0, offsets[:, None] + position, -1)
    rows = ops.buffer_sync(next_state["rows"], tf.reshape(target, [-1]),
                           tf.reshape(received[..., :dim], [-1, dim]))
    return rows, tf.reduce_sum(tf.cast(position >= 0, tf.int64))


@tf.autograph.experimental.do_not_convert  # graph ops only: no autograph pass needed
def lookup_from_buffer(table, state, layout, collectives, table_name):
    """Compute stage: per-sample rows from the active buffer; the gradient flows to the owners'
    rows through the reverse all-to-all (an IndexedSlices gradient of `table`)."""
    num_shards, dim = layout.num_shards, layout.dim
    owned = tf.gather(table, state["local_rows"])  # carries the gradient to the owned rows

    @tf.custom_gradient
    def active_rows(owned_rows):
        del owned_rows  # the values come from the buffer; only the gradient path is needed

        def grad(d_unique):
            d_slots = ops.segment_sum(d_unique, state["slot_of_bucket_pos"],
                                      num_shards * state["capacity"])
            back = collectives.all_to_all(tf.reshape(d_slots, [num_shards, state["capacity"], dim]),
                                          table_name + "/rows/grad", state["bucket"],
                                          send_counts=state["splits"])
            return ops.segment_sum(tf.reshape(back, [-1, dim]), state["slot_to_unique"],
                                   tf.size(state["local_rows"]))

        return tf.identity(state["rows"]), grad

    return ops.gather_rows(active_rows(owned), state["inverse"])
