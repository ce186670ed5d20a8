"""A diagonal matrix added to a matrix, as an update of its diagonal.

    X + diag(d)                  →   set_diag(X, diag_part(X) + d)
    X + c · diag(d)              →   set_diag(X, diag_part(X) + c · d)      (c a scalar)
    AddN(X, Y, diag(d), diag(e)) →   set_diag(X + Y, diag_part(X + Y) + d + e)

`tf.eye` added to a matrix (GPflow's jitter `Kuu + ε·eye(M)`) and the gradient of `diag_part` / `trace` (`MatrixDiag(dy)`, summed into
the rest of a matrix's gradient by `AddN`) are whole [M, M] matrices that are zero off
the diagonal. XLA fuses such an add when it sees both sides at once, but the split
stage cannot split a `MatrixDiag` and captures it whole into the loop that reads the
sum, where it must be materialised (SGPR at M=3000: two [M, M] diagonal gradients held
across a loop's run). The diagonal update never forms them; `MatrixSetDiag` updates its
input in place under XLA.

Conditions (rejections carry these reasons):
    * a diagonal term is a square zero-padded diagonal matrix on the main diagonal
      (`MatrixDiag`, `MatrixDiagV2/V3`; see `scale_by_diagonal.DIAG_MATRIX_OPS`), or
      one multiplied by a scalar;
    * at least one term is not diagonal (a sum of diagonal matrices stays a matrix);
    * every term has the sum's static shape (no broadcasting) and a real floating dtype.

Example:
    >>> f = tfmem.TfmemFunction(lambda k: k + tf.eye(3, dtype=k.dtype), passes=[AddDiagonal()])
    >>> str(f.report(k).records[0])
    '[add_diagonal] AddDiagonal fired at add: diagonal_terms=1 matrix_bytes=72'
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import tensorflow as tf

from rewrites._chain_algebra import REAL_DTYPES
from rewrites.scale_by_diagonal import DIAG_MATRIX_OPS
from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Emitted, RegionRule

SUM_OPS = frozenset({"Add", "AddV2", "AddN"})


@dataclasses.dataclass(frozen=True)
class DiagonalSum:
    """A sum (`node`) some of whose terms are diagonal matrices (input positions)."""

    node: str
    diagonal_terms: tuple[int, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.node,)


def diagonal_term(graph: Graph, tensor: TensorRef) -> tuple[TensorRef, TensorRef | None] | None:
    """(the diagonal d, the scalar c or None) if `tensor` is diag(d) or c · diag(d), else None.

    Only the op is looked at here; `_diagonal_reason` checks the diagonal matrix itself.
    """
    node = graph.node(tensor.node)
    if node.op in DIAG_MATRIX_OPS:
        return graph.inputs(node.name)[0], None
    if node.op == "Mul" and tensor.index == 0:
        for matrix, scalar in (graph.inputs(node.name), graph.inputs(node.name)[::-1]):
            if graph.node(matrix.node).op in DIAG_MATRIX_OPS and graph.spec(scalar).shape.rank == 0:
                return graph.inputs(matrix.node)[0], scalar
    return None


def _diagonal_matrix(graph: Graph, tensor: TensorRef) -> TensorRef:
    """The diag(d) of a diagonal term (itself, or the matrix a scalar multiplies)."""
    node = graph.node(tensor.node)
    if node.op in DIAG_MATRIX_OPS:
        return tensor
    return next(t for t in graph.inputs(node.name) if graph.node(t.node).op in DIAG_MATRIX_OPS)


def _diagonal_reason(graph: Graph, tensor: TensorRef) -> str | None:
    node = graph.node(_diagonal_matrix(graph, tensor).node)
    return DIAG_MATRIX_OPS[node.op](graph, node)


class AddDiagonal(RegionRule[DiagonalSum]):
    """Adds a diagonal matrix to a matrix as a diagonal update: `X + diag(d) → set_diag(X, …)`.

    Example:
        >>> f = tfmem.TfmemFunction(lambda k, d: k + tf.linalg.diag(d), passes=[AddDiagonal()])
        >>> tfmem.Graph(f.report(k, d).rewritten_graph_def).op_counts().get("MatrixDiagV3", 0)
        0
    """

    name = "add_diagonal"
    rule = "AddDiagonal"
    stage = "match_and_replace"
    reads = frozenset()  # no config key: the graph alone decides

    def find(self, graph: Graph) -> Iterator[DiagonalSum]:
        for node in list(graph.nodes):
            if node.op not in SUM_OPS or node.name not in graph:
                continue
            inputs = graph.inputs(node.name)
            diagonal = tuple(i for i, t in enumerate(inputs) if diagonal_term(graph, t) is not None)
            if diagonal:
                yield DiagonalSum(node.name, diagonal)

    def check(self, graph: Graph, region: DiagonalSum, config: Config) -> str | None:
        inputs = graph.inputs(region.node)
        for position in region.diagonal_terms:
            reason = _diagonal_reason(graph, inputs[position])
            if reason is not None:
                return reason
        if len(region.diagonal_terms) == len(inputs):
            return "every term is a diagonal matrix: the sum is one"
        spec = graph.spec(TensorRef(region.node))
        if spec.dtype not in REAL_DTYPES:
            return f"dtype {spec.dtype.name} is not a real floating type"
        if spec.shape.rank is None or spec.shape.rank < 2 or not spec.shape.is_fully_defined():
            return f"the sum's shape {spec.shape} is not a static matrix shape"
        for tensor in inputs:
            if graph.spec(tensor).shape != spec.shape:
                return f"{tensor.name} {graph.spec(tensor).shape} broadcasts to the sum's {spec.shape}"
        return None

    def emit(self, graph: Graph, region: DiagonalSum) -> Emitted | str:
        inputs = graph.inputs(region.node)
        terms = [diagonal_term(graph, inputs[i]) for i in region.diagonal_terms]
        diagonals = [d for d, _ in terms]
        scalars = {k: c for k, (_, c) in enumerate(terms) if c is not None}
        matrices = [t for i, t in enumerate(inputs) if i not in region.diagonal_terms]

        def build(*tensors: tf.Tensor) -> tf.Tensor:
            rest = iter(tensors)
            total = tf.add_n([next(rest) for _ in matrices])
            diags = [next(rest) for _ in diagonals]
            scale = {k: next(rest) for k in scalars}
            diags = [d * scale[k] if k in scale else d for k, d in enumerate(diags)]
            return tf.linalg.set_diag(total, tf.linalg.diag_part(total) + tf.add_n(diags))

        (result,) = graph.splice(build, [*matrices, *diagonals, *scalars.values()], scope=self.name)
        if graph.spec(result).shape != graph.spec(TensorRef(region.node)).shape:
            return f"internal: the diagonal update has shape {graph.spec(result).shape}"
        graph.replace_all_uses(TensorRef(region.node), result)
        matrix_bytes = sum(graph.nbytes(_diagonal_matrix(graph, inputs[i])) or 0 for i in region.diagonal_terms)
        return Emitted({"diagonal_terms": len(diagonals), "matrix_bytes": matrix_bytes})


__all__ = ["SUM_OPS", "AddDiagonal", "DiagonalSum"]
