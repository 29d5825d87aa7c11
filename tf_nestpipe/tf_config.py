"""Parses and validates `TF_CONFIG`, the only cluster description tf_nestpipe uses."""
import dataclasses
import json
import os
from typing import Dict, List, Optional

KNOWN_ROLES = ("chief", "worker", "ps", "evaluator")


class TFConfigError(ValueError):
    """Raised for a malformed `TF_CONFIG`; the message names the offending field and the fix."""


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster.

    Attributes:
        cluster: Role -> addresses ("host:port").
        task_type: This process's role, or None.
        task_index: This process's index within its role, or None.
    """

    cluster: Dict[str, List[str]]
    task_type: Optional[str]
    task_index: Optional[int]

    @property
    def num_workers(self) -> int:
        """Number of tasks that train synchronously (chief + workers)."""
        return len(self.cluster.get("chief", [])) + len(self.cluster.get("worker", []))

    def to_json(self) -> str:
        """Serializes back to the `TF_CONFIG` JSON form."""
        return json.dumps({"cluster": self.cluster,
                           "task": {"type": self.task_type, "index": self.task_index}})


def _fail(field, problem, fix):
    raise TFConfigError("TF_CONFIG field %s: %s. %s" % (field, problem, fix))


def parse_tf_config(text: Optional[str] = None) -> Optional[ClusterConfig]:
    """Parses and validates a `TF_CONFIG`.

    Args:
        text: The JSON text; default: the `TF_CONFIG` environment variable.

    Returns:
        A `ClusterConfig`, or None if the text is unset or empty.

    Raises:
        TFConfigError: Bad JSON, a missing or malformed `cluster` or `task`, an unknown role,
            an address listed twice, or a task index out of range, naming the field.
    """
    if text is None:
        text = os.environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise TFConfigError(
            "TF_CONFIG is not valid JSON (%s). Expected e.g. "
            '{"cluster": {"worker": ["host0:port", "host1:port"]}, '
            '"task": {"type": "worker", "index": 0}}' % e) from None
    if not isinstance(config, dict):
        _fail("<root>", "must be a JSON object, got %s" % type(config).__name__,
              "Wrap the description in {\"cluster\": ..., \"task\": ...}.")
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        _fail("cluster", "missing or empty",
              'Set "cluster" to a map of role -> list of "host:port", e.g. {"worker": ["h:1234"]}.')
    for role, addresses in cluster.items():
        if role not in KNOWN_ROLES:
            _fail("cluster.%s" % role, "unknown role %r" % role,
                  "Use only the roles %s." % ", ".join(KNOWN_ROLES))
        if isinstance(addresses, dict):  # TF also accepts {index: address}
            try:
                addresses = [addresses[k] for k in sorted(addresses, key=int)]
            except ValueError:
                _fail("cluster.%s" % role, "keys must be task indices", "Use a list of addresses.")
        if not isinstance(addresses, list) or not addresses:
            _fail("cluster.%s" % role, "must be a non-empty list of \"host:port\" strings",
                  "List one address per task.")
        for i, address in enumerate(addresses):
            if not isinstance(address, str) or ":" not in address:
                _fail("cluster.%s[%d]" % (role, i), "%r is not a \"host:port\" string" % (address,),
                      "Write each address as host:port.")
        cluster[role] = list(addresses)
    seen = {}
    for role, addresses in cluster.items():
        for i, address in enumerate(addresses):
            field = "cluster.%s[%d]" % (role, i)
            if address in seen:
                _fail(field, "%r is also %s: two tasks cannot share an address" % (address,
                                                                                   seen[address]),
                      "Give every task its own host:port.")
            seen[address] = field
    if "chief" in cluster and len(cluster["chief"]) != 1:
        _fail("cluster.chief", "has %d tasks" % len(cluster["chief"]), "A cluster has at most one chief.")
    task = config.get("task")
    if task is None:
        _fail("task", "missing", 'Set "task" to {"type": "worker", "index": N} for this process.')
    if not isinstance(task, dict):
        _fail("task", "must be an object", 'Set "task" to {"type": "worker", "index": N}.')
    task_type = task.get("type")
    if task_type is None:
        _fail("task.type", "missing", "Set it to one of the roles in cluster: %s." % sorted(cluster))
    if task_type not in KNOWN_ROLES:
        _fail("task.type", "unknown role %r" % (task_type,), "Use one of %s." % ", ".join(KNOWN_ROLES))
    if task_type not in cluster and task_type != "evaluator":
        _fail("task.type", "role %r has no addresses in cluster" % task_type,
              "Add cluster.%s or fix task.type (cluster has %s)." % (task_type, sorted(cluster)))
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        _fail("task.index", "must be an integer, got %r" % (index,), "Set it to this task's position.")
    if task_type != "evaluator" and not 0 <= index < len(cluster[task_type]):
        _fail("task.index", "%d is out of range for role %r with %d task(s)"
              % (index, task_type, len(cluster[task_type])),
              "Use an index in [0, %d)." % len(cluster[task_type]))
    return ClusterConfig(cluster=cluster, task_type=task_type, task_index=index)


SYNCHRONOUS_ROLES = ("chief", "worker")


def check_synchronous_roles(config: ClusterConfig, strategy: str = "NestPipeStrategy"):
    """Refuses a task (e.g. `evaluator`, `ps`) that a synchronous strategy cannot run, naming
    the fix, instead of failing inside TensorFlow."""
    if config.task_type in SYNCHRONOUS_ROLES:
        return
    if config.task_type == "evaluator":
        fix = ("Evaluate in a separate process without TF_CONFIG (or in the chief / worker 0 "
               "after fit); a side-car evaluator is a ParameterServerStrategy feature.")
    else:
        fix = ("Run the %s task with `python -m tf_nestpipe.server` (parameter-server mode, "
               "tnp.ParameterServerStrategy), or remove it." % config.task_type)
    _fail("task.type", "%s does not support the role %r (it runs only chief and worker tasks)"
          % (strategy, config.task_type), fix)
