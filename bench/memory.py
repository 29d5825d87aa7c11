"""Peak memory per worker of a 1 GiB table with Adagrad: 2 workers vs one process.

    python bench/memory.py [--rows 4194304 --dim 64]

Writes bench/results/memory.md.
"""
import argparse
import os
import time

from runner import HERE, run_program, write_result


def run(workers, args):
    return run_program([os.path.join(HERE, "memory_worker.py"), "--rows", str(args.rows),
                        "--dim", str(args.dim)], workers=workers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4 << 20)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    single, two = run(1, args), run(2, args)
    gib = float(1 << 30)
    ratio = two["peak_growth_bytes"] / single["peak_growth_bytes"]
    text = "\n".join([
        "# Peak memory per worker: %.2f GiB table + Adagrad accumulator" % (single["table_bytes"] / gib),
        "",
        "Command: `python bench/memory.py --rows %d --dim %d`" % (args.rows, args.dim),
        "",
        "Peak RSS growth of worker 0 from just before the table is built to after 3 Adagrad steps "
        "(ru_maxrss minus the RSS before; includes the initializer's temporaries). Date: %s."
        % time.strftime("%Y-%m-%d"),
        "",
        "| workers | rows held by worker 0 | peak growth (GiB) |",
        "|---|---|---|",
        "| 1 | %d | %.2f |" % (single["local_rows"], single["peak_growth_bytes"] / gib),
        "| 2 | %d | %.2f |" % (two["local_rows"], two["peak_growth_bytes"] / gib),
        "",
        "Per-worker peak on 2 workers / single process: **%.2f** (ideal 0.50)." % ratio,
    ]) + "\n"
    write_result("memory.md", text)


if __name__ == "__main__":
    main()
