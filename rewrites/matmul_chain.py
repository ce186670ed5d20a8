"""Matrix-chain reordering: re-associate chains of matrix products.

    (A @ B) @ v            →   A @ (B @ v)
    X₁ @ X₂ @ … @ Xₙ       →   the same product, bracketed to keep the largest set of
                               intermediates live at once smallest, then the flops fewest
    transpose(X) @ Y       →   matmul(X, Y, transpose_a=True)   (inside a rewritten chain)

A chain is a maximal tree of `MatMul` / `BatchMatMulV2` ops (with their `transpose_*` /
`adj_*` flags, and `Transpose` ops that swap the last two dimensions in between, using
(X @ Y)ᵀ = Yᵀ @ Xᵀ) whose intermediate products are read only inside the tree. Its
leaves are the factors X₁ … Xₙ, each possibly transposed. A dynamic programme over the
factor intervals picks the bracketing that minimises, lexicographically,

    1. the peak bytes of intermediates live while the chain runs (each product holds
       its two operands and its result; factors exist anyway and count zero), and
    2. the multiply-add flops.

The new products are built with `tf.linalg.matmul` and transpose flags, so transposed
factors are never copied. (The walk, the planner and the builder are `_chain_algebra`.)

Conditions (a chain left alone is recorded with its reason):
    * "already optimal": no bracketing beats the current one.
    * "intermediate X used outside the chain": X is read elsewhere too, so it must be
      materialised and ends the chain; recorded when a better order would cross it.
      Exception: when *every* reader of X is such a chain, each with a better order
      below X's size, the chains recompute X's factors instead and X is never built
      (the `dY @ vᵀ` of `(A @ B) @ v`'s gradient) — kept only if the whole graph's
      estimated peak does not grow.
    * "dynamic shape": a factor's shape is not fully static.
    * real floating dtypes only (for complex ones `adj_*` would also conjugate).
    * no control edges into or out of the chain's ops (they would be lost).

Example:
    >>> @tf.function
    ... def f(a, b, v):
    ...     return (a @ b) @ v                          # [N, N] intermediate
    >>> tfmem.TfmemFunction(f, passes=[ReorderMatMulChain()]).report(a, b, v).records[0]
    ... # [reorder_matmul_chain] ReorderMatMulChain fired at matmul_1:
    ... #   before=((a @ b) @ v) after=(a @ (b @ v)) ...
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import tensorflow as tf

from rewrites._chain_algebra import (PRODUCT_FLAGS, ChainCost, ChainPlanner, MatMulChain, Tree, chain_problem,
                                     emit_tree, extract_chain, factor_shapes, rewritable_shapes, splice_factors,
                                     subtrees, swaps_last_two)
from tfmem.config import Config, format_size
from tfmem.context import PassContext
from tfmem.graph import Graph, TensorRef
from tfmem.memory import estimate_memory
from tfmem.passes import PassResult, RewriteRecord
from tfmem.pattern import Emitted, RegionRule, live_nodes, outside_readers, sole_reader

logger = logging.getLogger(__name__)

_SCOPE = "reorder_matmul_chain"


@dataclasses.dataclass
class _Plan:
    """A chain's planner, its current cost, and the best bracketing with its cost."""

    planner: ChainPlanner
    before: ChainCost
    tree: Tree
    after: ChainCost

    @property
    def improves(self) -> bool:
        return self.after.key < self.before.key


@dataclasses.dataclass
class ChainRegion:
    """A chain found in the graph, and why shared intermediates block a better order."""

    chain: MatMulChain
    blocked: str | None  # "intermediate X used outside the chain ... prevents ...", or None
    rejection: dict[str, Any] = dataclasses.field(default_factory=dict)
    _plan: _Plan | str | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.chain.root,)

    def plan(self, graph: Graph) -> _Plan | str:
        """The best bracketing, or why the chain cannot be rewritten (dtype, control, shape)."""
        if self._plan is None:
            shapes = rewritable_shapes(graph, self.chain)
            if isinstance(shapes, str):
                self._plan = shapes
            else:
                planner = ChainPlanner(shapes, graph.spec(TensorRef(self.chain.root)).dtype.size)
                tree, after = planner.best()
                self._plan = _Plan(planner, planner.cost(self.chain.tree), tree, after)
        return self._plan


class ReorderMatMulChain(RegionRule[ChainRegion]):
    """Re-brackets chains of matrix products to shrink their largest intermediates.

    Example:
        >>> f = tfmem.TfmemFunction(lambda a, b, v: (a @ b) @ v, passes=[ReorderMatMulChain()])
        >>> [str(r) for r in f.report(a, b, v).records]
        ['[reorder_matmul_chain] ReorderMatMulChain fired at matmul_1 before=((a @ b) @ v) ...']
    """

    name = "reorder_matmul_chain"
    rule = "ReorderMatMulChain"
    stage = "reorder"
    reads = frozenset()  # no config key: the graph alone decides

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        crossed: set[str] = set()  # shared products that stand in the way of a better order
        result = self.rewrite(graph, context.config, self._chains(graph, crossed))
        graph = result.graph
        records = {r.nodes[0]: r for r in result.records}  # by chain root: a later verdict replaces one
        for shared in sorted(crossed):
            # Recomputing moves liveness around the whole graph, which the per-chain
            # model does not see: keep it only if the graph's estimated peak does not grow.
            before = graph.copy()
            recomputed = self._recompute_shared(graph, shared)
            if not recomputed:
                continue
            graph.prune()
            if estimate_memory(graph).peak_bytes > estimate_memory(before).peak_bytes:
                logger.info("not recomputing %s: the graph's estimated peak would grow", shared)
                graph = before
                continue
            records.update((record.nodes[0], record) for record in recomputed)
        return PassResult(graph, any(r.status == "fired" for r in records.values()), list(records.values()))

    def find(self, graph: Graph) -> Iterator[ChainRegion]:
        return self._chains(graph, set())

    def _chains(self, graph: Graph, crossed: set[str]) -> Iterator[ChainRegion]:
        """Each chain once, consumers before producers (the first product met is its root).

        Adds to `crossed` the shared products that a better order would cut through.
        """
        claimed: set[str] = set()
        for node in live_nodes(graph, PRODUCT_FLAGS, consumers_first=True):
            if node.name in claimed:
                continue
            chain = extract_chain(graph, node.name)
            claimed.update(chain.interior)
            region = ChainRegion(chain, self._blocked_reason(graph, chain, crossed) if chain.shared else None)
            if region.blocked is None and len(chain.factors) < 3:
                continue  # a lone product: no chain to reorder
            if region.blocked is None and chain.root.startswith(_SCOPE):
                plan = region.plan(graph)
                if isinstance(plan, _Plan) and not plan.improves:
                    continue  # our own output from an earlier round: optimal by construction
            yield region

    def check(self, graph: Graph, region: ChainRegion, config: Config) -> str | None:
        if len(region.chain.factors) < 3:
            return region.blocked
        plan = region.plan(graph)
        if isinstance(plan, str):
            return plan
        if plan.improves:
            return None
        if region.blocked:
            return region.blocked
        region.rejection = {"peak_bytes": plan.before.peak, "flops": plan.before.flops}
        return "already optimal"

    def rejection_details(self, region: ChainRegion) -> Mapping[str, Any]:
        return {"order": region.chain.describe(), **region.rejection}

    def emit(self, graph: Graph, region: ChainRegion) -> Emitted:
        plan = region.plan(graph)
        assert isinstance(plan, _Plan)  # `check` passed
        result, details = self._replace(graph, region.chain, plan.planner, plan.tree,
                                        {"also": region.blocked} if region.blocked else {})
        return Emitted(details, (result,))

    def _replace(self, graph: Graph, chain: MatMulChain, planner: ChainPlanner, tree: Tree,
                 extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Builds `tree` in place of the chain; returns the new root node and the record's details."""
        before, after = planner.cost(chain.tree), planner.cost(tree)

        def build(values: Callable[[int], tf.Tensor]) -> tf.Tensor:
            return emit_tree(tree, chain.factors, values, planner)[0]

        (result,) = splice_factors(graph, chain.factors, build, _SCOPE)
        graph.replace_all_uses(TensorRef(chain.root), result)
        logger.info("reordered %s → %s (peak %s → %s)", chain.describe(), chain.describe(tree),
                    format_size(before.peak), format_size(after.peak))
        return result.node, {"before": chain.describe(), "after": chain.describe(tree),
                             "peak_bytes_before": before.peak, "peak_bytes_after": after.peak,
                             "flops_before": before.flops, "flops_after": after.flops, **extra}

    def _blocked_reason(self, graph: Graph, chain: MatMulChain, crossed: set[str]) -> str | None:
        """Why shared intermediates cost this chain a better order, or None if they don't.

        Adds the shared products that a better order would cut through to `crossed`.
        """
        full = extract_chain(graph, chain.root, expand_shared=True)
        spans = [s for s in full.shared if s.span[0] < s.span[1]]
        shapes = factor_shapes(graph, full.factors)
        if not spans or isinstance(shapes, str) or chain_problem(graph, chain) is not None:
            return None
        planner = ChainPlanner(shapes, graph.spec(TensorRef(chain.root)).dtype.size)

        def keeps_shared(first: int, last: int) -> bool:  # no interval cuts a shared span
            return all(last < a or first > b or (first <= a and b <= last) or (a <= first and last <= b)
                       for a, b in (s.span for s in spans))

        free_tree, free = planner.best()
        _, kept = planner.best(keeps_shared)
        if free.key >= kept.key:
            return None
        cut = [s for s in spans if s.span not in subtrees(free_tree)]
        crossed.update(s.node for s in cut)
        return "; ".join(
            f"intermediate {s.node} used outside the chain (by {', '.join(s.users[:3])}) "
            f"prevents the order {full.describe(free_tree)} (peak {format_size(free.peak)} "
            f"instead of {format_size(kept.peak)})" for s in cut)

    def _recompute_shared(self, graph: Graph, shared: str) -> list[RewriteRecord]:
        """Re-brackets every chain reading `shared` through it, if that frees `shared`.

        A shared product is only worth dropping when *all* its readers are chains whose
        best order cuts through it and stays below its size: then each recomputes the
        small products it needs and the large one is never built (like `(dY @ vᵀ)`,
        read by both gradients of `(A @ B) @ v`). Otherwise nothing changes.
        """
        ref = TensorRef(shared)
        size = graph.nbytes(ref) if shared in graph else None
        readers = {c for c, _ in graph.consumers(ref)} if size is not None else set()
        if size is None or outside_readers(graph, [ref], readers):
            return []  # gone, dynamic, an output, kept, or read by a control edge / another output
        roots = list(dict.fromkeys(self._root_of(graph, c) for c, _ in graph.consumers(ref)))
        plans = []
        for root in roots:
            if graph.node(root).op not in PRODUCT_FLAGS:
                return []
            chain = extract_chain(graph, root, duplicate=frozenset({shared}))
            spans = [s.span for s in chain.shared if s.node == shared and s.span[0] < s.span[1]]
            shapes = factor_shapes(graph, chain.factors)
            if not spans or isinstance(shapes, str) or chain_problem(graph, chain) is not None:
                return []
            planner = ChainPlanner(shapes, graph.spec(TensorRef(root)).dtype.size)
            tree, cost = planner.best()
            if cost.peak >= size or any(span in subtrees(tree) for span in spans):
                return []
            plans.append((chain, planner, tree, len(spans)))
        if sum(uses for *_, uses in plans) != len(graph.consumers(ref)):
            return []  # some read of it is not through a chain we rebuild
        leaves = {f.tensor.node for chain, *_ in plans for f in chain.factors}
        if leaves & set(roots):
            return []  # one chain feeds another: rebuilding both would keep the old one alive
        records = []
        for chain, planner, tree, _ in plans:
            result, details = self._replace(graph, chain, planner, tree, {"recomputes": shared})
            records.append(RewriteRecord(self.name, self.rule, "fired", (chain.root, result), details=details))
        return records

    @staticmethod
    def _root_of(graph: Graph, name: str) -> str:
        """The root of the chain a product belongs to: follow sole readers up the chain."""
        while True:
            reader = sole_reader(graph, TensorRef(name))
            while reader is not None and swaps_last_two(graph, graph.node(reader)):
                reader = sole_reader(graph, TensorRef(reader))
            if reader is None or graph.node(reader).op not in PRODUCT_FLAGS or graph.control_inputs(name):
                return name
            name = reader


__all__ = ["ChainRegion", "ReorderMatMulChain"]
