"""Prepares TFRecord data sets: `python -m tf_nestpipe.data prepare NAME --out DIR [--shards N]`.

    python -m tf_nestpipe.data prepare movielens-1m --out DIR [--shards 4] [--test-fraction 0.1]
    python -m tf_nestpipe.data prepare movielens-100k --out DIR
    python -m tf_nestpipe.data prepare criteo --input day_0 [...] --out DIR [--test-input day_23]
        [--table-scale 1.0 | --table-sizes N x 26]
    python -m tf_nestpipe.data prepare synthetic --out DIR [--rows N] [--test-rows N]
        [--table-scale S] [--zipf A] [--seed S] [--multi-hot H x 26] [--format tfrecord|criteo-tsv]

Writes the shards and metadata.json (schema with vocab sizes, files, row counts) into DIR and
shows a progress bar on stderr.
"""
import argparse
import os
import sys
import time

from tf_nestpipe.data import criteo, movielens, synthetic

DATASETS = ("movielens-100k", "movielens-1m", "criteo", "synthetic")


class ProgressBar:
    """A one-line progress bar on a stream (stderr): a redrawn line on a terminal, otherwise a
    line at every 10%."""

    def __init__(self, label: str, unit: str, stream=None, width: int = 30):
        self.label, self.unit, self.width = label, unit, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.time()
        self._last_draw, self._last_decile, self._shown = 0.0, -1, False

    def __call__(self, done: int, total: int) -> None:
        now = time.time()
        fraction = min(1.0, done / total) if total else 1.0
        decile = int(fraction * 10)
        if self.tty and now - self._last_draw < 0.1 and fraction < 1.0:
            return
        if not self.tty and decile == self._last_decile:
            return
        self._last_draw, self._last_decile, self._shown = now, decile, True
        filled = int(fraction * self.width)
        line = "%s [%s%s] %5.1f%% %s/%s %s %.1fs" % (
            self.label, "#" * filled, "-" * (self.width - filled), 100 * fraction,
            _human(done), _human(total), self.unit, now - self.start)
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        """Ends the redrawn line."""
        if self.tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()


def _human(n: int) -> str:
    """1234567 -> '1.23M'."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return "%.2f%s" % (n / scale, suffix)
    return str(int(n))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tf_nestpipe.data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="convert a data set to TFRecord shards")
    prepare.add_argument("dataset", choices=DATASETS)
    prepare.add_argument("--out", required=True, help="output directory")
    prepare.add_argument("--shards", type=int, default=4, help="files per split (default 4)")
    prepare.add_argument("--test-fraction", type=float, default=0.1,
                         help="movielens: newest fraction of ratings in the test split")
    prepare.add_argument("--input", nargs="+", default=[], help="criteo: TSV files of the train split")
    prepare.add_argument("--test-input", nargs="+", default=[], help="criteo: TSV files of the test split")
    prepare.add_argument("--table-scale", type=float, default=None,
                         help="criteo/synthetic: Criteo Kaggle table sizes times this factor "
                              "(default 1.0 for criteo, 0.001 for synthetic)")
    prepare.add_argument("--table-sizes", type=int, nargs="+", default=None, metavar="N",
                         help="criteo/synthetic: the 26 table sizes (instead of --table-scale)")
    prepare.add_argument("--rows", type=int, default=1_000_000, help="synthetic: train rows")
    prepare.add_argument("--test-rows", type=int, default=0, help="synthetic: test rows")
    prepare.add_argument("--zipf", type=float, default=1.2, help="synthetic: Zipf exponent (> 1)")
    prepare.add_argument("--seed", type=int, default=0, help="synthetic: seed")
    prepare.add_argument("--multi-hot", type=int, nargs="+", default=None, metavar="H",
                         help="synthetic: most ids per row of each of the 26 tables")
    prepare.add_argument("--format", choices=("tfrecord", "criteo-tsv"), default="tfrecord",
                         help="synthetic: TFRecord shards, or Criteo TSV files (train.tsv, test.tsv)")
    return parser


def _check(parser, args) -> None:
    """Rejects options that do not apply to the chosen data set."""
    if args.shards < 1:
        parser.error("--shards must be >= 1")
    if args.dataset == "criteo" and not args.input:
        parser.error("criteo needs --input with the Criteo TSV files (e.g. train.txt or day_0)")
    if args.dataset != "criteo" and (args.input or args.test_input):
        parser.error("--input/--test-input only apply to criteo")
    for flag, values in (("--table-sizes", args.table_sizes), ("--multi-hot", args.multi_hot)):
        if values is not None and len(values) != 26:
            parser.error("%s needs 26 values (one per Criteo table), got %d" % (flag, len(values)))
    if args.table_scale is not None and args.table_sizes is not None:
        parser.error("give --table-scale or --table-sizes, not both")
    if args.dataset != "synthetic" and (args.multi_hot or args.format != "tfrecord"):
        parser.error("--multi-hot/--format only apply to synthetic")
    if args.dataset == "synthetic" and args.format == "criteo-tsv" and args.multi_hot:
        parser.error("the Criteo TSV format has single-hot categoricals; drop --multi-hot")


def _table_sizes(args, default_scale):
    """The 26 table sizes from --table-sizes or --table-scale."""
    if args.table_sizes is not None:
        return tuple(args.table_sizes)
    scale = default_scale if args.table_scale is None else args.table_scale
    return synthetic.criteo_kaggle_table_sizes(scale)


def _prepare(args, progress) -> str:
    """Runs the converter of args.dataset; returns a one-line summary."""
    if args.dataset.startswith("movielens"):
        metadata = movielens.prepare_movielens(args.dataset, args.out, args.shards, args.test_fraction,
                                               progress=progress)
    elif args.dataset == "criteo":
        metadata = criteo.convert_criteo(args.input, args.out, args.shards, _table_sizes(args, 1.0),
                                         args.test_input, progress=progress)
    else:
        log = synthetic.SyntheticClickLog(_table_sizes(args, 0.001), zipf_exponent=args.zipf,
                                          seed=args.seed, multi_hot=tuple(args.multi_hot or ()))
        if args.format == "criteo-tsv":
            os.makedirs(args.out, exist_ok=True)
            written = []
            for name, rows, first in (("train.tsv", args.rows, 0),
                                      ("test.tsv", args.test_rows, -(-args.rows // 65536))):
                if rows > 0:
                    path = os.path.join(args.out, name)
                    criteo.write_criteo_tsv(path, log, rows, first_batch=first, progress=progress)
                    written.append("%s (%d rows)" % (path, rows))
            return "wrote " + ", ".join(written)
        metadata = synthetic.write_synthetic_tfrecords(log, args.out, args.rows, args.shards,
                                                       args.test_rows, progress=progress)
    parts = ["%s: %d rows, positive rate %s" % (split, info["rows"], info["positive_rate"])
             for split, info in metadata["splits"].items()]
    return "wrote %s to %s (%s); vocab sizes %s" % (
        metadata["dataset"], args.out, "; ".join(parts), metadata["vocab_sizes"])


def main(argv=None) -> int:
    """Command-line entry point."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    unit = "bytes" if args.dataset == "criteo" else "rows"
    progress = ProgressBar("prepare %s" % args.dataset, unit)
    start = time.time()
    try:
        summary = _prepare(args, progress)
    except (OSError, ValueError, RuntimeError) as e:
        progress.close()
        print("error: %s" % e, file=sys.stderr)
        return 1
    progress.close()
    print("%s in %.1fs" % (summary, time.time() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
