"""The benchmark families (bench/families.py) and their one runner (bench/run.py): every family
names a script that exists and arguments that script accepts, results go to
bench/results/<family>.*, and the README's performance table is the natural family's file."""
import os
import re
import sys

import pytest

from conftest import REPO

BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, BENCH)
import compare  # noqa: E402  pylint: disable=wrong-import-position
import families  # noqa: E402  pylint: disable=wrong-import-position
import run  # noqa: E402  pylint: disable=wrong-import-position


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_every_family_runs_an_existing_script_into_its_own_file(name):
    family = families.FAMILIES[name]
    assert os.path.exists(os.path.join(BENCH, family.script)), family.script
    argv = run.command(name)
    assert os.path.join("bench", family.script) in argv
    if family.cell is not None:  # compare.py accepts the cell as given
        args = compare.parse_args(family.argv(name))
        assert args.output == name
        assert args.systems == list(family.cell.systems)
    elif family.output_flag:
        assert argv[-2:] == [family.output_flag, name]


def test_an_unknown_family_is_refused_listing_the_families(capsys):
    assert run.main(["nope"]) == 2
    assert "unknown benchmark family 'nope'; the families are" in capsys.readouterr().err
    assert run.main(["natural", "--dry-run"]) == 0
    assert "--output natural" in capsys.readouterr().out


def test_no_dated_copies_in_results():
    dated = [f for f in os.listdir(os.path.join(BENCH, "results"))
             if re.search(r"_(11|12)\d\d[a-z]?(_|\.)", f) and not f.startswith("plan_costs")]
    assert dated == []


def _table_cells(text, first_column):
    rows = [line for line in text.splitlines() if line.startswith("| " + first_column)]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_the_readmes_numbers_are_the_natural_familys():
    """Every ms/step and samples/s of the README's table is in bench/results/natural.md, the
    file its caption names (what would catch a README left behind by a rerun)."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Performance"):readme.index("## Documentation")]
    assert "bench/results/natural.md" in section and "python bench/run.py natural" in section
    with open(os.path.join(BENCH, "results", "natural.md")) as f:
        results = f.read()
    measured = set(re.findall(r"\| (\d+\.\d) \| [\d.]+ \| (\d+) \|", results))
    quoted = re.findall(r"\| ([\d.]+) \| ([\d,]+) \| [\d.]+ \|", section)
    assert len(quoted) == 4, quoted
    for ms, samples in quoted:
        assert (ms, samples.replace(",", "")) in measured, (ms, samples, measured)


def test_the_readme_check_sees_a_stale_number(tmp_path):
    """Positive control of the pattern: a row of the results table is found, and another
    number is not."""
    results = "| single | dlrm | synthetic | - | 1 | 5.6 | 7.9 | 184422 | 1.00 |"
    measured = set(re.findall(r"\| (\d+\.\d) \| [\d.]+ \| (\d+) \|", results))
    assert ("5.6", "184422") in measured and ("5.7", "184422") not in measured
