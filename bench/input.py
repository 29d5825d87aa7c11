"""Input pipeline throughput: our TFRecord reader vs a plain tf.data parse of the same files.

    python bench/input.py [--rows 400000] [--shards 8] [--batch 4096] [--rounds 3] [--movielens DIR]

Writes synthetic shards for two schemas (Criteo-like: 13 dense + 'sparse' [26]; multi-hot: 13
dense + 20 single-hot + 6 ragged tables), plus the train split of a data set made by
`python -m tf_nestpipe.data prepare movielens-1m --out DIR` if --movielens DIR is given, then
reads every file set once per round with
  plain    TFRecordDataset(files) -> map(parse_example per record, VarLenFeature) -> batch
           -> map(RaggedTensor.from_sparse)
  batched  TFRecordDataset(files) -> batch -> map(parse_example, VarLenFeature -> ragged)
  ours     tf_nestpipe.data.make_dataset (parallel interleave over files, batch first, one
           parse_example with RaggedFeature, parallel map, prefetch)
and reports median records/s. Also times the generators, the Criteo TSV writer/reader and the
TFRecord writer. Writes bench/results/input.md.
"""
import argparse
import os
import statistics
import tempfile
import time

import tensorflow as tf
from runner import write_result

from tf_nestpipe.data import (SyntheticClickLog, criteo_kaggle_table_sizes, format_criteo_tsv,
                              make_dataset, read_criteo_tsv, write_synthetic_tfrecords)
from tf_nestpipe.data.tfrecord import load_metadata, schema_from_metadata, split_files


def plain_dataset(files, schema, batch_size):
    """The usual first attempt: parse each record, batch, turn VarLen sparse into ragged."""
    spec = schema.parse_spec(ragged=False)
    ragged = [f.name for f in schema.sparse if f.multi_hot]

    def to_ragged(features):
        features = dict(features)
        labels = features.pop("label")
        for name in ragged:
            features[name] = tf.RaggedTensor.from_sparse(features[name])
        return features, labels

    return (tf.data.TFRecordDataset(files).map(lambda r: tf.io.parse_example(r, spec))
            .batch(batch_size).map(to_ragged))


def batched_dataset(files, schema, batch_size):
    """Batch first, then one parse_example per batch; sequential, no prefetch."""
    spec = schema.parse_spec(ragged=False)
    ragged = [f.name for f in schema.sparse if f.multi_hot]

    def parse(serialized):
        features = tf.io.parse_example(serialized, spec)
        labels = features.pop("label")
        for name in ragged:
            features[name] = tf.RaggedTensor.from_sparse(features[name])
        return features, labels

    return tf.data.TFRecordDataset(files).batch(batch_size).map(parse)


def records_per_second(dataset):
    """Reads one epoch; returns (records, records/s)."""
    start, n = time.perf_counter(), 0
    for _, labels in dataset:
        n += int(labels.shape[0])
    return n, n / (time.perf_counter() - start)


def rate(fn, rows):
    """rows/s of fn() (best of 3)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return rows / best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--movielens", default=None, help="a prepared MovieLens directory to read too")
    args = parser.parse_args()
    sizes = criteo_kaggle_table_sizes(0.01)
    logs = {"criteo-like (13 dense, sparse [26])": SyntheticClickLog(sizes, seed=1),
            "multi-hot (13 dense, 20 single-hot, 6 ragged of 1-8 ids)":
                SyntheticClickLog(sizes, seed=1, multi_hot=(8,) * 6 + (1,) * 20)}
    reader_lines, generator_rates, write_rates = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        readers = {}
        for i, (name, log) in enumerate(logs.items()):
            out = os.path.join(tmp, str(i))
            start = time.perf_counter()
            metadata = write_synthetic_tfrecords(log, out, args.rows, args.shards)
            write_rates.append(("generate + encode + write %d TFRecord shards, %s" % (args.shards, name),
                                args.rows / (time.perf_counter() - start)))
            files = split_files(out, "train", metadata)
            size = sum(os.path.getsize(f) for f in files)
            readers[name] = (files, log.schema(), size, args.rows)
        if args.movielens:
            metadata = load_metadata(args.movielens)
            files = split_files(args.movielens, "train", metadata)
            readers["%s train split (7 single-hot, genres ragged)" % metadata["dataset"]] = (
                files, schema_from_metadata(metadata), sum(os.path.getsize(f) for f in files),
                metadata["splits"]["train"]["rows"])
        results = {(name, kind): [] for name in readers for kind in ("plain", "batched", "ours")}
        for _ in range(args.rounds):
            for name, (files, schema, _, rows) in readers.items():
                for kind, build in (("plain", plain_dataset), ("batched", batched_dataset),
                                    ("ours", lambda f, s, b: make_dataset(f, s, b))):
                    count, speed = records_per_second(build(files, schema, args.batch))
                    assert count == rows, (kind, count)
                    results[(name, kind)].append(speed)
                    print(name, kind, "%.0f records/s" % speed, flush=True)
        for name, (_, _, size, rows) in readers.items():
            plain, batched, ours = (statistics.median(results[(name, k)])
                                    for k in ("plain", "batched", "ours"))
            reader_lines.append("| %s | %.0f | %s | %s | %s | %.2fx | %.2fx |" % (
                name, size / rows, _k(plain), _k(batched), _k(ours), ours / plain, ours / batched))

    chunk, chunks = 65536, 16   # the batch size the writers use
    n = chunk * chunks
    plain_log = SyntheticClickLog(criteo_kaggle_table_sizes(1.0), seed=0)
    multi_log = SyntheticClickLog(criteo_kaggle_table_sizes(1.0), seed=0, multi_hot=(8,) * 6 + (1,) * 20)
    for label, fn in (
            ("SyntheticClickLog.batch (26 tables, numpy Generator.zipf)", plain_log.batch),
            ("SyntheticClickLog.example_batch, 6 multi-hot tables of 1-8 ids", multi_log.example_batch),
            ("SyntheticClickLog.criteo_rows (power-law ids, hashing, empty fields)", plain_log.criteo_rows)):
        generator_rates.append(("%s, %d batches of %d rows" % (label, chunks, chunk),
                                rate(lambda: [fn(i, chunk) for i in range(chunks)], n)))
    rows = plain_log.criteo_rows(0, chunk)
    write_rates.append(("format_criteo_tsv, %d rows" % chunk, rate(lambda: format_criteo_tsv(rows), chunk)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "day_0")
        with open(path, "wb") as f:
            for index in range(chunks):
                f.write(format_criteo_tsv(plain_log.criteo_rows(index, chunk)))
        write_rates.append(("read_criteo_tsv (parse + DLRM preprocessing), %d rows" % n,
                            rate(lambda: list(read_criteo_tsv(path, criteo_kaggle_table_sizes(1.0))), n)))

    text = "\n".join([
        "# Input pipeline: records/s of our TFRecord reader vs plain tf.data", "",
        "Command: `python bench/input.py --rows %d --shards %d --batch %d --rounds %d%s`"
        % (args.rows, args.shards, args.batch, args.rounds,
           " --movielens %s" % args.movielens if args.movielens else ""), "",
        "Same files for every reader: %d synthetic rows in %d TFRecord shards (Criteo Kaggle table "
        "sizes x 0.01)%s. Median of %d interleaved epochs, records/s, on this machine's %d CPU cores "
        "(shared with other work: absolute numbers are noisy, ratios less so). TF %s, %s." % (
            args.rows, args.shards, " and the MovieLens train shards (written by `python -m "
            "tf_nestpipe.data prepare movielens-1m --out %s`)" % args.movielens if args.movielens else "",
            args.rounds, os.cpu_count(), tf.__version__, time.strftime("%Y-%m-%d")),
        "",
        "- plain: `TFRecordDataset(files).map(parse_example per record, VarLenFeature).batch(B)"
        ".map(RaggedTensor.from_sparse)`",
        "- batched: `TFRecordDataset(files).batch(B).map(parse_example, VarLenFeature -> ragged)` "
        "(sequential, no prefetch)",
        "- ours: `tf_nestpipe.data.make_dataset(files, schema, B)`: from_tensor_slices(files) -> "
        "parallel interleave of TFRecordDataset read in blocks of 256 records -> rebatch(B) -> "
        "parallel map(one parse_example per batch, RaggedFeature) -> prefetch",
        "",
        "| data (batch %d) | bytes/record | plain (rec/s) | batched (rec/s) | ours (rec/s) "
        "| ours / plain | ours / batched |" % args.batch,
        "|---|---|---|---|---|---|---|"] + reader_lines + [
        "", "## Writers and generators (rows/s, best of 3)", "",
        "| step | rows/s |", "|---|---|"]
        + ["| %s | %s |" % (k, _k(v)) for k, v in generator_rates + write_rates]) + "\n"
    write_result("input.md", text)


def _k(x):
    """12345.6 -> '12.3k'."""
    return "%.2fM" % (x / 1e6) if x >= 1e6 else "%.1fk" % (x / 1e3)


if __name__ == "__main__":
    main()
