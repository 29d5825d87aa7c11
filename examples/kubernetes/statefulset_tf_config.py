"""A StatefulSet pod's TF_CONFIG, from its ordinal (the suffix of its host name), then exec.

usage (the StatefulSet's container command, see render.py):
    python examples/kubernetes/statefulset_tf_config.py -- COMMAND ...
Reads NESTPIPE_WORKERS, NESTPIPE_SERVICE (the headless Service, also the StatefulSet's name),
NESTPIPE_PORT, POD_NAMESPACE and HOSTNAME (`<service>-<ordinal>`); every pod's cluster lists
`<service>-<i>.<service>.<namespace>.svc:<port>` for i < workers. Imports no TensorFlow.
"""
import json
import os
import sys


def tf_config(env):
    """The TF_CONFIG JSON for the pod whose environment is `env` (a mapping)."""
    workers, service = int(env["NESTPIPE_WORKERS"]), env["NESTPIPE_SERVICE"]
    port, namespace = int(env.get("NESTPIPE_PORT", "2222")), env.get("POD_NAMESPACE", "default")
    host = env["HOSTNAME"]
    prefix, _, ordinal = host.rpartition("-")
    if prefix != service or not ordinal.isdigit():
        raise ValueError("HOSTNAME %r is not <%s>-<ordinal>: is this pod part of the "
                         "StatefulSet %r?" % (host, service, service))
    index = int(ordinal)
    if index >= workers:
        raise ValueError("pod ordinal %d >= NESTPIPE_WORKERS=%d: scale the StatefulSet and "
                         "NESTPIPE_WORKERS together" % (index, workers))
    cluster = ["%s-%d.%s.%s.svc:%d" % (service, i, service, namespace, port)
               for i in range(workers)]
    return json.dumps({"cluster": {"worker": cluster}, "task": {"type": "worker", "index": index}})


def main():
    """Sets TF_CONFIG and execs the command after `--`."""
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    if not command:
        sys.exit("usage: statefulset_tf_config.py -- COMMAND ...")
    os.environ["TF_CONFIG"] = tf_config(os.environ)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
