"""NestPipeStrategy(collectives="horovod"): 2-worker training through Horovod (Gloo) equals the
single-process reference, under our launcher (`--horovod`) and under `horovodrun --gloo`; the
embedding all-to-alls send only the real split sizes; clear errors when Horovod is missing or its
cluster does not match TF_CONFIG. Needs Horovod (scripts/install_horovod.sh; CI builds it)."""
import json
import os
import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_nestpipe as tnp
from conftest import UNPINNED, PROGRAMS, run_command, run_together
from tf_nestpipe.collectives import horovod_collectives

STEPS = 12
# ":mixdp": table_a replicated (its gradient in hvd.allreduce), table_b row-wise (issue 15);
# ":tw": table_a table_wise on worker 0, fused with the row-wise table_b in Horovod's all-to-alls.
LAUNCHER_RUNS = ["none/loop:sgd", "none/loop:adagrad", "none/fit:adagrad", "none/fit:adam:mixdp",
                 "none/loop:adagrad:tw"]
HOROVODRUN_RUNS = ["dbp/loop:adagrad"]


def _require_horovod():
    pytest.importorskip("horovod.tensorflow",
                        reason="Horovod is not installed (scripts/install_horovod.sh)")


@pytest.fixture(scope="session")
def horovod_results(tmp_path_factory):
    """One single-process reference run, one 2-worker launch through our launcher and one
    through horovodrun; returns their output prefixes and the launches' logs."""
    _require_horovod()
    out = tmp_path_factory.mktemp("horovod")
    program = os.path.join(PROGRAMS, "horovod_exactness.py")
    reference_runs = sorted({spec.split("/")[1] for spec in LAUNCHER_RUNS + HOROVODRUN_RUNS})
    horovodrun = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable),
                                                            "horovodrun")
    assert "TF_CONFIG" not in os.environ  # under horovodrun the cluster is Horovod's alone
    ref, surface_ref, launched, hvdrun = run_together(  # independent: at once
        (run_command, [sys.executable, os.path.join(PROGRAMS, "exactness.py"), str(out / "ref"),
                       str(STEPS)] + reference_runs),
        (run_command, [sys.executable, os.path.join(PROGRAMS, "horovod_surface.py"),
                       str(out / "surface_ref")]),
        (run_command, [sys.executable, "-m", "tf_nestpipe.launch", "--workers", "2", UNPINNED,
                       "--horovod", "--", sys.executable, program, str(out / "launch"),
                       str(STEPS)] + LAUNCHER_RUNS + ["--check-splits", "--surface",
                                                      str(out / "surface")], 600),
        (run_command, [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2",
                       "--network-interface", "lo", sys.executable, program,
                       str(out / "horovodrun"), str(STEPS)] + HOROVODRUN_RUNS, 600,
         {"TF_CPP_MIN_LOG_LEVEL": "2"}))
    assert ref.returncode == 0, ref.stdout[-4000:]
    assert surface_ref.returncode == 0, surface_ref.stdout[-4000:]
    assert launched.returncode == 0, launched.stdout[-6000:]
    assert hvdrun.returncode == 0, hvdrun.stdout[-6000:]
    return {"ref": str(out / "ref"), "launch": str(out / "launch"),
            "horovodrun": str(out / "horovodrun"), "launch_log": launched.stdout,
            "horovodrun_log": hvdrun.stdout, "surface_ref": str(out / "surface_ref"),
            "surface": str(out / "surface")}


def _assert_equal_to_reference(results, prefix_key, spec):
    pipeline, run = spec.split("/")
    ref = np.load("%s.%s.npz" % (results["ref"], run.replace(":", ".")))
    got = np.load("%s.%s.%s.npz" % (results[prefix_key], pipeline, run.replace(":", ".")))
    params = [n for n in ref.files if not n.startswith("stats/")]
    assert len(params) == 6 and {"table_a", "table_b"} <= set(params)
    for name in params:
        assert ref[name].shape == got[name].shape, name
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)
    return got


@pytest.mark.parametrize("spec", LAUNCHER_RUNS)
def test_launcher_horovod_cluster_matches_single_process(horovod_results, spec):
    """`python -m tf_nestpipe.launch --workers 2 --horovod`: custom loop (SGD, Adagrad) and fit."""
    _assert_equal_to_reference(horovod_results, "launch", spec)


@pytest.mark.parametrize("spec", HOROVODRUN_RUNS)
def test_horovodrun_dual_buffer_pipeline_matches_single_process(horovod_results, spec):
    """`horovodrun --gloo -np 2` (no TF_CONFIG: the cluster is Horovod's), Dual-Buffer Pipeline."""
    got = _assert_equal_to_reference(horovod_results, "horovodrun", spec)
    assert int(got["stats/steps"]) == STEPS
    assert int(got["stats/rows_synced"]) > 0  # the buffer sync's all-to-all ran too


def test_both_launchers_give_each_worker_its_horovod_rank(horovod_results):
    for rank in (0, 1):
        assert "[worker:%d] collectives horovod rank %d of 2" % (rank, rank) \
            in horovod_results["launch_log"]
        assert "[%d]<stdout>:collectives horovod rank %d of 2" % (rank, rank) \
            in horovod_results["horovodrun_log"]


def test_only_real_split_sizes_travel(horovod_results):
    """Uneven counts per peer: each worker hands hvd.alltoall only its data entries (3 of 8
    slots on worker 0, 5 of 8 on worker 1) and receives them unpacked into the padded layout."""
    log = horovod_results["launch_log"]
    assert "[worker:0] variable splits ok: sent 3 of 8 slots" in log
    assert "[worker:1] variable splits ok: sent 5 of 8 slots" in log


@pytest.mark.cluster
def test_cluster_size_mismatch_is_a_clear_error(tmp_path):
    """A TF_CONFIG of 2 workers but no Horovod environment: hvd.size() is 1."""
    _require_horovod()
    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
              "task": {"type": "worker", "index": 0}}
    env = {"TF_CONFIG": json.dumps(config)}
    result = run_command([sys.executable, "-c",
                          "import tf_nestpipe as tnp; tnp.NestPipeStrategy(transport='horovod')"],
                         timeout=180, env=env)
    assert result.returncode != 0
    assert "HorovodClusterError" in result.stdout
    assert "hvd.size() is 1 but TF_CONFIG has 2 synchronous workers" in result.stdout
    assert "tf_nestpipe.launch --workers 2 --horovod" in result.stdout


def test_missing_horovod_names_the_install_script(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)
    with pytest.raises(horovod_collectives.HorovodUnavailableError,
                       match="scripts/install_horovod.sh"):
        tnp.NestPipeStrategy(transport="horovod")


def test_bad_backend_and_launcher_combinations_are_refused():
    from tf_nestpipe.launch.local_cluster import LocalCluster

    with pytest.raises(ValueError, match="transport must be one of"):
        tnp.NestPipeStrategy(transport="mpi")
    with pytest.raises(ValueError, match="cannot be combined with --ps"):
        LocalCluster(["python", "x.py"], 2, num_ps=1, horovod=True)


@pytest.mark.parametrize("sliced", [True, False], ids=["slices", "gather"])
def test_pack_and_unpack_are_inverse(monkeypatch, sliced):
    """The padded-layout <-> real-splits conversion around hvd.alltoall (one slice per peer for
    few peers, one gather for many)."""
    monkeypatch.setattr(horovod_collectives, "_MAX_PEERS_SLICED", 32 if sliced else 0)
    block = tf.constant([[[1.0], [2.0], [0.0]], [[3.0], [0.0], [0.0]]])
    flat = horovod_collectives.pack(block, tf.constant([2, 1]))
    assert flat.numpy().ravel().tolist() == [1.0, 2.0, 3.0]
    back = horovod_collectives.unpack(flat, tf.constant([2, 1]), 3, 0)
    np.testing.assert_array_equal(back.numpy(), block.numpy())
    shifted = horovod_collectives.unpack(flat, tf.constant([1, 2]), 4, -1).numpy()[..., 0]
    np.testing.assert_array_equal(shifted, [[1, -1, -1, -1], [2, 3, -1, -1]])
    keys = tf.constant([[5, 6, -1], [7, -1, -1], [8, 9, 10]], tf.int64)
    packed = horovod_collectives.pack(keys, tf.constant([2, 0, 3]))
    assert packed.numpy().tolist() == [5, 6, 8, 9, 10]
    received = horovod_collectives.unpack(packed, tf.constant([3, 0, 2]), 3, -1, peers=3)
    assert received.numpy().tolist() == [[5, 6, 8], [-1, -1, -1], [9, 10, -1]]


HOROVOD_STRATEGY = ("import tf_nestpipe as tnp\n"
                    "s = tnp.NestPipeStrategy(transport='horovod')\n"
                    "print('started', s.num_workers, s.worker_index, flush=True)\n")


def _horovod_pair(configs):
    """Starts 2 processes with Horovod's environment (our launcher's rendezvous) and the given
    TF_CONFIGs, each building NestPipeStrategy(collectives="horovod"); returns (codes, outputs,
    seconds)."""
    import subprocess
    import time

    from tf_nestpipe.launch.horovod_rendezvous import HorovodRendezvous

    rendezvous = HorovodRendezvous(2)
    start = time.time()
    try:
        processes = [subprocess.Popen(
            [sys.executable, "-c", HOROVOD_STRATEGY], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, TF_CONFIG=json.dumps(c), TF_NESTPIPE_STARTUP_TIMEOUT="20",
                     **rendezvous.env(rank))) for rank, c in enumerate(configs)]
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    finally:
        rendezvous.stop()
    return [p.returncode for p in processes], outputs, time.time() - start


@pytest.mark.cluster
def test_horovod_tasks_given_different_tf_configs_fail_naming_the_field():
    """Issue 17's start-up check under collectives="horovod": Horovod's size and rank agree with
    both TF_CONFIGs, but worker 1's lists another address for itself: every task fails within
    the timeout naming the field; the same TF_CONFIG on both (the positive control) starts."""
    _require_horovod()
    from tf_nestpipe.launch.local_cluster import free_ports

    ports = free_ports(3)
    good = {"worker": ["127.0.0.1:%d" % p for p in ports[:2]]}
    other = {"worker": [good["worker"][0], "127.0.0.1:%d" % ports[2]]}
    task = lambda cluster, i: {"cluster": cluster, "task": {"type": "worker", "index": i}}
    codes, outputs, took = _horovod_pair([task(good, 0), task(other, 1)])
    for code, output in zip(codes, outputs):
        assert code != 0, output[-3000:]
        assert "ClusterMismatchError" in output and "cluster.worker[1]: worker:0 (the leader) " \
            "has '%s', worker:1 has '%s'" % (good["worker"][1], other["worker"][1]) in output, \
            output[-3000:]
        assert "started" not in output
    assert took < 60, took
    codes, outputs, _ = _horovod_pair([task(good, 0), task(good, 1)])
    assert codes == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "started 2 0" in outputs[0] and "started 2 1" in outputs[1]


def test_keras_surface_paths_under_horovod_equal_one_process(horovod_results):
    """Issue 16's Keras paths with collectives="horovod" (2 workers, our launcher): fit, predict
    (all 100 rows in input order on every worker), a .h5 holding whole tables (a fresh model
    loads them back equal), and a custom train_step's raw total_loss (summed over the workers:
    equal on both and to one process's)."""
    ref = np.load(os.path.join(horovod_results["surface_ref"], "rank0.npz"))
    workers = [np.load(os.path.join(horovod_results["surface"], "rank%d.npz" % r))
               for r in (0, 1)]
    trained = [k for k in ref.files if k.startswith("trained/")]
    assert len(trained) == 6 and ref["trained/table_a"].shape == (37, 4)
    for got in workers:
        for key in trained:
            np.testing.assert_allclose(got[key], ref[key], atol=1e-5, err_msg=key)
            np.testing.assert_array_equal(got["h5/" + key[8:]], got[key], err_msg=key)
        assert got["predict"].shape == (100, 1)
        np.testing.assert_allclose(got["predict"], ref["predict"], atol=1e-5)
        np.testing.assert_allclose(got["raw/total_loss"], ref["raw/total_loss"], atol=1e-5)
    np.testing.assert_array_equal(workers[0]["raw/total_loss"], workers[1]["raw/total_loss"])
