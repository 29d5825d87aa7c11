"""TF_CONFIG parsing: valid configs, and a clear error naming the field for each malformed one."""
import json

import pytest

from tf_nestpipe.tf_config import TFConfigError, parse_tf_config

CLUSTER = {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"], "ps": ["127.0.0.1:2000"]}


def config(**task):
    return json.dumps({"cluster": CLUSTER, "task": task})


def test_valid_config():
    parsed = parse_tf_config(config(type="worker", index=1))
    assert parsed.task_type == "worker" and parsed.task_index == 1
    assert parsed.num_workers == 2 and parsed.cluster["ps"] == ["127.0.0.1:2000"]
    assert parse_tf_config(parsed.to_json()) == parsed


def test_unset_or_empty_means_single_process(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert parse_tf_config() is None
    assert parse_tf_config("  ") is None


@pytest.mark.parametrize("text,field", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "field <root>"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "field cluster:"),
    (json.dumps({"cluster": {}, "task": {"type": "worker"}}), "field cluster:"),
    (json.dumps({"cluster": {"boss": ["h:1"]}, "task": {"type": "boss"}}), "field cluster.boss"),
    (json.dumps({"cluster": {"worker": "h:1"}, "task": {"type": "worker"}}), "field cluster.worker:"),
    (json.dumps({"cluster": {"worker": ["h1"]}, "task": {"type": "worker"}}), r"field cluster.worker\[0\]"),
    (json.dumps({"cluster": {"chief": ["h:1", "h:2"]}, "task": {"type": "chief"}}), "field cluster.chief"),
    (json.dumps({"cluster": CLUSTER}), "field task: missing"),
    (json.dumps({"cluster": CLUSTER, "task": "worker"}), "field task: must be an object"),
    (config(index=0), "field task.type: missing"),
    (config(type="master", index=0), "field task.type: unknown role 'master'"),
    (config(type="chief", index=0), "field task.type: role 'chief' has no addresses"),
    (config(type="worker", index=2), "field task.index: 2 is out of range"),
    (config(type="worker", index=-1), "field task.index: -1 is out of range"),
    (config(type="worker", index="0"), "field task.index: must be an integer"),
])
def test_malformed_config_names_the_field(text, field):
    with pytest.raises(TFConfigError, match=field):
        parse_tf_config(text)


def test_strategy_refuses_malformed_tf_config(monkeypatch):
    import tf_nestpipe as tnp

    monkeypatch.setenv("TF_CONFIG", config(type="worker", index=5))
    with pytest.raises(tnp.TFConfigError, match="task.index"):
        tnp.NestPipeStrategy()
