"""Row gather with -1 padding and its adjoint, the deterministic sparse-gradient segment-sum;
a group of tables' row read and the gradient carrier that stands in for a gather whose values
come from elsewhere."""
import weakref

import tensorflow as tf

from tf_nestpipe import tf_private
from tf_nestpipe.ops.library import load_op_library


def gather_rows(params, indices):
    """Returns `params[indices]` for a 2-D `params`, with a zero row wherever an index is -1."""
    return load_op_library().nestpipe_gather_rows(params, indices)


def read_table_rows(handles, local_rows, row_offsets, dtype, dim):
    """Rows of the tables (variable `handles`, in order) at fused local rows `local_rows`: table t
    holds local rows from `row_offsets[t]` (the last table starting at or before a row holds it).
    One op, not differentiable."""
    return load_op_library().nestpipe_read_table_rows(
        handles, tf.cast(local_rows, tf.int64), tf.cast(row_offsets, tf.int64), dtype=dtype,
        dim=dim)


# Per graph, the names of the int tensors known to hold no value twice: the local rows of
# gradient carriers told so, and the indices their gradients give each table
# (`has_distinct_indices`). Names, not ops: a tape's gradient function sees a stand-in op.
_DISTINCT = weakref.WeakKeyDictionary()


def _graph_of(tensor):
    """A traced tensor's graph; None for an eager one (e.g. a constant a trace captures)."""
    try:
        return tensor.graph
    except AttributeError:
        return None


def _mark_distinct(tensor):
    graph = _graph_of(tensor)
    if graph is not None:  # an eager tensor stays unmarked: deduplicated as any other
        _DISTINCT.setdefault(graph, set()).add(tensor.name)


def _is_marked_distinct(tensor):
    graph = _graph_of(tensor)
    return graph is not None and tensor.name in _DISTINCT.get(graph, ())


def gradient_carrier(variables, local_rows, row_offsets, dtype, dim, distinct_rows=False,
                     table_sizes=None):
    """Zeros `[len(local_rows), dim]` of `dtype` (the tables') whose gradient reaches the tables
    `variables` (in order; the layout of `read_table_rows`) as the `IndexedSlices` a gather of
    `local_rows` would give each table. Reads no row: for a lookup whose values come from
    elsewhere (a prefetch buffer) and whose gradient must still reach the tables' rows.

    Args:
      variables: The tables' variables, in the order of `row_offsets`.
      local_rows: int `[r]`, fused local rows.
      row_offsets: int `[len(variables)]`, each table's first fused local row.
      dtype: The tables' dtype.
      dim: The tables' row width.
      distinct_rows: The caller's promise that no local row repeats: the `IndexedSlices` the
        tables get are marked so (`has_distinct_indices`), and an optimizer can skip summing
        duplicates there are none of.
      table_sizes: int32 `[len(variables)]` when `local_rows` are grouped by table (table 0's
        rows first, `table_sizes[t]` of table t: `owner_rounds`' order): the gradient is then
        cut per table by a split, not a partition (a split along rows shares the gradient's
        buffer where a row is a multiple of 64 bytes, e.g. float32 of dim 16, 32, 64). None:
        any order.

    Returns:
      The zeros `[r, dim]`.

    Raises:
      InvalidArgumentError: (when run) `local_rows` not grouped as `table_sizes` says.
    """
    for variable in variables:
        tf_private.variable_accessed(variable)  # so the tapes record the op on its handles
    local_rows = tf.cast(local_rows, tf.int64)
    if distinct_rows:
        _mark_distinct(local_rows)
    grouped = table_sizes is not None
    table_sizes = tf.zeros([0], tf.int32) if not grouped else tf.cast(table_sizes, tf.int32)
    return load_op_library().nestpipe_gradient_carrier(
        [variable.handle for variable in variables], local_rows,
        tf.cast(row_offsets, tf.int64), table_sizes, dtype=dtype, dim=dim, grouped=grouped)


def has_distinct_indices(gradient):
    """Whether `gradient` is an `IndexedSlices` a gradient carrier of distinct rows gave a table
    (its indices tensor itself: a gradient rebuilt from it, e.g. two lookups' gradients
    concatenated, is not).

    Args:
      gradient: A gradient (`IndexedSlices`, tensor or None).

    Returns:
      True if no index of `gradient` repeats, as its carrier's caller promised.
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return False
    return _is_marked_distinct(gradient.indices)


def tables_of_rows(local_rows, row_offsets, num_tables):
    """The layout of `read_table_rows` in TensorFlow ops: (each fused local row's table, int32
    `[r]`; each table's rows among them, in order, as rows of that table: `num_tables` tensors).
    Table t holds local rows from `row_offsets[t]`; a table reserving no rows here shares its
    start with the next table, and a row belongs to the last table starting at or before it."""
    row_offsets = tf.convert_to_tensor(row_offsets, tf.int64)
    table = tf.cast(tf.searchsorted(row_offsets, local_rows, side="right"), tf.int32) - 1
    return table, tf.dynamic_partition(local_rows - tf.gather(row_offsets, table), table,
                                       num_tables)


def segment_sum(data, segment_ids, num_segments):
    """Sums rows of `data` into `num_segments` rows by `segment_ids`, skipping ids of -1, in
    input order (deterministic).

    Args:
      data: A `[n, dim]` tensor, or a list of `[n_i, dim]` tensors read as their concatenation
        (summed in place, never concatenated).
      segment_ids: int32 or int64 `[n]` (`sum(n_i)`): each row's output row, or -1.
      num_segments: int scalar, the output's rows.

    Returns:
      `[num_segments, dim]` of `data`'s dtype.
    """
    pieces = list(data) if isinstance(data, (list, tuple)) else [data]
    return load_op_library().nestpipe_segment_sum(pieces, segment_ids,
                                                  tf.cast(num_segments, tf.int32))


def gather_pieces(params, indices, sizes, num):
    """`tf.split(gather_rows(params, indices), sizes, num=num)`, whose gradient sums the
    pieces' gradients into `params`' rows in one op (no concatenation of them first).

    Args:
      params: `[rows, dim]`.
      indices: int32 or int64 `[n]`, rows of `params` (no -1).
      sizes: int `[num]` summing to `n`: each piece's rows.
      num: the number of pieces (static).

    Returns:
      A list of `num` tensors `[sizes[i], dim]`.
    """

    @tf.custom_gradient
    def pieces_of(params):
        pieces = tf.split(gather_rows(params, indices), sizes, num=num)

        def grad(*d_pieces):
            return segment_sum(dense_pieces(d_pieces, pieces), indices,
                               tf.shape(params, out_type=tf.int32)[0])

        return pieces, grad

    return pieces_of(params)


def dense_pieces(gradients, pieces):
    """The gradients of `pieces` as dense tensors, zeros where a piece has none."""
    return [tf.zeros_like(piece) if gradient is None else tf.convert_to_tensor(gradient)
            for gradient, piece in zip(gradients, pieces)]


tf.no_gradient("NestpipeReadTableRows")
# Neither op updates its tables: reads are not ordered against each other (a prefetch's read and a
# compute pass's carrier may run together), only against the updates before and after them.
tf_private.register_read_only_resource_op("NestpipeReadTableRows")
tf_private.register_read_only_resource_op("NestpipeGradientCarrier")


@tf.RegisterGradient("NestpipeGradientCarrier")
def _gradient_carrier_grad(op, grad):
    """Each table's `IndexedSlices` of `grad`'s rows at its local rows (the gradient of a gather
    per table: the same values and indices, in the same order)."""
    num_tables = op.get_attr("N")
    handles = op.inputs[:num_tables]
    local_rows, row_offsets, table_sizes = op.inputs[num_tables:num_tables + 3]
    grad = tf.convert_to_tensor(grad)
    if num_tables == 1:
        slices = [tf.IndexedSlices(grad, local_rows, tf_private.variable_shape(handles[0]))]
    else:
        if op.get_attr("grouped"):
            # Each table's rows are one run: a split along rows (no copy where TensorFlow can
            # share the gradient's buffer: rows of a multiple of 64 bytes).
            values = tf.split(grad, table_sizes, num=num_tables)
            rows_in_table = [rows - row_offsets[t] for t, rows in
                             enumerate(tf.split(local_rows, table_sizes, num=num_tables))]
        else:
            table, rows_in_table = tables_of_rows(local_rows, row_offsets, num_tables)
            values = tf.dynamic_partition(grad, table, num_tables)
        slices = [tf.IndexedSlices(v, rows, tf_private.variable_shape(handle))
                  for v, rows, handle in zip(values, rows_in_table, handles)]
    if num_tables > 1 and _is_marked_distinct(local_rows):
        # Distinct fused rows are distinct within each table (a table's rows minus its start).
        for gradient in slices:
            _mark_distinct(gradient.indices)
    return slices + [None, None, None]


@tf.RegisterGradient("NestpipeGatherRows")
def _gather_rows_grad(op, grad):
    params, indices = op.inputs
    num_rows = tf.shape(params, out_type=tf.int32)[0]
    if isinstance(grad, tf.IndexedSlices):
        # A sparse upstream gradient (e.g. a tf.gather of the rows): each row of it goes straight
        # to the params row its output row was gathered from, never densified in between.
        return segment_sum(grad.values, tf.gather(indices, grad.indices), num_rows), None
    return segment_sum(grad, indices, num_rows), None


@tf.RegisterGradient("NestpipeSegmentSum")
def _segment_sum_grad(op, grad):
    num_pieces = op.get_attr("N")
    pieces, segment_ids = op.inputs[:num_pieces], op.inputs[num_pieces]
    gathered = gather_rows(grad, segment_ids)
    if num_pieces > 1:
        gathered = tf.split(gathered, [tf.shape(piece)[0] for piece in pieces], num=num_pieces)
    else:
        gathered = [gathered]
    return gathered + [None, None]
