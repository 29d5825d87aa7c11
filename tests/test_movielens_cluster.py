"""MovieLens-100K end to end on a 2-worker cluster: fetched and converted on first use (every
worker at once, under a file lock), read from TFRecord shards (training: full global batches,
AutoShard DATA; held-out: AutoShard FILE), trained with
tf_keras fit; the held-out AUC shows the model learned."""
import os
import re

import pytest

from conftest import fetch_movielens_or_skip, launch

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "dlrm.py")


@pytest.mark.cluster
def test_dlrm_learns_movielens_100k_on_two_workers():
    fetch_movielens_or_skip("movielens-100k")
    result = launch(2, [EXAMPLE, "--data", "movielens-100k", "--epochs", "2"], timeout=600)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "90000 train / 10000 test ratings" in result.stdout
    match = re.search(r"train: (\d+) steps, .* held-out: loss [\d.]+ auc ([\d.]+)", result.stdout)
    assert match, result.stdout[-3000:]
    steps, auc = int(match.group(1)), float(match.group(2))
    # 2 epochs of 90,000 ratings in full global batches of 512 (drop_remainder: equal shares).
    assert steps == 350, steps
    assert auc > 0.68, "held-out AUC %.3f: the model did not learn" % auc
