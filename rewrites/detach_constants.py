"""Cleanup: a constant waits for nothing.

    Const(^x) → Const

TensorFlow's gradient code builds some constants under a control dependency on the op
being differentiated (`gradient_tape/Const_8` waiting on `gradient_tape/Tile_5`). The
edge only orders when a value that never changes is produced, but it pins its producer
in place: a node something waits on cannot move into a split loop, so an [M, N] tile
would stay whole. Dropping the edge changes no value.

Conditions: the node is a `Const` (stateless, no data inputs); it keeps its data readers.
"""
from __future__ import annotations

from tfmem.context import PassContext
from tfmem.graph import Graph
from tfmem.passes import GraphPass, PassResult, RewriteRecord


class DetachConstants(GraphPass):
    """Drops the control inputs of `Const` nodes."""

    name = "detach_constants"
    stage = "cleanup"
    reads = frozenset()  # no config key: the graph alone decides

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        detached = [(node.name, producer) for node in graph.find("Const")
                    for producer in graph.control_inputs(node.name)]
        for name, producer in detached:
            graph.remove_control_input(name, producer)
        records = [RewriteRecord(self.name, "DetachConstants", "fired", tuple(dict.fromkeys(n for n, _ in detached)),
                                 kind="cleanup", details={"edges": len(detached)})] if detached else []
        return PassResult(graph, bool(detached), records)
