"""Regions: the connected part of a graph that one loop computes chunk by chunk.

Growing from an oversized tensor and one of its axes, a region takes in every op the
split can pass through (by the ops' dimension classes, see `op_rules`):

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
from collections.abc import Collection

from tfmem.graph import Graph, TensorRef

from rewrites.split.compared import mixed_comparisons
from rewrites.split.op_rules import DimClass, NoRule, class_of, dim_classes

# Graph inputs: a region slices them, never recomputes them, and they are never split.
GRAPH_INPUT_OPS = frozenset({"Placeholder", "Const", "ReadVariableOp", "VarHandleOp"})
# A slice's gradient pads its `dy` back to the sliced tensor's shape. One no bigger than a
# chunk saves nothing in a loop; it only takes the region on through what reads it (GPflow
# SGPR's [N] likelihood-variance gradient) and makes the loop's chunks narrower. Against
# narrower chunks XLA hoists its triangular solves' blocks of the factor out of the loop:
# at M=3,600 it planned 549.1 MiB with the slice's gradient in the loop, 491.7 without.
SMALL_PAD_OPS = frozenset({"StridedSliceGrad"})


@dataclasses.dataclass(frozen=True)
class Feed:
    """A tensor from outside a region, as its loop reads it: sliced along `axis`, or whole."""

    ref: TensorRef
    axis: int | None


@dataclasses.dataclass
class SliceRegion:
    """A set of nodes split along one dimension of length `size`.

    Attributes:
        seed: the oversized tensor it grew from.
        size: the length of the split dimension.
        axes: the split axis of each region tensor and of each sliced input.
        nodes: region nodes in topological order (sinks included).
        sinks: sink node → how its per-chunk results combine ("sum", "max", "topk", ...).
        boundaries: tensor → why a reader of it could not join the region.
        whole_reads: input positions `(node, position)` that read an outside tensor whole
            although other positions slice it (`X` in `X @ Xᵀ`, split by rows).
    """

    seed: TensorRef
    size: int
    axes: dict[TensorRef, int]
    nodes: list[str]
    sinks: dict[str, str]
    boundaries: dict[TensorRef, str] = dataclasses.field(default_factory=dict)
    whole_reads: set[tuple[str, int]] = dataclasses.field(default_factory=set)

    def feed_of(self, name: str, position: int, ref: TensorRef) -> Feed | None:
        """What input `position` of region node `name` (reading `ref`) is fed from outside
        the region: the tensor and its split axis (None: whole); None for a region tensor."""
        if ref.node in self.nodes:
            return None
        whole = (name, position) in self.whole_reads or ref not in self.axes
        return Feed(ref, None if whole else self.axes[ref])

    def feeds(self, graph: Graph) -> list[Feed]:
        """Everything the region reads from outside, each once, in first-use order."""
        found: dict[Feed, None] = {}
        for name in self.nodes:
            for position, ref in enumerate(graph.inputs(name)):
                feed = self.feed_of(name, position, ref)
                if feed is not None:
                    found[feed] = None
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

    def left_whole(self, graph: Graph, max_write_out: int, *, assemble_returned: bool = True) -> list[TensorRef]:
        """Write-outs a loop leaves to their original ops (`rewrites.split.loops.emit_loop`):
        those over `max_write_out` bytes, but (with `assemble_returned`) what the program
        returns, which is held whole anyway and so assembled from the chunks."""
        return [ref for ref in self.write_outs(graph) if (graph.nbytes(ref) or 0) > max_write_out
                and not (assemble_returned and graph.is_returned(ref))]

    def without(self, graph: Graph, names: Collection[str], why: str) -> SliceRegion:
        """The region without `names`, which its other nodes must not feed: what they make
        is read from outside instead, sliced along its axis; `why` says why they left."""
        drop = set(names)
        region = dataclasses.replace(
            self, nodes=[n for n in self.nodes if n not in drop],
            sinks={n: c for n, c in self.sinks.items() if n not in drop},
            boundaries={**self.boundaries, **{TensorRef(n, i): why for n in self.nodes if n in drop
                                              for i in range(len(graph.output_specs(n)))}})
        _trim(graph, region)
        return region

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

    def grow(self, seed: TensorRef, axis: int) -> SliceRegion | str:
        graph = self.graph
        size = graph.spec(seed).shape[axis]
        axes: dict[TensorRef, int] = {}
        members: dict[str, DimClass] = {}
        sinks: dict[str, str] = {}
        boundaries: dict[TensorRef, str] = {}
        whole: set[TensorRef] = set()  # inputs some region node reads unsplit
        whole_reads: set[tuple[str, int]] = set()
        pending: list[str] = []

        def try_add(name: str, via: TensorRef, via_axis: int) -> str | None:
            """Adds node `name` (reached through tensor `via` split at `via_axis`), or says why not."""
            classes = self.classes_of(name)
            if isinstance(classes, str):
                return classes
            node = graph.node(name)
            if node.op in GRAPH_INPUT_OPS:
                return f"{node.op} is a graph input"
            if node.op in SMALL_PAD_OPS and (graph.nbytes(TensorRef(name)) or 0) <= self.large:
                return f"{node.op} {name} makes a tensor no bigger than a chunk: it stays outside, its input written out"
            dim_class = class_of(classes, via, via_axis)
            if dim_class is None:
                return f"{node.op} cannot split {via} along axis {via_axis}"
            for ref, ref_axis in dim_class.tensors():
                if axes.get(ref, ref_axis) != ref_axis:
                    return f"{ref} would be split along two axes"
                if ref.node == name and ref in whole:
                    return f"{ref} is read whole by another node of the region"
            split_positions = dim_class.operands()
            reads_whole = []
            for position, ref in enumerate(graph.inputs(name)):
                if position in split_positions:
                    continue
                # Every reader in the loop sees the same chunk of a tensor the loop computes;
                # a tensor from outside can be fed both sliced and whole (x in x @ xᵀ).
                if ref.node in members or ref.node == name:
                    return f"{node.op} reads split tensor {ref} whole"
                reads_whole.append((position, ref))
            if graph.control_inputs(name):
                return f"{name} waits on control inputs, which a loop body cannot keep"
            if graph.control_dependants(name):
                return f"{name} has control dependants"
            members[name] = dim_class
            axes.update(dim_class.tensors())
            whole.update(ref for _, ref in reads_whole)
            whole_reads.update((name, position) for position, _ in reads_whole)
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
            for ref, ref_axis in dim_class.tensors():
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
        region = SliceRegion(seed, size, dict(axes), order, sinks, boundaries, whole_reads)
        _make_convex(graph, region)
        if not region.nodes:
            return "nothing can be computed in chunks"
        return region


def _make_convex(graph: Graph, region: SliceRegion) -> None:
    """Drops region nodes that read what the region itself computes, but only has whole
    after the loop: through outside nodes, or straight from a sink (a reduction over the
    split axis, e.g. the mean in `k - mean(k)`, is a partial sum until the last chunk)."""
    while True:
        members = set(region.nodes)
        sinks = set(region.sinks)
        downstream: set[str] = set()  # outside nodes that depend on the region
        for name in graph.topological_order():  # producers first: one sweep finds them all
            if name in members:
                continue
            producers = {r.node for r in graph.inputs(name)} | set(graph.control_inputs(name))
            if producers & (members | downstream):
                downstream.add(name)
        bad = [name for name in region.nodes
               if {r.node for r in graph.inputs(name)} & (downstream | sinks)]
        if not bad:
            break
        drop = set(bad)
        for name in region.nodes:  # and everything in the region below them
            if {r.node for r in graph.inputs(name)} & drop:
                drop.add(name)
        for name in drop:
            for ref in graph.inputs(name):
                if ref.node in members and ref.node not in drop:
                    region.boundaries[ref] = (
                        f"{name} reads {ref.node}, a reduction over the split axis, complete only "
                        "after the loop" if ref.node in sinks
                        else f"{name} depends on the region through outside nodes")
        region.nodes = [n for n in region.nodes if n not in drop]
        region.sinks = {n: c for n, c in region.sinks.items() if n not in drop}
    _trim(graph, region)


def _trim(graph: Graph, region: SliceRegion) -> None:
    """Keeps the axes and whole reads of what the region's nodes still make or read."""
    members = set(region.nodes)
    used = {ref for name in region.nodes for ref in graph.inputs(name)}
    region.axes = {ref: axis for ref, axis in region.axes.items()
                   if ref.node in members and ref.node not in region.sinks or ref in used}
    region.whole_reads = {(name, position) for name, position in region.whole_reads if name in members}


def mixed_in_loop(graph: Graph, region: SliceRegion, max_write_out: int, *,
                  assemble_returned: bool = True) -> dict[str, str]:
    """Region nodes a loop of `region` would make beside their originals, which a comparison
    would then see one of on each side (`compared.mixed_comparisons`): node → comparison.

    The originals that stay are those of the tensors the loop leaves whole, and of the
    region nodes they are made from; readers of what the loop writes out or sums read its
    evaluation. A comparison inside the loop reads both operands from its chunk.
    """
    members = set(region.nodes)
    whole = region.left_whole(graph, max_write_out, assemble_returned=assemble_returned)
    kept = graph.ancestors(*{ref.node for ref in whole}) & members if whole else set()
    if not kept:
        return {}
    replaced = [ref for ref in region.write_outs(graph) if ref not in whole] + [
        TensorRef(sink, i) for sink in region.sinks for i in range(len(graph.output_specs(sink)))]
    copies = {ref: graph.ancestors(ref.node) & kept for ref in replaced}
    return mixed_comparisons(graph, copies, kept, skip=members - kept)


def evaluated_once(graph: Graph, region: SliceRegion, max_write_out: int, *,
                   assemble_returned: bool = True) -> SliceRegion | str:
    """`region` without what its loop would make beside an original a comparison also reads
    (`mixed_in_loop`): those nodes, and the region nodes they are made from, stay outside and
    the loop reads them sliced, so that every comparison sees one evaluation; or why the
    region cannot do without them (its seed is among them).

    (A loss with `max(s)`: the loop that sums `s²` in row chunks must not make `s` again
    where `Equal(s, max(s))` reads the whole one and `max(s)` the loop's.)
    """
    while True:
        mixed = mixed_in_loop(graph, region, max_write_out, assemble_returned=assemble_returned)
        if not mixed:
            return region
        name, comparison = min(mixed.items())
        why = (f"{comparison} ({graph.node(comparison).op}) would compare what the loop makes from {name} with "
               f"what the whole {name}, kept for readers outside the loop, makes: the two are equal only to "
               "rounding, and a comparison must see one evaluation")
        drop = graph.ancestors(*mixed) & set(region.nodes)
        if region.seed.node in drop:
            return f"{name} would be made both in the loop and whole: {why}"
        region = region.without(graph, drop, why)


def grow_region(graph: Graph, seed: TensorRef, axis: int, large: int) -> SliceRegion | str:
    """The region grown from `seed` split along `axis`, or the reason there is none.

    Args:
        large: inputs over this many bytes are recomputed inside the loop, not sliced.
    """
    return _Grower(graph, large).grow(seed, axis)
