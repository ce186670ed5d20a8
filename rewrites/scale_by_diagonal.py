"""Multiplication by a diagonal matrix, as a broadcast scale.

    diag(d) @ X               →   d[..., :, None] ∘ X
    X @ diag(d)               →   X ∘ d[..., None, :]

The backward of `diag_part` is `MatrixDiagV3(dy)`, an [N, N] matrix that is zero off
the diagonal, fed to the backward MatMuls: the gradient's side of what
`diag_of_product` saves in the forward. This pass replaces every product with a
`MatrixDiag` / `MatrixDiagV2/V3` by a broadcast multiply; then the [N, N] matrix has no
readers left. A transposed other operand is copied upright.

Conditions (rejections carry these reasons):
    * the diagonal matrix is square, on the main diagonal, with zero padding;
    * every reader of the diagonal matrix is a product: otherwise it is materialised
      anyway ("diagonal matrix D is also read by Y");
    * a real floating dtype; not a product of the diagonal matrix with itself.

Example:
    >>> f = tfmem.TfmemFunction(lambda d, x: tf.linalg.diag(d) @ x, passes=[ScaleByDiagonal()])
    >>> [str(r) for r in f.report(d, x).records]
    ['[scale_by_diagonal] ScaleByDiagonal fired at diag: products=1 matrix_bytes=28.1 KiB']
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from rewrites._chain_algebra import PRODUCT_FLAGS, REAL_DTYPES, peel_transposes
from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Emitted, RegionRule, live_nodes, outside_readers, self_containment_reason

logger = logging.getLogger(__name__)


def _square_zero_padded(graph: Graph, node: node_def_pb2.NodeDef) -> str | None:
    """Why a MatrixDiagV2/V3 node is not a plain square diagonal matrix, or None."""
    diagonal, k, rows, cols, padding = graph.inputs(node.name)[:5]
    values = [graph.constant_value(t) for t in (k, rows, cols, padding)]
    if any(v is None for v in values):
        return "k, num_rows, num_cols and padding_value must be constants"
    k_value, rows_value, cols_value, padding_value = (np.asarray(v) for v in values)
    if np.any(k_value != 0):
        return f"only the main diagonal is handled, k={k_value.tolist()}"
    if np.any(padding_value != 0):
        return f"off-diagonal padding is {padding_value.tolist()}, not 0"
    length = graph.spec(diagonal).shape[-1] if graph.spec(diagonal).shape.rank else None
    if any(int(v) not in (-1, length) for v in (rows_value, cols_value)):
        return f"not square: num_rows={int(rows_value)}, num_cols={int(cols_value)}"
    return None


# Diagonal-matrix op → why this node is not a square zero-padded diagonal matrix (None: it is).
DIAG_MATRIX_OPS: dict[str, Callable[[Graph, node_def_pb2.NodeDef], str | None]] = {
    "MatrixDiag": lambda graph, node: None,
    "MatrixDiagV2": _square_zero_padded,
    "MatrixDiagV3": _square_zero_padded,
}


@dataclasses.dataclass(frozen=True)
class DiagonalMatrixRegion:
    """A diagonal matrix and the products that read it: (product node, input position)."""

    node: str
    products: tuple[tuple[str, int], ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.node,)


class ScaleByDiagonal(RegionRule[DiagonalMatrixRegion]):
    """Multiplies by a diagonal matrix as a broadcast scale: `diag(d) @ X → d[:, None] ∘ X`.

    Example:
        >>> f = tfmem.TfmemFunction(lambda d, x: tf.linalg.diag(d) @ x,
        ...                         passes=[ScaleByDiagonal()])
        >>> tfmem.Graph(f.report(d, x).rewritten_graph_def).op_counts().get("MatrixDiagV3", 0)
        0
    """

    name = "scale_by_diagonal"
    rule = "ScaleByDiagonal"
    stage = "reorder"
    reads = frozenset()  # no config key: the graph alone decides

    def find(self, graph: Graph) -> Iterator[DiagonalMatrixRegion]:
        for node in live_nodes(graph, DIAG_MATRIX_OPS):
            products = tuple((c, i) for c, i in graph.consumers(TensorRef(node.name))
                             if graph.node(c).op in PRODUCT_FLAGS)
            if products:  # no product by a diagonal matrix: no match
                yield DiagonalMatrixRegion(node.name, products)

    def check(self, graph: Graph, region: DiagonalMatrixRegion, config: Config) -> str | None:
        node, matrix = graph.node(region.node), TensorRef(region.node)
        reason = DIAG_MATRIX_OPS[node.op](graph, node) or self_containment_reason(
            graph, outside_readers(graph, [matrix], {c for c, _ in region.products}),
            subject="diagonal matrix {node}", consequence="it is materialised anyway")
        if reason is not None:
            return reason
        if graph.spec(matrix).dtype not in REAL_DTYPES:
            return f"dtype {graph.spec(matrix).dtype.name} is not a real floating type"
        if any(graph.inputs(c)[0] == graph.inputs(c)[1] for c, _ in region.products):
            return "a product of the diagonal matrix with itself"
        return None

    def emit(self, graph: Graph, region: DiagonalMatrixRegion) -> Emitted | str:
        matrix = TensorRef(region.node)
        replaced = []
        for product, position in region.products:
            result = self._scale(graph, product, position, graph.inputs(region.node)[0])
            if result is not None:
                graph.replace_all_uses(TensorRef(product), result)
                replaced.append(product)
        if not replaced:
            return "internal: no product could be rebuilt with matching shapes"
        return Emitted({"products": len(replaced), "matrix_bytes": graph.nbytes(matrix) or 0}, tuple(replaced))

    def _scale(self, graph: Graph, product: str, position: int, diagonal: TensorRef) -> TensorRef | None:
        """`product`, which reads the diagonal matrix at input `position`, as a scale."""
        # diag(d) is symmetric: only the other operand's transpose flag matters.
        flag_name = PRODUCT_FLAGS[graph.node(product).op][1 - position]
        attrs = graph.node(product).attr
        flag = bool(attrs[flag_name].b) if flag_name in attrs else False
        source, peeled, _ = peel_transposes(graph, graph.inputs(product)[1 - position])
        transposed = flag ^ peeled

        def build(d: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
            x = tf.linalg.matrix_transpose(x) if transposed else x
            if position == 0:
                return d[..., :, None] * x  # rows of x scaled: diag(d) @ x
            return x * d[..., None, :]  # columns of x scaled: x @ diag(d)

        (result,) = graph.splice(build, [diagonal, source], scope=self.name)
        if graph.spec(result).shape != graph.spec(TensorRef(product)).shape:
            logger.warning("scale by diagonal at %s built %s, expected %s", product,
                           graph.spec(result).shape, graph.spec(TensorRef(product)).shape)
            return None
        return result


__all__ = ["DIAG_MATRIX_OPS", "DiagonalMatrixRegion", "ScaleByDiagonal"]
