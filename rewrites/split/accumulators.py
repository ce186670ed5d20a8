"""Gradient accumulators of a loop, collected as outer products and summed after it.

    dK = 0                               G, P = [], []
    while ...:                     →     while ...:
        dK = dK + g @ pᵀ                     G.append(g); P.append(p)
                                         dK = [g₀ g₁ …] @ [p₀ p₁ …]ᵀ      (after the loop)

TensorFlow differentiates a `tf.while_loop` with a second loop that runs the body's
gradient backwards and sums, trip by trip, the gradient of every tensor the body
captured. For a kernel matrix K read as `K @ p` (conjugate gradients, power iteration)
that sum is `dK += g pᵀ`: an `[n, n]` accumulator carried whole through the loop, beside
K itself. Its terms are outer products of vectors, so the loop can instead keep the
vectors (`[T, n, k]`, T the loop's bound on its trips) and form their sum after it as
one matrix product, which the split planner computes in row chunks, fused into its
readers, never whole. K in the gradient loop is then an invariant like any other, which
`sink` recomputes in chunks.

A slot is collected when the body's only use of its value is `acc + Σⱼ aⱼ @ bⱼ`
(`AddN`/`AddV2` of the argument and rank-2 `MatMul`s), the condition does not read it,
the loop's trips have a static bound (`trip_bound`), and the vectors take at most a
quarter of the accumulator.

Example (the gradient loop of conjugate gradients; slot 7 is dK [n, n]):
    >>> [slot] = [a.slot for a in outer_product_accumulators(graph, "gradients/while_grad", limit=2**20)]
    >>> collect_outer_products(graph, outer_product_accumulators(graph, "gradients/while_grad", limit=2**20))
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfmem.graph import Graph, GraphError, TensorRef
from tfmem.memory import WHILE_LOOP_OPS, loop_function_graph, while_passthrough

from rewrites.split.rebuild import Extras, rebuild_while

_SUMS = frozenset({"AddN", "AddV2", "Add"})
# The collected vectors may take at most this share of the accumulator they replace.
_VECTOR_SHARE = 4


@dataclasses.dataclass(frozen=True)
class OuterProductAccumulator:
    """A loop variable the body updates as `acc + Σⱼ op(aⱼ) @ op(bⱼ)`.

    Attributes:
        loop: the `While` node.
        slot: the accumulator's loop-variable position.
        terms: per product, (lhs, rhs, transpose_a, transpose_b) in the body's graph.
        width: the products' summed inner dimension (columns collected per trip).
        trips: the loop's bound on its trips.
    """

    loop: str
    slot: int
    terms: tuple[tuple[TensorRef, TensorRef, bool, bool], ...]
    width: int
    trips: int


def trip_bound(graph: Graph, loop: str) -> int | None:
    """A static bound on how many times `loop` runs its body, or None.

    Found from a conjunct `counter < bound` of the condition, where `counter` starts at
    a constant and the body adds one to it, and `bound` is a constant, or the final
    counter of another loop with a bound (a gradient loop runs as often as its forward
    loop did, and `tf.while_loop(maximum_iterations=...)` bounds that one).
    """
    return _trip_bound(graph, loop, depth=0)


def _trip_bound(graph: Graph, loop: str, depth: int) -> int | None:
    node = graph.node(loop)
    cond_def = graph.function(node.attr["cond"].func.name)
    body_def = graph.function(node.attr["body"].func.name)
    if cond_def is None or body_def is None or depth > 4:
        return None
    inputs = graph.inputs(loop)
    cond = loop_function_graph(graph, loop, "cond")
    cond_args = {arg.name: i for i, arg in enumerate(cond_def.signature.input_arg)}
    passthrough = while_passthrough(graph, loop)
    best = None
    for less in _conjuncts(cond, cond.outputs[0]):
        counter, bound = cond.inputs(less)
        slot = cond_args.get(counter.node)
        if slot is None or not _is_counter(graph, loop, slot):
            continue
        if bound.node in cond_args:
            limit = (_value_bound(graph, inputs[cond_args[bound.node]], depth)
                     if passthrough.get(cond_args[bound.node]) == cond_args[bound.node] else None)
        else:
            limit = _int_constant(cond, bound)
        start = _int_constant(graph, inputs[slot])
        if limit is not None and start is not None:
            trips = max(0, limit - start)
            best = trips if best is None else min(best, trips)
    return best


def _conjuncts(cond: Graph, ref: TensorRef) -> list[str]:
    """The `Less` nodes whose conjunction (through Identity and LogicalAnd) is `ref`."""
    node = cond.node(ref.node)
    if node.op == "Identity":
        return _conjuncts(cond, cond.inputs(ref.node)[0])
    if node.op == "LogicalAnd":
        return [less for part in cond.inputs(ref.node) for less in _conjuncts(cond, part)]
    return [ref.node] if node.op == "Less" else []


def _is_counter(graph: Graph, loop: str, slot: int) -> bool:
    """Whether the body returns its argument at `slot` plus the constant 1."""
    body_def = graph.function(graph.node(loop).attr["body"].func.name)
    body = loop_function_graph(graph, loop, "body")
    arg = TensorRef(body_def.signature.input_arg[slot].name)
    out = _through_identities(body, body.outputs[slot])
    if body.node(out.node).op not in ("AddV2", "Add"):
        return False
    operands = [_through_identities(body, ref) for ref in body.inputs(out.node)]
    return arg in operands and any(_int_constant(body, ref) == 1 for ref in operands if ref != arg)


def _value_bound(graph: Graph, ref: TensorRef, depth: int) -> int | None:
    """An upper bound on an int scalar: a constant, or a bounded loop's final counter."""
    ref = _through_identities(graph, ref)
    value = _int_constant(graph, ref)
    if value is not None:
        return value
    node = graph.node(ref.node)
    if node.op in WHILE_LOOP_OPS and _is_counter(graph, ref.node, ref.index):
        start, trips = _int_constant(graph, graph.inputs(ref.node)[ref.index]), _trip_bound(graph, ref.node, depth + 1)
        if start is not None and trips is not None:
            return start + trips
    return None


def _int_constant(graph: Graph, ref: TensorRef) -> int | None:
    value = graph.constant_value(_through_identities(graph, ref))
    if value is None or np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.integer):
        return None
    return int(value)


def _through_identities(graph: Graph, ref: TensorRef) -> TensorRef:
    while graph.node(ref.node).op == "Identity":
        ref = graph.inputs(ref.node)[0]
    return ref


def outer_product_accumulators(graph: Graph, loop: str, limit: int) -> list[OuterProductAccumulator] | str:
    """The accumulators of `loop` over `limit` bytes whose updates are sums of products
    (see the module docstring); or why the loop has none that can be collected."""
    node = graph.node(loop)
    body_def, cond_def = graph.function(node.attr["body"].func.name), graph.function(node.attr["cond"].func.name)
    if body_def is None or cond_def is None:
        return f"loop {loop}: its functions are not in the graph's library"
    if body_def.control_ret or cond_def.control_ret:
        return f"loop {loop}: it has side effects (control outputs)"
    inputs = graph.inputs(loop)
    passthrough = while_passthrough(graph, loop)
    big = [slot for slot, ref in enumerate(inputs) if (graph.nbytes(ref) or 0) > limit and passthrough.get(slot) != slot]
    if not big:
        return []
    body = loop_function_graph(graph, loop, "body")
    cond = loop_function_graph(graph, loop, "cond")
    trips = None
    found: list[OuterProductAccumulator] = []
    reasons: list[str] = []
    for slot in big:
        arg = TensorRef(body_def.signature.input_arg[slot].name)
        if cond.consumers(TensorRef(cond_def.signature.input_arg[slot].name)):
            reasons.append(f"slot {slot}: the loop's condition reads it")
            continue
        terms = _product_terms(body, arg, body.outputs[slot])
        if isinstance(terms, str):
            reasons.append(f"slot {slot}: {terms}")
            continue
        trips = trip_bound(graph, loop) if trips is None else trips
        if trips is None:
            return f"loop {loop}: its number of trips has no static bound"
        width = sum(_inner_dim(body, term) for term in terms)
        rows, cols = graph.spec(inputs[slot]).shape.as_list()
        if (rows + cols) * width * trips * _VECTOR_SHARE > rows * cols:
            reasons.append(f"slot {slot}: {trips} trips of {width} columns are not much smaller than "
                           f"[{rows}, {cols}]")
            continue
        found.append(OuterProductAccumulator(loop, slot, tuple(terms), width, trips))
    return found if found or not reasons else f"loop {loop}: " + "; ".join(reasons)


def _product_terms(body: Graph, arg: TensorRef, output: TensorRef
                   ) -> list[tuple[TensorRef, TensorRef, bool, bool]] | str:
    """The products `acc + Σ op(a) @ op(b)` adds to `arg` to make `output`, or why not."""
    total = _through_identities(body, output)
    if body.node(total.node).op not in _SUMS:
        return f"it is updated by {body.node(total.node).op}, not a sum"
    # The running sum may be read by nothing but the chain to the body's output.
    chain = {total.node}
    ref = output
    while ref != total:
        chain.add(ref.node)
        ref = body.inputs(ref.node)[0]
    if any(consumer not in chain for name in chain for consumer, _ in body.consumers(TensorRef(name))) \
            or sum(1 for out in body.outputs if _through_identities(body, out) == total) != 1:
        return "its running sum is read inside the loop"
    operands = _sum_leaves(body, total)
    accumulated = [ref for ref in operands if _through_identities(body, ref) == arg]
    if len(accumulated) != 1:
        return "its update does not add to it exactly once"
    for identity in _identity_chain(body, accumulated[0]):
        if len(body.consumers(TensorRef(identity))) != 1:
            return "its value is read inside the loop"
    if len(body.consumers(arg)) != 1:
        return "its value is read inside the loop"
    terms = []
    for ref in operands:
        if ref == accumulated[0]:
            continue
        product = _through_identities(body, ref)
        node = body.node(product.node)
        if node.op != "MatMul" or len(body.spec(product).shape) != 2:
            return f"it adds {node.op}, not a product of two matrices"
        lhs, rhs = body.inputs(product.node)
        if body.spec(lhs).shape.num_elements() is None or body.spec(rhs).shape.num_elements() is None:
            return "its products' shapes are not static"
        terms.append((lhs, rhs, node.attr["transpose_a"].b, node.attr["transpose_b"].b))
    return terms or "it adds nothing"


def _sum_leaves(body: Graph, total: TensorRef) -> list[TensorRef]:
    """The operands of a tree of sums rooted at `total` (`(acc + a) + b`, `acc + AddN(a, b)`);
    an inner sum read elsewhere is an operand itself."""
    leaves = []
    for ref in body.inputs(total.node):
        inner = _through_identities(body, ref)
        if body.node(inner.node).op in _SUMS and len(body.consumers(inner)) == 1 and inner == ref:
            leaves.extend(_sum_leaves(body, inner))
        else:
            leaves.append(ref)
    return leaves


def _identity_chain(graph: Graph, ref: TensorRef) -> list[str]:
    chain = []
    while graph.node(ref.node).op == "Identity":
        chain.append(ref.node)
        ref = graph.inputs(ref.node)[0]
    return chain


def _inner_dim(body: Graph, term: tuple[TensorRef, TensorRef, bool, bool]) -> int:
    lhs, _, transpose_a, _ = term
    rows, cols = body.spec(lhs).shape.as_list()
    return rows if transpose_a else cols


def collect_outer_products(graph: Graph, accumulators: Sequence[OuterProductAccumulator]) -> list[TensorRef]:
    """Rebuilds their loop (one loop: all of `accumulators` share it) to collect each
    accumulator's products, and sums them after the loop (see the module docstring).

    Readers of each accumulator's output read the sum after the loop; returns those
    sums. Raises GraphError when the loop cannot be rebuilt.
    """
    loop = accumulators[0].loop
    if any(acc.loop != loop for acc in accumulators):
        raise ValueError("collect_outer_products rebuilds one loop at a time")
    node = graph.node(loop)
    loop_inputs = graph.inputs(loop)
    body = loop_function_graph(graph, loop, "body")
    cond = loop_function_graph(graph, loop, "cond")
    body_args = [arg.name for arg in graph.function(node.attr["body"].func.name).signature.input_arg]
    collected = {acc.slot for acc in accumulators}
    kept = [slot for slot in range(len(loop_inputs)) if slot not in collected]
    outputs = list(body.outputs)
    body.outputs = [outputs[slot] for slot in kept] + [ref for acc in accumulators
                                                       for lhs, rhs, _, _ in acc.terms for ref in (lhs, rhs)]
    body.prune()
    for slot in collected:
        if body_args[slot] in body:
            body.remove(body_args[slot])
    initial = [loop_inputs[acc.slot] for acc in accumulators]
    zero = [_is_zeros(graph, ref) for ref in initial]

    def start(_inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        values = [tf.constant(0)]
        for acc in accumulators:
            rows, cols = graph.spec(loop_inputs[acc.slot]).shape.as_list()
            dtype = graph.spec(loop_inputs[acc.slot]).dtype
            values += [tf.zeros([acc.trips, rows, acc.width], dtype), tf.zeros([acc.trips, cols, acc.width], dtype)]
        return values

    def step(values: list[tf.Tensor], products: list[tf.Tensor]) -> list[tf.Tensor]:
        trip, buffers, products = values[0], values[1:], iter(products)
        updated = [trip + 1]
        for i, acc in enumerate(accumulators):
            left, right = [], []
            for _, _, transpose_a, transpose_b in acc.terms:
                a, b = next(products), next(products)
                left.append(tf.transpose(a) if transpose_a else a)  # [rows, k]
                right.append(b if transpose_b else tf.transpose(b))  # [cols, k]
            for buffer, columns in zip(buffers[2 * i:2 * i + 2], (left, right)):
                block = tf.concat(columns, 1) if len(columns) > 1 else columns[0]
                updated.append(tf.tensor_scatter_nd_update(buffer, [[trip]], block[None]))
        return updated

    def finish(values: list[tf.Tensor], inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        results = []
        for i, acc in enumerate(accumulators):
            left, right = (tf.reshape(tf.transpose(buffer, [1, 0, 2]), [buffer.shape[1], acc.trips * acc.width])
                           for buffer in values[1 + 2 * i:3 + 2 * i])
            total = tf.matmul(left, right, transpose_b=True)
            results.append(total if zero[i] else inputs[i] + total)
        return results

    extras = Extras(inputs=initial, start=start, step=step, finish=finish)
    kept_refs, sums = rebuild_while(graph, loop, body, cond, kept, extras=extras, scope="tfmem_outer_products")
    for slot, new in zip(kept, kept_refs):
        graph.replace_all_uses(TensorRef(loop, slot), new)
    for acc, total in zip(accumulators, sums):
        graph.replace_all_uses(TensorRef(loop, acc.slot), total)
    graph.prune()
    if loop in graph:
        raise GraphError(f"loop {loop} is still read after it was rebuilt")
    return sums


def _is_zeros(graph: Graph, ref: TensorRef) -> bool:
    """Whether `ref` is all zeros by construction (`tf.zeros`: Fill of 0, ZerosLike, a zero Const)."""
    node = graph.node(ref.node)
    if node.op == "ZerosLike":
        return True
    if node.op == "Fill":
        value = graph.constant_value(graph.inputs(ref.node)[1])
        return value is not None and not np.any(value)
    value = graph.constant_value(ref)
    return value is not None and not np.any(value)
