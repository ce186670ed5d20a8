"""Comparisons must see one evaluation: what a rewrite that makes a tensor twice may not split.

A rewrite that computes a tensor again — a split loop's region beside the original its
other readers keep, a copy for late readers (`recompute`), a copy in a loop's body
(`sink`) — makes a second evaluation of the same value. The two are equal only to
rounding: another chunk length, another fusion, a scalar XLA moves into a product's
operand, and the last bits differ. Arithmetic does not mind; a comparison does. The
gradient of `max(s)` is `Equal(s, max(s)) / count`:

    m = max(s)                 (a loop: s made in column chunks)
    Equal(s, m)                (another loop: s made again in row chunks)
        → no entry equals m: the gradient is lost, or count = 0 and 0/0 = NaN

So a comparison (`Equal`, `Greater`, ..., and ops that compare inside, such as
`MaxPoolGrad`) whose operands are made from one tensor must read both from the same
evaluation of it. `mixed_comparisons` finds the comparisons a rewrite would break: those
whose one operand would read the new evaluation and the other the original.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from tfmem.graph import Graph, GraphError, TensorRef

# Ops whose result changes when an operand changes in its last bit at a tie. (Not
# `ApproximateEqual`, which has a tolerance.)
COMPARING_OPS = frozenset({"Equal", "NotEqual", "Greater", "GreaterEqual", "Less", "LessEqual",
                           "MaxPoolGrad", "MaxPoolGradV2", "MaxPool3DGrad", "MaxPoolGradGrad",
                           "MaxPoolGradGradV2", "MaxPool3DGradGrad"})


def mixed_comparisons(graph: Graph, copies: Mapping[TensorRef, Collection[str]], twice: Collection[str], *,
                      skip: Iterable[str] = ()) -> dict[str, str]:
    """The nodes made twice that a comparison would read one evaluation of on one side and
    the other on the other: node → that comparison.

    Args:
        graph: the program, where its readers read `copies` for the new evaluations.
        copies: tensors that stand for new evaluations, and the nodes each of them is made
            from anew (a loop's output and the region nodes it is made from; a copy's output
            and its cone). A walk up from a comparison stops at them.
        twice: nodes whose original is kept beside their new evaluation.
        skip: comparisons that do not stay as they are (they move into a split loop, with
            both operands made from its chunk).
    """
    twice = set(twice)
    if not twice:
        return {}
    skip = set(skip)
    found: dict[str, str] = {}
    for node in graph.nodes:
        if node.op not in COMPARING_OPS or node.name in skip:
            continue
        operands = graph.inputs(node.name)
        reached = [_evaluations(graph, ref, copies, twice) for ref in operands]
        for i, (originals, _) in enumerate(reached):
            for j, (_, copied) in enumerate(reached):
                # One tensor on both sides is one evaluation (`x ≠ x`, as `order.computed_after` asks).
                if operands[i] != operands[j]:
                    for name in sorted(originals & copied):
                        found.setdefault(name, node.name)
    return found


def _evaluations(graph: Graph, tensor: TensorRef, copies: Mapping[TensorRef, Collection[str]],
                 twice: set[str]) -> tuple[set[str], set[str]]:
    """(nodes of `twice` `tensor` is made from as they are, those it is made from anew)."""
    originals: set[str] = set()
    copied: set[str] = set()
    seen: set[TensorRef] = set()
    stack = [tensor]
    while stack:
        ref = stack.pop()
        if ref in seen:
            continue
        seen.add(ref)
        if ref in copies:
            copied.update(name for name in copies[ref] if name in twice)
            continue
        if ref.node in twice:
            originals.add(ref.node)
        stack.extend(graph.inputs(ref.node))
    return originals, copied


def check_one_evaluation(graph: Graph, made_again: Collection[str], copies: Mapping[TensorRef, Collection[str]]) -> None:
    """Raises GraphError when a comparison would read, on one side, a new evaluation of one
    of the nodes `made_again` (through `copies`, as in `mixed_comparisons`) and on the
    other its original, which readers outside them keep. For the rewrites that copy a
    cone (`recompute`, `sink`), after they rewired its readers: their callers roll back."""
    inside = set(made_again)
    readers = {reader for name in inside for reader in graph.node_consumers(name) if reader not in inside}
    kept = graph.ancestors(*readers, *(ref.node for ref in graph.outputs if ref.node in inside)) & inside
    mixed = mixed_comparisons(graph, copies, kept)
    if mixed:
        name, comparison = min(mixed.items())
        raise GraphError(f"{comparison} ({graph.node(comparison).op}) would compare a value made from {name} with one "
                         f"made from its copy: the two are equal only to rounding, and a comparison must see one "
                         "evaluation")
