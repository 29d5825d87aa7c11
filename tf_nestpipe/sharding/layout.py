"""Layout of one embedding table over the workers: the ownership rule id -> (worker, local row).

Row-wise (the default): id `k` of a table with `vocab_size` rows sharded over `num_shards`
workers is owned by shard `k mod num_shards` and stored there at local row `k // num_shards`.
Modulo placement spreads frequency-ranked (Zipf-hot, small) ids evenly over the workers.
Table-wise (`owner_shard` set): the whole table lives on worker `owner_shard`, id `k`
at local row `k`; every other worker holds none of its rows.
"""
import dataclasses
from typing import Optional

import numpy as np


def _as_ids(ids):
    """Lists become NumPy arrays; arrays and tensors pass through."""
    return np.asarray(ids) if isinstance(ids, (list, tuple)) else ids


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which rows of a `[vocab_size, dim]` table shard `shard_index` of `num_shards` holds: the
    rows of ids `k mod num_shards == shard_index`, or, with `owner_shard` (a table-wise table),
    every row on that shard and none elsewhere.

    Attributes:
        vocab_size: Rows of the whole table.
        dim: Its width.
        num_shards: The workers it is spread over.
        shard_index: The shard this layout describes.
        owner_shard: The shard holding the whole table (table-wise), else None (row-wise).
    """

    vocab_size: int
    dim: int
    num_shards: int = 1
    shard_index: int = 0
    owner_shard: Optional[int] = None

    def __post_init__(self):
        if self.vocab_size < 1 or self.dim < 1:
            raise ValueError("vocab_size and dim must be >= 1, got %d and %d"
                             % (self.vocab_size, self.dim))
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError("shard_index %d out of range for %d shards"
                             % (self.shard_index, self.num_shards))
        if self.owner_shard is not None and not 0 <= self.owner_shard < self.num_shards:
            raise ValueError("owner_shard %d of a table-wise table out of range for %d shards"
                             % (self.owner_shard, self.num_shards))

    @property
    def table_wise(self) -> bool:
        """Whether the whole table lives on one shard (`owner_shard`)."""
        return self.owner_shard is not None

    @property
    def local_rows(self) -> int:
        """Number of rows this shard stores."""
        return self.rows_of_shard(self.shard_index)

    def rows_of_shard(self, shard: int) -> int:
        """Number of rows shard `shard` stores.

        Args:
            shard: A shard index in `[0, num_shards)`.

        Returns:
            The row count."""
        if self.table_wise:
            return self.vocab_size if shard == self.owner_shard else 0
        return max(0, (self.vocab_size - shard + self.num_shards - 1) // self.num_shards)

    @property
    def max_local_rows(self) -> int:
        """Rows of the largest shard (shard 0, or the owner of a table-wise table)."""
        return self.vocab_size if self.table_wise else self.rows_of_shard(0)

    def global_ids(self) -> np.ndarray:
        """Global ids of this shard's rows, in local row order."""
        ids = np.arange(self.vocab_size, dtype=np.int64)
        return ids[self.owner(ids) == self.shard_index]

    def owner(self, ids):
        """Owner shard of each id.

        Args:
            ids: Ids, a NumPy array or an int64 tensor.

        Returns:
            The owner of each id, of the same kind and shape."""
        ids = _as_ids(ids)
        if self.table_wise:
            return ids * 0 + self.owner_shard
        return ids % self.num_shards

    def local_row(self, ids):
        """Row of each id in its owner's shard.

        Args:
            ids: Ids, a NumPy array or an int64 tensor.

        Returns:
            The local row of each id, of the same kind and shape."""
        ids = _as_ids(ids)
        return ids if self.table_wise else ids // self.num_shards
