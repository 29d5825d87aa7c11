"""Restoring a table into a table of another size is refused on every worker with the table
name and both sizes (never rows silently wrong or truncated, never a bare IndexError); a damaged
ShardedCheckpoint manifest is refused with its path and what to do."""
import json
import os
import sys

import pytest

from conftest import PROGRAMS, launch, run_command

PROGRAM = os.path.join(PROGRAMS, "restore_sizes.py")
REFUSED = {"whole_into_200": "the checkpoint holds a table of 100 rows, this model's table has "
                             "200 rows",
           "whole_into_50": "holds a table of 100 rows, this model's table has 50 rows",
           "sharded_into_60": "written for a table of 100 rows x [4], this model's table has "
                              "60 rows x [4]",
           "sharded_into_101": "a table of 100 rows x [4], this model's table has 101 rows",
           "sharded_into_200": "a table of 100 rows x [4], this model's table has 200 rows",
           "sharded_into_50": "a table of 100 rows x [4], this model's table has 50 rows",
           # restored on creation (deferred): a 100-row table equals a 200-row table's shard
           "deferred_into_200": "holds a table of 100 rows, this model's table has 200 rows"}


@pytest.fixture(scope="session")
def restore_results(tmp_path_factory):
    """Saves a 100-row table on 2 workers and tries every restore on 2 workers and on 1."""
    out = tmp_path_factory.mktemp("restore_sizes")
    result = launch(2, [PROGRAM, str(out), "save", "restore"], timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    single = run_command([sys.executable, PROGRAM, str(out), "restore"], timeout=180)
    assert single.returncode == 0, single.stdout[-4000:]
    results = {}
    for workers, rank in ((2, 0), (2, 1), (1, 0)):
        with open(out / ("results-%d-%d.json" % (workers, rank))) as f:
            results[(workers, rank)] = json.load(f)
    return results


@pytest.mark.cluster
@pytest.mark.parametrize("where", [(2, 0), (2, 1), (1, 0)])
def test_tables_of_another_size_are_refused_on_every_worker(restore_results, where):
    results = restore_results[where]
    for case, message in REFUSED.items():
        assert results[case].startswith("error: cannot restore embeddings"), (case, results[case])
        assert message in results[case], (case, results[case])
    # Positive controls: the same checkpoints restore exactly into a table of the saved size
    # (on 1 worker through the resharding path, on 2 through the per-worker files).
    for case in ("whole_into_100", "sharded_into_100", "deferred_into_100"):
        assert results[case] == "ok", (case, results[case])


@pytest.mark.parametrize("text,problem", [("{not json", "is not valid JSON"),
                                          ('{"step": 1}', "has no integer num_workers"),
                                          ('[1, 2]', "has no integer num_workers")])
def test_a_damaged_manifest_names_its_path_and_the_fix(tmp_path, text, problem):
    import tf_nestpipe as tnp

    (tmp_path / "step-1").mkdir()
    manifest = tmp_path / "step-1" / "manifest.json"
    manifest.write_text(text)
    checkpoint = tnp.ShardedCheckpoint(tnp.NestPipeStrategy())
    with pytest.raises(ValueError) as error:
        checkpoint.restore(str(tmp_path))
    assert str(manifest) in str(error.value) and problem in str(error.value)
    assert "step=N" in str(error.value) and "delete that step's directory" in str(error.value)
