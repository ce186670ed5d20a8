"""Diagonal of a product, contracted without forming the product.

    diag_part(P @ Q)          →   Σ_j (P ∘ Qᵀ)[..., :, j]            ([N, K] not [N, N])
    diag_part(A @ B @ Aᵀ)     →   Σ_j ((A @ B) ∘ A)[..., :, j]
    trace(A @ B)              →   Σ_i Σ_j (A ∘ Bᵀ)[..., i, j]         (trace is Sum ∘ diag_part)

`diag_part(X)ᵢ = Σⱼ Pᵢⱼ Qⱼᵢ` needs only the rows of P and the columns of Q, so the
[N, N] product (the allocation behind GPflow/trieste predictive variances, trieste
issue #524) is never built. For a longer chain X₁ @ … @ Xₙ the pass picks where to cut
it into P and Q, builds both sides in their cheapest bracketing (see `_chain_algebra`),
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

The gradient of `diag_part` is an [N, N] diagonal matrix fed to the backward products;
`scale_by_diagonal` removes it.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from rewrites._chain_algebra import (PRODUCT_FLAGS, ChainCost, ChainPlanner, Factor, MatMulChain, Tree,
                                     combine_peak, describe_tree, emit_tree, extract_chain, factor_shapes,
                                     peel_transposes, rewritable_shapes, splice_factors)
from tfmem.config import Config, format_size
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Emitted, RegionRule, live_nodes, outside_readers, self_containment_reason

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


@dataclasses.dataclass
class DiagRegion:
    """A diagonal of a product: the diagonal op, the product and the transposes between."""

    node: str
    source: TensorRef  # the product
    flipped: bool  # an odd number of transposes between: diag of the product's transpose
    path: list[TensorRef]  # the transposes' outputs, the diagonal's input first
    chain: MatMulChain | None = None  # set by `check`
    before: ChainCost | None = None
    plan: _Plan | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.node,)


class ContractDiagOfProduct(RegionRule[DiagRegion]):
    """Computes `diag_part(P @ Q)` as a row sum of `P ∘ Qᵀ`, never forming `P @ Q`.

    Example:
        >>> f = tfmem.TfmemFunction(lambda a, b: tf.linalg.trace(a @ b),
        ...                         passes=[ContractDiagOfProduct()])
        >>> f.report(a, b).records[0].status
        'fired'
    """

    name = "contract_diag_of_product"
    rule = "ContractDiagOfProduct"
    stage = "reorder"
    reads = frozenset()  # no config key: the graph alone decides

    def find(self, graph: Graph) -> Iterator[DiagRegion]:
        for node in live_nodes(graph, DIAG_OPS):
            source, flipped, path = peel_transposes(graph, graph.inputs(node.name)[0])
            if graph.node(source.node).op in PRODUCT_FLAGS and source.index == 0:
                yield DiagRegion(node.name, source, flipped, path)

    def check(self, graph: Graph, region: DiagRegion, config: Config) -> str | None:
        node = graph.node(region.node)
        reason = DIAG_OPS[node.op](graph, node) or self_containment_reason(
            graph, outside_readers(graph, [*region.path, region.source], {node.name, *(t.node for t in region.path)}),
            subject="product {node}", consequence="it is materialised anyway, so contracting saves nothing")
        if reason is not None:
            return reason
        chain = extract_chain(graph, region.source.node, flipped=region.flipped)
        shapes = rewritable_shapes(graph, chain)
        if isinstance(shapes, str):
            return shapes
        planner = ChainPlanner(shapes, graph.spec(region.source).dtype.size)
        out_bytes = graph.nbytes(TensorRef(node.name)) or 0
        product = planner.cost(chain.tree)
        before = ChainCost(max(product.peak, product.size + out_bytes), product.flops, out_bytes)
        plan = self._best_plan(graph, chain, out_bytes)
        if plan.cost.key >= before.key:
            return (f"no saving: the product {list(planner.result_shape(0, len(shapes) - 1))} "
                    f"peaks at {format_size(before.peak)}, the contraction "
                    f"{plan.describe()} at {format_size(plan.cost.peak)}")
        region.chain, region.before, region.plan = chain, before, plan
        return None

    def emit(self, graph: Graph, region: DiagRegion) -> Emitted | str:
        chain, before, plan = region.chain, region.before, region.plan
        assert chain is not None and before is not None and plan is not None  # `check` passed

        def build(values: Callable[[int], tf.Tensor]) -> tf.Tensor:
            return self._emit(plan, values)

        (result,) = splice_factors(graph, plan.left.factors + plan.right.factors, build, _SCOPE)
        want, got = graph.spec(TensorRef(region.node)), graph.spec(result)
        if want.shape != got.shape or want.dtype != got.dtype:  # a bug here must not corrupt the graph
            logger.warning("diag contraction at %s built %s, expected %s", region.node, got, want)
            return f"internal: the contraction has spec {got}, expected {want}"
        graph.replace_all_uses(TensorRef(region.node), result)
        logger.info("contracted diag of %s at %s: peak %s → %s", chain.describe(), region.node,
                    format_size(before.peak), format_size(plan.cost.peak))
        return Emitted({"before": f"diag_part{chain.describe()}", "after": plan.describe(),
                        "peak_bytes_before": before.peak, "peak_bytes_after": plan.cost.peak,
                        "flops_before": before.flops, "flops_after": plan.cost.flops}, (result.node,))

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


__all__ = ["ContractDiagOfProduct", "DiagRegion"]
