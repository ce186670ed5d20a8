"""Diagonal of a product, contracted without forming the product; and its adjoint.

    diag_part(P @ Q)          →   Σ_j (P ∘ Qᵀ)[..., :, j]            ([N, K] not [N, N])
    diag_part(A @ B @ Aᵀ)     →   Σ_j ((A @ B) ∘ A)[..., :, j]
    trace(A @ B)              →   Σ_i Σ_j (A ∘ Bᵀ)[..., i, j]         (trace is Sum ∘ diag_part)
    diag(d) @ X               →   d[..., :, None] ∘ X                 (`ScaleByDiagonal`)
    X @ diag(d)               →   X ∘ d[..., None, :]

`diag_part(X)ᵢ = Σⱼ Pᵢⱼ Qⱼᵢ` needs only the rows of P and the columns of Q, so the
[N, N] product (the allocation behind GPflow/trieste predictive variances, trieste
issue #524) is never built. For a longer chain X₁ @ … @ Xₙ the pass picks where to cut
it into P and Q, builds both sides in their cheapest bracketing (see `matmul_chain`),
and uses `Σ_{-2} (Pᵀ ∘ Q)` instead when that avoids copying a transposed factor.
Batch dimensions broadcast as in `BatchMatMulV2`. A non-square product [N, L] keeps
the first min(N, L) rows of P and columns of Q. Under XLA the multiply fuses into the
reduction, so not even the [N, K] elementwise product is materialised.

Matches `MatrixDiagPart`, `MatrixDiagPartV2/V3` (what `tf.linalg.diag_part` emits) with
the main diagonal `k = 0`, and `DiagPart` of a matrix, applied to a `MatMul` /
`BatchMatMulV2` (through last-two-dims transposes: diag(Xᵀ) = diag(X)).

Conditions (rejections carry these reasons):
    * the product is read only by the diagonal: otherwise it is materialised anyway and
      nothing is saved ("product X is also read by Y");
    * the diagonal offset is the constant 0;
    * static shapes and a real floating dtype;
    * the contraction has a lower peak (then fewer flops) than the product: e.g. not
      for diag(A @ B) with A [3, 100], B [100, 3].

`ScaleByDiagonal` is the same saving for the gradient: the backward of `diag_part` is
`MatrixDiagV3(dy)`, an [N, N] matrix that is zero off the diagonal, fed to the
backward MatMuls. It replaces every product with a `MatrixDiag` / `MatrixDiagV2/V3`
(square, main diagonal, zero padding) by a broadcast multiply; then the [N, N] matrix
has no readers left. It is rejected when the diagonal matrix has a reader that is not
a product (it is materialised anyway). A transposed other operand is copied upright.

Example:
    >>> def predictive_var(knm, qinv):                # knm [N, M], qinv [M, M]
    ...     return tf.linalg.diag_part(knm @ qinv @ tf.transpose(knm))   # [N, N] inside
    >>> f = tfmem.TfmemFunction(predictive_var, passes=[ContractDiagOfProduct()])
    >>> str(f.report(knm, qinv).records[0])
    '[contract_diag_of_product] ContractDiagOfProduct fired at diag_part: ... \
after=Σ_j ((knm @ qinv) ∘ knm) ...'
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from rewrites.matmul_chain import (PRODUCT_FLAGS, REAL_DTYPES, ChainCost, ChainPlanner, Factor,
                                   MatMulChain, Tree, combine_peak, describe_tree,
                                   emit_tree, extract_chain, factor_shapes, peel_transposes, rewritable_shapes,
                                   splice_factors)
from tfmem.config import Config, format_size
from tfmem.graph import Graph, TensorRef
from tfmem.passes import GraphPass, PassResult, RewriteRecord

logger = logging.getLogger(__name__)

_SCOPE = "contract_diag_of_product"


def _k_is_zero(graph: Graph, node: node_def_pb2.NodeDef) -> str | None:
    k = graph.constant_value(graph.inputs(node.name)[1])
    if k is None:
        return "the diagonal offset k is not a constant"
    if np.any(np.asarray(k) != 0):
        return f"only the main diagonal is handled, k={np.asarray(k).tolist()}"
    return None


def _matrix_input(graph: Graph, node: node_def_pb2.NodeDef) -> str | None:
    rank = graph.spec(graph.inputs(node.name)[0]).shape.rank
    return None if rank == 2 else f"DiagPart of a rank-{rank} tensor is not a matrix diagonal"


# Diagonal op → why this node is not a main-diagonal extraction (None: it is).
DIAG_OPS: dict[str, Callable[[Graph, node_def_pb2.NodeDef], str | None]] = {
    "MatrixDiagPart": lambda graph, node: None,
    "MatrixDiagPartV2": _k_is_zero,
    "MatrixDiagPartV3": _k_is_zero,
    "DiagPart": _matrix_input,
}

Form = Literal["rows", "cols"]


@dataclasses.dataclass(frozen=True)
class _Side:
    """One side of the contraction: factors in the orientation it is needed in."""

    factors: tuple[Factor, ...]
    tree: Tree
    cost: ChainCost
    planner: ChainPlanner | None  # None for a single factor


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where to cut the chain and which of the two contraction forms to use."""

    form: Form  # rows: Σ_{-1} (P ∘ Qᵀ); cols: Σ_{-2} (Pᵀ ∘ Q)
    left: _Side  # P (rows) or Pᵀ (cols)
    right: _Side  # Qᵀ (rows) or Q (cols)
    diagonal: int  # min(N, L)
    cost: ChainCost

    def describe(self) -> str:
        left = _describe_side(self.left)
        right = _describe_side(self.right)
        axis = "j" if self.form == "rows" else "i"
        return f"Σ_{axis} ({left} ∘ {right})"


def _describe_side(side: _Side) -> str:
    return describe_tree(side.tree, [f.label for f in side.factors])


def _flip(factors: Sequence[Factor]) -> tuple[Factor, ...]:
    """The factors of the transposed product: reversed, each transposed."""
    return tuple(Factor(f.tensor, not f.transposed) for f in reversed(factors))


class ContractDiagOfProduct(GraphPass):
    """Computes `diag_part(P @ Q)` as a row sum of `P ∘ Qᵀ`, never forming `P @ Q`.

    Example:
        >>> f = tfmem.TfmemFunction(lambda a, b: tf.linalg.trace(a @ b),
        ...                         passes=[ContractDiagOfProduct()])
        >>> f.report(a, b).records[0].status
        'fired'
    """

    name = "contract_diag_of_product"
    stage = "reorder"

    def run(self, graph: Graph, config: Config) -> PassResult:
        records: list[RewriteRecord] = []
        for node in list(graph.find(DIAG_OPS)):
            record = self._rewrite(graph, node)
            if record is not None:
                records.append(record)
        if records:  # also drops a splice whose shapes did not match
            graph.prune()
        return PassResult(graph, any(r.status == "fired" for r in records), records)

    def _reject(self, node: node_def_pb2.NodeDef, reason: str) -> RewriteRecord:
        return RewriteRecord(self.name, "ContractDiagOfProduct", "rejected", (node.name,), reason)

    def _rewrite(self, graph: Graph, node: node_def_pb2.NodeDef) -> RewriteRecord | None:
        matrix = graph.inputs(node.name)[0]
        source, flipped, path = peel_transposes(graph, matrix)
        if graph.node(source.node).op not in PRODUCT_FLAGS or source.index != 0:
            return None  # not a diagonal of a product: no match
        reason = DIAG_OPS[node.op](graph, node)
        if reason is not None:
            return self._reject(node, reason)
        for tensor in [*path, source]:
            if graph.sole_consumer(tensor) is None:
                own = {node.name} | {t.node for t in path}
                users = [c for c, _ in graph.consumers(tensor) if c not in own]
                users += ["<graph output>"] if graph.is_output(tensor) else []
                return self._reject(node, f"product {tensor.node} is also read by "
                                          f"{', '.join(users[:3]) or 'a control edge'}: it is "
                                          f"materialised anyway, so contracting saves nothing")
        chain = extract_chain(graph, source.node, flipped=flipped)
        shapes = rewritable_shapes(graph, chain)
        if isinstance(shapes, str):
            return self._reject(node, shapes)
        itemsize = graph.spec(source).dtype.size
        planner = ChainPlanner(shapes, itemsize)
        out_bytes = graph.nbytes(TensorRef(node.name)) or 0
        product = planner.cost(chain.tree)
        before = ChainCost(max(product.peak, product.size + out_bytes), product.flops, out_bytes)
        plan = self._best_plan(graph, chain, out_bytes)
        if plan.cost.key >= before.key:
            return self._reject(
                node, f"no saving: the product {list(planner.result_shape(0, len(shapes) - 1))} "
                      f"peaks at {format_size(before.peak)}, the contraction "
                      f"{plan.describe()} at {format_size(plan.cost.peak)}")

        def build(values: Callable[[int], tf.Tensor]) -> tf.Tensor:
            return self._emit(plan, values)

        (result,) = splice_factors(graph, plan.left.factors + plan.right.factors, build, _SCOPE)
        want, got = graph.spec(TensorRef(node.name)), graph.spec(result)
        if want.shape != got.shape or want.dtype != got.dtype:  # a bug here must not corrupt the graph
            logger.warning("diag contraction at %s built %s, expected %s", node.name, got, want)
            return self._reject(node, f"internal: the contraction has spec {got}, expected {want}")
        graph.replace_all_uses(TensorRef(node.name), result)
        logger.info("contracted diag of %s at %s: peak %s → %s", chain.describe(), node.name,
                    format_size(before.peak), format_size(plan.cost.peak))
        return RewriteRecord(self.name, "ContractDiagOfProduct", "fired", (node.name, result.node),
                             details={"before": f"diag_part{chain.describe()}",
                                      "after": plan.describe(),
                                      "peak_bytes_before": before.peak,
                                      "peak_bytes_after": plan.cost.peak,
                                      "flops_before": before.flops, "flops_after": plan.cost.flops})

    def _best_plan(self, graph: Graph, chain: MatMulChain, out_bytes: int) -> _Plan:
        factors = chain.factors
        plans = []
        for cut in range(1, len(factors)):
            p, q = factors[:cut], factors[cut:]
            # rows: P and Qᵀ upright; cols: Pᵀ and Q upright.
            for form, left, right in (("rows", tuple(p), _flip(q)), ("cols", _flip(p), tuple(q))):
                plans.append(self._plan(graph, form, left, right, out_bytes))
        return min(plans, key=lambda plan: plan.cost.key)

    def _side(self, graph: Graph, factors: tuple[Factor, ...]) -> _Side:
        shapes = factor_shapes(graph, factors)
        assert not isinstance(shapes, str)  # checked for the whole chain already
        itemsize = graph.spec(factors[0].tensor).dtype.size
        if len(factors) == 1:
            # A transposed lone factor must be copied upright for the elementwise product.
            copy = int(np.prod(shapes[0], dtype=np.int64)) * itemsize if factors[0].transposed else 0
            return _Side(factors, 0, ChainCost(copy, 0, copy), None)
        planner = ChainPlanner(shapes, itemsize)
        tree, cost = planner.best()
        return _Side(factors, tree, cost, planner)

    def _plan(self, graph: Graph, form: Form, left_factors: tuple[Factor, ...],
              right_factors: tuple[Factor, ...], out_bytes: int) -> _Plan:
        left, right = self._side(graph, left_factors), self._side(graph, right_factors)
        itemsize = graph.spec(left_factors[0].tensor).dtype.size
        left_shape = self._shape(graph, left)
        right_shape = self._shape(graph, right)
        # rows: left [.., N, K], right [.., L, K]; cols: left [.., K, N], right [.., K, L].
        axis = -2 if form == "rows" else -1
        diagonal = min(left_shape[axis], right_shape[axis])
        batch = np.broadcast_shapes(left_shape[:-2], right_shape[:-2])
        inner = left_shape[-1] if form == "rows" else left_shape[-2]
        elementwise = int(np.prod(batch, dtype=np.int64)) * diagonal * inner * itemsize
        slices = sum(int(np.prod(s, dtype=np.int64)) // s[axis] * diagonal * itemsize
                     for s in (left_shape, right_shape) if s[axis] != diagonal)
        peak, _ = combine_peak(left.cost, right.cost, slices + elementwise)
        peak = max(peak, elementwise + out_bytes)
        flops = left.cost.flops + right.cost.flops + 2 * elementwise // itemsize
        return _Plan(form, left, right, diagonal, ChainCost(peak, flops, out_bytes))

    @staticmethod
    def _shape(graph: Graph, side: _Side) -> tuple[int, ...]:
        if side.planner is not None:
            return side.planner.result_shape(0, len(side.factors) - 1)
        shapes = factor_shapes(graph, side.factors)
        assert not isinstance(shapes, str)
        return shapes[0]

    @staticmethod
    def _emit(plan: _Plan, values: Callable[[int], tf.Tensor]) -> tf.Tensor:
        offset = len(plan.left.factors)

        def build_side(side: _Side, first: int) -> tf.Tensor:
            if side.planner is None:
                value = values(first)
                return tf.linalg.matrix_transpose(value) if side.factors[0].transposed else value
            return emit_tree(side.tree, side.factors, lambda i: values(first + i), side.planner)[0]

        # Build the side with the larger peak first, as combine_peak assumed.
        if combine_peak(plan.left.cost, plan.right.cost, 0)[1]:
            right = build_side(plan.right, offset)
            left = build_side(plan.left, 0)
        else:
            left = build_side(plan.left, 0)
            right = build_side(plan.right, offset)
        # rows: left [.., N, K], right [.., L, K]; cols: the same, transposed.
        axis = -2 if plan.form == "rows" else -1
        left, right = (_first(x, plan.diagonal, axis) for x in (left, right))
        return tf.reduce_sum(left * right, axis=-1 if plan.form == "rows" else -2)  # [.., d]


def _first(x: tf.Tensor, count: int, axis: int) -> tf.Tensor:
    """The first `count` entries of `x` along `axis` (-1 or -2); `x` itself if that is all."""
    if x.shape[axis] == count:
        return x  # a no-op slice would still be a copy for the estimate
    return x[..., :count, :] if axis == -2 else x[..., :count]


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


class ScaleByDiagonal(GraphPass):
    """Multiplies by a diagonal matrix as a broadcast scale: `diag(d) @ X → d[:, None] ∘ X`.

    Example:
        >>> f = tfmem.TfmemFunction(lambda d, x: tf.linalg.diag(d) @ x,
        ...                         passes=[ScaleByDiagonal()])
        >>> tfmem.Graph(f.rewritten_graph_def(d, x)).op_counts().get("MatrixDiagV3", 0)
        0
    """

    name = "scale_by_diagonal"
    stage = "reorder"

    def run(self, graph: Graph, config: Config) -> PassResult:
        records = [r for node in list(graph.find(DIAG_MATRIX_OPS))
                   if (r := self._rewrite(graph, node)) is not None]
        if records:  # also drops a splice whose shapes did not match
            graph.prune()
        return PassResult(graph, any(r.status == "fired" for r in records), records)

    def _rewrite(self, graph: Graph, node: node_def_pb2.NodeDef) -> RewriteRecord | None:
        matrix = TensorRef(node.name)
        uses = graph.consumers(matrix)
        products = [(c, i) for c, i in uses if graph.node(c).op in PRODUCT_FLAGS]
        if not products:
            return None  # no product by a diagonal matrix: no match

        def reject(reason: str) -> RewriteRecord:
            return RewriteRecord(self.name, "ScaleByDiagonal", "rejected", (node.name,), reason)

        reason = DIAG_MATRIX_OPS[node.op](graph, node)
        if reason is not None:
            return reject(reason)
        others = [c for c, _ in uses if graph.node(c).op not in PRODUCT_FLAGS]
        others += ["<graph output>"] if graph.is_output(matrix) else []
        others += graph.control_dependants(node.name)
        if others or node.name in graph.keep:
            return reject(f"diagonal matrix {node.name} is also read by "
                          f"{', '.join(others[:3]) or 'a kept node'}: it is materialised anyway")
        if graph.spec(matrix).dtype not in REAL_DTYPES:
            return reject(f"dtype {graph.spec(matrix).dtype.name} is not a real floating type")
        if any(graph.inputs(c)[0] == graph.inputs(c)[1] for c, _ in products):
            return reject("a product of the diagonal matrix with itself")
        replaced = []
        for product, position in products:
            result = self._scale(graph, product, position, graph.inputs(node.name)[0])
            if result is not None:
                graph.replace_all_uses(TensorRef(product), result)
                replaced.append(product)
        if not replaced:
            return reject("internal: no product could be rebuilt with matching shapes")
        return RewriteRecord(self.name, "ScaleByDiagonal", "fired", (node.name, *replaced),
                             details={"products": len(replaced),
                                      "matrix_bytes": graph.nbytes(matrix) or 0})

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
