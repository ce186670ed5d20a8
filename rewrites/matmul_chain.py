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
factors are never copied.

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
from collections.abc import Callable, Sequence
from typing import Any, Union

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tfmem.config import Config, format_size
from tfmem.graph import Graph, TensorRef
from tfmem.memory import estimate_memory
from tfmem.passes import GraphPass, PassResult, RewriteRecord

logger = logging.getLogger(__name__)

# A bracketing: a factor index, or (left, right) for the product of two sub-brackets.
Tree = Union[int, tuple["Tree", "Tree"]]

# Product op → the attrs that transpose its first and second operand.
PRODUCT_FLAGS: dict[str, tuple[str, str]] = {
    "MatMul": ("transpose_a", "transpose_b"),
    "BatchMatMul": ("adj_x", "adj_y"),
    "BatchMatMulV2": ("adj_x", "adj_y"),
}
# Transposes are only absorbed when they swap the last two dimensions and nothing else;
# ConjugateTranspose is a plain transpose for the real dtypes chains are limited to.
TRANSPOSE_OPS = frozenset({"Transpose", "ConjugateTranspose"})
REAL_DTYPES = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64})
# The DP keeps a few (peak, flops) trade-offs per interval; more never mattered in practice.
_PARETO_WIDTH = 8
# Longer chains are left as they are: the DP is cubic in the length.
MAX_FACTORS = 64
_SCOPE = "reorder_matmul_chain"


@dataclasses.dataclass(frozen=True)
class Factor:
    """One leaf of a chain: `tensor`, transposed in its last two dims if `transposed`."""

    tensor: TensorRef
    transposed: bool = False

    @property
    def label(self) -> str:
        name = self.tensor.node if self.tensor.index == 0 else self.tensor.name
        return name + ("ᵀ" if self.transposed else "")


@dataclasses.dataclass(frozen=True)
class SharedProduct:
    """A product inside a chain's span that is also read elsewhere, so it ends the chain."""

    node: str
    users: tuple[str, ...]
    span: tuple[int, int]  # first and last factor it covers (in the expanded chain)


@dataclasses.dataclass
class MatMulChain:
    """A tree of products over `factors`, as found in the graph.

    Attributes:
        root: the node computing the whole product.
        factors: the leaves, left to right.
        tree: the graph's current bracketing of the factors.
        interior: the chain's own nodes (products and transposes), the root included:
            nothing outside the chain reads them.
        shared: products that were left as factors because something else reads them
            (or, when extracted with `expand_shared`, expanded anyway; see `span`).
    """

    root: str
    factors: list[Factor]
    tree: Tree
    interior: list[str]
    shared: list[SharedProduct]

    def describe(self, tree: Tree | None = None) -> str:
        """The bracketing as text, e.g. `((a @ b) @ v)`."""
        return describe_tree(self.tree if tree is None else tree, [f.label for f in self.factors])


def describe_tree(tree: Tree, labels: Sequence[str]) -> str:
    if isinstance(tree, int):
        return labels[tree]
    return f"({describe_tree(tree[0], labels)} @ {describe_tree(tree[1], labels)})"


def swaps_last_two(graph: Graph, node: node_def_pb2.NodeDef) -> bool:
    """Whether a Transpose node swaps exactly its last two dimensions."""
    if node.op not in TRANSPOSE_OPS:
        return False
    perm = graph.constant_value(graph.inputs(node.name)[1])
    if perm is None or perm.ndim != 1 or perm.size < 2:
        return False
    rank = perm.size
    return list(perm) == [*range(rank - 2), rank - 1, rank - 2]


def peel_transposes(graph: Graph, ref: TensorRef) -> tuple[TensorRef, bool, list[TensorRef]]:
    """Follows last-two-dims transposes back from `ref`.

    Returns:
        (source tensor, whether an odd number of transposes was peeled, the tensors on
        the path from `ref` back to just before the source: `ref` first).
    """
    flipped, path = False, []
    while swaps_last_two(graph, graph.node(ref.node)):
        path.append(ref)
        ref = graph.inputs(ref.node)[0]
        flipped = not flipped
    return ref, flipped, path


class _ChainBuilder:
    """Walks back from a product, collecting factors and the chain's own nodes."""

    def __init__(self, graph: Graph, expand_shared: bool, duplicate: frozenset[str]) -> None:
        self.graph = graph
        self.expand_shared = expand_shared  # one level through shared products
        self.duplicate = duplicate  # shared products to expand for real (recomputed)
        self.factors: list[Factor] = []
        self.interior: list[str] = []
        self.shared: list[SharedProduct] = []
        self._inside_shared = False

    def product(self, name: str, flipped: bool) -> Tree:
        """The tree of a product node; `flipped` asks for its transpose."""
        first, second = PRODUCT_FLAGS[self.graph.node(name).op]
        attrs = self.graph.node(name).attr
        a, b = self.graph.inputs(name)[:2]
        ta = bool(attrs[first].b) if first in attrs else False
        tb = bool(attrs[second].b) if second in attrs else False
        if flipped:  # (op(a) @ op(b))ᵀ = op(b)ᵀ @ op(a)ᵀ
            return self.operand(b, not tb, name), self.operand(a, not ta, name)
        return self.operand(a, ta, name), self.operand(b, tb, name)

    def operand(self, ref: TensorRef, flipped: bool, reader: str) -> Tree:
        """The tree of `ref` as read by the product `reader`."""
        source, peeled, path = peel_transposes(self.graph, ref)
        flipped ^= peeled
        node = self.graph.node(source.node)
        if node.op not in PRODUCT_FLAGS or source.index != 0 or len(self.factors) >= MAX_FACTORS:
            return self._leaf(Factor(source, flipped))
        private = all(self.graph.sole_consumer(t) is not None for t in [*path, source])
        private = private and not self.graph.control_inputs(node.name)
        if private and not self._inside_shared:
            self.interior.extend([t.node for t in path] + [node.name])
            return self.product(node.name, flipped)
        if private:  # inside a shared product being expanded hypothetically
            return self.product(node.name, flipped)
        # The other readers: not the chain's own product or the transposes on the way.
        own = {reader} | {t.node for t in path}
        users = tuple(dict.fromkeys(c for t in [*path, source] for c, _ in self.graph.consumers(t)
                                    if c not in own))
        if any(self.graph.is_output(t) for t in [*path, source]):
            users += ("<graph output>",)
        duplicated = (node.name in self.duplicate and not self._inside_shared
                      and all(self.graph.sole_consumer(t) is not None for t in path)
                      and not self.graph.control_inputs(node.name))
        if not duplicated and (not self.expand_shared or self._inside_shared):
            self.shared.append(SharedProduct(node.name, users, (len(self.factors),) * 2))
            return self._leaf(Factor(source, flipped))
        if duplicated:  # the transposes on the way are ours; the product stays the others'
            self.interior.extend(t.node for t in path)
        first = len(self.factors)
        self._inside_shared = True
        try:
            tree = self.product(node.name, flipped)
        finally:
            self._inside_shared = False
        self.shared.append(SharedProduct(node.name, users, (first, len(self.factors) - 1)))
        return tree

    def _leaf(self, factor: Factor) -> int:
        self.factors.append(factor)
        return len(self.factors) - 1


def extract_chain(graph: Graph, root: str, *, expand_shared: bool = False,
                  duplicate: frozenset[str] = frozenset(), flipped: bool = False) -> MatMulChain:
    """The chain of products ending at node `root` (a MatMul or BatchMatMulV2).

    Args:
        graph: the graph.
        root: the product node computing the whole chain.
        expand_shared: also expand (one level deep) the products that are read outside
            the chain, to see what order the chain would have without them. Their spans
            are in `shared`.
        duplicate: shared products to expand (one level deep) anyway, because every
            reader will recompute them; their spans are in `shared`.
        flipped: extract the chain of the root's transpose instead.

    Example:
        >>> chain = extract_chain(graph, "matmul_1")   # for (a @ b) @ v
        >>> chain.describe(), chain.interior
        ('((a @ b) @ v)', ['matmul_1', 'matmul'])
    """
    builder = _ChainBuilder(graph, expand_shared, duplicate)
    builder.interior.append(root)
    tree = builder.product(root, flipped)
    return MatMulChain(root, builder.factors, tree, builder.interior, builder.shared)


@dataclasses.dataclass(frozen=True)
class ChainCost:
    """The cost of evaluating one bracketing.

    Attributes:
        peak: bytes of intermediates (not factors) live at the worst moment, the
            result included.
        flops: multiply-adds × 2.
        size: bytes of the result (0 for a bare factor: it exists anyway).
    """

    peak: int
    flops: int
    size: int

    @property
    def key(self) -> tuple[int, int]:
        return self.peak, self.flops


def combine_peak(left: ChainCost, right: ChainCost, extra: int) -> tuple[int, bool]:
    """Peak of evaluating two subtrees, then an op holding both and allocating `extra`.

    Returns the peak and whether evaluating `right` first gives it: whichever runs
    first keeps its result live while the other runs.
    """
    last = left.size + right.size + extra
    left_first = max(left.peak, left.size + right.peak, last)
    right_first = max(right.peak, right.size + left.peak, last)
    return (right_first, True) if right_first < left_first else (left_first, False)


class ChainPlanner:
    """Costs and optimal bracketings of a chain of factors with static shapes.

    Args:
        shapes: each factor's shape after its transposition: `[*batch, rows, cols]`.
        itemsize: bytes per element.

    Example:
        >>> planner = ChainPlanner([(1000, 1000), (1000, 1000), (1000, 1)], 8)
        >>> planner.best()[0], planner.cost(((0, 1), 2)).peak, planner.best()[1].peak
        ((0, (1, 2)), 8008000, 16000)
    """

    def __init__(self, shapes: Sequence[Sequence[int]], itemsize: int) -> None:
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.itemsize = itemsize
        for left, right in zip(self.shapes, self.shapes[1:]):
            if left[-1] != right[-2]:
                raise ValueError(f"factor shapes {left} and {right} do not chain")

    def batch(self, first: int, last: int) -> tuple[int, ...]:
        """The broadcast batch shape of the product of factors `first` … `last`."""
        return tuple(np.broadcast_shapes(*(s[:-2] for s in self.shapes[first:last + 1])))

    def result_shape(self, first: int, last: int) -> tuple[int, ...]:
        return (*self.batch(first, last), self.shapes[first][-2], self.shapes[last][-1])

    def result_bytes(self, first: int, last: int) -> int:
        return int(np.prod(self.result_shape(first, last), dtype=np.int64)) * self.itemsize

    def span(self, tree: Tree) -> tuple[int, int]:
        if isinstance(tree, int):
            return tree, tree
        return self.span(tree[0])[0], self.span(tree[1])[1]

    def _product(self, left: ChainCost, right: ChainCost, first: int, split: int,
                 last: int) -> tuple[ChainCost, bool]:
        size = self.result_bytes(first, last)
        peak, right_first = combine_peak(left, right, size)
        batch = int(np.prod(self.batch(first, last), dtype=np.int64))
        flops = 2 * batch * self.shapes[first][-2] * self.shapes[split][-1] * self.shapes[last][-1]
        return ChainCost(peak, left.flops + right.flops + flops, size), right_first

    def cost(self, tree: Tree) -> ChainCost:
        """The cost of one bracketing, its subtrees in their best order."""
        if isinstance(tree, int):
            return ChainCost(0, 0, 0)
        (first, split), (_, last) = self.span(tree[0]), self.span(tree[1])
        return self._product(self.cost(tree[0]), self.cost(tree[1]), first, split, last)[0]

    def right_first(self, tree: tuple[Tree, Tree]) -> bool:
        """Whether to evaluate the right operand of this product first."""
        (first, split), (_, last) = self.span(tree[0]), self.span(tree[1])
        return self._product(self.cost(tree[0]), self.cost(tree[1]), first, split, last)[1]

    def best(self, allowed: Callable[[int, int], bool] | None = None) -> tuple[Tree, ChainCost]:
        """The bracketing with the lowest (peak, flops).

        Args:
            allowed: which intervals of factors may be a subtree (e.g. not crossing a
                product that must exist anyway); all by default.
        """
        n = len(self.shapes)
        fronts: dict[tuple[int, int], list[tuple[ChainCost, Tree]]] = {
            (i, i): [(ChainCost(0, 0, 0), i)] for i in range(n)}
        for length in range(2, n + 1):
            for first in range(n - length + 1):
                last = first + length - 1
                if allowed is not None and not allowed(first, last):
                    continue
                candidates = []
                for split in range(first, last):
                    for left, left_tree in fronts.get((first, split), ()):
                        for right, right_tree in fronts.get((split + 1, last), ()):
                            cost, _ = self._product(left, right, first, split, last)
                            candidates.append((cost, (left_tree, right_tree)))
                fronts[(first, last)] = _pareto(candidates)
        if not fronts.get((0, n - 1)):
            raise ValueError("no bracketing satisfies the constraints")
        tree, cost = fronts[(0, n - 1)][0][1], fronts[(0, n - 1)][0][0]
        return tree, cost


def _pareto(candidates: list[tuple[ChainCost, Tree]]) -> list[tuple[ChainCost, Tree]]:
    # Keep the (peak, flops) trade-offs: a higher peak is only worth keeping for fewer
    # flops, because an enclosing product may hide the peak difference but not the flops.
    front: list[tuple[ChainCost, Tree]] = []
    for cost, tree in sorted(candidates, key=lambda c: c[0].key):
        if not front or cost.flops < front[-1][0].flops:
            front.append((cost, tree))
    return front[:_PARETO_WIDTH]


def subtrees(tree: Tree) -> set[tuple[int, int]]:
    """The factor intervals that are products in a bracketing."""
    spans: set[tuple[int, int]] = set()

    def walk(t: Tree) -> tuple[int, int]:
        if isinstance(t, int):
            return t, t
        span = walk(t[0])[0], walk(t[1])[1]
        spans.add(span)
        return span

    walk(tree)
    return spans


def emit_tree(tree: Tree, factors: Sequence[Factor], values: Callable[[int], tf.Tensor],
              planner: ChainPlanner) -> tuple[tf.Tensor, bool]:
    """Builds a bracketing with `tf.linalg.matmul` inside a `Graph.splice` build function.

    Returns the result and whether it is still to be transposed (only for a bare
    factor; products come out upright).
    """
    if isinstance(tree, int):
        return values(tree), factors[tree].transposed
    if planner.right_first(tree):  # build order is run order: the larger subtree first
        right = emit_tree(tree[1], factors, values, planner)
        left = emit_tree(tree[0], factors, values, planner)
    else:
        left = emit_tree(tree[0], factors, values, planner)
        right = emit_tree(tree[1], factors, values, planner)
    product = tf.linalg.matmul(left[0], right[0], transpose_a=left[1], transpose_b=right[1])
    return product, False


def factor_shapes(graph: Graph, factors: Sequence[Factor]) -> list[tuple[int, ...]] | str:
    """Each factor's static shape after its transposition, or the reason there is none."""
    shapes = []
    for factor in factors:
        shape = graph.spec(factor.tensor).shape
        if not shape.is_fully_defined():
            return f"dynamic shape: factor {factor.tensor} has shape {shape}"
        dims = tuple(shape.as_list())
        shapes.append((*dims[:-2], dims[-1], dims[-2]) if factor.transposed else dims)
    return shapes


def chain_problem(graph: Graph, chain: MatMulChain) -> str | None:
    """Why a chain cannot be rewritten at all (dtype, control edges), or None."""
    dtype = graph.spec(TensorRef(chain.root)).dtype
    if dtype not in REAL_DTYPES:
        return f"dtype {dtype.name} is not a real floating type"
    for name in chain.interior:
        if graph.control_inputs(name):
            return f"{name} has control inputs"
        waiting = graph.control_dependants(name)
        if waiting:
            return f"{name} is a control dependency of {waiting[0]}"
    return None


def rewritable_shapes(graph: Graph, chain: MatMulChain) -> list[tuple[int, ...]] | str:
    """The chain's factor shapes, or why the chain cannot be rewritten (dtype, control, shape)."""
    problem = chain_problem(graph, chain)
    return problem if problem is not None else factor_shapes(graph, chain.factors)


def splice_factors(graph: Graph, factors: Sequence[Factor],
                   build: Callable[[Callable[[int], tf.Tensor]], Any], scope: str) -> list[TensorRef]:
    """`Graph.splice` over the distinct tensors of `factors`; `build` gets factor index → value."""
    refs = list(dict.fromkeys(f.tensor for f in factors))
    position = {ref: i for i, ref in enumerate(refs)}

    def build_from_inputs(*inputs: tf.Tensor) -> Any:
        return build(lambda i: inputs[position[factors[i].tensor]])

    return graph.splice(build_from_inputs, refs, scope=scope)


class ReorderMatMulChain(GraphPass):
    """Re-brackets chains of matrix products to shrink their largest intermediates.

    Example:
        >>> f = tfmem.TfmemFunction(lambda a, b, v: (a @ b) @ v, passes=[ReorderMatMulChain()])
        >>> [str(r) for r in f.report(a, b, v).records]
        ['[reorder_matmul_chain] ReorderMatMulChain fired at matmul_1 before=((a @ b) @ v) ...']
    """

    name = "reorder_matmul_chain"
    stage = "reorder"

    def run(self, graph: Graph, config: Config) -> PassResult:
        records: dict[str, RewriteRecord] = {}  # by chain root: a later verdict replaces one
        claimed: set[str] = set()
        crossed: set[str] = set()  # shared products that stand in the way of a better order
        # Consumers before producers: the first product met in a chain is its root.
        for node in reversed(graph.nodes):
            if node.op not in PRODUCT_FLAGS or node.name in claimed:
                continue
            chain = extract_chain(graph, node.name)
            claimed.update(chain.interior)
            record = self._rewrite(graph, chain, crossed)
            if record is not None:
                records[chain.root] = record
        if any(r.status == "fired" for r in records.values()):
            graph.prune()  # the replaced chains must not count as readers below
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
        modified = any(r.status == "fired" for r in records.values())
        if modified:
            graph.prune()
        return PassResult(graph, modified, list(records.values()))

    def _reject(self, chain: MatMulChain, reason: str, **details: Any) -> RewriteRecord:
        return RewriteRecord(self.name, "ReorderMatMulChain", "rejected", (chain.root,), reason,
                             {"order": chain.describe(), **details})

    def _rewrite(self, graph: Graph, chain: MatMulChain, crossed: set[str]) -> RewriteRecord | None:
        blocked = self._blocked_reason(graph, chain, crossed) if chain.shared else None
        if len(chain.factors) < 3:
            return self._reject(chain, blocked) if blocked else None
        shapes = rewritable_shapes(graph, chain)
        if isinstance(shapes, str):
            return self._reject(chain, shapes)
        planner = ChainPlanner(shapes, graph.spec(TensorRef(chain.root)).dtype.size)
        before = planner.cost(chain.tree)
        tree, after = planner.best()
        if after.key >= before.key:
            if blocked:
                return self._reject(chain, blocked)
            if chain.root.startswith(_SCOPE):
                return None  # our own output from an earlier round: optimal by construction
            return self._reject(chain, "already optimal",
                                peak_bytes=before.peak, flops=before.flops)
        return self._replace(graph, chain, planner, tree, {"also": blocked} if blocked else {})

    def _replace(self, graph: Graph, chain: MatMulChain, planner: ChainPlanner, tree: Tree,
                 extra: dict[str, Any]) -> RewriteRecord:
        """Builds `tree` in place of the chain; records the change."""
        before, after = planner.cost(chain.tree), planner.cost(tree)

        def build(values: Callable[[int], tf.Tensor]) -> tf.Tensor:
            return emit_tree(tree, chain.factors, values, planner)[0]

        (result,) = splice_factors(graph, chain.factors, build, _SCOPE)
        graph.replace_all_uses(TensorRef(chain.root), result)
        logger.info("reordered %s → %s (peak %s → %s)", chain.describe(), chain.describe(tree),
                    format_size(before.peak), format_size(after.peak))
        details = {"before": chain.describe(), "after": chain.describe(tree),
                   "peak_bytes_before": before.peak, "peak_bytes_after": after.peak,
                   "flops_before": before.flops, "flops_after": after.flops, **extra}
        return RewriteRecord(self.name, "ReorderMatMulChain", "fired",
                             (chain.root, result.node), details=details)

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
        if (size is None or graph.is_output(ref) or shared in graph.keep
                or len(graph.node_consumers(shared)) != len({c for c, _ in graph.consumers(ref)})):
            return []  # gone, dynamic, an output, or read by a control edge / another output
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
        return [self._replace(graph, chain, planner, tree, {"recomputes": shared})
                for chain, planner, tree, _ in plans]

    @staticmethod
    def _root_of(graph: Graph, name: str) -> str:
        """The root of the chain a product belongs to: follow sole readers up the chain."""
        while True:
            use = graph.sole_consumer(TensorRef(name))
            while use is not None and swaps_last_two(graph, graph.node(use[0])):
                use = graph.sole_consumer(TensorRef(use[0]))
            if use is None or graph.node(use[0]).op not in PRODUCT_FLAGS \
                    or graph.control_inputs(name):
                return name
            name = use[0]
