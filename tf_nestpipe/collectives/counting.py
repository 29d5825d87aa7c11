"""Counts the cross-worker collectives a traced step issues: on a CPU testbed each costs ~1-3 ms
whatever its size, so their number per step decides the step time."""
import collections

# TensorFlow's collective ops, the socket mesh's all-to-all, and Horovod's (matched by prefix).
_TF_COLLECTIVES = ("CollectiveAllToAllV2", "CollectiveAllToAllV3", "CollectiveGatherV2",
                   "CollectiveReduceV2", "CollectiveReduceScatterV2", "CollectiveBcastSendV2",
                   "CollectiveBcastRecvV2", "CollectiveReduce", "CollectiveGather",
                   "CollectiveBcastSend", "CollectiveBcastRecv", "NestpipeSocketAllToAll")
_BRANCHING = ("If", "StatelessIf", "Case", "StatelessCase")
_LOOPING = ("While", "StatelessWhile")


def is_collective(op_type):
    """Whether an op type is a cross-worker collective."""
    return op_type in _TF_COLLECTIVES or op_type.startswith("Horovod")


def called_functions(node, library):
    """The functions of `library` that `node` runs: a call's, a branch's or a loop's bodies.

    Args:
      node: A `NodeDef`.
      library: `{function name: FunctionDef}` of the graph the node belongs to.

    Returns:
      Their names, in attribute order (a name may repeat).
    """
    names = [attr.func.name for attr in node.attr.values() if attr.func.name]
    names += [f.name for attr in node.attr.values() for f in attr.list.func]
    return [name for name in names if name in library]


def collective_issuers(graph_def):
    """A predicate telling whether a node of `graph_def` issues a collective: is one, or runs a
    function of its library that (at any depth) does.

    Args:
      graph_def: A `GraphDef` with its function library.

    Returns:
      `issues(node) -> bool`, memoized per function.
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    issuing = {}

    def function_issues(name):
        if name not in issuing:
            issuing[name] = False  # recursion guard
            issuing[name] = any(issues(n) for n in library[name].node_def)
        return issuing[name]

    def issues(node):
        return is_collective(node.op) or any(
            function_issues(name) for name in called_functions(node, library))

    return issues


class CollectiveCount(collections.namedtuple("CollectiveCount", ["always", "conditional"])):
    """Collectives of one step: `always` issued every step, `conditional` inside a branch or a
    loop (e.g. the keys exchange's overflow round); each a `{op type: count}` dict."""

    @property
    def total(self):
        """Collectives issued every step."""
        return sum(self.always.values())

    def describe(self):
        """A short line, e.g. `3 (CollectiveAllToAllV2 2, CollectiveReduceV2 1) + 1 conditional`."""
        parts = ", ".join("%s %d" % item for item in sorted(self.always.items()))
        text = "%d (%s)" % (self.total, parts) if parts else "0"
        extra = sum(self.conditional.values())
        return text + (" + %d conditional" % extra if extra else "")


def count_collectives(graph):
    """The `CollectiveCount` of a (function) graph, nested functions included: calls count as
    their bodies, a branch as its costliest branch (conditional), loop bodies as conditional."""
    graph_def = graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    cache = {}

    def of_nodes(nodes):
        always, conditional = collections.Counter(), collections.Counter()
        for node in nodes:
            if is_collective(node.op):
                always[node.op] += 1
                continue
            bodies = [of_function(name) for name in called_functions(node, library)]
            if node.op in _BRANCHING:  # one branch runs: the costliest counts
                bodies = [max(bodies, key=lambda c: sum(c[0].values()) + sum(c[1].values()),
                              default=(collections.Counter(), collections.Counter()))]
            # A call's body runs whenever the node does; a branch or a loop body may not.
            into = always if node.op not in _BRANCHING + _LOOPING else conditional
            for inner in bodies:
                into.update(inner[0])
                conditional.update(inner[1])
        return always, conditional

    def of_function(name):
        if name not in cache:
            cache[name] = (collections.Counter(), collections.Counter())  # recursion guard
            cache[name] = of_nodes(library[name].node_def)
        return cache[name]

    always, conditional = of_nodes(graph_def.node)
    return CollectiveCount(dict(always), dict(conditional))
