"""Restores of tables into tables of another size must be refused, never silently wrong.

usage: restore_sizes.py OUT_DIR [save] [restore]
  save    (any number of workers): a 100-row table (row k = [k, k + .5, ...]) written as a
          tf.train.Checkpoint (OUT_DIR/whole, by worker 0; the others to a scratch directory)
          and as a ShardedCheckpoint (OUT_DIR/sharded, step 1).
  restore (any number of workers): tries every case of CASES and writes
          OUT_DIR/results-<workers>-<rank>.json: {case: "ok" | "error: <message>"}; a restore
          that succeeds is "ok" only if every row this worker holds is the saved row.
"""
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_nestpipe as tnp  # noqa: E402

SAVED_ROWS, DIM = 100, 4
# case: (checkpoint kind, vocabulary size of the table restored into)
CASES = {"whole_into_200": ("whole", 200), "whole_into_100": ("whole", 100),
         "whole_into_50": ("whole", 50), "sharded_into_60": ("sharded", 60),
         "sharded_into_101": ("sharded", 101), "sharded_into_200": ("sharded", 200),
         "sharded_into_100": ("sharded", 100),
         # Half the saved table: on 2 workers each saved shard holds exactly this many rows,
         # which a restore guessing from row counts took for a whole replicated table.
         "sharded_into_50": ("sharded", 50),
         # Restored before the table exists (as tf_keras BackupAndRestore does when fit builds
         # the model): the value is restored when the variable is created.
         "deferred_into_100": ("deferred", 100), "deferred_into_200": ("deferred", 200)}


def table(strategy, rows):
    """A built ShardedEmbedding of `rows` rows, every value -1."""
    with strategy.scope():
        layer = tnp.ShardedEmbedding(rows, DIM, embeddings_initializer="zeros")
        layer.build((None,))
    layer.embeddings.assign(-tf.ones_like(layer.embeddings))
    return layer


def expected_rows(layout):
    ids = layout.global_ids().astype(np.float32)
    return ids[:, None] + 0.5 * np.arange(DIM, dtype=np.float32)[None, :]


def main():
    out, modes = sys.argv[1], sys.argv[2:]
    # row_wise: the row shards are what is resized ("auto" would replicate these tables).
    strategy = tnp.NestPipeStrategy(placement="row_wise")
    if "save" in modes:
        save(strategy, out)
    if "restore" in modes:
        restore(strategy, out)


def save(strategy, out):
    """Writes the 100-row table both ways."""
    rank = strategy.worker_index
    layer = table(strategy, SAVED_ROWS)
    layer.embeddings.assign(expected_rows(layer.layout))
    whole = os.path.join(out, "whole" if rank == 0 else "scratch-%d" % rank, "ckpt")
    tf.train.Checkpoint(table=layer).write(whole)
    tnp.ShardedCheckpoint(strategy, table=layer).save(os.path.join(out, "sharded"), 1)


def restore(strategy, out):
    """Tries every case of CASES; writes this worker's results."""
    rank, workers = strategy.worker_index, strategy.num_workers
    results = {}
    for case, (kind, rows) in CASES.items():
        try:
            if kind == "deferred":
                with strategy.scope():
                    layer = tnp.ShardedEmbedding(rows, DIM, embeddings_initializer="zeros")
                tf.train.Checkpoint(table=layer).read(os.path.join(out, "whole", "ckpt"))
                with strategy.scope():
                    layer.build((None,))
            else:
                layer = table(strategy, rows)
            if kind == "whole":
                tf.train.Checkpoint(table=layer).read(os.path.join(out, "whole", "ckpt"))
            elif kind == "sharded":
                tnp.ShardedCheckpoint(strategy, table=layer).restore(os.path.join(out, "sharded"))
        except (ValueError, tf.errors.OpError) as error:
            results[case] = "error: %s" % error
            continue
        got = layer.embeddings.numpy()
        want = expected_rows(layer.layout)
        results[case] = "ok" if got.shape == want.shape and np.array_equal(got, want) else \
            "wrong rows (%d of %d differ)" % (int((got != want).any(axis=1).sum()), got.shape[0])
    with open(os.path.join(out, "results-%d-%d.json" % (workers, rank)), "w") as f:
        json.dump(results, f)
    print("restore cases done on worker", rank, flush=True)


if __name__ == "__main__":
    main()
