"""The one runner of the benchmarks: `python bench/run.py FAMILY [FAMILY ...]` regenerates
each family's results, bench/results/FAMILY.{md,json} (+ .png), overwriting them.

    python bench/run.py --list              # the families (bench/families.py) and what they measure
    python bench/run.py natural             # the README's table
    python bench/run.py natural --dry-run   # print the command only
    python bench/run.py bandwidth_family --quick             # a family of cells: its quick subset
    python bench/run.py bandwidth_family --cells NAME [...]  # or the cells named
    python bench/run.py bandwidth_family --report-only       # rewrite its report, measure nothing

Run from the repository root; the scripts use this checkout's tf_nestpipe. Timings on a shared
machine are unreliable: every side-by-side result records the load average and CPU steal of its
run next to its numbers.
"""
import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from families import FAMILIES  # noqa: E402  pylint: disable=wrong-import-position
import family_report  # noqa: E402  pylint: disable=wrong-import-position


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
    return _launched(family, program)


def _launched(family, program):
    if family.launcher_workers:
        return [sys.executable, "-m", "tf_nestpipe.launch", "--workers",
                str(family.launcher_workers), "--"] + program
    return program


def cell_commands(name, cells=None, quick=False):
    """[(cell name, command line)] of a family of cells (`Family.cells`): all, its `quick`
    subset, or the `cells` named.

    Raises:
        KeyError: No such family, or a cell it does not have; the message lists them.
    """
    family = FAMILIES[name]
    declared = dict(family.cells)
    chosen = list(cells or (family.quick if quick else declared))
    unknown = [c for c in chosen if c not in declared]
    if unknown:
        raise KeyError("family %s has no cell %s; its cells are %s"
                       % (name, ", ".join(unknown), ", ".join(declared)))
    return [(c, _launched(family, [sys.executable, os.path.join("bench", family.script)]
                          + declared[c].argv(family_report.cell_output(name, c))))
            for c in chosen]


def main(argv=None):
    """Runs the families named; returns the first non-zero exit code, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="family names (see --list)")
    parser.add_argument("--list", action="store_true", help="list the families")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--quick", action="store_true",
                        help="a family of cells: only its quick subset")
    parser.add_argument("--cells", nargs="+", help="a family of cells: only these cells")
    parser.add_argument("--report-only", action="store_true",
                        help="a family of cells: rewrite its report from its stored cells by "
                             "today's rules (family_report.py), measuring nothing")
    args = parser.parse_args(argv)
    if args.list or not args.families:
        for name, family in sorted(FAMILIES.items()):
            print("%-20s %s%s" % (name, family.about, " (root)" if family.needs_root else ""))
        return 0
    if args.report_only:
        if args.cells or args.quick or args.dry_run:
            print("error: --report-only measures nothing; it takes no --cells, --quick or "
                  "--dry-run", file=sys.stderr)
            return 2
        return report_only(args.families)
    try:
        commands = [(name, cell_commands(name, args.cells, args.quick)
                     if name in FAMILIES and FAMILIES[name].cells else command(name))
                    for name in args.families]
    except KeyError as error:
        print("error: %s" % error.args[0], file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
    for name, argv_ in commands:
        if FAMILIES[name].needs_root and os.geteuid() != 0 and not args.dry_run:
            print("error: %s emulates a network (bench/netem.py) and needs root" % name,
                  file=sys.stderr)
            return 2
        if not FAMILIES[name].cells:
            print("bench/run.py %s: %s" % (name, " ".join(argv_)), flush=True)
            code = 0 if args.dry_run else subprocess.call(argv_, cwd=REPO, env=env)
            if code:
                return code
            continue
        started, load = time.time(), os.getloadavg()[0]
        for cell, cell_argv in argv_:
            print("bench/run.py %s, cell %s: %s" % (name, cell, " ".join(cell_argv)), flush=True)
            code = 0 if args.dry_run else subprocess.call(cell_argv, cwd=REPO, env=env)
            if code:
                return code
        if not args.dry_run:
            invoked = " ".join(["python bench/run.py", name] + (["--quick"] if args.quick else [])
                               + (["--cells"] + args.cells if args.cells else []))
            print(family_report.join(name, FAMILIES[name].about, [c for c, _ in argv_],
                                     invoked, started, load, os.getloadavg()[0],
                                     declared=[c for c, _ in FAMILIES[name].cells]))
    return 0


def report_only(names):
    """Rewrites the reports of the families of cells `names` from their stored cells (each
    keeps the run that measured it). Returns 0, or 2 for a family without cells."""
    plain = [n for n in names if n not in FAMILIES or not FAMILIES[n].cells]
    if plain:
        print("error: --report-only rewrites a family of cells' report; %s %s none (families "
              "of cells: %s)" % (", ".join(plain), "has" if len(plain) == 1 else "have",
                                 ", ".join(sorted(n for n, f in FAMILIES.items() if f.cells))),
              file=sys.stderr)
        return 2
    for name in names:
        load = os.getloadavg()[0]
        print(family_report.join(name, FAMILIES[name].about, [],
                                 "python bench/run.py %s --report-only" % name, time.time(),
                                 load, load, declared=[c for c, _ in FAMILIES[name].cells]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
