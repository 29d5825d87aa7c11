"""Python wrappers, shape contracts and gradients of the tf_nestpipe custom ops."""
from tf_nestpipe.ops.buffer_sync import (apply_sync_payload, buffer_sync, gather_blocks,
                                          gather_from_blocks, pack_per_peer, sync_header,
                                          sync_payload, sync_plan, sync_plan_pad, sync_rows)
from tf_nestpipe.ops.dynamic_table import (DynamicTable, DynamicTableState, dynamic_owner,
                                          dynamic_row_init)
from tf_nestpipe.ops.gather import (dense_pieces, gather_pieces, gather_rows, gradient_carrier,
                                    has_distinct_indices, read_table_rows, segment_sum,
                                    tables_of_rows)
from tf_nestpipe.ops.library import load_op_library
from tf_nestpipe.ops.routing import (bucket_slots, capacity_bucket, check_ids, fuse_ids,
                                     keys_block, owner_rounds, route_counts, route_keys,
                                     window_grad_index, window_layout)
from tf_nestpipe.ops.row_init import stateless_row_init
from tf_nestpipe.ops.updates import scatter_rows
from tf_nestpipe.ops.wire import (HALF_MAX, decode_int8_rows, encode_int8_rows,
                                  from_int64_words, int8_words, saturate_to_half, to_int64_words)

__all__ = [
    "HALF_MAX",
    "DynamicTable",
    "DynamicTableState",
    "decode_int8_rows",
    "dense_pieces",
    "dynamic_owner",
    "dynamic_row_init",
    "encode_int8_rows",
    "from_int64_words",
    "int8_words",
    "saturate_to_half",
    "to_int64_words",
    "apply_sync_payload",
    "bucket_slots",
    "capacity_bucket",
    "buffer_sync",
    "check_ids",
    "fuse_ids",
    "gather_blocks",
    "gather_from_blocks",
    "gather_pieces",
    "gather_rows",
    "gradient_carrier",
    "has_distinct_indices",
    "keys_block",
    "load_op_library",
    "owner_rounds",
    "pack_per_peer",
    "read_table_rows",
    "route_counts",
    "route_keys",
    "scatter_rows",
    "segment_sum",
    "stateless_row_init",
    "sync_header",
    "sync_payload",
    "sync_plan",
    "sync_plan_pad",
    "sync_rows",
    "tables_of_rows",
    "window_grad_index",
    "window_layout",
]
