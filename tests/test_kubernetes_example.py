"""The Kubernetes example (examples/kubernetes): rendered manifests give every pod a TF_CONFIG
our parser accepts, the same cluster on every pod, and a NetworkPolicy that admits only the job's
own pods to the TensorFlow port. No cluster is needed: the manifests are rendered and parsed."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from tf_nestpipe.tf_config import parse_tf_config

sys.path.insert(0, os.path.join(REPO, "examples", "kubernetes"))
import render  # noqa: E402
import statefulset_tf_config  # noqa: E402


def _documents(kind, workers, namespace="train"):
    text = render.render(kind, "dlrm", workers, "registry/tf-nestpipe:1", namespace=namespace)
    return {d["kind"]: d for d in yaml.safe_load_all(text)}


def _operator_tf_config(job, index):
    """The TF_CONFIG Kubeflow's training operator gives Worker pod `index` of a TFJob: the
    addresses of every Worker replica on the port named tfjob-port."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    spec = job["spec"]["tfReplicaSpecs"]["Worker"]
    container = spec["template"]["spec"]["containers"][0]
    assert container["name"] == "tensorflow"  # the operator reads the port of this container
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "tfjob-port")
    cluster = ["%s-worker-%d.%s.svc:%d" % (name, i, namespace, port)
               for i in range(spec["replicas"])]
    return json.dumps({"cluster": {"worker": cluster}, "task": {"type": "worker", "index": index},
                       "environment": "cloud"})


def _admits(policy, pod_labels, from_labels, port):
    """Whether `policy` lets a pod labelled `from_labels` reach a pod labelled `pod_labels` on
    TCP `port` (the subset of NetworkPolicy semantics the example uses)."""
    def matches(selector, labels):
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    spec = policy["spec"]
    if not matches(spec["podSelector"], pod_labels):
        return True  # the policy does not select the pod
    for rule in spec.get("ingress", []):
        peers = rule.get("from", [])
        ports = [p["port"] for p in rule.get("ports", []) if p.get("protocol", "TCP") == "TCP"]
        if any(matches(p["podSelector"], from_labels) for p in peers if "podSelector" in p) \
                and port in ports:
            return True
    return False


@pytest.mark.parametrize("workers", [1, 3])
def test_tfjob_gives_every_pod_a_valid_tf_config(workers):
    job = _documents("tfjob", workers)["TFJob"]
    clusters = []
    for index in range(workers):
        config = parse_tf_config(_operator_tf_config(job, index))
        assert (config.task_type, config.task_index, config.num_workers) == ("worker", index,
                                                                             workers)
        clusters.append(config.cluster)
    assert all(c == clusters[0] for c in clusters)
    assert clusters[0]["worker"][-1] == "dlrm-worker-%d.train.svc:2222" % (workers - 1)
    command = job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "tf_nestpipe.launch.task", "--"]


@pytest.mark.parametrize("workers", [1, 3])
def test_statefulset_pods_build_valid_tf_configs_from_their_ordinals(workers):
    docs = _documents("statefulset", workers)
    sts, service = docs["StatefulSet"], docs["Service"]
    assert sts["spec"]["replicas"] == workers
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] == sts["metadata"]["name"]
    assert service["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    env["POD_NAMESPACE"] = "train"  # the downward API's metadata.namespace
    clusters = []
    for ordinal in range(workers):
        pod_env = dict(env, HOSTNAME="%s-%d" % (sts["metadata"]["name"], ordinal))
        config = parse_tf_config(statefulset_tf_config.tf_config(pod_env))
        assert (config.task_index, config.num_workers) == (ordinal, workers)
        clusters.append(config.cluster)
    assert all(c == clusters[0] for c in clusters)
    assert clusters[0]["worker"][0] == "dlrm-worker-0.dlrm-worker.train.svc:2222"
    assert container["command"][:3] == ["python", "examples/kubernetes/statefulset_tf_config.py",
                                        "--"]


def test_statefulset_helper_refuses_a_foreign_host_or_an_ordinal_out_of_range():
    env = {"NESTPIPE_WORKERS": "2", "NESTPIPE_SERVICE": "dlrm-worker", "NESTPIPE_PORT": "2222"}
    with pytest.raises(ValueError, match="is not <dlrm-worker>-<ordinal>"):
        statefulset_tf_config.tf_config(dict(env, HOSTNAME="other-0"))
    with pytest.raises(ValueError, match="ordinal 2 >= NESTPIPE_WORKERS=2"):
        statefulset_tf_config.tf_config(dict(env, HOSTNAME="dlrm-worker-2"))


def test_statefulset_helper_sets_tf_config_and_execs_the_command():
    env = dict(os.environ, NESTPIPE_WORKERS="2", NESTPIPE_SERVICE="dlrm-worker",
               HOSTNAME="dlrm-worker-1", POD_NAMESPACE="train")
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "kubernetes", "statefulset_tf_config.py"),
         "--", sys.executable, "-c", "import os; print(os.environ['TF_CONFIG'])"],
        stdout=subprocess.PIPE, text=True, env=env, timeout=60, check=True)
    assert parse_tf_config(result.stdout.strip()).task_index == 1


@pytest.mark.parametrize("kind", ["tfjob", "statefulset"])
def test_network_policy_admits_only_the_jobs_own_pods_to_the_tensorflow_port(kind):
    docs = _documents(kind, 2)
    policy = docs["NetworkPolicy"]
    template = (docs["TFJob"]["spec"]["tfReplicaSpecs"]["Worker"]["template"] if kind == "tfjob"
                else docs["StatefulSet"]["spec"]["template"])
    pod = template["metadata"]["labels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert _admits(policy, pod, pod, 2222)  # the job's own pods: admitted
    assert not _admits(policy, pod, {"app": "other"}, 2222)  # other pods: refused
    assert not _admits(policy, pod, dict(pod, **{"app.kubernetes.io/name": "x"}), 2222)
    assert _admits(policy, pod, pod, 2223)  # the transport's port: admitted
    assert not _admits(policy, pod, {"app": "other"}, 2223)
    assert not _admits(policy, pod, pod, 22)  # other ports of the job's pods: refused
    assert _admits(policy, {"app": "other"}, {"app": "any"}, 80)  # other pods are not selected


def test_render_command_line_prints_the_manifests():
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "kubernetes", "render.py"), "--kind",
         "tfjob", "--name", "j", "--workers", "2", "--image", "i", "--", "python", "train.py"],
        stdout=subprocess.PIPE, text=True, timeout=60, check=True)
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["Secret", "TFJob", "NetworkPolicy"]
    container = docs[1]["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"][-2:] == ["python", "train.py"]


@pytest.mark.parametrize("kind", ["tfjob", "statefulset"])
def test_every_pod_reads_the_jobs_transport_secret_from_the_mounted_secret(kind):
    docs = _documents(kind, 2)
    secret = docs["Secret"]
    value = secret["stringData"]["secret"]
    assert len(value) == 64 and int(value, 16) >= 0  # 32 random bytes, hex
    assert _documents(kind, 2)["Secret"]["stringData"]["secret"] != value  # fresh per render
    template = (docs["TFJob"]["spec"]["tfReplicaSpecs"]["Worker"]["template"] if kind == "tfjob"
                else docs["StatefulSet"]["spec"]["template"])
    spec = template["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "transport-secret")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    container = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "transport-secret")
    assert env["TF_NESTPIPE_TRANSPORT_SECRET_FILE"] == mount["mountPath"] + "/secret"
    assert env["TF_NESTPIPE_TRANSPORT_PORT"] == "2223"
