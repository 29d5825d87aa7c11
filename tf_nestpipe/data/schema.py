"""Schema of a recommendation example: a float label, dense floats and int64 id features.

A `SparseFeature` is single-hot (`length=1`: int64 `[B]`), fixed multi-id (`length=k`: int64
`[B, k]`, one shared table or one table per column) or multi-hot (`length=None`:
`tf.RaggedTensor` int64 `[B, None]`), which is what `ShardedEmbedding` and
`ShardedEmbeddingCollection` consume. A `Schema` round-trips through a JSON-safe dict.
"""
import dataclasses
from typing import NamedTuple, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

RESERVED_NAMES = ("dense", "label")


class RaggedIds(NamedTuple):
    """Multi-hot ids of a batch in CSR form: row i holds `values[row_splits[i]:row_splits[i + 1]]`."""

    values: np.ndarray
    row_splits: np.ndarray

    @classmethod
    def from_lists(cls, rows):
        """Builds RaggedIds from a list of per-row id lists."""
        lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        values = np.fromiter((v for r in rows for v in r), np.int64, int(splits[-1]))
        return cls(values, splits)

    def row_lengths(self) -> np.ndarray:
        """Number of ids in each row."""
        return np.diff(self.row_splits)

    def to_lists(self):
        """The rows as a list of Python int lists."""
        values = self.values.tolist()
        splits = self.row_splits.tolist()
        return [values[a:b] for a, b in zip(splits[:-1], splits[1:])]


@dataclasses.dataclass(frozen=True)
class SparseFeature:
    """An int64 id feature: `length=1` -> `[B]`, `length=k` -> `[B, k]`, `None` -> ragged `[B, None]`.

    `vocab_size` is the table size (ids lie in `[0, vocab_size)`); a `length=k` feature may give a
    tuple of k sizes, one table per column, as `ShardedEmbeddingCollection` takes.
    """

    name: str
    vocab_size: Union[int, Tuple[int, ...]]
    length: Optional[int] = 1

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or self.name in RESERVED_NAMES:
            raise ValueError("sparse feature name must be a non-empty string other than %s, got %r"
                             % (RESERVED_NAMES, self.name))
        if self.length is not None and (not isinstance(self.length, int) or self.length < 1):
            raise ValueError("feature %r: length must be a positive int or None (multi-hot), got %r"
                             % (self.name, self.length))
        if isinstance(self.vocab_size, (tuple, list)):
            sizes = tuple(int(s) for s in self.vocab_size)
            if self.length is None or len(sizes) != self.length:
                raise ValueError("feature %r: a tuple vocab_size needs length == len(vocab_size), got "
                                 "length=%r and %d sizes" % (self.name, self.length, len(sizes)))
            object.__setattr__(self, "vocab_size", sizes)
        else:
            sizes = (int(self.vocab_size),)
            object.__setattr__(self, "vocab_size", sizes[0])
        if min(sizes) < 1:
            raise ValueError("feature %r: vocab sizes must be >= 1, got %r" % (self.name, self.vocab_size))

    @property
    def multi_hot(self) -> bool:
        """True for a ragged (variable number of ids per row) feature."""
        return self.length is None

    def to_dict(self) -> dict:
        """JSON-safe form."""
        size = list(self.vocab_size) if isinstance(self.vocab_size, tuple) else self.vocab_size
        return {"name": self.name, "vocab_size": size, "length": self.length}


@dataclasses.dataclass(frozen=True)
class Schema:
    """A float label, `num_dense` dense floats (feature `'dense'`) and the `sparse` id features."""

    sparse: Tuple[SparseFeature, ...]
    num_dense: int = 0

    def __post_init__(self):
        object.__setattr__(self, "sparse", tuple(self.sparse))
        names = [f.name for f in self.sparse]
        if len(set(names)) != len(names):
            raise ValueError("sparse feature names must be unique, got %s" % names)
        if int(self.num_dense) < 0:
            raise ValueError("num_dense must be >= 0, got %r" % self.num_dense)

    def feature(self, name: str) -> SparseFeature:
        """The sparse feature called `name`."""
        for f in self.sparse:
            if f.name == name:
                return f
        raise KeyError("schema has no sparse feature %r (has %s)" % (name, [f.name for f in self.sparse]))

    def vocab_sizes(self) -> dict:
        """{feature name: table size (int, or tuple of per-column sizes)}."""
        return {f.name: f.vocab_size for f in self.sparse}

    def parse_spec(self, ragged: bool = True) -> dict:
        """Feature spec for `tf.io.parse_example` (multi-hot as RaggedFeature, or VarLenFeature)."""
        spec = {"label": tf.io.FixedLenFeature([1], tf.float32)}
        if self.num_dense:
            spec["dense"] = tf.io.FixedLenFeature([self.num_dense], tf.float32)
        for f in self.sparse:
            if f.multi_hot:
                spec[f.name] = (tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64) if ragged
                                else tf.io.VarLenFeature(tf.int64))
            else:
                spec[f.name] = tf.io.FixedLenFeature([] if f.length == 1 else [f.length], tf.int64)
        return spec

    def to_dict(self) -> dict:
        """JSON-safe form (inverse of `Schema.from_dict`)."""
        return {"num_dense": int(self.num_dense), "sparse": [f.to_dict() for f in self.sparse]}

    @classmethod
    def from_dict(cls, d: dict) -> "Schema":
        """Schema from `to_dict` output; raises ValueError naming the bad field."""
        if not isinstance(d, dict) or "sparse" not in d or "num_dense" not in d:
            raise ValueError("schema must be a dict with keys 'num_dense' and 'sparse', got %r" % (d,))
        features = []
        for entry in d["sparse"]:
            if not isinstance(entry, dict) or set(entry) != {"name", "vocab_size", "length"}:
                raise ValueError("sparse feature entry must have keys name, vocab_size, length; "
                                 "got %r" % (entry,))
            size = entry["vocab_size"]
            features.append(SparseFeature(entry["name"], tuple(size) if isinstance(size, list) else size,
                                          entry["length"]))
        return cls(tuple(features), int(d["num_dense"]))
