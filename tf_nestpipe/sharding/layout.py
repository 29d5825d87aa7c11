"""Row-sharding layout of one embedding table.

Ownership rule: id `k` of a table with `vocab_size` rows sharded over `num_shards` workers is
owned by shard `k mod num_shards` and stored there at local row `k // num_shards`. Modulo
placement spreads frequency-ranked (Zipf-hot, small) ids evenly over the workers.
"""
import dataclasses

import numpy as np


def _as_ids(ids):
    """Lists become NumPy arrays; arrays and tensors pass through."""
    return np.asarray(ids) if isinstance(ids, (list, tuple)) else ids


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which rows of a `[vocab_size, dim]` table shard `shard_index` of `num_shards` holds."""

    vocab_size: int
    dim: int
    num_shards: int = 1
    shard_index: int = 0

    def __post_init__(self):
        if self.vocab_size < 1 or self.dim < 1:
            raise ValueError("vocab_size and dim must be >= 1, got %d and %d"
                             % (self.vocab_size, self.dim))
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError("shard_index %d out of range for %d shards"
                             % (self.shard_index, self.num_shards))

    @property
    def local_rows(self) -> int:
        """Number of rows this shard stores."""
        return self.rows_of_shard(self.shard_index)

    def rows_of_shard(self, shard: int) -> int:
        """Number of rows shard `shard` stores."""
        return max(0, (self.vocab_size - shard + self.num_shards - 1) // self.num_shards)

    @property
    def max_local_rows(self) -> int:
        """Rows of the largest shard (shard 0)."""
        return self.rows_of_shard(0)

    def global_ids(self) -> np.ndarray:
        """Global ids of this shard's rows, in local row order."""
        ids = np.arange(self.vocab_size, dtype=np.int64)
        return ids[self.owner(ids) == self.shard_index]

    def owner(self, ids):
        """Owner shard of each id (NumPy arrays or int64 tensors)."""
        return _as_ids(ids) % self.num_shards

    def local_row(self, ids):
        """Row of each id in its owner's shard (NumPy arrays or int64 tensors)."""
        return _as_ids(ids) // self.num_shards
