"""Checks a dataset's AutoShard policy before `experimental_distribute_dataset` shards it across
workers, so that the known traps of tf.data auto-sharding become clear errors or correct
fallbacks instead of hangs or silently duplicated samples:

- FILE (or AUTO) with fewer input files than workers: tf.data fails on some workers at their
  first batch while the others wait in a collective forever. Every worker now probes its own
  shard first and all of them agree: FILE raises an error naming the fix on every worker, AUTO
  falls back to DATA sharding (every worker reads every file and keeps its share of records).
- HINT without `shard(SHARD_HINT, SHARD_HINT)` in the pipeline: tf.data does not shard at all,
  so every worker trains on every sample. Refused with an error naming the fix.

Uneven data (workers whose shards run out at different steps) needs nothing here: the
distributed iterator agrees across workers whether any has data left, and a worker that has
none gets empty batches until all are done, so every sample is seen exactly once. That agreement
costs an all-reduce at the start of every step of a finite dataset (and relaxes the batch
dimension to unknown); `equal_static_shares` says when no worker can run out first, so the
strategy distributes such a dataset without it.
"""
import logging

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tf_nestpipe.tf_private import input_ops
from tf_nestpipe import tf_private

AutoShardPolicy = tf.data.experimental.AutoShardPolicy

_FILE_SHARDING_ERROR = "Could not apply FILE based sharding"
OK, TOO_FEW_FILES, FAILED = 0, 1, 2


def _graph_def(dataset):
    serialized = tf_private.serialized_dataset_graph(
        dataset, tf.data.experimental.ExternalStatePolicy.WARN)
    return graph_pb2.GraphDef.FromString(serialized.numpy())


def has_shard_hint(dataset):
    """Whether the dataset's graph has a `shard(SHARD_HINT, ...)` for HINT to rewrite."""
    graph = _graph_def(dataset)
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    constants = {}
    for node in nodes:
        if (node.op == "Const" and "value" in node.attr
                and tf.dtypes.as_dtype(node.attr["dtype"].type).is_integer):
            value = tf.make_ndarray(node.attr["value"].tensor)
            if value.size == 1:
                constants[node.name] = int(value.reshape(()))
    for node in nodes:
        if node.op == "ShardDataset" and len(node.input) > 1:
            source = node.input[1].split(":")[0].lstrip("^")
            if constants.get(source) == tf.data.experimental.SHARD_HINT:
                return True
    return False


def probe_file_sharding(dataset, num_workers, worker_index):
    """Applies tf.data's auto-shard rewrite for this worker and reads one element: returns
    (OK | TOO_FEW_FILES | FAILED, message)."""
    sharded = input_ops.auto_shard_dataset(dataset, num_workers, worker_index, num_workers)
    try:
        for _ in sharded.take(1):
            pass
    except tf.errors.InvalidArgumentError as e:
        if _FILE_SHARDING_ERROR in str(e):
            return TOO_FEW_FILES, str(e).splitlines()[0]
        return FAILED, str(e).splitlines()[0]
    except tf.errors.OpError as e:
        return FAILED, str(e).splitlines()[0]
    return OK, ""


def with_policy(dataset, policy):
    """`dataset` with its AutoShard policy set to `policy`."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def check_auto_shard(dataset, num_workers, worker_index, agree):
    """Returns the dataset to distribute (DATA-sharded if AUTO cannot shard by file) or raises a
    ValueError naming the fix. `agree(status)` returns every worker's status (a collective:
    every worker calls this at the same point)."""
    if num_workers <= 1 or not isinstance(dataset, tf.data.Dataset):
        return dataset
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy == AutoShardPolicy.HINT and not has_shard_hint(dataset):
        raise ValueError(
            "AutoShardPolicy.HINT needs `dataset.shard(tf.data.experimental.SHARD_HINT, "
            "tf.data.experimental.SHARD_HINT)` in the input pipeline; without it every one of "
            "the %d workers would train on every sample. Add the shard hint where the pipeline "
            "should be split, or use AutoShardPolicy.FILE / DATA." % num_workers)
    if policy not in (AutoShardPolicy.FILE, AutoShardPolicy.AUTO):
        return dataset
    status, message = probe_file_sharding(dataset, num_workers, worker_index)
    statuses = [int(s) for s in agree(status)]
    if FAILED in statuses:
        raise ValueError(
            "the input pipeline failed on worker(s) %s while probing its shard%s; fix the "
            "dataset (see that worker's log)" % (
                [i for i, s in enumerate(statuses) if s == FAILED],
                (": " + message) if status == FAILED else ""))
    if TOO_FEW_FILES not in statuses:
        return dataset
    if policy == AutoShardPolicy.FILE:
        raise ValueError(
            "AutoShardPolicy.FILE gives each of the %d workers its own input files, but the "
            "dataset has fewer files than workers, so tf.data cannot shard it by file. Split "
            "the data into at least %d files, or set AutoShardPolicy.DATA." % (
                num_workers, num_workers))
    logging.getLogger("tf_nestpipe").warning(
        "AutoShardPolicy.AUTO: fewer input files than the %d workers; sharding by DATA instead "
        "(every worker reads every file and keeps every %d-th record).", num_workers, num_workers)
    return with_policy(dataset, AutoShardPolicy.DATA)


def equal_static_shares(dataset, num_replicas):
    """Whether every replica's share of every element of `dataset`, once distributed, has the
    same static size, and every worker the same number of elements: DATA sharding of batches of
    one static size divisible by `num_replicas` (e.g. `batch(global_batch,
    drop_remainder=True)`). Each global batch is then split into equal pieces and each worker
    keeps its own piece of every batch, so no worker can run out of data before another."""
    if not isinstance(dataset, tf.data.Dataset) or num_replicas < 1:
        return False
    if dataset.options().experimental_distribute.auto_shard_policy != AutoShardPolicy.DATA:
        return False
    sizes = set()
    for spec in tf.nest.flatten(dataset.element_spec):
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None or shape.rank == 0 or shape[0] is None:
            return False
        sizes.add(shape[0])
    return len(sizes) == 1 and sizes.pop() % num_replicas == 0
