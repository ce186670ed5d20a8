"""Cleanup: a pure op whose result no effect waits on need not wait for anything.

    n(x, ^g) → n(x)      when n is pure and no stateful op depends on n (by data or control)

TensorFlow's gradients order some of their work by control edges: `Cos`'s gradient is
`with control_dependencies([grad]): -grad * sin(x)`, so `sin(x)` waits on `grad`
(likewise Sin, Acos, Square, Reciprocal, RealDiv, ...). The edge only delays when a value
is computed, and XLA, which compiles the function, schedules pure ops by their data alone.
But it pins both ends in place: a node with control inputs or control dependants cannot
move into a split loop, so in GPflow's ArcCosine, Periodic and Cosine kernels every
[M, N] tensor of the gradient stayed whole ("waits on control inputs, which a loop body
cannot keep").

Conditions (where ordering can matter, the edge stays):
- `n` is pure: not stateful, calls no function, is no v1 control-flow op, and is not a
  control output the function must run;
- no stateful op, function call or control output is reachable from `n`: an ordering
  `effect → g → n → effect` would be lost with the edge;
- `g` is pure and waits, by control edges, on nothing ordered (an edge from a variable
  write, or from the `NoOp` that groups a function's writes, is kept as it is).
"""
from __future__ import annotations

from tfmem.context import PassContext
from tfmem.graph import ORDERED_OPS, Graph
from tfmem.passes import GraphPass, PassResult, RewriteRecord


def _ordered(graph: Graph, name: str) -> bool:
    """Whether the moment node `name` runs may matter: an effect, a call, a frame, a kept node."""
    node = graph.node(name)
    return (name in graph.keep or node.op in ORDERED_OPS or graph.is_stateful(name)
            or graph.function(node.op) is not None
            or any(value.HasField("func") or len(value.list.func) for value in node.attr.values()))


def _feeds_ordered(graph: Graph, ordered: dict[str, bool]) -> dict[str, bool]:
    """Node → whether an ordered node is reachable from it (itself included), by data or control."""
    reaches: dict[str, bool] = {}
    for name in reversed(graph.topological_order()):
        reaches[name] = ordered[name] or any(reaches[c] for c in graph.node_consumers(name))
    return reaches


def _waits_on_ordered(graph: Graph, ordered: dict[str, bool]) -> dict[str, bool]:
    """Node → whether it is ordered or waits, through control edges alone, on an ordered node."""
    waits: dict[str, bool] = {}
    for name in graph.topological_order():
        waits[name] = ordered[name] or any(waits[p] for p in graph.control_inputs(name))
    return waits


class DropOrderOnlyControlEdges(GraphPass):
    """Drops control edges between pure ops that no effect depends on. See the module docstring."""

    name = "drop_order_only_control_edges"
    stage = "cleanup"
    reads = frozenset()  # no config key: the graph alone decides

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        ordered = {name: _ordered(graph, name) for name in graph.topological_order()}
        reaches, waits = _feeds_ordered(graph, ordered), _waits_on_ordered(graph, ordered)
        dropped = [(node.name, producer) for node in graph.nodes if not reaches[node.name]
                   for producer in graph.control_inputs(node.name) if not waits[producer]]
        for name, producer in dropped:
            graph.remove_control_input(name, producer)
        records = [RewriteRecord(self.name, "DropOrderOnlyControlEdges", "fired",
                                 tuple(dict.fromkeys(n for n, _ in dropped)), kind="cleanup",
                                 details={"edges": len(dropped)})] if dropped else []
        return PassResult(graph, bool(dropped), records)
