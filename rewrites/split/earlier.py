"""Reducing earlier than XLA would: a big temporary XLA makes late, at its peak, made first.

A value that only the loss needs, not its gradient, can run anywhere in XLA's schedule,
and XLA may run it last. GPflow's VGP with a Gaussian likelihood is one: the variance
`fvar = Σ (L·q_sqrt)²` enters the loss, but the loss's gradient with respect to `fvar`
is a constant, so nothing in the gradient waits for it. XLA squared `L·q_sqrt` (a
`[N, N]` temporary its CPU tree reduction stores whole) after it had made the gradient's
own `[N, N]` matrices, and peaked there:

    LTA = L·q                               LTA = L·q
    dLTA = 2·LTA·g   (a [N, N])      →      fvar = Σ LTA²          (the square, then gone)
    fvar = Σ LTA²    (XLA's peak)           dLTA = 2·LTA·g′,  g′ = g − 0·(fvar₀ ≠ fvar₀)

`reduce_before_xla_peak` finds, from XLA's live set at its peak (`XlaPlan.peak`), the
op running there and the small results its big output is reduced to, and the tensors
XLA holds at the peak that it made after that op's inputs were ready but that the op
does not need. The first of those to be made reads one of its inputs through an exact
zero computed from the small results (`order.computed_after`): XLA must reduce first,
while those tensors do not exist yet. What else XLA does is its own choice; its next plan
decides whether the change stays (`tfmem.stages.compile_within_budget`).

Example (the VGP above; `Square_3` is `LTA²`, where XLA peaks):
    >>> records = reduce_before_xla_peak(graph, plan.peak, "reduce_before_xla_peak")
    >>> records[0].details["before"]     # the gradient's [N, N] XLA made before it: now after
    'gradient_tape/Mul_9'
"""
from __future__ import annotations

from tfmem.config import format_size
from tfmem.graph import Graph, GraphError, TensorRef
from tfmem.memory import MemoryEstimate, graph_node_for, xla_schedule
from tfmem.passes import RewriteRecord
from tfmem.report import XLA_EARLIER_RULE

from rewrites.split.order import can_order, computed_after, input_to_tie, made_from_inputs
from rewrites.split.recompute import CHEAP_OPS

# How many ops a big temporary may flow through (elementwise maps, reshapes) before it is
# reduced to a small result.
_MAX_WALK = 16


def small_results(graph: Graph, node: str, small: int) -> tuple[list[TensorRef], set[str]] | str:
    """The tensors of at most `small` bytes that `node`'s big outputs are reduced to, and
    the ops on the way; or why there are none.

    Every reader of a big output must be a cheap op (`recompute.CHEAP_OPS`: elementwise
    maps, reshapes, reductions); its big outputs are followed in turn, up to `_MAX_WALK` ops.
    A node whose outputs are all small is its own result.
    """
    results: list[TensorRef] = []
    walked: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in walked:
            continue
        walked.add(current)
        if len(walked) > _MAX_WALK:
            return f"{node}'s output flows through more than {_MAX_WALK} ops before it is small"
        for index in range(len(graph.output_specs(current))):
            ref = TensorRef(current, index)
            nbytes = graph.nbytes(ref)
            if nbytes is None:
                return f"{ref.name} has no static size"
            readers = graph.consumers(ref)
            if nbytes <= small:
                if readers or graph.is_output(ref):
                    results.append(ref)
                continue
            if graph.is_output(ref):
                return f"{ref.name} ({format_size(nbytes)}) is an output of the program"
            for reader, _ in readers:
                if graph.node(reader).op not in CHEAP_OPS:
                    return f"{ref.name} ({format_size(nbytes)}) is read by {reader} ({graph.node(reader).op})"
                stack.append(reader)
    if not results:
        return f"{node}'s output is not reduced to anything"
    return results, walked


def reduce_before_xla_peak(graph: Graph, xla_peak: MemoryEstimate, pass_name: str,
                           *, worth: int = 16) -> list[RewriteRecord]:
    """Makes the op at XLA's peak, with its reduction, run before what XLA made after its inputs.

    `xla_peak` is XLA's live set at the peak of this graph's previous compile
    (`XlaPlan.peak`). When the op there makes a big tensor (at least 1/`worth` of the
    peak) that cheap ops reduce to small results (`small_results`), the earliest tensor
    in that live set which XLA made after every input of those ops, and which they do not
    need, is made from one of its inputs read through an exact zero computed from those
    results. Returns one record: fired, or rejected with the reason.
    """
    def rejected(reason: str) -> list[RewriteRecord]:
        return [RewriteRecord(pass_name, XLA_EARLIER_RULE, "rejected", (peak_node or "",), kind="split",
                              reason=f"not reduced before XLA's peak at {xla_peak.peak_node}: {reason}")]

    peak_node = graph_node_for(graph, xla_peak.peak_node or "")
    xla_order = xla_schedule(graph, xla_peak)
    if peak_node is None or peak_node not in xla_order:
        return rejected("it is at no op of the program's own graph")
    big = xla_peak.peak_bytes // worth
    sizes = [graph.nbytes(TensorRef(peak_node, i)) or 0 for i in range(len(graph.output_specs(peak_node)))]
    if max(sizes, default=0) < big:
        return rejected(f"{peak_node} makes no tensor of {format_size(big)} or more")
    found = small_results(graph, peak_node, small=big)
    if isinstance(found, str):
        return rejected(found)
    results, walked = found
    varying = made_from_inputs(graph)
    ties = [ref for ref in results if can_order(graph, ref, varying)]
    if not ties:
        return rejected("none of its results is a floating-point tensor made from the program's inputs")
    needed = graph.ancestors(*(ref.node for ref in results))
    after = graph.descendants(*(ref.node for ref in results))
    ready = max((xla_order[name] for name in needed if name in xla_order and name not in walked), default=-1)
    candidates = []
    for live in xla_peak.live_at_peak:
        if live.nbytes < big:
            break  # largest first: the rest are small
        node = graph_node_for(graph, live.name)
        if (node is None or " (" in live.name or node in needed or node in after or node in walked
                or node not in xla_order or xla_order[node] <= ready):
            continue
        candidates.append(node)
    if not candidates:
        return rejected("XLA holds nothing there that it made after the op's inputs were ready "
                        "and that the op does not need")
    first = min(candidates, key=lambda name: xla_order[name])
    slot = input_to_tie(graph, first)
    if slot is None:
        return rejected(f"{first}, made after its inputs, reads no floating-point tensor to order")
    checkpoint = graph.copy()
    try:
        leaf = graph.inputs(first)[slot]
        for tie in ties:
            [leaf] = graph.splice(computed_after, [tie, leaf], scope="tfmem_reduce_before")
        graph.set_input(first, slot, leaf)
    except (GraphError, ValueError, TypeError, KeyError) as err:
        graph.assign(checkpoint)
        return rejected(f"{first} could not be ordered after it: {err}")
    return [RewriteRecord(
        pass_name, XLA_EARLIER_RULE, "fired", (peak_node,), kind="split",
        reason=f"XLA ran {peak_node} at its peak ({format_size(xla_peak.peak_bytes)}) beside {first}, made after "
               f"its inputs: {', '.join(ref.name for ref in ties)} now made before {first}",
        details={"tensor": peak_node, "before": first, "results": ", ".join(ref.name for ref in ties)})]


__all__ = ["reduce_before_xla_peak", "small_results"]
