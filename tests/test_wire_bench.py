"""Fast checks of bench/wire_dtypes.py's pure-Python parts (its rows' command lines and the
report) and of `WireStats`' byte accounting per backend; no cluster is started."""
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import wire_dtypes  # noqa: E402
from tf_nestpipe.collectives.wire import WireStats  # noqa: E402


def _result(ms, auc, forward, backward, wire="fp32/fp32"):
    return {"ms_median": ms, "auc": auc, "wire_dtype": wire, "clamped": 0,
            "wire_bytes_per_step": {"keys": 1000.0, "forward": forward, "backward": backward,
                                    "sync": 0.0}}


def test_rows_pass_the_wire_dtype_and_the_held_out_batches():
    args = wire_dtypes.parse_args(["--wire-dtypes", "int8-bf16", "--eval-batches", "3"])
    assert args.wire_dtypes == ["fp32", "int8-bf16"]  # fp32 is always the reference
    argv = wire_dtypes.worker_argv(args, ("synthetic", 2, "0.2ms:1gbit", "dbp"), "int8-bf16")
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--wire-dtype"] == "int8-bf16" and flags["--eval-batches"] == "3"
    assert flags["--pipeline"] == "dbp" and flags["--global-batch"] == "4096"
    assert flags["--dim"] == "64"
    assert flags["--placement"] == "row_wise"  # compressed exchanges need exchanged tables


def test_report_puts_each_wire_next_to_fp32():
    args = wire_dtypes.parse_args([])
    cell = ("synthetic", 2, "0.2ms:1gbit", "none")
    rows = [(cell, {"fp32": _result(100.0, 0.7000, 9000.0, 9000.0),
                    "int8-bf16": _result(80.0, 0.6990, 2000.0, 4500.0, "int8/bf16"),
                    "bf16-bf16": {"error": "failed (rc=1): boom"}})]
    text = wire_dtypes.markdown(args, rows, "python bench/wire_dtypes.py")
    line = next(l for l in text.splitlines() if "int8/bf16" in l)
    assert "| 80.0 | 1.25x |" in line and "2.53x fewer" in line  # 19000 / 7500 bytes
    assert "| 0.6990 | -0.0010 |" in line
    assert "| 0.1 | 0.6990" in line  # 7500 bytes at 1 Gbit/s: 0.06 ms
    assert wire_dtypes.link_ms("1ms:200mbit", 25000) == 1.0
    assert wire_dtypes.link_ms("loopback", 25000) is None
    assert "failed: failed (rc=1): boom" in text
    assert "`python bench/wire_dtypes.py`" in text


class _FakeCollectives:
    def __init__(self, name, worker_index):
        self.name = name
        self.sends_real_splits = name in ("horovod", "sockets")
        self.worker_index = worker_index


def test_wire_stats_count_what_each_backend_sends():
    stats = WireStats("/cpu:0")
    block = tf.zeros([3, 5, 4], tf.float16)  # 3 workers, capacity 5, 8 bytes an entry
    counts = tf.constant([2, 4, 1])
    stats.count_sent("forward", block, _FakeCollectives("tf", 1), counts)
    assert stats.read()["forward"] == 2 * 5 * 8  # two padded blocks leave this worker
    stats.count_sent("backward", block, _FakeCollectives("horovod", 1), counts)
    assert stats.read()["backward"] == (2 + 1) * 8  # only the data entries, not its own 4
    stats.count_sent("keys", tf.zeros([3, 7], tf.int64), _FakeCollectives("tf", 0))
    assert stats.read()["keys"] == 2 * 7 * 8
    stats.add("clamped", np.int64(3))
    assert stats.read() == {"keys": 112, "forward": 80, "backward": 24, "sync": 0, "clamped": 3}


def test_wire_stats_count_the_same_when_shapes_are_known_only_at_run_time():
    stats = WireStats("/cpu:0")

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float16)])
    def count_unknown(block):
        stats.count_sent("forward", block, _FakeCollectives("tf", 1))

    @tf.function(input_signature=[tf.TensorSpec([3, None, 4], tf.float16)])
    def count_static(block):
        stats.count_sent("sync", block, _FakeCollectives("tf", 1))

    count_unknown(tf.zeros([3, 5, 4], tf.float16))
    count_static(tf.zeros([3, 5, 4], tf.float16))
    assert stats.read()["forward"] == stats.read()["sync"] == 2 * 5 * 8
