"""A step whose workers got shares of different sizes of the global batch (the last batch of a
dataset batched without drop_remainder: 3 samples as 2 + 1 on 2 workers) is refused on every
worker at that step, naming the fix, with every pipeline and in eager custom loops; steps with
equal shares train, evaluate (exact for any shares) is not refused, and static shapes pay no
check."""
import json
import os

import pytest

from conftest import PROGRAMS, launch

CASES = ["uneven", "even", "static", "repeated", "loop", "evaluate", "uneven:dbp",
         "uneven:fwp", "uneven:nested", "middle:dbp", "middle:nested"]


@pytest.fixture(scope="session")
def share_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("unequal_shares")
    result = launch(2, [os.path.join(PROGRAMS, "unequal_shares.py"), str(out)] + CASES,
                    timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    results = {}
    for case in CASES:
        for rank in (0, 1):
            with open(out / ("%s-%d.json" % (case.replace(":", "."), rank))) as f:
                results[case, rank] = json.load(f)
    return results


@pytest.mark.cluster
@pytest.mark.parametrize("case", ["uneven", "loop", "uneven:dbp", "uneven:fwp", "uneven:nested",
                                  "middle:dbp", "middle:nested"])
def test_unequal_shares_are_refused_at_that_step_on_every_worker(share_results, case):
    # middle: a look-ahead pipeline's refused step also prefetches the next batch and reads the
    # iterator (collectives): it fails on every worker before any of them starts, or the
    # launch would hang (the cases after it run in the same processes).
    for rank in (0, 1):
        result = share_results[case, rank]
        assert result["steps"] == 1, result  # the first (equal) step trained, the second refused
        assert "shares of this global batch differ in size" in result["error"], result
        assert "drop_remainder=True" in result["error"]
        assert ("2 + 1 samples" if case == "loop" else "[2 1]") in result["error"]


@pytest.mark.cluster
@pytest.mark.parametrize("case", ["even", "static", "repeated", "evaluate"])
def test_equal_shares_train(share_results, case):  # the positive controls
    for rank in (0, 1):
        assert share_results[case, rank]["error"] is None, share_results[case, rank]
        assert share_results[case, rank]["steps"] == 2


@pytest.mark.cluster
def test_only_dynamic_batch_dimensions_pay_the_check(share_results):
    assert share_results["repeated", 0]["checks"] == 0  # static shapes: no collective traced
    assert share_results["static", 0]["checks"] > 0  # finite: TF relaxes the batch dimension
    assert share_results["evaluate", 0]["checks"] == 0  # no gradients: sums and counts


@pytest.mark.cluster
def test_fit_reads_the_share_sizes_from_the_keys_exchange(share_results):
    """Under fit every step's keys all-to-all carries each worker's share size: the check adds
    no collective; a strategy.run loop (each table its own exchange) all-gathers them."""
    for case in ("static", "uneven", "uneven:dbp", "uneven:fwp", "uneven:nested"):
        assert share_results[case, 0]["checks"] > 0 and share_results[case, 0]["gathered_checks"] == 0
    assert share_results["loop", 0]["gathered_checks"] > 0


@pytest.mark.cluster
@pytest.mark.parametrize("case", ["uneven", "static", "uneven:dbp", "uneven:fwp", "uneven:nested",
                                  "middle:dbp", "middle:nested"])
def test_no_collective_can_be_pending_when_the_check_fails(share_results, case):
    """Every collective of a checked step runs before its check or after it: a refused step
    leaves no exchange half-done (its cancellation would close the mesh, and every later step
    of the process would fail)."""
    for rank in (0, 1):
        assert share_results[case, rank]["checks"] > 0, share_results[case, rank]
        assert share_results[case, rank]["racing"] == [], share_results[case, rank]


@pytest.mark.parametrize("size,workers,shares,advice", [(63, 2, "32 + 31", "e.g. 62 or 64"),
                                                        (10, 4, "3 + 3 + 2 + 2", "e.g. 8 or 12"),
                                                        (3, 4, "1 + 1 + 1 + 0", "e.g. 4")])
def test_a_global_batch_not_divisible_by_the_workers_is_refused_naming_divisible_sizes(
        size, workers, shares, advice):
    """`batch(63, drop_remainder=True)` on 2 workers: refused when the dataset is distributed
    (not at a step, and not with advice to add the drop_remainder=True that is there)."""
    import tensorflow as tf
    from tf_nestpipe.strategy.equal_shares import UnequalSharesError, check_global_batch

    dataset = tf.data.Dataset.range(100).map(lambda i: {"ids": i, "label": 1.0}).batch(
        size, drop_remainder=True)
    with pytest.raises(UnequalSharesError) as error:
        check_global_batch(dataset, workers)
    message = str(error.value)
    assert "global batch of %d samples" % size in message and "(%s samples)" % shares in message
    assert advice in message and "drop_remainder" not in message
    # Positive controls: a divisible static batch, and a dynamic one (its steps are checked).
    check_global_batch(tf.data.Dataset.range(100).batch(size - size % workers or workers,
                                                        drop_remainder=True), workers)
    check_global_batch(tf.data.Dataset.range(100).batch(size), workers)
