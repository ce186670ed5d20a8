"""Split at XLA's peak: what XLA holds whole there, computed in chunks instead.

The split planner splits by the static estimate's peak, before the rules that read XLA's
peak run; those make copies of cheap tensors for late readers (`recompute`), each waiting
for a tensor of the program (`order.computed_after`). Where XLA then peaks among the
copies and what reads them — a kernel's gradient: `dK`, the distances made again, and the
maps between, each `[n, n]` and each summed into a small gradient — no loop was ever tried,
and the waits themselves stop one: a tie reads the whole tensor it waits for.

This rule grows a region (`planner.best_region`) from each big tensor XLA holds at its
peak, on the graph as if nothing waited. A region that then computes those tensors in
chunks is emitted, with its waits made to fit the loop:

- a copy's leaf the loop reads (or what the loop reads is made from) waits instead for
  what the loop reads that is made last: it cannot wait for a tensor the loop makes, and
  without a wait XLA would merge the copy in the loop's first chunk, made before the loop,
  with its original, and hold that (VGP: the forward `XXᵀ`, 30.5 MiB, across the solves);
- a wait after the loop on a tensor the loop computes in chunks waits for one of the
  loop's sums instead, which the loop makes last.

Only waits on what the loop computes change. The region must come out the same with the
waits fitted as it did without them, or nothing changes.

XLA's next plan decides whether the loop stays (`tfmem.stages.compile_within_budget`).

Example (GPflow VGP, Matérn-5/2, N=2,000: XLA peaks in the kernel's gradient holding five
`[N, N]` maps of it; one loop of 64 ops computes them in row chunks, summed into the
gradients of the lengthscales and the inputs):
    >>> records = split_at_xla_peak(graph, plan.peak, "split_at_xla_peak", target=2**27, split_size=None)
    >>> records[0].details["tensor"], records[0].details["nodes"]
    ('gradient_tape/mul_4/Mul:0', 64)
"""
from __future__ import annotations

import tensorflow as tf

from tfmem.config import format_size
from tfmem.errors import first_line
from tfmem.graph import Graph, GraphError, TensorRef
from tfmem.memory import WHILE_LOOP_OPS, MemoryEstimate, held_at_xla_peak
from tfmem.passes import RewriteRecord
from tfmem.report import XLA_SPLIT_RULE

from rewrites.split.order import TiedLeaf, can_order, computed_after, made_from_inputs, tied_leaves
from rewrites.split.planner import FIRST_CHUNK_SHARE, Planner, at_least_two_chunks, best_region
from rewrites.split.regions import GRAPH_INPUT_OPS, SliceRegion

# A tensor counts as one XLA holds at its peak when it is at least 1/_WORTH of the peak.
_WORTH = 16


def split_at_xla_peak(graph: Graph, xla_peak: MemoryEstimate, pass_name: str, *, target: int,
                      split_size: int | None) -> list[RewriteRecord]:
    """Computes in chunks, in one loop per region, the big tensors XLA holds at its peak.

    `xla_peak` is XLA's live set at the peak of this graph's previous compile
    (`XlaPlan.peak`). For each tensor of the program in it (at least 1/`_WORTH` of the
    peak, largest first, made by an op outside any loop), the region that leaves fewest
    big tensors whole is grown as if no copy waited for anything (see the module
    docstring). Its loop takes chunks in which every tensor a trip makes, together, is about
    an eighth of the plan's `target`, as the planner's first split at a peak sizes its
    largest one (never over the user's `split_size`). Returns a record per tensor tried.
    """
    chunk_bytes = max(1, min(split_size or target, target // FIRST_CHUNK_SHARE))
    records: list[RewriteRecord] = []
    for live, seed in held_at_xla_peak(graph, xla_peak, worth=_WORTH):
        # A loop emitted for an earlier seed may have taken this one in.
        if seed.node in graph and graph.node(seed.node).op not in GRAPH_INPUT_OPS | WHILE_LOOP_OPS:
            records.append(_split(graph, seed, live.nbytes, xla_peak, pass_name, chunk_bytes, split_size))
    return records


def _split(graph: Graph, seed: TensorRef, nbytes: int, xla_peak: MemoryEstimate, pass_name: str,
           chunk_bytes: int, split_size: int | None) -> RewriteRecord:
    where = f"XLA holds it whole at its peak at {xla_peak.peak_node} ({format_size(xla_peak.peak_bytes)})"

    def rejected(why: str) -> RewriteRecord:
        return RewriteRecord(pass_name, XLA_SPLIT_RULE, "rejected", (seed.node,), kind="split",
                             reason=f"{where}, not split: {why}", details={"tensor": seed.name})

    untied = _untied(graph)
    if seed.node not in untied:
        return rejected("only waits read it")
    region, why = best_region(untied, seed, nbytes - 1, chunk_bytes)
    if region is None:
        return rejected(why)
    before = graph.copy()
    try:
        _fit_ties(graph, region)
        again, why = best_region(graph, seed, nbytes - 1, chunk_bytes)
        if again is None:
            raise GraphError(why)
        lost = [name for name in region.nodes if name not in again.nodes]
        if lost or len(again.nodes) != len(region.nodes):
            raise GraphError("its waits could not be fitted to the loop: it loses "
                             + ", ".join(f"{name} ({again.boundaries.get(TensorRef(name), 'made outside')})"
                                         for name in lost[:3]))
        chunk = at_least_two_chunks(_chunk_for(graph, again, chunk_bytes), again.size)
        planner = Planner(pass_name, graph, split_size=split_size)
        loop = planner.emit(again, chunk, max_write_out=nbytes - 1)
    except (GraphError, ValueError, TypeError, KeyError, tf.errors.OpError) as err:
        graph.assign(before)
        return rejected(first_line(err))
    details = planner.records[-1].details
    return RewriteRecord(pass_name, XLA_SPLIT_RULE, "fired", (seed.node,), kind="split",
                         reason=f"{where}: {len(again.nodes)} ops in {loop.chunks} chunks of {loop.chunk} along axis "
                                f"{again.axes[seed]}", details=details)


def _untied(graph: Graph) -> Graph:
    """A copy of `graph` in which every leaf passed through a tie is read as it is."""
    untied = graph.copy()
    ties = tied_leaves(untied)
    passed_from = _passed_from(ties)
    for tied in ties:
        untied.replace_all_uses(TensorRef(tied.node), _bare(passed_from, tied.leaf))
    untied.prune()
    return untied


def _fit_ties(graph: Graph, region: SliceRegion) -> None:
    """Fits the waits on what `region` computes to its loop (see the module docstring).
    Raises GraphError when one cannot move.

    Only a wait on a tensor the loop computes in chunks changes: one on a tensor outside
    the loop orders what it orders as before, inside the loop or not.
    """
    members = set(region.nodes)
    ends = [TensorRef(sink, i) for sink in region.sinks for i in range(len(graph.output_specs(sink)))
            if graph.spec(TensorRef(sink, i)).dtype.is_floating and graph.spec(TensorRef(sink, i)).shape.num_elements()]
    ties = [tied for tied in tied_leaves(graph) if tied.tie.node in members]
    if not ties:
        return
    passed_from = _passed_from(ties)
    varying = made_from_inputs(graph)
    after_ties = graph.descendants(*(tied.node for tied in ties))  # a wait on these would wait for itself
    feeds = [feed.ref for feed in region.feeds(graph)
             if feed.ref.node not in after_ties and can_order(graph, feed.ref, varying)]
    # The loop's first chunk is made before the loop, outside it: a copy's leaf read there
    # without a wait would let XLA merge the copy with its original, and hold that.
    latest = max(feeds, key=lambda ref: len(graph.ancestors(ref.node)), default=None)
    passed: dict[TensorRef, TensorRef] = {}
    changed = True
    while changed:
        changed = False
        before_loop = graph.ancestors(*members)
        for tied in ties:
            for reader, slot in list(graph.consumers(TensorRef(tied.node))):
                if reader not in before_loop:
                    continue
                if latest is None:
                    raise GraphError(f"{tied.node} waits for {tied.tie.name}, which the loop computes in chunks, "
                                     "and the loop reads nothing made late enough to wait for instead")
                leaf = _bare(passed_from, tied.leaf)
                if leaf not in passed:
                    [passed[leaf]] = graph.splice(computed_after, [latest, leaf], scope="tfmem_split_after")
                graph.set_input(reader, slot, passed[leaf])
                changed = True
    for tied in ties:
        if not graph.consumers(TensorRef(tied.node)):
            continue
        if not ends:
            raise GraphError(f"{tied.node} waits for {tied.tie.name}, which the loop computes in chunks, and the loop "
                             "sums nothing it could wait for instead")
        if tied.first is None:
            raise GraphError(f"{tied.node} waits for {tied.tie.name}, which the loop computes in chunks, and tests "
                             "it whole")
        # A new flattening: the old one's recorded shape is the tensor it flattened.
        [flat] = graph.splice(lambda end: tf.reshape(end, [-1]), [ends[0]], scope="tfmem_split_end")
        for reader, slot in graph.consumers(TensorRef(tied.first)):
            graph.set_input(reader, slot, flat)
    graph.prune()


def _chunk_for(graph: Graph, region: SliceRegion, budget: int) -> int:
    """The chunk length at which every tensor the region makes in a trip, together, is
    about `budget` bytes: XLA holds many of a trip's tensors at once where they have many
    readers (a kernel gradient's maps each feed several sums), not only the largest."""
    per_unit = sum((graph.nbytes(ref) or 0) // region.size for ref in region.axes
                   if ref.node in region.nodes and ref.node not in region.sinks)
    return int(min(region.size, max(1, budget // max(per_unit, 1))))


def _passed_from(ties: list[TiedLeaf]) -> dict[TensorRef, TensorRef]:
    """Each tie's output, mapped to the leaf it passes."""
    return {TensorRef(tied.node): tied.leaf for tied in ties}


def _bare(passed_from: dict[TensorRef, TensorRef], leaf: TensorRef) -> TensorRef:
    """`leaf` before any tie passed it (`passed_from`, from `_passed_from`): a copy of a
    copy passes a leaf through two."""
    while leaf in passed_from:
        leaf = passed_from[leaf]
    return leaf
