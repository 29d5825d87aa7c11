"""Key statistics of the DLRM example's Zipf ids, sampled exactly as the routing sees them.

For `n` samples per worker and `W` workers (ids fused over the 26 tables, owner = id mod W):
`unique` distinct ids per worker (requester-side dedup), `capacity` the largest count one worker
sends one owner (what the padded all-to-all is sized by), `owner_rows` distinct rows per owner
after the owner-side dedup across requesters (hot keys asked by many workers are read once),
`sync_capacity` / `sync_rows` the rows of the next batch's prefetch that this batch updated
(the Dual-Buffer re-sync with Adagrad: keys updated at step i ∩ keys prefetched for step i+1).
NumPy only; a few tens of seconds for the default grid.
"""
import numpy as np

SAMPLES = (32, 64, 128, 256, 512)
WORKERS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536)
MAX_GLOBAL_SAMPLES = 1536 * 256
STATS = ("unique", "capacity", "owner_rows", "sync_capacity", "sync_rows")


def _fused(sparse, table_sizes):
    offsets = np.concatenate([[0], np.cumsum(table_sizes)[:-1]]).astype(np.int64)
    return sparse + offsets[None, :]


def cell_stats(current, upcoming, samples, workers, vocab):
    """Statistics of one (samples, workers) cell: `upcoming` (the prefetched batch) and `current`
    (the batch whose update the prefetch must see) are fused id arrays [workers*samples, F]."""
    fields = upcoming.shape[1]
    worker = np.repeat(np.arange(workers, dtype=np.int64), samples * fields)
    codes = np.unique(worker * vocab + upcoming.reshape(-1))
    requester, key = codes // vocab, codes % vocab
    pair = requester * workers + key % workers
    counts = np.bincount(pair, minlength=workers * workers)
    updated = np.unique(current)
    where = np.minimum(np.searchsorted(updated, key), len(updated) - 1)
    stale = updated[where] == key
    sync_counts = np.bincount(pair[stale], minlength=workers * workers)
    return {"unique": len(codes) / workers, "capacity": float(counts.max()),
            "owner_rows": len(np.unique(key)) / workers,
            "sync_capacity": float(sync_counts.max()), "sync_rows": float(stale.sum()) / workers}


def sample_key_stats(table_scale=0.002, samples=SAMPLES, workers=WORKERS, seed=1,
                     max_global_samples=MAX_GLOBAL_SAMPLES, zipf_exponent=1.2):
    """The statistics grid (`STATS` x samples x workers; None where samples*workers exceeds
    `max_global_samples`) of the synthetic Criteo-profile log at `table_scale`, as a dict ready
    for the costs file. Small cells average several disjoint blocks of the sampled batches."""
    from tf_nestpipe.data import SyntheticClickLog, criteo_kaggle_table_sizes

    table_sizes = criteo_kaggle_table_sizes(table_scale)
    vocab = int(sum(table_sizes))
    log = SyntheticClickLog(table_sizes, seed=seed, zipf_exponent=zipf_exponent)
    pool = min(max_global_samples, max(samples) * max(workers))
    current = _fused(log.batch(1000, pool)[0]["sparse"], table_sizes)
    upcoming = _fused(log.batch(1001, pool)[0]["sparse"], table_sizes)
    grid = {name: [] for name in STATS}
    for n in samples:
        rows = {name: [] for name in STATS}
        for w in workers:
            size = n * w
            if size > max_global_samples:
                for name in STATS:
                    rows[name].append(None)
                continue
            blocks = max(1, min(8, pool // size, 65536 // size))
            cells = [cell_stats(current[i * size:(i + 1) * size], upcoming[i * size:(i + 1) * size],
                                n, w, vocab) for i in range(blocks)]
            for name in STATS:
                rows[name].append(float(np.mean([c[name] for c in cells])))
        for name in STATS:
            grid[name].append(rows[name])
    return dict(grid, samples=list(samples), workers=list(workers), table_scale=table_scale,
                fields=len(table_sizes), vocab=vocab, zipf_exponent=zipf_exponent,
                how="sampled from SyntheticClickLog(criteo_kaggle_table_sizes(%g), seed=%d, "
                    "zipf_exponent=%g): two independent global batches of W*n samples (batch i "
                    "and i+1), worker k holds samples [k*n, (k+1)*n); mean over up to 8 disjoint "
                    "blocks for small cells; capacity = max over (requester, owner) pairs "
                    "(before the 1.19^k capacity bucketing, which the model applies)"
                    % (table_scale, seed, zipf_exponent))
