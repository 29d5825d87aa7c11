"""TFRecord shards of `tf.train.Example`s for a `Schema`: a vectorized writer and a tf.data reader.

Writing: `encode_examples` serializes a whole batch of rows at once with NumPy, in the protobuf
wire format of `tf.train.Example` (each record parses to the same message `tf.train.Example`
would build), and `ShardWriter` spreads rows round-robin over `num_shards` files. A
`metadata.json` next to the shards records the schema (vocabulary sizes), the files of each
split and their row counts.

Reading: `make_dataset` lists the files (a recognizable file source, so tf.data AutoShard FILE
or DATA can act on it), interleaves `TFRecordDataset`s in parallel, batches the serialized
records first and then parses each batch with one `tf.io.parse_example`, and prefetches.
"""
import glob
import json
import os
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_nestpipe.data.schema import RaggedIds, Schema

METADATA_FILE = "metadata.json"
FORMAT = "tf_nestpipe.tfrecord.v1"
_ENCODE_CHUNK = 8192


# ----------------------------------------------------------------------------------- encoding
def _varint_len(x: np.ndarray) -> np.ndarray:
    """Bytes of the protobuf varint encoding of each non-negative value in `x`."""
    x = np.asarray(x, np.uint64)
    n = np.ones(x.shape, np.int64)
    for k in range(1, 10):
        n += x >= np.uint64(1 << (7 * k))
    return n


def _varint_bytes(x: np.ndarray):
    """Varint encoding of each value of `x` (int64 as two's complement) -> (bytes [..., w], mask)."""
    u = np.asarray(x).astype(np.int64).view(np.uint64)
    count = _varint_len(u)
    width = int(count.max()) if count.size else 1
    shifts = np.arange(width, dtype=np.uint64) * np.uint64(7)
    groups = (u[..., None] >> shifts) & np.uint64(0x7F)
    positions = np.arange(width)
    more = positions < (count[..., None] - 1)
    data = (groups | (more.astype(np.uint64) << np.uint64(7))).astype(np.uint8)
    return data, positions < count[..., None]


def _const(rows: int, raw: bytes):
    """A block of the same bytes in every row."""
    data = np.broadcast_to(np.frombuffer(raw, np.uint8)[None, :], (rows, len(raw)))
    return data, np.ones((rows, len(raw)), bool)


def _int_payload(feature, column, rows):
    """(data, mask, payload bytes per row, ids per row) of the packed varints of one id feature."""
    if feature.multi_hot:
        if not isinstance(column, RaggedIds):
            raise TypeError("multi-hot feature %r needs RaggedIds, got %s" % (feature.name, type(column)))
        splits = np.asarray(column.row_splits, np.int64)
        if splits.shape != (rows + 1,) or splits[0] != 0 or np.any(np.diff(splits) < 0) \
                or splits[-1] != len(column.values):
            raise ValueError("feature %r: row_splits must be [0, ..., len(values)] non-decreasing with "
                             "%d entries" % (feature.name, rows + 1))
        counts = np.diff(splits)
        width = int(counts.max()) if rows else 0
        ids = np.zeros((rows, width), np.int64)
        valid = np.arange(width)[None, :] < counts[:, None]
        ids[valid] = np.asarray(column.values, np.int64)
    else:
        ids = np.asarray(column)
        shape = (rows,) if feature.length == 1 else (rows, feature.length)
        if ids.shape != shape or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("feature %r: expected integer ids of shape %s, got %s %s"
                             % (feature.name, shape, ids.dtype, ids.shape))
        ids = ids.reshape(rows, -1).astype(np.int64)
        valid = np.ones(ids.shape, bool)
        counts = np.full(rows, ids.shape[1], np.int64)
    sizes = np.broadcast_to(np.asarray(feature.vocab_size, np.int64), ids.shape[1:]) \
        if not feature.multi_hot else np.int64(feature.vocab_size)
    bad = valid & ((ids < 0) | (ids >= sizes))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError("feature %r: id %d in row %d is outside [0, %s); map ids into the vocabulary "
                         "(0 may be the OOV id) before writing"
                         % (feature.name, ids[r, c], r, sizes if np.ndim(sizes) == 0 else sizes[c]))
    data, mask = _varint_bytes(ids)
    mask &= valid[..., None]
    data, mask = data.reshape(rows, -1), mask.reshape(rows, -1)
    return data, mask, mask.sum(1), counts


def _float_payload(name, column, rows, width):
    """(data, mask, payload bytes per row, values per row) of a packed float32 feature."""
    values = np.asarray(column, np.float32).reshape(rows, -1) if rows else np.zeros((0, width), np.float32)
    if values.shape != (rows, width):
        raise ValueError("feature %r: expected %d floats per row, got shape %s"
                         % (name, width, np.asarray(column).shape))
    data = np.ascontiguousarray(values.astype("<f4")).view(np.uint8).reshape(rows, 4 * width)
    return data, np.ones(data.shape, bool), np.full(rows, 4 * width), np.full(rows, width)


def _feature_blocks(name, tag, payload, rows):
    """Blocks of one `features.feature` map entry and its byte length per row."""
    data, mask, plen, count = payload
    present = count > 0
    inner = np.where(present, 1 + _varint_len(plen) + plen, 0)  # packed field 1 of the *List
    flen = 1 + _varint_len(inner) + inner                        # Feature{tag: *List}
    key = name.encode()
    entry = 1 + _varint_len(len(key)) + len(key) + 1 + _varint_len(flen) + flen
    blocks = [_const(rows, b"\x0a"), _varint_bytes(entry),
              _const(rows, b"\x0a" + bytes([len(key)]) + key + b"\x12"), _varint_bytes(flen),
              _const(rows, bytes([tag])), _varint_bytes(inner)]
    header, hmask = _const(rows, b"\x0a")
    blocks += [(header, hmask & present[:, None])]
    vd, vm = _varint_bytes(plen)
    blocks += [(vd, vm & present[:, None]), (data, mask)]
    return blocks, 1 + _varint_len(entry) + entry


def encode_examples(schema: Schema, features: Mapping, labels) -> list:
    """Serialized `tf.train.Example` bytes for each row of a batch of NumPy columns.

    `features` holds `'dense'` `[B, num_dense]` (if num_dense > 0) and one entry per sparse
    feature: int ids `[B]` / `[B, k]`, or `RaggedIds` for multi-hot; `labels` is `[B]` or `[B, 1]`.
    """
    labels = np.asarray(labels, np.float32).reshape(-1)
    for name, column in features.items():
        count = len(column.row_splits) - 1 if isinstance(column, RaggedIds) else len(column)
        if count != len(labels):
            raise ValueError("feature %r has %d rows but there are %d labels" % (name, count, len(labels)))
    out = []
    for start in range(0, len(labels), _ENCODE_CHUNK):
        stop = min(len(labels), start + _ENCODE_CHUNK)
        out.extend(_encode_chunk(schema, features, labels, start, stop))
    return out


def _slice(column, start, stop):
    """Rows [start, stop) of a NumPy column or RaggedIds."""
    if isinstance(column, RaggedIds):
        a, b = int(column.row_splits[start]), int(column.row_splits[stop])
        return RaggedIds(column.values[a:b], column.row_splits[start:stop + 1] - a)
    return np.asarray(column)[start:stop]


def _encode_chunk(schema, features, labels, start, stop):
    """`encode_examples` for rows [start, stop)."""
    rows = stop - start
    payloads = [("label", 0x12, _float_payload("label", labels[start:stop], rows, 1))]
    if schema.num_dense:
        if "dense" not in features:
            raise KeyError("features lack 'dense' (schema has num_dense=%d)" % schema.num_dense)
        payloads.append(("dense", 0x12, _float_payload(
            "dense", _slice(features["dense"], start, stop), rows, schema.num_dense)))
    for f in schema.sparse:
        if f.name not in features:
            raise KeyError("features lack sparse feature %r (have %s)" % (f.name, sorted(features)))
        payloads.append((f.name, 0x1A, _int_payload(f, _slice(features[f.name], start, stop), rows)))
    blocks, total = [], np.zeros(rows, np.int64)
    for name, tag, payload in payloads:
        if len(name.encode()) > 127:
            raise ValueError("feature name %r is longer than 127 bytes" % name)
        feature_blocks, length = _feature_blocks(name, tag, payload, rows)
        blocks += feature_blocks
        total += length
    blocks = [_const(rows, b"\x0a"), _varint_bytes(total)] + blocks
    data = np.concatenate([b[0] for b in blocks], axis=1)
    mask = np.concatenate([b[1] for b in blocks], axis=1)
    flat = data[mask].tobytes()
    ends = np.cumsum(mask.sum(1)).tolist()
    return [flat[a:b] for a, b in zip([0] + ends[:-1], ends)]


# ------------------------------------------------------------------------------------ writing
def shard_name(split: str, index: int, num_shards: int) -> str:
    """File name of shard `index` of `num_shards` of a split."""
    return "%s-%05d-of-%05d.tfrecord" % (split, index, num_shards)


class ShardWriter:
    """Writes examples of one split round-robin (global row r -> shard r mod n) into n TFRecord files."""

    def __init__(self, out_dir: str, split: str, num_shards: int, schema: Schema):
        if int(num_shards) < 1:
            raise ValueError("num_shards must be >= 1, got %r" % num_shards)
        os.makedirs(out_dir, exist_ok=True)
        self.schema = schema
        self.files = [shard_name(split, i, num_shards) for i in range(num_shards)]
        self._writers = [tf.io.TFRecordWriter(os.path.join(out_dir, f)) for f in self.files]
        self.rows_per_file = [0] * num_shards
        self.positives = 0
        self._next = 0

    def write(self, features: Mapping, labels) -> None:
        """Encodes and writes one batch of rows (same arguments as `encode_examples`)."""
        records = encode_examples(self.schema, features, labels)
        self.positives += int(np.sum(np.asarray(labels).reshape(-1) > 0.5))
        n = len(self._writers)
        for i, record in enumerate(records):
            shard = (self._next + i) % n
            self._writers[shard].write(record)
            self.rows_per_file[shard] += 1
        self._next += len(records)

    def close(self) -> dict:
        """Closes the files; returns {"files", "rows", "rows_per_file", "positives", "positive_rate"}."""
        for w in self._writers:
            w.close()
        rows = sum(self.rows_per_file)
        return {"files": list(self.files), "rows": rows, "rows_per_file": list(self.rows_per_file),
                "positives": self.positives,
                "positive_rate": round(self.positives / rows, 6) if rows else None}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for w in self._writers:
            w.close()


# ----------------------------------------------------------------------------------- metadata
def write_metadata(out_dir: str, metadata: dict) -> str:
    """Writes `metadata` (JSON-safe dict) to OUT_DIR/metadata.json atomically; returns the path."""
    path = os.path.join(out_dir, METADATA_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def dataset_metadata(name: str, schema: Schema, splits: dict, **extra) -> dict:
    """The metadata dict of a prepared data set: format, name, schema, vocab sizes, splits."""
    vocab = {k: (list(v) if isinstance(v, tuple) else v) for k, v in schema.vocab_sizes().items()}
    return dict(extra, format=FORMAT, dataset=name, schema=schema.to_dict(), vocab_sizes=vocab,
                splits=splits)


def load_metadata(out_dir: str) -> dict:
    """Reads OUT_DIR/metadata.json written by `python -m tf_nestpipe.data prepare`."""
    path = os.path.join(out_dir, METADATA_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError("%s not found; create the data set with `python -m tf_nestpipe.data "
                                "prepare ... --out %s`" % (path, out_dir))
    with open(path) as f:
        metadata = json.load(f)
    if metadata.get("format") != FORMAT:
        raise ValueError("%s has format %r, expected %r; re-run `python -m tf_nestpipe.data prepare`"
                         % (path, metadata.get("format"), FORMAT))
    return metadata


def schema_from_metadata(metadata: dict) -> Schema:
    """The `Schema` stored in a metadata dict."""
    return Schema.from_dict(metadata["schema"])


def split_files(out_dir: str, split: str = "train", metadata: Optional[dict] = None) -> list:
    """Paths of the shards of `split` listed in OUT_DIR/metadata.json."""
    metadata = metadata or load_metadata(out_dir)
    if split not in metadata["splits"]:
        raise KeyError("split %r not in %s (has %s)"
                       % (split, os.path.join(out_dir, METADATA_FILE), sorted(metadata["splits"])))
    return [os.path.join(out_dir, f) for f in metadata["splits"][split]["files"]]


# ------------------------------------------------------------------------------------ reading
def resolve_files(files: Union[str, Sequence[str]]) -> list:
    """A sorted glob match of a pattern string, or a list of paths (kept in order); all must exist."""
    if isinstance(files, (str, os.PathLike)):
        pattern = os.fspath(files)
        found = sorted(glob.glob(pattern))
        if not found:
            raise FileNotFoundError("no files match %r; create them with `python -m tf_nestpipe.data "
                                    "prepare`" % pattern)
        return found
    found = [os.fspath(f) for f in files]
    if not found:
        raise ValueError("the file list is empty")
    missing = [f for f in found if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError("input files do not exist: %s" % missing[:5])
    return found


def parse_batch(serialized: tf.Tensor, schema: Schema):
    """Parses a `[B]` string tensor of Examples -> (features, labels `[B, 1]` float32).

    Features: `'dense'` `[B, num_dense]` float32 (when num_dense > 0) and one int64 entry per
    sparse feature (`[B]`, `[B, k]`, or `tf.RaggedTensor` `[B, None]`).
    """
    parsed = tf.io.parse_example(serialized, schema.parse_spec(ragged=True))
    labels = parsed.pop("label")
    return parsed, labels


def make_dataset(files: Union[str, Sequence[str]], schema: Schema, batch_size: int,
                 shuffle: bool = False, seed: int = 0, shuffle_buffer: int = 16384,
                 num_epochs: Optional[int] = 1, drop_remainder: bool = False,
                 input_context: Optional[tf.distribute.InputContext] = None,
                 cycle_length: Optional[int] = None, block_size: int = 256,
                 deterministic: bool = True) -> tf.data.Dataset:
    """A dataset of (features, labels) batches read from TFRecord shards of `schema`.

    `files` is a glob pattern or a list of paths. The source is
    `Dataset.from_tensor_slices(files)` interleaved into `TFRecordDataset`s, so tf.data AutoShard
    can shard it by FILE or DATA; this function applies no sharding itself. With
    `input_context`, `batch_size` is the global batch and each replica gets
    `input_context.get_per_replica_batch_size(batch_size)`.

    Without `shuffle`, each file yields blocks of `block_size` serialized records (taken in turn
    from `cycle_length` files in parallel) that are rebatched to `batch_size`: per-record
    interleaving costs more than parsing small records. `shuffle` reshuffles the file order
    (seeded, so every worker sees the same order) and single records in a `shuffle_buffer`
    each epoch. Every batch is parsed by one `tf.io.parse_example`; `num_epochs=None` repeats
    forever.
    """
    paths = resolve_files(files)
    if input_context is not None:
        batch_size = input_context.get_per_replica_batch_size(batch_size)
    if int(batch_size) < 1 or int(block_size) < 1:
        raise ValueError("batch_size and block_size must be >= 1, got %r and %r" % (batch_size, block_size))
    names = tf.data.Dataset.from_tensor_slices(paths)
    if shuffle:
        names = names.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)
    if num_epochs != 1:
        names = names.repeat(num_epochs)
    block = 1 if shuffle else int(block_size)

    def read(path):
        records = tf.data.TFRecordDataset(path, buffer_size=1 << 20)
        return records if shuffle else records.batch(block)

    records = names.interleave(read, cycle_length=cycle_length or min(len(paths), 8), block_length=1,
                               num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    if shuffle:
        batches = records.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True).batch(
            int(batch_size), drop_remainder=drop_remainder)
    else:
        batches = records.rebatch(int(batch_size), drop_remainder=drop_remainder)
    parsed = batches.map(lambda s: parse_batch(s, schema), num_parallel_calls=tf.data.AUTOTUNE,
                         deterministic=deterministic)
    return parsed.prefetch(tf.data.AUTOTUNE)
