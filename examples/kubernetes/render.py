"""Renders Kubernetes manifests that run a tf_nestpipe job on N pods with TF_CONFIG.

usage: python examples/kubernetes/render.py --kind {tfjob,statefulset} --name NAME --workers N
           --image IMAGE [--namespace NS] [--port 2222] [-- COMMAND ...]   > job.yaml

- `tfjob`: a Kubeflow TFJob (the training operator gives every pod its TF_CONFIG: the worker
  addresses `<name>-worker-<i>.<namespace>.svc:<port>` and the pod's index).
- `statefulset`: the plain equivalent: a headless Service (stable DNS names per pod) and a
  StatefulSet whose pods build their TF_CONFIG from their ordinal at start
  (`statefulset_tf_config.py`, then exec the command).
Both include a NetworkPolicy that admits only the job's own pods to the TensorFlow port and the
socket transport's port (the next one; nothing else to these pods): TensorFlow's gRPC servers
have no authentication, so anyone who reaches a worker port can run operations, e.g. read
files, as the training user. And a Secret with a fresh random job secret, mounted as a file
that every pod names in `TF_NESTPIPE_TRANSPORT_SECRET_FILE`: the transport's peers prove they
hold it before they may join (apply the rendered file as it is; render again for a new secret).
The command runs through `python -m tf_nestpipe.launch.task`, which makes the server listen on
the pod's own address only.
"""
import argparse
import secrets
import sys

import yaml

DEFAULT_COMMAND = ["python", "examples/dlrm.py"]
SECRET_DIR = "/var/run/secrets/tf-nestpipe"


def _labels(name):
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "tf-nestpipe-worker"}


def network_policy(name, namespace, port, labels):
    """Ingress to the job's pods only from the job's pods, only on the TensorFlow port and the
    transport's (`port + 1`)."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name + "-tf-ports", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": dict(labels)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": dict(labels)}}],
                         "ports": [{"protocol": "TCP", "port": port},
                                   {"protocol": "TCP", "port": port + 1}]}],
        },
    }


def transport_secret(name, namespace):
    """A Secret holding a fresh random job secret for the socket transport."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name + "-transport", "namespace": namespace},
            "stringData": {"secret": secrets.token_hex(32)}}


def _container(image, command, port, env=()):
    return {"name": "tensorflow", "image": image,
            "command": ["python", "-m", "tf_nestpipe.launch.task", "--"] + list(command),
            "ports": [{"name": "tfjob-port", "containerPort": port},
                      {"name": "transport-port", "containerPort": port + 1}],
            "env": [{"name": "TF_USE_LEGACY_KERAS", "value": "1"},
                    {"name": "TF_NESTPIPE_TRANSPORT_PORT", "value": str(port + 1)},
                    {"name": "TF_NESTPIPE_TRANSPORT_SECRET_FILE",
                     "value": SECRET_DIR + "/secret"}] + list(env),
            "volumeMounts": [{"name": "transport-secret", "mountPath": SECRET_DIR,
                              "readOnly": True}]}


def _pod_spec(name, container):
    return {"containers": [container],
            "volumes": [{"name": "transport-secret",
                         "secret": {"secretName": name + "-transport"}}]}


def tfjob(name, namespace, workers, image, port, command):
    """A Kubeflow TFJob of `workers` Worker replicas, and its NetworkPolicy."""
    labels = _labels(name)
    job = {
        "apiVersion": "kubeflow.org/v1", "kind": "TFJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"runPolicy": {"cleanPodPolicy": "Running"},
                 "tfReplicaSpecs": {"Worker": {
                     "replicas": workers, "restartPolicy": "OnFailure",
                     "template": {"metadata": {"labels": dict(labels)},
                                  "spec": _pod_spec(name, _container(image, command, port))}}}},
    }
    return [transport_secret(name, namespace), job, network_policy(name, namespace, port, labels)]


def statefulset(name, namespace, workers, image, port, command):
    """A headless Service, a StatefulSet of `workers` pods and the NetworkPolicy."""
    labels = _labels(name)
    service_name = name + "-worker"
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service_name, "namespace": namespace},
        "spec": {"clusterIP": "None", "selector": dict(labels),
                 "ports": [{"name": "tfjob-port", "port": port, "targetPort": port}]},
    }
    env = [{"name": "NESTPIPE_WORKERS", "value": str(workers)},
           {"name": "NESTPIPE_SERVICE", "value": service_name},
           {"name": "NESTPIPE_PORT", "value": str(port)},
           {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    container = _container(image, command, port, env)
    container["command"] = (["python", "examples/kubernetes/statefulset_tf_config.py", "--"]
                            + container["command"])
    sts = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": service_name, "namespace": namespace},
        "spec": {"serviceName": service_name, "replicas": workers,
                 "podManagementPolicy": "Parallel",  # all workers start together
                 "selector": {"matchLabels": dict(labels)},
                 "template": {"metadata": {"labels": dict(labels)},
                              "spec": _pod_spec(name, container)}},
    }
    return [transport_secret(name, namespace), service, sts,
            network_policy(name, namespace, port, labels)]


def render(kind, name, workers, image, namespace="default", port=2222, command=None):
    """The manifests of `kind` ("tfjob" or "statefulset") as a YAML string."""
    if int(workers) < 1:
        raise ValueError("workers must be >= 1, got %r" % (workers,))
    build = {"tfjob": tfjob, "statefulset": statefulset}[kind]
    documents = build(name, namespace, int(workers), image, int(port),
                      list(command or DEFAULT_COMMAND))
    return yaml.safe_dump_all(documents, sort_keys=False)


def main(argv=None):
    """Command line: prints the manifests."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = None
    if "--" in argv:
        command, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=("tfjob", "statefulset"), required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--image", required=True)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--port", type=int, default=2222)
    args = parser.parse_args(argv)
    sys.stdout.write(render(args.kind, args.name, args.workers, args.image, args.namespace,
                            args.port, command))


if __name__ == "__main__":
    main()
