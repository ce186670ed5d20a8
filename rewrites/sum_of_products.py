"""A sum of squares (or of products) over a tensor's last axis, as a contraction.

    reduce_sum(square(x), -1)           →   einsum("ij,ij->i", x, x)
    reduce_sum(x * y, -1)               →   einsum("ij,ij->i", x, y)
    reduce_sum(square(x), [-2, -1])     →   reduce_sum(einsum("bij,bij->bi", x, x), -1)
    reduce_mean(square(x), -1)          →   einsum("ij,ij->i", x, x) / x.shape[-1]

XLA's CPU compiler rewrites every reduction over more than 32 elements into a tree of
`reduce-window`s (for precision), and it fuses no elementwise op into a `reduce-window`:
the square is formed whole, a second tensor as large as `x`, beside `x` itself when
something else holds `x` (GPflow's VGP: `Σⱼ (L q)²ᵢⱼ`, with `L q` kept for the gradient,
one whole [N, N] more at the peak). A contraction forms no square: `x · x` row by row,
each row's products summed as they are made (N = 1500, float64: XLA plans 34.9 MiB for
`reduce_sum(square(x), -1)` of an argument, 17.2 MiB for the einsum). On a GPU, XLA's
simplifier turns such a dot (batch and contracted axes only) back into a multiply and a
reduction, which it fuses as it fuses the original (`ShouldStrengthReduceDotToReduce` in
XLA's GPU algebraic simplifier; read there, not measured: this machine has no GPU).

Only the last axis is contracted: a contraction over a leading axis makes XLA copy `x`
transposed (no smaller), and a contraction of every element in one dot would sum them in
a sequence, not a tree. The other reduced axes are reduced after, over the contraction's
small result.

Conditions (rejections carry these reasons):
    * the reduction (`Sum`, `Mean`) has constant axes that include the last, over more than
      `XLA_TREE_WINDOW` elements, of a float32 or float64 tensor of at least
      `MIN_BYTES` (below it the square costs little, and the rewrite would change only the
      order of the sum);
    * what it reduces is `Square(x)`, or `Mul(x, y)` of two tensors of the same static shape,
      read by nothing else (otherwise the square is formed anyway);
    * `x` (and `y`) are formed whole anyway: made by an op XLA does not fuse into its
      readers (a product, a factorization, an argument, a variable). An elementwise `x`
      would be formed for the contraction instead of its square: no smaller, and slower.

Under a budget the rule runs only once a plan without it does not fit, and stays only where
XLA then plans less (`xla_checked`): it trades a fusion for a dot, and XLA schedules the
program around that differently.

Example (a: [600, 600] float64):
    >>> traced = tfmem.TfmemFunction(lambda a: tf.reduce_sum(tf.square(a @ a), -1)).trace(a)
    >>> graph = traced.rewrite(tfmem.Config(), passes=[SumOfProductsAsContraction()]).graph
    >>> graph.op_counts().get("Einsum")
    1
"""
from __future__ import annotations

import dataclasses
import string
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from rewrites.split.recompute import CHEAP_OPS
from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Emitted, RegionRule, outside_readers, self_containment_reason

# XLA's CPU tree reduction (`TreeReductionRewriter`) leaves reductions of at most this many
# elements per reduced axis alone, and fuses their operand into them.
XLA_TREE_WINDOW = 32
MIN_BYTES = 1 << 20
_REDUCTIONS = frozenset({"Sum", "Mean"})
_DTYPES = frozenset({tf.float32, tf.float64})
# Ops whose output is their input's buffer, seen through to the op that makes it.
_SAME_BUFFER_OPS = frozenset({"Identity", "Reshape", "ExpandDims", "Squeeze", "Snapshot"})


@dataclasses.dataclass(frozen=True)
class SumOfProducts:
    """`reduction` of `product` (a `Square` or a `Mul`), whose operands are `factors`."""

    reduction: str
    product: str
    factors: tuple[TensorRef, TensorRef]

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.reduction, self.product)


class SumOfProductsAsContraction(RegionRule[SumOfProducts]):
    """Sums products over the last axis as an einsum, never forming the products whole.

    Example (a, b: [600, 600] float64):
        >>> traced = tfmem.TfmemFunction(lambda a, b: tf.reduce_sum((a @ b) * a, -1)).trace(a, b)
        >>> traced.rewrite(tfmem.Config(), passes=[SumOfProductsAsContraction()]).records[0].status
        'fired'
    """

    name = "sum_of_products"
    rule = "SumOfProductsAsContraction"
    stage = "match_and_replace"
    reads = frozenset()  # no config key: the graph alone decides
    # One tensor fewer, but a dot where XLA had a fusion: its scheduler orders the program
    # around it differently. GPflow's VGP (Linear, N=1,200): 17% less planned for the
    # rewrite alone, and yet, with the other rewrites under a budget, 62.0 MiB against
    # 56.4 MiB without it. Only XLA's plan tells (`tfmem.stages._with_xla_checked_passes`).
    xla_checked = True

    def find(self, graph: Graph) -> Iterator[SumOfProducts]:
        for node in list(graph.nodes):
            if node.op not in _REDUCTIONS or node.name not in graph:
                continue
            product = graph.node(graph.inputs(node.name)[0].node)
            if product.op == "Square":
                [x] = graph.inputs(product.name)
                yield SumOfProducts(node.name, product.name, (x, x))
            elif product.op == "Mul":
                x, y = graph.inputs(product.name)
                yield SumOfProducts(node.name, product.name, (x, y))

    def check(self, graph: Graph, region: SumOfProducts, config: Config) -> str | None:
        product = TensorRef(region.product)
        spec = graph.spec(product)
        if spec.dtype not in _DTYPES:
            return f"{region.product} is {spec.dtype.name}, not float32 or float64"
        if not spec.shape.is_fully_defined() or spec.shape.rank == 0:
            return f"{region.product}'s shape {spec.shape} is not static"
        if any(graph.spec(f).shape != spec.shape for f in region.factors):
            return f"{region.product} broadcasts its operands to {spec.shape}"
        axes = _axes(graph, region.reduction, spec.shape.rank)
        if axes is None:
            return f"{region.reduction}'s axes are not a constant"
        if spec.shape.rank - 1 not in axes:
            return f"{region.reduction} does not reduce the last axis of {spec.shape}"
        if spec.shape[-1] <= XLA_TREE_WINDOW:
            return f"its last axis has {spec.shape[-1]} elements: XLA fuses the product into the reduction"
        nbytes = graph.nbytes(product) or 0
        if nbytes < MIN_BYTES:
            return f"{region.product} is {nbytes} bytes, under {MIN_BYTES}"
        reason = self_containment_reason(graph, outside_readers(graph, [product], {region.reduction}),
                                         subject="{tensor}", consequence="it is formed anyway")
        if reason is not None:
            return reason
        for factor in region.factors:
            maker = _maker(graph, factor)
            if maker.op in CHEAP_OPS:
                return (f"{factor.name} is made by {maker.op}, which XLA fuses into its readers: "
                        "the contraction would form it instead of the product")
        return None

    def emit(self, graph: Graph, region: SumOfProducts) -> Emitted | str:
        reduction = graph.node(region.reduction)
        shape = graph.spec(TensorRef(region.product)).shape
        rank = shape.rank
        axes = _axes(graph, region.reduction, rank)
        assert axes is not None  # checked
        rest = sorted(axes - {rank - 1})
        keep = bool(reduction.attr["keep_dims"].b)
        mean = reduction.op == "Mean"
        letters = string.ascii_letters[:rank]
        equation = f"{letters},{letters}->{letters[:-1]}"

        def build(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            result = tf.einsum(equation, x, y)
            if mean:
                result = result / tf.constant(shape[-1], result.dtype)
            if keep:
                result = tf.expand_dims(result, -1)
            if rest:
                reduce = tf.reduce_mean if mean else tf.reduce_sum
                result = reduce(result, rest, keepdims=keep)
            return result

        [result] = graph.splice(build, list(region.factors), scope=self.name)
        if graph.spec(result).shape != graph.spec(TensorRef(region.reduction)).shape:
            return (f"internal: the contraction has shape {graph.spec(result).shape}, "
                    f"{region.reduction} {graph.spec(TensorRef(region.reduction)).shape}")
        graph.replace_all_uses(TensorRef(region.reduction), result)
        return Emitted({"equation": equation, "product_bytes": graph.nbytes(TensorRef(region.product)) or 0},
                       (result.node,))


def _axes(graph: Graph, reduction: str, rank: int) -> set[int] | None:
    """The reduction's axes, each in [0, rank), or None when they are not a constant."""
    value = graph.constant_value(graph.inputs(reduction)[1])
    if value is None:
        return None
    return {int(a) % rank for a in np.atleast_1d(np.asarray(value))}


def _maker(graph: Graph, tensor: TensorRef) -> node_def_pb2.NodeDef:
    """The node that makes `tensor`'s buffer (through ops that only rename it)."""
    node = graph.node(tensor.node)
    while node.op in _SAME_BUFFER_OPS:
        node = graph.node(graph.inputs(node.name)[0].node)
    return node


__all__ = ["MIN_BYTES", "SumOfProducts", "SumOfProductsAsContraction", "XLA_TREE_WINDOW"]
