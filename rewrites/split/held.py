"""Reduced before XLA's peak: a big tensor XLA holds across it only to reduce it later.

Cheap ops that fold a big tensor into a smaller one (slices, reshapes, a sum) are ones
XLA fuses into whatever reads their result, and it may run that reader last: the big
tensor then stays alive across the program's peak. GPflow's VGP is one. The gradient of
its `[N, N]` `q_sqrt`, `dq = Lᵀ·dLTA`, is folded by `fill_triangular`'s gradient into the
`N(N + 1)/2` parameter vector; XLA fused the fold into the final sum of the parameter's
gradient and ran it after the Cholesky gradient, holding `dq` beside that gradient's
three `[N, N]` matrices.

An order on the fold's result alone (`order.computed_after`) does not help: XLA fuses
the fold again into the tie and reads one element of `dq` there. So the fold runs in a
`tf.while_loop` of one trip, whose count XLA cannot know before the program runs (it is
two when `dq`'s first element is NaN; the body computes the same each trip). XLA neither
removes nor fuses through such a loop; `dq` dies in it, and the op at XLA's peak reads
one of its inputs through an exact zero computed from the loop's result:

    dq = Lᵀ·dLTA                               dq = Lᵀ·dLTA
    P  = Lᵀ·dL              (XLA's peak)  →    r  = loop once: fold(dq)      (dq dies)
    g  = fold(dq) + other                      P  = Lᵀ·(dL − 0·(r₀ ≠ r₀))
                                               g  = r + other

The fold is walked from the big tensor through cheap ops up to small results or to a sum
(`AddN`, `AddV2`) with operands from elsewhere; the loop returns the small results and,
for each such sum, the sum of its operands that come from the big tensor. XLA's next
plan decides whether the change stays (`tfmem.stages.compile_within_budget`).

Example (GPflow VGP, Linear kernel, N=2,000 under 192 MiB; `dq` is XLA's `dot.155`):
    >>> records = reduce_held_before_xla_peak(graph, plan.peak, "reduce_held_before_xla_peak")
    >>> records[0].details["tensor"], records[0].details["before"]
    ('gradient_tape/MatMul_2/MatMul_1', 'gradient_tape/MatMul')
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf

from tfmem.config import format_size
from tfmem.graph import Graph, GraphError, TensorRef, copy_node, set_node_inputs
from tfmem.memory import MemoryEstimate, graph_node_for, xla_schedule
from tfmem.passes import RewriteRecord
from tfmem.report import XLA_HELD_RULE

from rewrites.split.diagonals import bands_offset_by
from rewrites.split.fragment import fragment
from rewrites.split.order import can_order, computed_after, input_to_tie, made_from_inputs, once_in_a_loop
from rewrites.split.recompute import CHEAP_OPS, PRODUCT_OPS

# A fold may pass through this many ops before its results are small or summed.
_MAX_WALK = 24
# Ops a fold passes through besides the cheap ones: pads (a slice's gradient).
_FOLD_OPS = CHEAP_OPS | frozenset({"StridedSliceGrad", "Pad", "PadV2", "AddN"})
_SUM_OPS = frozenset({"AddN", "AddV2", "Add"})
# A fold's result is small at 1/_SMALL of the tensors it looks for: a scalar, a vector.
_SMALL = 16


@dataclasses.dataclass(frozen=True)
class Fold:
    """What cheap ops reduce a big tensor to (`find_fold`).

    Attributes:
        source: the big tensor.
        nodes: the ops of the fold, in topological order (they read the source or each other).
        small: small results of the fold read by ops outside it.
        sums: sum node → the positions of its operands that come from the fold.
    """

    source: TensorRef
    nodes: tuple[str, ...]
    small: tuple[TensorRef, ...]
    sums: dict[str, tuple[int, ...]]

    def nbytes(self, graph: Graph) -> int:
        """The bytes of what the loop returns: the small results and one partial sum per sum."""
        partial = sum(graph.nbytes(graph.inputs(name)[slots[0]]) or 0 for name, slots in self.sums.items())
        return partial + sum(graph.nbytes(ref) or 0 for ref in self.small)


def find_fold(graph: Graph, source: TensorRef, small: int) -> Fold | str:
    """The fold of `source` (see `Fold`), or why it has none.

    Every reader of a big tensor on the way must be a cheap op (`_FOLD_OPS`, without
    control edges or state), or a sum. A tensor of at most `small` bytes ends the walk; so
    does a sum some of whose operands the fold does not make (it is summed in part). No big
    tensor on the way may be an output of the program, and no op of the fold may read what
    its results make (the loop runs before their readers).
    """
    walked: set[str] = set()
    small_results: list[TensorRef] = []
    waiting: dict[str, set[int]] = {}  # sums reached, by the positions the fold feeds
    stack = [source]
    while stack:
        while stack:
            ref = stack.pop()
            nbytes = graph.nbytes(ref)
            if nbytes is None:
                return f"{ref.name} has no static size"
            if ref != source and nbytes <= small:
                if ref not in small_results:
                    small_results.append(ref)
                continue
            if graph.is_output(ref):
                return f"{ref.name} ({format_size(nbytes)}) is an output of the program"
            for reader, slot in graph.consumers(ref):
                node = graph.node(reader)
                if reader in walked:
                    continue
                if node.op not in _FOLD_OPS:
                    return f"{ref.name} ({format_size(nbytes)}) is read by {reader} ({node.op})"
                if graph.control_inputs(reader) or graph.control_dependants(reader) or graph.is_stateful(reader):
                    return f"{reader} has control edges or state"
                if node.op in _SUM_OPS:
                    waiting.setdefault(reader, set()).add(slot)
                    continue
                walked.add(reader)
                stack.extend(TensorRef(reader, i) for i in range(len(graph.output_specs(reader))))
        # A sum all of whose operands the fold makes is part of it: the walk goes on from it.
        for name in [name for name, slots in waiting.items() if len(slots) == len(graph.inputs(name))]:
            del waiting[name]
            walked.add(name)
            stack.extend(TensorRef(name, i) for i in range(len(graph.output_specs(name))))
        if len(walked) > _MAX_WALK:
            return f"{source.name} flows through more than {_MAX_WALK} ops before it is small or summed"
    if not waiting and not small_results:
        return f"{source.name} is not reduced to anything"
    if any(not graph.spec(graph.inputs(name)[next(iter(slots))]).dtype.is_floating for name, slots in waiting.items()):
        return "a sum it flows into is not of floating-point tensors"
    # The loop runs before what reads its results: its ops must not read what those make
    # (`K + c·I` as `AddDiagonal` writes it: the diagonal is read off, summed, and set back).
    downstream = graph.descendants(*walked) - walked
    if any(ref.node in downstream for name in walked for ref in graph.inputs(name)):
        return f"{source.name}'s fold reads what its own results make"
    order = [name for name in graph.topological_order() if name in walked]
    return Fold(source, tuple(order), tuple(small_results),
                {name: tuple(sorted(slots)) for name, slots in waiting.items()})


def reduce_held_before_xla_peak(graph: Graph, xla_peak: MemoryEstimate, pass_name: str,
                                *, worth: int = 8) -> list[RewriteRecord]:
    """Folds, before the op at XLA's peak, a big tensor XLA holds there only to fold later.

    `xla_peak` is XLA's live set at the peak of this graph's previous compile
    (`XlaPlan.peak`). A candidate is a tensor of the graph as big as a buffer XLA holds
    there (at least 1/`worth` of the peak, named for it or for no node of the graph), that
    the op at the peak neither reads nor leads to, and whose fold (`find_fold`) returns
    fewer bytes than it. The largest candidate's fold runs in a loop of one trip (see the
    module docstring) that the op at the peak waits for. Returns one record: fired, or
    rejected with the reason.
    """
    def rejected(reason: str) -> list[RewriteRecord]:
        return [RewriteRecord(pass_name, XLA_HELD_RULE, "rejected", (peak_node or "",), kind="split",
                              reason=f"nothing folded before XLA's peak at {xla_peak.peak_node}: {reason}")]

    peak_node = graph_node_for(graph, xla_peak.peak_node or "")
    if peak_node is None:
        return rejected("it is at no op of the program's own graph")
    big = xla_peak.peak_bytes // worth
    # What XLA holds there: nodes of the graph by name, and buffers of XLA's own naming
    # (`XLA's dot.155`) by size and by whether a product made them.
    held_nodes: set[str] = set()
    held_unnamed: set[tuple[int, bool]] = set()
    for live in xla_peak.live_at_peak:
        if live.nbytes < big:
            break  # largest first
        node = graph_node_for(graph, live.name)
        if node is not None:
            held_nodes.add(node)
        elif live.name.startswith("XLA's "):
            held_unnamed.add((live.nbytes, live.name[len("XLA's "):].startswith("dot")))
    if not held_nodes and not held_unnamed:
        return rejected(f"XLA holds no buffer of {format_size(big)} or more there")
    before_peak = graph.ancestors(peak_node)
    xla_order = xla_schedule(graph, xla_peak)
    peak_step = xla_order.get(peak_node)
    after_peak = graph.descendants(peak_node)
    read_at_peak = {ref.node for ref in graph.inputs(peak_node)}
    varying = made_from_inputs(graph)
    reasons: list[str] = []
    candidates: list[tuple[int, int, Fold]] = []  # (bytes held, bytes folded to, fold)
    for node in graph.nodes:
        if node.name in after_peak or node.name in read_at_peak or node.name == peak_node:
            continue
        for index in range(len(graph.output_specs(node.name))):
            ref = TensorRef(node.name, index)
            nbytes = graph.nbytes(ref) or 0
            if not can_order(graph, ref, varying):
                continue  # XLA could fold the loop's trip count, and the order with it
            if node.name not in held_nodes and (nbytes, node.op in PRODUCT_OPS) not in held_unnamed:
                continue
            if peak_step is not None and any(xla_order.get(name, -1) >= peak_step
                                             for name in graph.ancestors(node.name)):
                continue  # XLA made it after its peak: not what it holds there
            fold = find_fold(graph, ref, small=big // _SMALL)
            if isinstance(fold, str):
                reasons.append(fold)
                continue
            folded = fold.nbytes(graph)
            if folded >= nbytes:
                reasons.append(f"{ref.name} folds to {format_size(folded)}, no less than itself")
                continue
            if any(name in before_peak or name == peak_node for name in fold.nodes):
                reasons.append(f"the op at XLA's peak needs {ref.name}'s fold")
                continue
            if _fold_feeds(graph, fold) & after_peak:
                reasons.append(f"{ref.name}'s fold reads what the op at XLA's peak makes")
                continue
            candidates.append((nbytes, folded, fold))
    if not candidates:
        return rejected("; ".join(dict.fromkeys(reasons[:3])) or "XLA holds no tensor there that a cheap fold reduces")
    nbytes, folded, fold = max(candidates, key=lambda c: c[0] - c[1])
    slot = input_to_tie(graph, peak_node, prefer_made_by=CHEAP_OPS)
    if slot is None:
        return rejected(f"{peak_node} reads no floating-point tensor to order")
    checkpoint = graph.copy()
    try:
        results = _fold_in_loop(graph, fold)
        tie = max(results, key=lambda ref: graph.nbytes(ref) or 0)
        [leaf] = graph.splice(computed_after, [tie, graph.inputs(peak_node)[slot]], scope="tfmem_fold_before")
        graph.set_input(peak_node, slot, leaf)
    except (GraphError, ValueError, TypeError, KeyError) as err:
        graph.assign(checkpoint)
        return rejected(f"{fold.source.name}'s fold could not be put in a loop: {err}")
    return [RewriteRecord(
        pass_name, XLA_HELD_RULE, "fired", (fold.source.node,), kind="split",
        reason=f"XLA held {fold.source.name} ({format_size(nbytes)}) across its peak at {peak_node} to fold it "
               f"later: folded before it, to {format_size(folded)}",
        details={"tensor": fold.source.node, "before": peak_node, "nodes": len(fold.nodes)})]


def _fold_feeds(graph: Graph, fold: Fold) -> set[str]:
    """The nodes outside the fold that it reads."""
    inside = set(fold.nodes)
    return {ref.node for name in fold.nodes for ref in graph.inputs(name) if ref.node not in inside}


def _fold_in_loop(graph: Graph, fold: Fold) -> list[TensorRef]:
    """Splices `fold` into a loop of one trip and points its readers at the loop's results;
    returns those results (the small ones, then one partial sum per sum)."""
    nodes, zero, _ = bands_offset_by(graph, fold.nodes, scope="tfmem_fold_band")
    fold = dataclasses.replace(fold, nodes=tuple(nodes))
    cut = fragment(graph, fold.nodes)
    feeds = list(cut.feeds)
    small = list(fold.small)
    sums = list(fold.sums.items())
    specs = [graph.spec(ref) for ref in small] + [graph.spec(graph.inputs(name)[slots[0]]) for name, slots in sums]
    # What the loop returns, by the fold's tensors it sums (a sum may read the source itself).
    wanted = small + [graph.inputs(name)[slot] for name, slots in sums for slot in slots]
    inside = set(fold.nodes)
    made = [ref for ref in wanted if ref.node in inside]  # the rest is the source itself

    def build(*values: tf.Tensor) -> list[tf.Tensor]:
        given = dict(zip(feeds, values))

        def fold_once(through: Callable[[tf.Tensor], tf.Tensor]) -> list[tf.Tensor]:
            # Nothing of the fold is hoisted out of the loop: not its source, nor its band masks.
            local = {key: through(t) if key in (fold.source, zero) else tf.identity(t) for key, t in given.items()}
            imported = dict(zip(made, cut.import_into(local, made, name="fold")))
            got = iter(imported[ref] if ref in imported else local[ref] for ref in wanted)
            results = [next(got) for _ in small]
            return results + [tf.add_n([next(got) for _ in slots]) for _, slots in sums]

        # The source is a float: candidates pass `order.can_order`.
        return once_in_a_loop(given[fold.source], specs, fold_once)

    refs = graph.splice(build, feeds, scope="tfmem_fold")
    for ref, new in zip(small, refs):
        graph.replace_all_uses(ref, new)  # the fold's own readers of it are left dead
    for (name, slots), new in zip(sums, refs[len(small):]):
        _replace_operands(graph, name, slots, new)
    for name in reversed(fold.nodes):  # the fold outside the loop is read no more
        if not graph.node_consumers(name) and not any(out.node == name for out in graph.outputs):
            graph.remove(name)
    return refs


def _replace_operands(graph: Graph, name: str, slots: tuple[int, ...], partial: TensorRef) -> None:
    """Makes sum `name` read `partial` in place of its operands at `slots`."""
    node = graph.node(name)
    if node.op != "AddN":  # AddV2 / Add: one operand from the fold (both would be walked through)
        graph.set_input(name, slots[0], partial)
        return
    kept = [ref for slot, ref in enumerate(graph.inputs(name)) if slot not in slots]
    new = set_node_inputs(copy_node(node, name), [partial, *kept], graph.control_inputs(name))
    new.attr["N"].i = 1 + len(kept)
    graph.replace_node(new)


__all__ = ["Fold", "find_fold", "reduce_held_before_xla_peak"]
