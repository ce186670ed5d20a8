"""A two-operand einsum that is a matrix product, as `MatMul` / `BatchMatMulV2`.

    einsum("ij,jk->ik", a, b)     →   a @ b
    einsum("kl,jk->lj", c, b)     →   cᵀ @ bᵀ         (transpose flags, no copies)
    einsum("bij,bkj->bik", x, y)  →   x @ yᵀ          (shared leading batch letters)

`tf.einsum("ij,jk,kl->il", a, b, c)` is traced as a sequence of two-operand `Einsum`
ops in an order opt_einsum picks from the shapes alone. Written with `@`, the same
chain is re-associated for the least peak memory by `matmul_chain`; written with einsum
it was not, and the [N, N] intermediate was split instead (issue 19: 322 MiB against
under 1 MiB). As products, einsum chains reorder like any other.

Conditions (rejections carry these reasons):
    * two operands, no ellipsis, no letter repeated within an operand (a trace or a
      diagonal is not a product);
    * after the shared leading batch letters, each operand has two letters: one it
      shares with the other (summed over, absent from the output) and one of its own;
    * the output is the batch letters and the two letters of their own, in either order.

Example:
    >>> f = tfmem.TfmemFunction(lambda a, b: tf.einsum("ij,kj->ik", a, b), passes=[EinsumAsMatMul()])
    >>> tfmem.Graph(f.report(a, b).rewritten_graph_def).op_counts().get("MatMul")
    1
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import tensorflow as tf

from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Emitted, RegionRule


@dataclasses.dataclass(frozen=True)
class Product:
    """How a two-operand einsum multiplies: `op(first) @ op(second)`, operands by position."""

    first: int
    second: int
    transpose_first: bool
    transpose_second: bool
    batch: int  # leading batch letters


def product_of(equation: str) -> Product | str:
    """The matrix product an einsum equation is, or why it is not one.

    Example:
        >>> product_of("ij,kj->ik")
        Product(first=0, second=1, transpose_first=False, transpose_second=True, batch=0)
        >>> product_of("ij,jk->ijk")
        "output 'ijk' is not the batch letters and the two free letters"
    """
    if "..." in equation or "->" not in equation:
        return f"equation {equation!r} has an ellipsis or no explicit output"
    inputs, output = equation.replace(" ", "").split("->")
    operands = inputs.split(",")
    if len(operands) != 2:
        return f"{len(operands)} operands, not two"
    a, b = operands
    if any(len(set(x)) != len(x) for x in (a, b, output)):
        return f"a letter repeats within an operand of {equation!r} (a trace or a diagonal)"
    batch = 0
    while batch < min(len(a), len(b), len(output)) - 2 and a[batch] == b[batch] == output[batch]:
        batch += 1
    a_rest, b_rest, out_rest = a[batch:], b[batch:], output[batch:]
    if len(a_rest) != 2 or len(b_rest) != 2:
        return f"after {batch} batch letters the operands are {a_rest!r} and {b_rest!r}, not matrices"
    shared = set(a_rest) & set(b_rest)
    if len(shared) != 1:
        return f"{a_rest!r} and {b_rest!r} share {len(shared)} letters, not one"
    (summed,) = shared
    free_a, free_b = (a_rest.replace(summed, ""), b_rest.replace(summed, ""))
    if set(out_rest) != {free_a, free_b} or len(out_rest) != 2:
        return f"output {output!r} is not the batch letters and the two free letters"
    # op(A) must read [free_a, summed]: A written [summed, free_a] is transposed.
    if out_rest == free_a + free_b:  # A @ B
        return Product(0, 1, a_rest[0] == summed, b_rest[1] == summed, batch)
    return Product(1, 0, b_rest[0] == summed, a_rest[1] == summed, batch)  # (A @ B)ᵀ = B' @ A'


@dataclasses.dataclass(frozen=True)
class EinsumRegion:
    node: str

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.node,)


class EinsumAsMatMul(RegionRule[EinsumRegion]):
    """Writes a two-operand einsum that is a matrix product as one: `einsum("ij,jk->ik") → @`.

    Example:
        >>> f = tfmem.TfmemFunction(lambda a, b, c: tf.einsum("ij,jk,kl->il", a, b, c),
        ...                         passes=[EinsumAsMatMul(), ReorderMatMulChain()])
        >>> tfmem.Graph(f.report(a, b, c).rewritten_graph_def).op_counts().get("Einsum", 0)
        0
    """

    name = "einsum_as_matmul"
    rule = "EinsumAsMatMul"
    stage = "match_and_replace"
    reads = frozenset()  # no config key: the graph alone decides

    def find(self, graph: Graph) -> Iterator[EinsumRegion]:
        for node in list(graph.find("Einsum")):
            if node.name in graph:
                yield EinsumRegion(node.name)

    def check(self, graph: Graph, region: EinsumRegion, config: Config) -> str | None:
        product = product_of(graph.node(region.node).attr["equation"].s.decode())
        if isinstance(product, str):
            return product
        specs = [graph.spec(t) for t in graph.inputs(region.node)]
        if any(s.shape.rank is None for s in specs):
            return "an operand has no static rank"
        if specs[0].dtype != specs[1].dtype:
            return f"operands of dtypes {specs[0].dtype.name} and {specs[1].dtype.name}"
        return None

    def emit(self, graph: Graph, region: EinsumRegion) -> Emitted | str:
        node = graph.node(region.node)
        product = product_of(node.attr["equation"].s.decode())
        assert isinstance(product, Product)
        inputs = graph.inputs(region.node)
        operands = [inputs[product.first], inputs[product.second]]

        def build(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            return tf.linalg.matmul(x, y, transpose_a=product.transpose_first, transpose_b=product.transpose_second)

        (result,) = graph.splice(build, operands, scope=self.name)
        if graph.spec(result).shape != graph.spec(TensorRef(region.node)).shape:
            return f"internal: the product has shape {graph.spec(result).shape}"
        graph.replace_all_uses(TensorRef(region.node), result)
        return Emitted({"equation": node.attr["equation"].s.decode()})


__all__ = ["EinsumAsMatMul", "EinsumRegion", "Product", "product_of"]
