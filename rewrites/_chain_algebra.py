"""The algebra of matrix-product chains, shared by the passes that re-bracket them.

A chain is a maximal tree of `MatMul` / `BatchMatMulV2` ops (with their `transpose_*` /
`adj_*` flags, and `Transpose` ops that swap the last two dimensions in between, using
(X @ Y)ᵀ = Yᵀ @ Xᵀ) whose intermediate products are read only inside the tree. Its
leaves are the factors X₁ … Xₙ, each possibly transposed.

- `extract_chain` walks a chain back from its root product (`MatMulChain`, `Factor`).
- `ChainPlanner` costs bracketings and finds the best by a dynamic programme over the
  factor intervals, minimising, lexicographically, the peak bytes of intermediates live
  while the chain runs (each product holds its two operands and its result; factors
  exist anyway and count zero), then the multiply-add flops.
- `emit_tree` / `splice_factors` build a bracketing with `tf.linalg.matmul` and
  transpose flags, so transposed factors are never copied.

Used by `matmul_chain` (re-bracketing) and `diag_of_product` (contracting a diagonal).

Example:
    >>> chain = extract_chain(graph, "matmul_1")   # (a @ b) @ v
    >>> planner = ChainPlanner(factor_shapes(graph, chain.factors), 8)
    >>> chain.describe(planner.best()[0])
    '(a @ (b @ v))'
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Union

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tfmem.graph import Graph, TensorRef
from tfmem.pattern import describe_reader, outside_readers, sole_reader

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
        tensors = [*path, source]
        private = all(sole_reader(self.graph, t) is not None for t in tensors)
        private = private and not self.graph.control_inputs(node.name)
        if private and not self._inside_shared:
            self.interior.extend([t.node for t in path] + [node.name])
            return self.product(node.name, flipped)
        if private:  # inside a shared product being expanded hypothetically
            return self.product(node.name, flipped)
        # The other readers: not the chain's own product or the transposes on the way.
        own = {reader} | {t.node for t in path}
        users = tuple(dict.fromkeys(describe_reader(self.graph, r)
                                    for r in outside_readers(self.graph, tensors, own)))
        duplicated = (node.name in self.duplicate and not self._inside_shared
                      and all(sole_reader(self.graph, t) is not None for t in path)
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
