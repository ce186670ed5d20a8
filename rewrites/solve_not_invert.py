"""Products with the inverse of a triangular matrix, as triangular solves.

    T = triangular_solve(L, I)        (T = L⁻¹, formed whole)
    T @ B     →   triangular_solve(L, B)
    Tᵀ @ B    →   triangular_solve(L, B, adjoint=True)
    A @ T     →   triangular_solve(L, Aᵀ, adjoint=True)ᵀ
    A @ Tᵀ    →   triangular_solve(L, Aᵀ)ᵀ

TensorFlow's Cholesky gradient (`linalg_grad._CholeskyGrad`) builds `L⁻¹` by solving
against `eye(M)` and multiplies it in twice: `L⁻ᵀ · Φ(Lᵀ Ḡ) · L⁻¹`. The identity and
the inverse are two whole [M, M] matrices the math does not need, and XLA's peak for
GPflow's SGPR gradient sits in exactly that solve (at M=1500, N=20,000: the identity,
the inverse being assembled and its block temporaries). Solving against the other
factor instead (Murray 2016, "Differentiation of the Cholesky decomposition"; JAX's
Cholesky rule does the same) never forms either, and costs fewer flops: M²K per solve
against M³ for the inverse plus 2M²K per product.

Conditions (rejections carry these reasons):
    * the right-hand side is an identity matrix (`eye`: a square zero-padded diagonal
      matrix of ones, or a constant identity);
    * every reader of the inverse is a product (otherwise it is formed anyway: "inverse T
      is also read by Y"); not a product of the inverse with itself;
    * float32 or float64; the other operand has the inverse's batch dimensions (or none);
    * for the inverse on the right (which needs the other operand transposed), that
      operand is no larger than the inverse: a wide operand's transposed copies could
      cost more than the inverse saved.

Example:
    >>> def cholesky_grad(a, w):                      # a [M, M] SPD, w [M, M]
    ...     with tf.GradientTape() as tape:
    ...         tape.watch(a)
    ...         loss = tf.reduce_sum(tf.linalg.cholesky(a) * w)
    ...     return tape.gradient(loss, a)             # builds L⁻¹ = solve(L, eye(M))
    >>> f = tfmem.TfmemFunction(cholesky_grad, passes=[SolveInsteadOfInverse()])
    >>> str(f.report(a, w).records[0])
    '[solve_not_invert] SolveInsteadOfInverse fired at ...MatrixTriangularSolve: products=2 inverse_bytes=...'
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from rewrites._chain_algebra import PRODUCT_FLAGS
from rewrites.scale_by_diagonal import DIAG_MATRIX_OPS
from rewrites.splats import splat_value
from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Emitted, RegionRule, outside_readers, self_containment_reason

logger = logging.getLogger(__name__)

SOLVE_DTYPES = frozenset({tf.float32, tf.float64})
# A constant identity is only read back when it is small; large ones are never constants
# here (the cleanup stage keeps big splats and diagonals out of Grappler's folding).
_MAX_CONSTANT_ELEMENTS = 1 << 20


def identity_reason(graph: Graph, tensor: TensorRef) -> str | None:
    """Why `tensor` is not statically an identity matrix (or a batch of them), or None.

    Example:
        >>> identity_reason(graph, TensorRef("eye/diag"))   # tf.eye(3)
        >>> identity_reason(graph, TensorRef("x"))
        'x is Placeholder, not an identity matrix'
    """
    node = graph.node(tensor.node)
    if node.op in DIAG_MATRIX_OPS:
        reason = DIAG_MATRIX_OPS[node.op](graph, node)
        if reason is not None:
            return reason
        value = splat_value(graph, graph.inputs(node.name)[0])
        return None if value is not None and value == 1 else f"{node.name} is a diagonal matrix, not of ones"
    if node.op == "Const":
        shape = graph.spec(tensor).shape
        if shape.rank is None or shape.rank < 2 or not shape.is_fully_defined() \
                or shape.num_elements() > _MAX_CONSTANT_ELEMENTS or shape[-1] != shape[-2]:
            return f"{node.name} is a constant of shape {shape}, not a small square matrix"
        value = np.asarray(graph.constant_value(tensor))
        return None if np.array_equal(value, np.broadcast_to(np.eye(shape[-1]), value.shape)) \
            else f"{node.name} is a constant, not the identity"
    return f"{node.name} is {node.op}, not an identity matrix"


@dataclasses.dataclass(frozen=True)
class InverseRegion:
    """`solve`, a triangular solve against the identity, and its products: (node, position)."""

    solve: str
    products: tuple[tuple[str, int], ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.solve,)


def _flag(node: node_def_pb2.NodeDef, position: int) -> bool:
    name = PRODUCT_FLAGS[node.op][position]
    return bool(node.attr[name].b) if name in node.attr else False


class SolveInsteadOfInverse(RegionRule[InverseRegion]):
    """Multiplies by a triangular inverse as a triangular solve: `L⁻¹ @ B → solve(L, B)`.

    Example:
        >>> f = tfmem.TfmemFunction(lambda l, b: tf.linalg.triangular_solve(l, tf.eye(3)) @ b,
        ...                         passes=[SolveInsteadOfInverse()])
        >>> tfmem.Graph(f.report(l, b).rewritten_graph_def).op_counts().get("MatMul", 0)
        0
    """

    name = "solve_not_invert"
    rule = "SolveInsteadOfInverse"
    stage = "match_and_replace"
    reads = frozenset()  # no config key: the graph alone decides

    def find(self, graph: Graph) -> Iterator[InverseRegion]:
        for node in list(graph.find("MatrixTriangularSolve")):
            if node.name not in graph:
                continue
            products = tuple((c, i) for c, i in graph.consumers(TensorRef(node.name))
                             if graph.node(c).op in PRODUCT_FLAGS)
            if products:  # an inverse nothing multiplies by: no match
                yield InverseRegion(node.name, products)

    def check(self, graph: Graph, region: InverseRegion, config: Config) -> str | None:
        inverse = TensorRef(region.solve)
        reason = identity_reason(graph, graph.inputs(region.solve)[1]) or self_containment_reason(
            graph, outside_readers(graph, [inverse], {c for c, _ in region.products}),
            subject="inverse {node}", consequence="it is formed anyway")
        if reason is not None:
            return reason
        spec = graph.spec(inverse)
        if spec.dtype not in SOLVE_DTYPES:
            return f"dtype {spec.dtype.name} is not float32 or float64"
        if not spec.shape.is_fully_defined():
            return f"the inverse's shape {spec.shape} is not static"
        inverse_elements = spec.shape.num_elements()
        for product, position in region.products:
            inputs = graph.inputs(product)
            if inputs[0] == inputs[1]:
                return f"{product} multiplies the inverse by itself"
            other = graph.spec(inputs[1 - position]).shape
            if other.rank is None or not other.is_fully_defined():
                return f"{product}'s other operand has no static shape"
            if other.rank > 2 and other[:-2] != spec.shape[:-2]:
                return f"{product}'s other operand has batch dims {other[:-2]}, the inverse {spec.shape[:-2]}"
            if position == 1 and other.num_elements() > inverse_elements:
                return (f"{product} multiplies the inverse from the right by {inputs[0].name} {other}, larger "
                        f"than the inverse {spec.shape}: its transposed copies could cost more than the inverse")
        return None

    def emit(self, graph: Graph, region: InverseRegion) -> Emitted | str:
        solve = graph.node(region.solve)
        factor = graph.inputs(region.solve)[0]
        lower, adjoint = bool(solve.attr["lower"].b), bool(solve.attr["adjoint"].b)
        replaced = []
        for product, position in region.products:
            result = self._solve(graph, product, position, factor, lower=lower, adjoint=adjoint)
            if result is None:
                return f"internal: {product} rebuilt as a solve has another shape"
            replaced.append((product, result))
        for product, result in replaced:
            graph.replace_all_uses(TensorRef(product), result)
        return Emitted({"products": len(replaced), "inverse_bytes": graph.nbytes(TensorRef(region.solve)) or 0},
                       tuple(p for p, _ in replaced))

    def _solve(self, graph: Graph, product: str, position: int, factor: TensorRef, *,
               lower: bool, adjoint: bool) -> TensorRef | None:
        """`product`, which reads T = op(L)⁻¹ at input `position`, as a triangular solve."""
        node = graph.node(product)
        other = graph.inputs(product)[1 - position]
        other_flag = _flag(node, 1 - position)
        # op(T) = op'(L)⁻¹ with op' adjoint iff exactly one of (solve, product) transposes.
        inverse_adjoint = adjoint ^ _flag(node, position)

        def build(l: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
            if position == 0:  # op'(L)⁻¹ op(B)
                rhs = tf.linalg.matrix_transpose(x) if other_flag else x
                return tf.linalg.triangular_solve(l, rhs, lower=lower, adjoint=inverse_adjoint)
            # op(A) op'(L)⁻¹ = (op'(L)⁻ᵀ op(A)ᵀ)ᵀ
            rhs = x if other_flag else tf.linalg.matrix_transpose(x)
            solved = tf.linalg.triangular_solve(l, rhs, lower=lower, adjoint=not inverse_adjoint)
            return tf.linalg.matrix_transpose(solved)

        (result,) = graph.splice(build, [factor, other], scope=self.name)
        if graph.spec(result).shape != graph.spec(TensorRef(product)).shape:
            logger.warning("solve instead of inverse at %s built %s, expected %s", product,
                           graph.spec(result).shape, graph.spec(TensorRef(product)).shape)
            return None
        return result


__all__ = ["InverseRegion", "SolveInsteadOfInverse", "identity_reason"]
