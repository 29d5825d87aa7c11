"""Criteo Kaggle / 1TB click logs: the TSV format, DLRM preprocessing, conversion to TFRecord.

A line is `label \\t I1..I13 \\t C1..C26`: label 0/1, 13 integer counts (may be empty or
negative), 26 categorical values hashed to 8 hex digits (may be empty). DLRM preprocessing:
dense = log(max(x, 0) + 1) with empty -> 0; categorical = int(hex, 16) mod table_sizes[f] with
empty -> 0. With `raw_ids=True` (for `tnp.DynamicEmbedding` tables, no fixed vocabulary) the
categorical values keep their raw hash instead: int(hex, 16) as int64 (a hash of 16 hex digits
above 2^63 - 1 wraps to a negative int64, two's complement) and empty -> `EMPTY_ID` (-1, which
no 8-digit Criteo hash can be; a 16-digit hash of all f's reads alike). Parsing and formatting are vectorized over chunks of lines with
NumPy; a malformed line raises ValueError naming FILE:LINE and the column.
"""
import os
import time
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from tf_nestpipe.data.schema import Schema, SparseFeature
from tf_nestpipe.data.synthetic import CriteoRows, SyntheticClickLog, criteo_kaggle_table_sizes
from tf_nestpipe.data.tfrecord import ShardWriter, dataset_metadata, write_metadata

NUM_INTEGER = 13
NUM_CATEGORICAL = 26
COLUMNS = ("label",) + tuple("I%d" % i for i in range(1, 14)) + tuple("C%d" % i for i in range(1, 27))
_MAX_DIGITS = 18   # longest integer field accepted (fits int64)
_MAX_HEX = 16      # longest categorical field accepted (fits uint64)
EMPTY_ID = -1      # the raw id of an empty categorical field (raw_ids=True)
_HEX_VALUE = np.full(256, -1, np.int8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_VALUE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_VALUE[_c] = 10 + _i
# Two hex characters of every byte value, and four decimal characters of every value < 10000.
_HEX_PAIRS = np.frombuffer(b"".join(b"%02x" % i for i in range(256)), np.uint16)
_DIGITS4 = np.frombuffer(b"".join(b"%04d" % i for i in range(10000)), np.uint8).reshape(10000, 4)


def criteo_schema(table_sizes: Sequence[int]) -> Schema:
    """Schema of converted Criteo data: 'dense' [B, 13] and 'sparse' [B, 26] (one table per column)."""
    sizes = tuple(int(s) for s in table_sizes)
    if len(sizes) != NUM_CATEGORICAL:
        raise ValueError("Criteo needs %d table sizes, got %d" % (NUM_CATEGORICAL, len(sizes)))
    return Schema((SparseFeature("sparse", sizes, NUM_CATEGORICAL),), NUM_INTEGER)


# ------------------------------------------------------------------------------------- format
def format_criteo_tsv(rows: CriteoRows) -> bytes:
    """The TSV bytes of `rows` (one line each, LF-terminated), exactly as in the Criteo files."""
    labels = np.asarray(rows.labels, np.int64)
    n = len(labels)
    integers, integers_mask = _decimal_fields(rows.integers, rows.integers_missing)
    hexes, hexes_mask = _hex_fields(rows.categorical, rows.categorical_missing)
    data = np.concatenate([(labels + ord("0")).astype(np.uint8)[:, None], integers, hexes,
                           np.full((n, 1), 10, np.uint8)], axis=1)
    mask = np.concatenate([np.ones((n, 1), bool), integers_mask, hexes_mask, np.ones((n, 1), bool)],
                          axis=1)
    return data[mask].tobytes()


def _decimal_fields(values, missing):
    """[B, F * (1 + w)] bytes: a tab then the right-aligned decimal (with '-') of each value."""
    values = np.asarray(values, np.int64)
    magnitude = np.abs(values)
    digits = np.ones(values.shape, np.int64)
    for k in range(1, _MAX_DIGITS + 1):
        digits += magnitude >= 10 ** k
    groups = -(-int((digits + (values < 0)).max()) // 4) if values.size else 1
    width = 4 * groups
    data = np.empty(values.shape + (1 + width,), np.uint8)
    data[..., 0] = 9
    for g in range(groups):   # four digits at a time, from the right
        magnitude, part = np.divmod(magnitude, 10000)
        data[..., width - 4 * g - 3:width - 4 * g + 1] = _DIGITS4[part]
    position = np.arange(1, width + 1)
    first = (1 + width - digits)[..., None]
    sign = (values < 0)[..., None] & (position == first - 1)
    data[..., 1:][sign] = ord("-")
    mask = np.empty(data.shape, bool)
    mask[..., 0] = True
    mask[..., 1:] = ((position >= first) | sign) & ~np.asarray(missing, bool)[..., None]
    return data.reshape(len(values), -1), mask.reshape(len(values), -1)


def _hex_fields(values, missing):
    """[B, F * 9] bytes: a tab then the 8 lowercase hex digits of each 32-bit value."""
    octets = np.asarray(values, np.int64).astype(">u4")[..., None].view(np.uint8)   # [B, F, 4]
    data = np.empty(octets.shape[:-1] + (9,), np.uint8)
    data[..., 0] = 9
    data[..., 1:] = _HEX_PAIRS[octets].view(np.uint8).reshape(octets.shape[:-1] + (8,))
    mask = np.empty(data.shape, bool)
    mask[..., 0] = True
    mask[..., 1:] = ~np.asarray(missing, bool)[..., None]
    return data.reshape(len(octets), -1), mask.reshape(len(octets), -1)


def write_criteo_tsv(path: str, log: SyntheticClickLog, num_rows: int, batch_size: int = 65536,
                     first_batch: int = 0, progress: Optional[Callable[[int, int], None]] = None) -> int:
    """Writes `num_rows` synthetic rows (`log.criteo_rows` batches first_batch, first_batch + 1,
    ...) to a Criteo TSV file; returns the number of rows written."""
    written = 0
    with open(path, "wb") as f:
        for offset in range(-(-int(num_rows) // batch_size)):
            rows = log.criteo_rows(first_batch + offset, min(batch_size, num_rows - written))
            f.write(format_criteo_tsv(rows))
            written += len(rows.labels)
            if progress:
                progress(written, num_rows)
    return written


# -------------------------------------------------------------------------------------- parse
def read_criteo_tsv(path: str, table_sizes: Optional[Sequence[int]] = None,
                    chunk_bytes: int = 1 << 22, raw_ids: bool = False) -> Iterator[tuple]:
    """Yields (features, labels) NumPy batches of one Criteo TSV file after DLRM preprocessing.

    features = {'dense': [B, 13] float32, 'sparse': [B, 26] int64}; labels [B] float32.
    'sparse' holds the hashes mod `table_sizes` (26 sizes), or with `raw_ids=True` (then
    `table_sizes` must be None) the raw hashes as int64 ids, empty -> `EMPTY_ID` (see module).
    """
    for features, labels, _ in _read_with_position(path, table_sizes, chunk_bytes, raw_ids):
        yield features, labels


def _sparse_moduli(table_sizes, raw_ids):
    """The 26 table sizes as int64 (None for raw ids); a wrong combination is refused."""
    if raw_ids:
        if table_sizes is not None:
            raise ValueError("read_criteo_tsv: raw_ids=True keeps the raw hashes (no table "
                             "sizes); pass table_sizes=None, or raw_ids=False to fold the "
                             "hashes into the table sizes")
        return None
    if table_sizes is None:
        raise ValueError("read_criteo_tsv needs the 26 table_sizes (e.g. "
                         "criteo_kaggle_table_sizes(1.0)), or raw_ids=True for the raw hashes "
                         "(tnp.DynamicEmbedding tables)")
    return np.asarray(criteo_schema(table_sizes).feature("sparse").vocab_size, np.int64)


def _read_with_position(path, table_sizes, chunk_bytes=1 << 22, raw_ids=False):
    """`read_criteo_tsv` batches with the number of bytes of the file consumed so far."""
    sizes = _sparse_moduli(table_sizes, raw_ids)
    if not os.path.exists(path):
        raise FileNotFoundError("Criteo input file %s does not exist" % path)
    line_base, consumed, rest = 0, 0, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            data = rest + block
            if not block:
                if data:
                    features, labels = _parse_lines(data + b"\n", path, line_base, sizes)
                    yield features, labels, consumed + len(data)
                return
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            if cut:
                features, labels = _parse_lines(data[:cut], path, line_base, sizes)
                line_base += len(labels)
                consumed += cut
                yield features, labels, consumed


def _parse_lines(chunk: bytes, path: str, line_base: int, sizes: Optional[np.ndarray]):
    """Parses complete LF-terminated lines; `line_base` lines of the file precede the chunk.
    `sizes` None: the categorical values stay raw hashes (see module)."""
    arr = np.frombuffer(chunk, np.uint8)
    ends = np.flatnonzero(arr == 10)
    starts = np.concatenate([[0], ends[:-1] + 1])
    tabs = np.flatnonzero(arr == 9)
    per_line = np.diff(np.searchsorted(tabs, np.concatenate([[-1], ends])))
    wrong = np.flatnonzero(per_line != len(COLUMNS) - 1)
    if len(wrong):
        i = wrong[0]
        raise ValueError("%s:%d: expected %d tab-separated fields (label, I1-I13, C1-C26), got %d: %r"
                         % (path, line_base + i + 1, len(COLUMNS), per_line[i] + 1,
                            _line_text(chunk, starts[i], ends[i])))
    line_ends = ends - (arr[np.maximum(ends - 1, 0)] == 13)   # tolerate CRLF
    tabs = tabs.reshape(len(ends), len(COLUMNS) - 1)
    field_start = np.concatenate([starts[:, None], tabs + 1], axis=1)
    field_end = np.concatenate([tabs, line_ends[:, None]], axis=1)

    def fail(line, column, reason):
        a, b = field_start[line, column], field_end[line, column]
        raise ValueError("%s:%d: column %s %s: %r" % (path, line_base + line + 1, COLUMNS[column],
                                                      reason, chunk[a:b].decode("latin-1")))

    label_ok = (field_end[:, 0] - field_start[:, 0] == 1) & np.isin(arr[field_start[:, 0]], (48, 49))
    if not label_ok.all():
        fail(int(np.flatnonzero(~label_ok)[0]), 0, "must be 0 or 1")
    labels = (arr[field_start[:, 0]] - 48).astype(np.float32)
    integers, bad = _parse_decimal(arr, field_start[:, 1:14], field_end[:, 1:14])
    if bad is not None:
        fail(bad[0], 1 + bad[1], "is not an integer of at most %d digits" % _MAX_DIGITS)
    hashed, present, bad = _parse_hex(arr, field_start[:, 14:], field_end[:, 14:])
    if bad is not None:
        fail(bad[0], 14 + bad[1], "is not a hex string of at most %d digits" % _MAX_HEX)
    dense = np.log1p(np.maximum(integers, 0).astype(np.float64)).astype(np.float32)
    if sizes is None:
        sparse = np.where(present, hashed.view(np.int64), EMPTY_ID)
    else:
        sparse = np.where(present, (hashed % sizes.astype(np.uint64)[None, :]).astype(np.int64),
                          0)
    return {"dense": dense, "sparse": sparse}, labels


def _line_text(chunk, start, end, limit=200):
    """The text of one line for an error message (truncated)."""
    return chunk[start:min(end, start + limit)].decode("latin-1")


def _gather(arr, start, end, width):
    """[L, F, width] right-aligned characters of each field, '0' left of shorter fields."""
    idx = end[..., None].astype(np.int32) - width + np.arange(width, dtype=np.int32)
    chars = arr.take(idx, mode="clip")
    return np.where(idx >= start[..., None], chars, np.uint8(ord("0")))


def _parse_decimal(arr, start, end):
    """Integers of decimal fields (empty -> 0); returns (values, (line, column) of a bad field | None)."""
    length = end - start
    width = max(1, int(length.max()) if length.size else 1)
    if width > _MAX_DIGITS + 1:
        return None, tuple(np.argwhere(length > _MAX_DIGITS + 1)[0])
    chars = _gather(arr, start, end, width)
    negative = (length > 1) & (arr.take(start, mode="clip") == ord("-"))
    if negative.any():
        chars[negative[..., None] & (np.arange(width) == (width - length)[..., None])] = ord("0")
    digits = chars - np.uint8(ord("0"))   # wraps non-digits to values > 9
    ok = (digits <= 9).all(-1) & (length - negative <= _MAX_DIGITS)
    if not ok.all():
        return None, tuple(np.argwhere(~ok)[0])
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    values = digits.astype(np.int64) @ powers
    return np.where(negative, -values, values), None


def _parse_hex(arr, start, end):
    """uint64 of hex fields; returns (values, present mask, (line, column) of a bad field | None)."""
    length = end - start
    longest = int(length.max()) if length.size else 0
    if longest > _MAX_HEX:
        return None, None, tuple(np.argwhere(length > _MAX_HEX)[0])
    width = 8 if longest <= 8 else 16
    nibbles = _HEX_VALUE[_gather(arr, start, end, width)]
    ok = (nibbles >= 0).all(-1)
    if not ok.all():
        return None, None, tuple(np.argwhere(~ok)[0])
    octets = np.ascontiguousarray((nibbles[..., 0::2] << 4) | nibbles[..., 1::2])
    values = octets.view(">u4" if width == 8 else ">u8")[..., 0].astype(np.uint64)
    return values, length > 0, None


# ------------------------------------------------------------------------------------ convert
def convert_criteo(input_files: Sequence[str], out_dir: str, shards: int = 8,
                   table_sizes: Optional[Sequence[int]] = None, test_files: Sequence[str] = (),
                   progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """Converts Criteo TSV files to TFRecord shards ('train' from `input_files`, 'test' from
    `test_files`) plus metadata.json; returns the metadata. `table_sizes` defaults to
    `criteo_kaggle_table_sizes(1.0)`; `progress(bytes_done, bytes_total)` is called as it goes."""
    sizes = tuple(table_sizes) if table_sizes is not None else criteo_kaggle_table_sizes(1.0)
    schema = criteo_schema(sizes)
    inputs = {"train": list(input_files), "test": list(test_files)}
    missing = [p for files in inputs.values() for p in files if not os.path.exists(p)]
    if not inputs["train"] or missing:
        raise FileNotFoundError("Criteo input files missing: %s" % (missing or "no --input given"))
    total = sum(os.path.getsize(p) for files in inputs.values() for p in files)
    done, start, splits = 0, time.time(), {}
    for split, files in inputs.items():
        if not files:
            continue
        with ShardWriter(out_dir, split, shards, schema) as writer:
            for path in files:
                for features, labels, position in _read_with_position(path, sizes):
                    writer.write(features, labels)
                    if progress:
                        progress(done + position, total)
                done += os.path.getsize(path)
            splits[split] = writer.close()
            splits[split]["sources"] = [os.path.abspath(p) for p in files]
    metadata = dataset_metadata(
        "criteo", schema, splits, seconds=round(time.time() - start, 2),
        preprocessing="dense = log(max(x, 0) + 1), empty -> 0; sparse = int(hex, 16) mod "
                      "vocab_size, empty -> 0")
    write_metadata(out_dir, metadata)
    return metadata
