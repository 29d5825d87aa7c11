"""Deterministic synthetic click logs with Zipf-distributed ids and a learnable label.

Each categorical field draws ids from a Zipf law (hot ids are small integers, as in frequency-
ranked vocabularies). Labels come from a hidden logistic "teacher": a per-id weight derived from
a hash of (field, id), plus a linear term in the dense features, so a model can learn it and a
held-out AUC is meaningful. Batch `i` depends only on (seed, i): every worker can build any
global batch and keep its own slice.

Alongside `batch`: `multi_hot` turns tables into multi-hot bags (`example_batch`, `schema`), and
`criteo_rows` draws raw rows in the Criteo TSV layout (integer counts with missing values, 32-bit
hashed categoricals) for `tf_nestpipe.data.criteo.write_criteo_tsv`.
"""
import dataclasses
from typing import NamedTuple, Sequence, Tuple

import numpy as np

from tf_nestpipe.data.schema import RaggedIds, Schema, SparseFeature
from tf_nestpipe.data.tfrecord import ShardWriter, dataset_metadata, write_metadata

# Rows per categorical feature of the Criteo Kaggle (Display Advertising Challenge) data set as
# used by the DLRM reference preprocessing.
_CRITEO_KAGGLE_SIZES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


def criteo_kaggle_table_sizes(scale: float = 1.0, min_rows: int = 4) -> Tuple[int, ...]:
    """The 26 Criteo Kaggle table sizes multiplied by `scale` (at least `min_rows` each)."""
    return tuple(max(min_rows, int(round(n * scale))) for n in _CRITEO_KAGGLE_SIZES)


def _id_weight(field: int, ids: np.ndarray) -> np.ndarray:
    """Teacher weight of each id: a fixed pseudo-random value in [-1.5, 1.5) per (field, id)."""
    h = (ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(field * 40503 + 7)) % np.uint64(1 << 20)
    return (h.astype(np.float64) / float(1 << 20) - 0.5) * 3.0


# From here up a Zipf id is a double rounded to an integer (numpy's sampler and `power_law_ids`
# compute it in floating point): a multiple of a power of two, less one, so odd and mostly
# 63 mod 64. Wrapped by a plain `% size` this tail would land on a few rows of one parity, i.e.
# on one worker's shard under the row-wise "mod" layout.
_EXACT_IDS = 1 << 53


def fold_ids(raw: np.ndarray, sizes) -> np.ndarray:
    """Zipf ids `raw` (>= 0) folded into tables of `sizes` rows (broadcast against `raw`).

    Ids below a table's size stay (hot ids stay hot) and the tail wraps around (`% size`); ids
    of 2**53 or more, whose low bits are rounding rather than random, are hashed first (the
    splitmix64 finalizer), so that tail spreads over every row instead of a few of one parity.

    Args:
      raw: int64 ids >= 0.
      sizes: Table sizes (ints > 0), broadcastable against `raw`.

    Returns:
      int64 ids in `[0, size)`.
    """
    raw = np.asarray(raw, np.int64)
    sizes = np.asarray(sizes, np.int64)
    mixed = _splitmix64(raw.astype(np.uint64)) % sizes.astype(np.uint64)
    return np.where(raw >= _EXACT_IDS, mixed.astype(np.int64), raw % sizes)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer of uint64 `x` (a bijection; wraps mod 2^64)."""
    z = np.asarray(x, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclasses.dataclass(frozen=True)
class SyntheticClickLog:
    """A click log of `num_dense` dense features and one categorical id per table in `table_sizes`."""

    table_sizes: Sequence[int]
    num_dense: int = 13
    zipf_exponent: float = 1.2
    seed: int = 0
    # Per table: the most ids in one row (1 = single-hot); empty = every table single-hot.
    multi_hot: Sequence[int] = ()

    def batch(self, index: int, batch_size: int):
        """Global batch `index`: dict(dense=[B, num_dense] f32, sparse=[B, F] i64), labels [B, 1] f32."""
        if self.zipf_exponent <= 1.0:
            raise ValueError("zipf_exponent must be > 1, got %r" % self.zipf_exponent)
        if max(self.hotness(), default=1) > 1:
            raise ValueError("SyntheticClickLog has multi-hot tables (multi_hot=%r); use example_batch"
                             % (tuple(self.multi_hot),))
        rng = np.random.default_rng([self.seed, index])
        sizes = np.asarray(self.table_sizes, np.int64)
        raw = rng.zipf(self.zipf_exponent, size=(batch_size, len(sizes))) - 1
        sparse = fold_ids(raw, sizes[None, :])
        dense = rng.lognormal(0.0, 1.0, size=(batch_size, self.num_dense)).astype(np.float32)
        dense = np.log1p(dense)  # DLRM-style log(x + 1) transform
        logit = sum(_id_weight(f, sparse[:, f]) for f in range(len(sizes))) / np.sqrt(len(sizes))
        logit = logit + (dense - dense.mean()) @ np.linspace(-1.0, 1.0, self.num_dense) * 0.5
        labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-2.0 * logit))).astype(np.float32)
        return {"dense": dense, "sparse": sparse}, labels[:, None]

    def hotness(self) -> Tuple[int, ...]:
        """Most ids per row of each table (all 1 unless `multi_hot` is set)."""
        if not self.multi_hot:
            return (1,) * len(self.table_sizes)
        hot = tuple(int(h) for h in self.multi_hot)
        if len(hot) != len(self.table_sizes) or min(hot) < 1:
            raise ValueError("multi_hot needs one entry >= 1 per table (%d tables), got %r"
                             % (len(self.table_sizes), tuple(self.multi_hot)))
        return hot

    def schema(self) -> Schema:
        """Schema of `example_batch`: 'dense' plus 'sparse' [B, F] (all single-hot), or one feature
        per table 'C1'..'CF' (int64 [B] if single-hot, ragged if multi-hot)."""
        hot = self.hotness()
        if max(hot) == 1:
            sizes = tuple(int(n) for n in self.table_sizes)
            return Schema((SparseFeature("sparse", sizes, len(sizes)),), self.num_dense)
        return Schema(tuple(SparseFeature("C%d" % (f + 1), int(n), 1 if h == 1 else None)
                            for f, (n, h) in enumerate(zip(self.table_sizes, hot))), self.num_dense)

    def example_batch(self, index: int, batch_size: int):
        """Global batch `index` in the layout of `schema()`: `batch()` if every table is single-hot;
        otherwise multi-hot table f holds 1..multi_hot[f] ids per row (uniform length) as RaggedIds.
        The first id of a bag, every single-hot id and the dense features equal `batch()` of the
        same log without `multi_hot`; the other ids come from `power_law_ids` (same exponent).
        Labels [B, 1] use the mean teacher weight of each bag."""
        hot = self.hotness()
        if max(hot) == 1:
            return self.batch(index, batch_size)
        if self.zipf_exponent <= 1.0:
            raise ValueError("zipf_exponent must be > 1, got %r" % self.zipf_exponent)
        # The same draws, in the same order, as batch(); the extra ids come after them.
        rng = np.random.default_rng([self.seed, index])
        sizes = np.asarray(self.table_sizes, np.int64)
        raw = rng.zipf(self.zipf_exponent, size=(batch_size, len(sizes))) - 1
        sparse = fold_ids(raw, sizes[None, :])
        dense = rng.lognormal(0.0, 1.0, size=(batch_size, self.num_dense)).astype(np.float32)
        dense = np.log1p(dense)
        coins = rng.random(batch_size)
        out = {"dense": dense}
        logit = np.zeros(batch_size)
        for f, h in enumerate(hot):
            if h == 1:
                out["C%d" % (f + 1)] = sparse[:, f]
                logit += _id_weight(f, sparse[:, f])
                continue
            lengths = rng.integers(1, h + 1, size=batch_size)
            splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            values = np.empty(splits[-1], np.int64)
            first = np.zeros(splits[-1], bool)
            first[splits[:-1]] = True
            values[first] = sparse[:, f]
            extra = power_law_ids(rng, self.zipf_exponent, int(splits[-1]) - batch_size)
            values[~first] = fold_ids(extra, sizes[f])
            out["C%d" % (f + 1)] = RaggedIds(values, splits)
            logit += np.add.reduceat(_id_weight(f, values), splits[:-1]) / lengths
        logit = logit / np.sqrt(len(sizes))
        logit = logit + (dense - dense.mean()) @ np.linspace(-1.0, 1.0, self.num_dense) * 0.5
        labels = (coins < 1.0 / (1.0 + np.exp(-2.0 * logit))).astype(np.float32)
        return out, labels[:, None]

    def criteo_rows(self, index: int, batch_size: int) -> "CriteoRows":
        """Batch `index` of raw rows in the Criteo TSV layout (needs 13 dense and 26 tables): integer
        counts (a few negative in I2), 32-bit hashes of `power_law_ids` (a bijection of the id per
        table, so hot hashes stay hot), empty fields at roughly the Criteo Kaggle column rates."""
        if self.num_dense != 13 or len(self.table_sizes) != 26:
            raise ValueError("Criteo rows need num_dense=13 and 26 tables, got %d and %d"
                             % (self.num_dense, len(self.table_sizes)))
        if self.zipf_exponent <= 1.0:
            raise ValueError("zipf_exponent must be > 1, got %r" % self.zipf_exponent)
        rng = np.random.default_rng([self.seed, index, 0xC7])
        sizes = np.asarray(self.table_sizes, np.int64)
        ids = fold_ids(power_law_ids(rng, self.zipf_exponent, (batch_size, 26)), sizes[None, :])
        # Lognormal counts, median growing from 1 (I1) to e^4 (I13).
        log_counts = np.linspace(0.0, 4.0, 13)[None, :] + 1.5 * rng.standard_normal((batch_size, 13))
        integers = np.floor(np.exp(log_counts)).astype(np.int64)
        negative = rng.random(batch_size) < 0.05
        integers[negative, 1] = -rng.integers(1, 4, size=int(negative.sum()))
        integers_missing = rng.random((batch_size, 13)) < np.asarray(_CRITEO_DENSE_MISSING)[None, :]
        categorical_missing = rng.random((batch_size, 26)) < np.asarray(_CRITEO_SPARSE_MISSING)[None, :]
        hashed = _mix32(ids + 1 + np.arange(26, dtype=np.int64)[None, :] * 0x01000193)
        dense = np.log1p(np.where(integers_missing, 0, np.maximum(integers, 0)))
        logit = sum(np.where(categorical_missing[:, f], 0.0, _id_weight(f, ids[:, f])) for f in range(26))
        logit = logit / np.sqrt(26) + (dense - dense.mean(0)) @ np.linspace(-1.0, 1.0, 13) * 0.1
        # The intercept puts the click rate near Criteo's (about 25%).
        labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(1.5 - 2.0 * logit))).astype(np.int64)
        return CriteoRows(labels, integers, integers_missing, hashed.astype(np.int64), categorical_missing)


def power_law_ids(rng: np.random.Generator, exponent: float, shape) -> np.ndarray:
    """Zipf-law ids >= 0 with tail exponent `exponent`, by inverse transform (vectorized, several
    times faster than `Generator.zipf`): id = floor(exp(E / (exponent - 1))) - 1 with E ~ Exp(1),
    so P(id >= k) = (k + 1) ** (1 - exponent) and P(id = k) ~ (exponent - 1) * k ** -exponent.
    From 2**53 up the ids are rounded doubles: put them in a table with `fold_ids`."""
    if exponent <= 1.0:
        raise ValueError("exponent must be > 1, got %r" % exponent)
    with np.errstate(over="ignore"):
        x = np.exp(rng.standard_exponential(shape) * (1.0 / (exponent - 1.0)))
    return np.minimum(x, 2.0 ** 62).astype(np.int64) - 1


def _mix32(x: np.ndarray) -> np.ndarray:
    """A bijection of [0, 2^32) (the murmur3 finalizer) applied to `x` mod 2^32, as int64."""
    h = np.asarray(x, np.int64).astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h.astype(np.int64)


class CriteoRows(NamedTuple):
    """Raw Criteo rows: labels [B] in {0, 1}, integers [B, 13], hashed categoricals [B, 26] in
    [0, 2^32), and masks of the fields that are empty in the TSV."""

    labels: np.ndarray
    integers: np.ndarray
    integers_missing: np.ndarray
    categorical: np.ndarray
    categorical_missing: np.ndarray


# Approximate fraction of empty fields per column in the Criteo Kaggle training data.
_CRITEO_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.001, 0.04, 0.45, 0.04, 0.77, 0.22)
_CRITEO_SPARSE_MISSING = (0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0,
                          0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44)


def write_synthetic_tfrecords(log: SyntheticClickLog, out_dir: str, rows: int, shards: int = 4,
                              test_rows: int = 0, batch_size: int = 65536, progress=None) -> dict:
    """Writes `log.example_batch` rows as TFRecord shards (+ metadata.json) in `out_dir`: 'train'
    from batches 0, 1, ... and 'test' from the batches after them; returns the metadata."""
    schema, splits, index, done = log.schema(), {}, 0, 0
    for split, count in (("train", int(rows)), ("test", int(test_rows))):
        if count <= 0:
            continue
        with ShardWriter(out_dir, split, shards, schema) as writer:
            for start in range(0, count, batch_size):
                features, labels = log.example_batch(index, min(batch_size, count - start))
                writer.write(features, labels)
                index, done = index + 1, done + len(labels)
                if progress:
                    progress(done, int(rows) + max(0, int(test_rows)))
            splits[split] = writer.close()
    metadata = dataset_metadata(
        "synthetic", schema, splits, generator={
            "table_sizes": [int(n) for n in log.table_sizes], "num_dense": log.num_dense,
            "zipf_exponent": log.zipf_exponent, "seed": log.seed, "multi_hot": list(log.hotness()),
            "batch_size": batch_size})
    write_metadata(out_dir, metadata)
    return metadata
