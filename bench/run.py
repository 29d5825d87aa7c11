"""The one runner of the benchmarks: `python bench/run.py FAMILY [FAMILY ...]` regenerates
each family's results, bench/results/FAMILY.{md,json} (+ .png), overwriting them.

    python bench/run.py --list              # the families (bench/families.py) and what they measure
    python bench/run.py natural             # the README's table
    python bench/run.py natural --dry-run   # print the command only

Run from the repository root; the scripts use this checkout's tf_nestpipe. Timings on a shared
machine are unreliable: every side-by-side result records the load average and CPU steal of its
run next to its numbers.
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from families import FAMILIES  # noqa: E402  pylint: disable=wrong-import-position


def command(name):
    """The command line that regenerates family `name`.

    Raises:
        KeyError: No such family; the message lists them.
    """
    if name not in FAMILIES:
        raise KeyError("unknown benchmark family %r; the families are %s"
                       % (name, ", ".join(sorted(FAMILIES))))
    family = FAMILIES[name]
    program = [sys.executable, os.path.join("bench", family.script)] + family.argv(name)
    if family.launcher_workers:
        return [sys.executable, "-m", "tf_nestpipe.launch", "--workers",
                str(family.launcher_workers), "--"] + program
    return program


def main(argv=None):
    """Runs the families named; returns the first non-zero exit code, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="family names (see --list)")
    parser.add_argument("--list", action="store_true", help="list the families")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    if args.list or not args.families:
        for name, family in sorted(FAMILIES.items()):
            print("%-20s %s%s" % (name, family.about, " (root)" if family.needs_root else ""))
        return 0
    try:
        commands = [(name, command(name)) for name in args.families]
    except KeyError as error:
        print("error: %s" % error.args[0], file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
    for name, argv_ in commands:
        print("bench/run.py %s: %s" % (name, " ".join(argv_)), flush=True)
        if args.dry_run:
            continue
        if FAMILIES[name].needs_root and os.geteuid() != 0:
            print("error: %s emulates a network (bench/netem.py) and needs root" % name,
                  file=sys.stderr)
            return 2
        code = subprocess.call(argv_, cwd=REPO, env=env)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
