"""Deterministic synthetic click logs with Zipf-distributed ids and a learnable label.

Each categorical field draws ids from a Zipf law (hot ids are small integers, as in frequency-
ranked vocabularies). Labels come from a hidden logistic "teacher": a per-id weight derived from
a hash of (field, id), plus a linear term in the dense features, so a model can learn it and a
held-out AUC is meaningful. Batch `i` depends only on (seed, i): every worker can build any
global batch and keep its own slice.
"""
import dataclasses
from typing import Sequence, Tuple

import numpy as np

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


@dataclasses.dataclass(frozen=True)
class SyntheticClickLog:
    """A click log of `num_dense` dense features and one categorical id per table in `table_sizes`."""

    table_sizes: Sequence[int]
    num_dense: int = 13
    zipf_exponent: float = 1.2
    seed: int = 0

    def batch(self, index: int, batch_size: int):
        """Global batch `index`: dict(dense=[B, num_dense] f32, sparse=[B, F] i64), labels [B, 1] f32."""
        if self.zipf_exponent <= 1.0:
            raise ValueError("zipf_exponent must be > 1, got %r" % self.zipf_exponent)
        rng = np.random.default_rng([self.seed, index])
        sizes = np.asarray(self.table_sizes, np.int64)
        raw = rng.zipf(self.zipf_exponent, size=(batch_size, len(sizes))) - 1
        # Fold the Zipf tail back into the table so hot ids stay hot and no id is out of range.
        sparse = (raw % sizes[None, :]).astype(np.int64)
        dense = rng.lognormal(0.0, 1.0, size=(batch_size, self.num_dense)).astype(np.float32)
        dense = np.log1p(dense)  # DLRM-style log(x + 1) transform
        logit = sum(_id_weight(f, sparse[:, f]) for f in range(len(sizes))) / np.sqrt(len(sizes))
        logit = logit + (dense - dense.mean()) @ np.linspace(-1.0, 1.0, self.num_dense) * 0.5
        labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-2.0 * logit))).astype(np.float32)
        return {"dense": dense, "sparse": sparse}, labels[:, None]
