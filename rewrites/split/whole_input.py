"""Made whole before XLA's peak: a factorization's input, written out once in a loop.

XLA expands a Cholesky factorization into a loop over blocks, and does not write its
input out first when cheap elementwise ops make it: each block's slice of the input is
computed from the input's own operands. Those operands then all stay alive through the
whole factorization. A Matérn kernel matrix is one: `K = σ²(1 + √5·r + 5/3·r²)·e^{-√5·r}`
is never stored, so XLA holds the distances' product `XXᵀ`, `r` and `e^{-√5·r}`, three
`[n, n]` matrices, beside the factor it writes, where the math needs K alone.

An order (`order.computed_after`) does not make XLA write K out: fusion happens anyway.
A loop does. K is made in a `tf.while_loop` of one trip whose count XLA cannot know
before the program runs (as in `rewrites.split.held`), from the small tensors its cheap
cone starts from (`recompute.cheap_cone`): XLA neither removes nor fuses through such a
loop, so K is written out there, its operands die inside it, and the factorization reads
K alone:

    d = XXᵀ; r = √d; e = exp(−√5·r)           K = loop once: k(X)    (d, r, e die inside)
    L = chol(σ²(1 + √5·r + 5/3·r²)·e)    →    L = chol(K)

The same operands stay outside for any other reader. XLA's next plan decides whether the
change stays (`tfmem.stages.compile_within_budget`).

Not for an input sized by a value (GPflow VGP's `eye(num_data)`, `num_data` a variable):
XLA must know every shape in a loop's body when it compiles the loop.

Example (the log-determinant of a Matérn-5/2 kernel matrix plus jitter, n=2,000, under
110 MiB; XLA's peak is the Cholesky, where stock XLA plans 133.8 MiB and this 72.7 MiB):
    >>> [record] = whole_input_before_xla_peak(graph, plan.peak, "whole_input_before_xla_peak")
    >>> record.details["tensor"], record.details["before"]
    ('add_diagonal/set_diag', 'Cholesky')
"""
from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from tfmem.config import format_size
from tfmem.graph import Graph, GraphError, TensorRef
from tfmem.memory import MemoryEstimate, graph_node_for
from tfmem.passes import RewriteRecord
from tfmem.report import XLA_WHOLE_RULE

from rewrites.split.diagonals import bands_offset_by
from rewrites.split.fragment import fragment
from rewrites.split.order import can_order, made_from_inputs, once_in_a_loop
from rewrites.split.recompute import FACTORIZATION_OPS, cheap_cone

# A tensor counts as one XLA holds for the input when it is at least 1/_WORTH of its peak.
_WORTH = 8


def whole_input_before_xla_peak(graph: Graph, xla_peak: MemoryEstimate, pass_name: str) -> list[RewriteRecord]:
    """Makes the input of the factorization at XLA's peak whole, in a loop of one trip.

    `xla_peak` is XLA's live set at the peak of this graph's previous compile
    (`XlaPlan.peak`). When the op there is a factorization (`FACTORIZATION_OPS`) whose
    input cheap ops make from small tensors, and XLA holds there at least two big
    tensors of that input's cone (its operands, which it computes the input's blocks
    from), the input is made in a loop of one trip (see the module docstring). Returns
    one record: fired, or rejected with the reason.
    """
    peak_node = graph_node_for(graph, xla_peak.peak_node or "")

    def rejected(reason: str) -> list[RewriteRecord]:
        return [RewriteRecord(pass_name, XLA_WHOLE_RULE, "rejected", (peak_node or "",), kind="split",
                              reason=f"nothing made whole before XLA's peak at {xla_peak.peak_node}: {reason}")]

    if peak_node is None:
        return rejected("it is at no op of the program's own graph")
    op = graph.node(peak_node).op
    if op not in FACTORIZATION_OPS:
        return rejected(f"{peak_node} is a {op}, not a factorization XLA computes from its input's blocks")
    source = graph.inputs(peak_node)[0]
    big = xla_peak.peak_bytes // _WORTH
    cone = cheap_cone(graph, source, leaf_limit=big, in_loop=True, value_sized_leaves=True)
    if isinstance(cone, str):
        return rejected(cone)
    held = [live for live in xla_peak.live_at_peak if live.nbytes >= big
            and graph_node_for(graph, live.name) in cone.nodes]
    if len(held) < 2:
        return rejected(f"XLA holds {len(held)} tensor{'s' * (len(held) != 1)} of {source.name}'s cone there, "
                        "no more than the input itself")
    varying = made_from_inputs(graph)
    ties = [leaf for leaf in cone.leaves if graph.spec(leaf).dtype.is_floating and can_order(graph, leaf, varying)]
    if not ties:
        return rejected(f"{source.name} is made from no floating-point tensor the program's inputs decide: "
                        "XLA could count the loop's trips")
    nbytes = graph.nbytes(source) or 0
    checkpoint = graph.copy()
    try:
        whole = _made_in_loop(graph, source, list(cone.nodes), list(cone.leaves), ties[0])
        graph.set_input(peak_node, 0, whole)
        graph.prune()
    except (GraphError, ValueError, TypeError, KeyError, tf.errors.OpError) as err:
        graph.assign(checkpoint)
        return rejected(f"{source.name} could not be made in a loop: {err}")
    names = ", ".join(live.name for live in held)
    return [RewriteRecord(
        pass_name, XLA_WHOLE_RULE, "fired", (source.node,), kind="split",
        reason=f"XLA computed {peak_node}'s input from {len(held)} tensors it held at its peak ({names}, "
               f"{format_size(sum(live.nbytes for live in held))}): {source.name} "
               f"({format_size(nbytes)}) made whole in a loop before it",
        details={"tensor": source.node, "before": peak_node, "nodes": len(cone.nodes)})]


def _made_in_loop(graph: Graph, source: TensorRef, nodes: list[str], leaves: list[TensorRef],
                  tie: TensorRef) -> TensorRef:
    """Splices a loop of one trip (`order.once_in_a_loop`) that makes `source` from `leaves`
    by `nodes`; returns its result."""
    # The cone's band masks are made in the loop too, not hoisted out of it whole.
    nodes, zero, lowered = bands_offset_by(graph, nodes, scope="tfmem_whole_band")
    source = lowered.get(source, source)
    cut = fragment(graph, nodes)
    feeds = list(cut.feeds)
    if not all(feed in leaves or feed == zero for feed in feeds):
        raise GraphError(f"{source.name}'s cone reads tensors other than its leaves")

    def build(*values: tf.Tensor) -> tf.Tensor:
        given = dict(zip(feeds, values))

        def make(through: Callable[[tf.Tensor], tf.Tensor]) -> list[tf.Tensor]:
            # Every float leaf and the masks' offset through the trip counter: XLA cannot hoist
            # the cone out of the loop.
            local = {key: through(t) if t.dtype.is_floating or key == zero else tf.identity(t)
                     for key, t in given.items()}
            return cut.import_into(local, [source], name="whole")

        [result] = once_in_a_loop(given[tie], [graph.spec(source)], make)
        return result

    [result] = graph.splice(build, feeds, scope="tfmem_whole")
    return result


__all__ = ["whole_input_before_xla_peak"]
