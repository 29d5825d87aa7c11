"""Row-shard variables: the marker a strategy reads to treat a variable as one worker's rows of a
table (its layout), and the context in which the next variables created are row shards."""
import contextlib
import threading

_SHARD_ATTR = "_nestpipe_row_shard"
_creation_state = threading.local()


def is_row_shard(variable):
    """True for a sharded-embedding row shard or one of its optimizer slots."""
    return row_shard_layout(variable) is not None


def row_shard_layout(variable):
    """The `ShardLayout` of a row-shard variable (or its slot), else None."""
    return getattr(variable, _SHARD_ATTR, None)


def mark_row_shard(variable, layout):
    """Records on `variable` that it holds the row shard `layout` of a table."""
    setattr(variable, _SHARD_ATTR, layout)


def row_shard_being_created():
    """The layout of the row shard being created in this thread (see `creating_row_shard`)."""
    return getattr(_creation_state, "layout", None)


@contextlib.contextmanager
def creating_row_shard(layout):
    """Within this context, the next variables created under a NestPipeStrategy are row shards."""
    previous = row_shard_being_created()
    _creation_state.layout = layout
    try:
        yield
    finally:
        _creation_state.layout = previous


# --- replicated (data-parallel) tables ----------------------------------------------
_REPLICATED_ATTR = "_nestpipe_replicated_table"


def mark_replicated_table(variable, name):
    """Records on `variable` (a mirrored variable) that it is the whole table `name` replicated
    on every worker: its gradient is made dense and joins the dense all-reduce."""
    setattr(variable, _REPLICATED_ATTR, name)


def replicated_table_name(variable):
    """The table name of a replicated (data-parallel) table variable, else None."""
    return getattr(variable, _REPLICATED_ATTR, None)
