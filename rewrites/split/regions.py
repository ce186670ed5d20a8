"""Regions: the connected part of a graph that one loop computes chunk by chunk.

Growing from an oversized tensor and one of its axes, a region takes in every op the
split can pass through (by the ops' dimension classes, see `rules`):

- downwards, consumers that map the split axis to an output join the region; consumers
  that reduce it (a sum, a contraction, a top-k) join as *sinks*, whose results are
  accumulated across chunks; any other consumer makes the tensor a *write-out*,
  assembled in full from its chunks (fine when it is small, reported when it is not);
- upwards, producers of large inputs join too (they are recomputed per chunk), while
  small inputs are sliced per chunk, and inputs without the split axis are passed whole.

A region must be convex (no path leaves it and comes back), so that one loop can run
after its inputs and before its readers; nodes that would break this are dropped.
"""
from __future__ import annotations

import dataclasses

from tfmem.graph import Graph, TensorRef

from rewrites.split.rules import DimClass, NoRule, class_of, dim_classes

# Graph inputs: a region slices them, never recomputes them, and they are never split.
GRAPH_INPUT_OPS = frozenset({"Placeholder", "Const", "ReadVariableOp", "VarHandleOp"})


@dataclasses.dataclass
class Region:
    """A set of nodes split along one dimension of length `size`.

    Attributes:
        seed: the oversized tensor it grew from.
        size: the length of the split dimension.
        axes: the split axis of each region tensor and of each sliced input.
        nodes: region nodes in topological order (sinks included).
        sinks: sink node → how its per-chunk results combine ("sum", "max", "topk", ...).
        boundaries: tensor → why a reader of it could not join the region.
    """

    seed: TensorRef
    size: int
    axes: dict[TensorRef, int]
    nodes: list[str]
    sinks: dict[str, str]
    boundaries: dict[TensorRef, str] = dataclasses.field(default_factory=dict)

    def inputs(self, graph: Graph) -> list[TensorRef]:
        """Tensors read by region nodes and produced outside it, in first-use order."""
        members = set(self.nodes)
        found: dict[TensorRef, None] = {}
        for name in self.nodes:
            for ref in graph.inputs(name):
                if ref.node not in members:
                    found[ref] = None
        return list(found)

    def write_outs(self, graph: Graph) -> list[TensorRef]:
        """Split tensors that something outside the region reads (or the graph returns)."""
        members = set(self.nodes)
        result = []
        for name in self.nodes:
            if name in self.sinks:
                continue
            for index in range(len(graph.output_specs(name))):
                ref = TensorRef(name, index)
                readers = {consumer for consumer, _ in graph.consumers(ref)}
                if graph.is_output(ref) or readers - members:
                    result.append(ref)
        return result

    def per_unit_bytes(self, graph: Graph) -> int:
        """Bytes of the largest split tensor per unit of the split dimension."""
        return max((graph.nbytes(ref) or 0) // self.size for ref in self.axes)


class _Grower:
    def __init__(self, graph: Graph, large: int) -> None:
        self.graph = graph
        self.large = large  # an input bigger than this is recomputed, not sliced
        self.classes: dict[str, list[DimClass] | str] = {}

    def classes_of(self, name: str) -> list[DimClass] | str:
        if name not in self.classes:
            try:
                self.classes[name] = dim_classes(self.graph, name)
            except NoRule as reason:
                self.classes[name] = str(reason)
        return self.classes[name]

    def grow(self, seed: TensorRef, axis: int) -> Region | str:
        graph = self.graph
        size = graph.spec(seed).shape[axis]
        axes: dict[TensorRef, int] = {}
        members: dict[str, DimClass] = {}
        sinks: dict[str, str] = {}
        boundaries: dict[TensorRef, str] = {}
        whole: set[TensorRef] = set()  # inputs some region node reads unsplit
        pending: list[str] = []

        def try_add(name: str, via: TensorRef, via_axis: int) -> str | None:
            """Adds node `name` (reached through tensor `via` split at `via_axis`), or says why not."""
            classes = self.classes_of(name)
            if isinstance(classes, str):
                return classes
            node = graph.node(name)
            if node.op in GRAPH_INPUT_OPS:
                return f"{node.op} is a graph input"
            dim_class = class_of(classes, via, via_axis)
            if dim_class is None:
                return f"{node.op} cannot split {via} along axis {via_axis}"
            for ref, ref_axis in dim_class.members:
                if axes.get(ref, ref_axis) != ref_axis:
                    return f"{ref} would be split along two axes"
                if ref in whole:
                    return f"{ref} is read whole by another node of the region"
            split_here = dict(dim_class.members)
            for ref in graph.inputs(name):
                # Every reader in the loop sees the same chunk of a split tensor, so a node
                # cannot read one tensor both split and whole (e.g. x in x @ xᵀ split by rows).
                if ref in split_here:
                    roles = sum(1 for c in classes if (ref, split_here[ref]) in c.members)
                    if roles > 1:
                        return f"{node.op} reads {ref} in two roles that split differently"
                elif ref in axes:
                    return f"{node.op} reads split tensor {ref} whole"
            if graph.control_inputs(name):
                return f"{name} waits on control inputs, which a loop body cannot keep"
            if graph.control_dependants(name):
                return f"{name} has control dependants"
            members[name] = dim_class
            axes.update(dim_class.members)
            whole.update(ref for ref in graph.inputs(name) if ref not in split_here)
            if dim_class.combine is not None:
                sinks[name] = dim_class.combine
            pending.append(name)
            return None

        producer = seed.node
        why = try_add(producer, seed, axis)
        if why is not None:
            return f"its producer cannot be split along axis {axis}: {why}"
        while pending:
            name = pending.pop()
            dim_class = members[name]
            for ref, ref_axis in dim_class.members:
                if ref.node not in members:  # an input: recompute it if large, else slice it
                    nbytes = graph.nbytes(ref) or 0
                    if nbytes > self.large and graph.node(ref.node).op not in GRAPH_INPUT_OPS:
                        try_add(ref.node, ref, ref_axis)
                    continue
                if ref.node in sinks:  # sink outputs are accumulated, not split
                    continue
                for consumer, _ in graph.consumers(ref):
                    if consumer in members:
                        continue
                    why = try_add(consumer, ref, ref_axis)
                    if why is not None:
                        boundaries[ref] = why
        order = [n for n in graph.topological_order() if n in members]
        region = Region(seed, size, {r: a for r, a in axes.items()}, order, sinks, boundaries)
        _make_convex(graph, region)
        if not region.nodes:
            return "nothing can be computed in chunks"
        return region


def _make_convex(graph: Graph, region: Region) -> None:
    """Drops region nodes that read (through outside nodes) what the region itself computes."""
    while True:
        members = set(region.nodes)
        downstream: set[str] = set()  # outside nodes that depend on the region
        for name in graph.topological_order():  # producers first: one sweep finds them all
            if name in members:
                continue
            producers = {r.node for r in graph.inputs(name)} | set(graph.control_inputs(name))
            if producers & (members | downstream):
                downstream.add(name)
        bad = [name for name in region.nodes
               if {r.node for r in graph.inputs(name)} & downstream]
        if not bad:
            break
        drop = set(bad)
        for name in region.nodes:  # and everything in the region below them
            if {r.node for r in graph.inputs(name)} & drop:
                drop.add(name)
        for name in drop:
            for ref in graph.inputs(name):
                if ref.node in members and ref.node not in drop:
                    region.boundaries[ref] = f"{name} depends on the region through outside nodes"
        region.nodes = [n for n in region.nodes if n not in drop]
        region.sinks = {n: c for n, c in region.sinks.items() if n not in drop}
    members = set(region.nodes)
    used = {ref for name in region.nodes for ref in graph.inputs(name)}
    region.axes = {ref: axis for ref, axis in region.axes.items()
                   if ref.node in members and ref.node not in region.sinks or ref in used}


def grow_region(graph: Graph, seed: TensorRef, axis: int, large: int) -> Region | str:
    """The region grown from `seed` split along `axis`, or the reason there is none.

    Args:
        large: inputs over this many bytes are recomputed inside the loop, not sliced.
    """
    return _Grower(graph, large).grow(seed, axis)
