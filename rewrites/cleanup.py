"""Cleanup: forward pure `Identity` nodes, then drop what no output needs.

    y = Identity(x); z = f(y)   →   z = f(x)

Conditions: the Identity has no control inputs (those order effects), is not itself a
graph output, and reads a tensor of the same dtype. Nodes left without readers are
pruned, except stateful ops, placeholders and the function's control outputs.
Patterns downstream then see `f(x)` directly instead of `f(Identity(x))`.
"""
from __future__ import annotations

from tfmem.context import PassContext
from tfmem.graph import Graph, TensorRef
from tfmem.passes import GraphPass, PassResult, RewriteRecord


class ForwardIdentities(GraphPass):
    """Forwards pure Identity nodes and prunes dead nodes."""

    name = "forward_identities"
    stage = "cleanup"
    reads = frozenset()  # no config key: the graph alone decides

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        forwarded = 0
        for node in list(graph.find("Identity")):
            ref = TensorRef(node.name)
            if graph.control_inputs(node.name) or graph.is_output(ref) or node.name in graph.keep:
                continue
            if graph.control_dependants(node.name):
                continue  # something waits on it by control edge
            forwarded += graph.replace_all_uses(ref, graph.inputs(node.name)[0]) > 0
        pruned = graph.prune()
        records = []
        if forwarded or pruned:
            records.append(RewriteRecord(self.name, "ForwardIdentities", "fired",
                                         details={"forwarded": forwarded, "pruned": len(pruned)}, kind="cleanup"))
        return PassResult(graph, bool(forwarded or pruned), records)
