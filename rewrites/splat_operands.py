"""Cleanup: an elementwise op reads a splat's one value, not the splat.

    K * Fill([n, n], v)           →  K * v
    Fill([n, n], v) - K           →  v - K
    AddN(K1, Fill([n, n], v), K2) →  (K1 + v) + K2       (AddN's own left-to-right order)

A `Fill` (or a `BroadcastTo` of a scalar) repeats one value, which may be computed (GPflow's
`Constant` kernel is `tf.fill([n, n], variance)`, in a `Product` or a `Sum` with other
kernels, and its gradient reads the fill again). An elementwise op broadcasts a scalar
operand by itself, so the `[n, n]` splat never needs to exist; left in the graph it is a
whole matrix that XLA may keep alive across a Cholesky. The values are the same bits: each
element is the same operation on the same two numbers.

Conditions: the splat has a static shape over `LARGE_TENSOR_BYTES` (smaller ones are cheap
either way), and another operand of the op has the op's whole output shape (the splat adds
no dimension to the result). `CanonicalizeSplats` runs first, so `zeros_like`, `ones_like`
and splat constants arrive here as `Fill`s.

Example:
    >>> f = tfmem.TfmemFunction(lambda k, v: k * tf.fill([2000, 2000], v),
    ...                         passes=[ScalarForSplatOperand()])
    >>> f.report(k, v).fired[0].details["readers"]
    1
"""
from __future__ import annotations

import tensorflow as tf

from tfmem.context import PassContext
from tfmem.graph import Graph, TensorRef
from tfmem.passes import GraphPass, PassResult, RewriteRecord

from tfmem.host_folding import LARGE_TENSOR_BYTES

# Elementwise ops that broadcast their operands (a scalar operand stands for a splat of it).
BROADCASTING_OPS = frozenset("""Add AddV2 Sub Mul RealDiv Div DivNoNan MulNoNan Maximum Minimum Pow
    SquaredDifference Xdivy Xlogy Atan2 FloorDiv FloorMod TruncateDiv Greater GreaterEqual Less LessEqual
    Equal NotEqual LogicalAnd LogicalOr SelectV2""".split())


def splat_scalar(graph: Graph, tensor: TensorRef) -> TensorRef | None:
    """The scalar every element of `tensor` repeats, when a `Fill` or a `BroadcastTo` of a
    scalar makes it; else None."""
    node = graph.node(tensor.node)
    if node.op == "Fill":
        return graph.inputs(node.name)[1]  # `value` is 0-D by the op's definition
    if node.op == "BroadcastTo":
        value = graph.inputs(node.name)[0]
        if graph.spec(value).shape.rank == 0:
            return value
    return None


class ScalarForSplatOperand(GraphPass):
    """Feeds elementwise ops a splat's scalar instead of the splat; see the module docstring."""

    name = "scalar_splat_operands"
    stage = "cleanup"
    reads = frozenset()  # no config key: the graph alone decides

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        records = []
        for node in list(graph.nodes):
            if node.op not in ("Fill", "BroadcastTo") or node.name not in graph:
                continue
            splat = TensorRef(node.name)
            scalar = splat_scalar(graph, splat)
            if scalar is None or (graph.nbytes(splat) or 0) <= LARGE_TENSOR_BYTES:  # None: no static shape
                continue
            readers = sorted({reader for reader, _ in graph.consumers(splat)})
            changed = [reader for reader in readers if _read_as_scalar(graph, reader, splat, scalar)]
            if changed:
                records.append(RewriteRecord(self.name, "ScalarForSplatOperand", "fired", (node.name,), kind="cleanup",
                                             details={"readers": len(changed), "bytes": graph.nbytes(splat)}))
        if records:
            graph.prune()
        return PassResult(graph, bool(records), records)


def _read_as_scalar(graph: Graph, reader: str, splat: TensorRef, scalar: TensorRef) -> bool:
    """Rewires `reader`'s operands that are `splat` to `scalar` when the op broadcasts and
    another operand carries its whole output shape; True if anything changed."""
    node = graph.node(reader)
    operands = graph.inputs(reader)
    specs = graph.output_specs(reader)
    if not specs or not specs[0].shape.is_fully_defined():
        return False
    out = specs[0].shape
    full = [ref != splat and graph.spec(ref).shape == out for ref in operands]
    if node.op in BROADCASTING_OPS:
        if not any(full):
            return False
        for position, ref in enumerate(operands):
            if ref == splat:
                graph.set_input(reader, position, scalar)
        return True
    if node.op == "AddN" and any(full):
        # AddN sums in its operands' order; XLA lowers it to that chain of adds.
        terms = [scalar if ref == splat else ref for ref in operands]

        def chain(*xs: tf.Tensor) -> tf.Tensor:
            total = xs[0]
            for x in xs[1:]:
                total = total + x
            return total

        (new,) = graph.splice(chain, terms, scope=f"{reader}_scalar_splat")
        graph.replace_all_uses(TensorRef(reader), new)
        return True
    return False


__all__ = ["BROADCASTING_OPS", "ScalarForSplatOperand", "splat_scalar"]
