"""Tests for `rewrites.matmul_chain`: re-bracketing chains of matrix products."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings

import tfmem
from tfmem.testing import assert_close
from tfmem.testing import random_inputs as inputs
from rewrites.matmul_chain import ReorderMatMulChain
from tfmem.graph import Graph, TensorRef

PRODUCT_OPS = ("MatMul", "BatchMatMulV2")


def rewrite(fn: Callable[..., Any], *args: Any, jit_compile: bool = True) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[ReorderMatMulChain()], lint=True,
                               config={"jit_compile": jit_compile, "strict": True})


def records(function: tfmem.TfmemFunction, *args: Any, status: str) -> list[tfmem.RewriteRecord]:
    return [r for r in function.report(*args).records if r.status == status]


def rewritten_graph(function: tfmem.TfmemFunction, *args: Any) -> Graph:
    return Graph(function.report(*args).rewritten_graph_def)


def largest_product(graph: Graph) -> int:
    """Elements of the largest product in a graph."""
    return max(graph.spec(TensorRef(n.name)).shape.num_elements() for n in graph.find(PRODUCT_OPS))



def with_gradient(fn: Callable[..., tf.Tensor]) -> Callable[..., Any]:
    """`fn` plus the gradient of a weighted sum of its result, by a tape inside the function."""
    def value_and_gradients(*args: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = fn(*args)
            weights = tf.reshape(tf.cast(tf.range(tf.size(y)), y.dtype), tf.shape(y))
            loss = tf.reduce_sum(y * weights)
        return y, tape.gradient(loss, args)
    return value_and_gradients


# name → (function, factor shapes, the order after the rewrite)
CHAINS: dict[str, tuple[Callable[..., tf.Tensor], list[list[int]], str]] = {
    "ab_v": (lambda a, b, v: (a @ b) @ v, [[40, 30], [30, 40], [40, 1]], "(a @ (b @ v))"),
    "transpose_flags": (
        lambda a, b, v: tf.linalg.matmul(tf.linalg.matmul(a, b, transpose_a=True, transpose_b=True), v),
        [[30, 40], [40, 30], [40, 1]], "(aᵀ @ (bᵀ @ v))"),
    "transpose_op": (lambda a, b, v: tf.transpose(a @ b) @ v, [[40, 30], [30, 40], [40, 2]],
                     "(bᵀ @ (aᵀ @ v))"),
    "batched_adjoint": (
        lambda a, b, v: tf.linalg.matmul(tf.linalg.matmul(a, b, adjoint_a=True), v),
        [[2, 30, 40], [30, 40], [2, 40, 1]], "(aᵀ @ (b @ v))"),
    "batched_transpose_perm": (
        lambda a, b, v: tf.transpose(a @ b, [0, 2, 1]) @ v, [[3, 40, 30], [3, 30, 40], [3, 40, 1]],
        "(bᵀ @ (aᵀ @ v))"),
    "row_vector": (lambda u, a, b: u @ (a @ b), [[1, 40], [40, 30], [30, 40]], "((u @ a) @ b)"),
    "five_factors": (lambda x1, x2, x3, x4, x5: (((x1 @ x2) @ x3) @ x4) @ x5,
                     [[30, 2], [2, 30], [30, 2], [2, 30], [30, 1]],
                     "(x1 @ (x2 @ (x3 @ (x4 @ x5))))"),
    "matvec": (lambda a, b, v: tf.linalg.matvec(a @ b, v), [[40, 30], [30, 40], [40]],
               "(a @ (b @ MatVec/ExpandDims))"),
}



@pytest.mark.parametrize("name", sorted(CHAINS))
def test_reorders_to_the_cheapest_bracketing(name: str, rng: np.random.Generator) -> None:
    fn, shapes, order = CHAINS[name]
    args = inputs(rng, shapes, tf.float64)
    function = rewrite(fn)
    (fired,) = records(function, *args, status="fired")
    assert fired.rule == "ReorderMatMulChain"
    assert fired.details["after"] == order
    assert fired.details["peak_bytes_after"] < fired.details["peak_bytes_before"]
    assert fired.details["flops_after"] < fired.details["flops_before"]
    graph = rewritten_graph(function, *args)
    ops = graph.op_counts()
    assert ops.get("Transpose", 0) == 0  # absorbed into transpose flags
    assert sum(ops.get(op, 0) for op in PRODUCT_OPS) == len(shapes) - 1
    original = Graph(function.report(*args).original_graph_def)
    assert largest_product(graph) < largest_product(original)


def test_ab_v_becomes_a_times_bv(rng: np.random.Generator) -> None:
    a, b, v = inputs(rng, [[40, 30], [30, 40], [40, 1]], tf.float32)
    graph = rewritten_graph(rewrite(lambda a, b, v: (a @ b) @ v), a, b, v)
    (outer,) = [n for n in graph.find("MatMul") if graph.inputs(n.name)[0] == TensorRef("a")]
    inner = graph.node(graph.inputs(outer.name)[1].node)
    assert inner.op == "MatMul"
    assert graph.inputs(inner.name) == [TensorRef("b"), TensorRef("v")]


@pytest.mark.parametrize("gradient", [False, True], ids=["value", "gradient"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_numerically_equal(name: str, dtype: tf.DType, gradient: bool, rng: np.random.Generator) -> None:
    fn, shapes, _ = CHAINS[name]
    fn = with_gradient(fn) if gradient else fn
    args = inputs(rng, shapes, dtype)
    function = rewrite(fn)
    assert_close(function(*args), fn(*args), dtype)
    report = function.report(*args)
    chain_records = [r for r in report.records if r.rule == "ReorderMatMulChain"]
    fired = [r for r in chain_records if r.status == "fired"]
    if not gradient:
        assert report.status == "rewritten" and len(fired) == 1, chain_records
        return
    # With a tape, the backward reads the forward's intermediates: a chain may stay, but
    # then its record must say so, and the status must match what fired.
    assert chain_records, "the pass saw no chain in the gradient graph"
    for record in chain_records:
        assert record.status == "fired" or "used outside the chain" in record.reason, record
    assert report.status == ("rewritten" if fired else "unchanged"), (report.status, chain_records)


def traced_graph(fn: Callable[..., Any], args: Sequence[tf.Tensor]) -> Graph:
    concrete = tf.function(fn).get_concrete_function(*args)
    return Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_memory_estimate_goes_down(name: str, rng: np.random.Generator) -> None:
    fn, shapes, _ = CHAINS[name]
    graph = traced_graph(fn, inputs(rng, shapes, tf.float64))
    result = tfmem.PassManager([ReorderMatMulChain()], lint=True).run(graph, tfmem.PassContext(tfmem.Config()))
    assert tfmem.estimate_memory(result.graph).peak_bytes < tfmem.estimate_memory(graph).peak_bytes


def test_gradient_recomputes_shared_intermediates(rng: np.random.Generator) -> None:
    # The tape's backward reads the forward's a @ b (for dv) and its own [40, 40] dY @ vᵀ
    # (for da and db). Each is shared by two chains that both order better around it, so
    # both chains recompute the small products instead and the [40, 40] ones vanish.
    fn = with_gradient(CHAINS["ab_v"][0])
    args = inputs(rng, CHAINS["ab_v"][1], tf.float64)
    function = rewrite(fn)
    fired = records(function, *args, status="fired")
    assert len([r for r in fired if "recomputes" in r.details]) == 4
    assert not records(function, *args, status="rejected")
    graph = rewritten_graph(function, *args)
    assert largest_product(graph) < 40 * 40
    report = function.report(*args)
    assert report.memory_after.peak_bytes < report.memory_before.peak_bytes
    assert_close(function(*args), fn(*args), tf.float64)


def test_two_chains_in_one_graph_both_reorder(rng: np.random.Generator) -> None:
    a, b, v = inputs(rng, [[40, 30], [30, 40], [40, 1]], tf.float64)

    def fn(a: tf.Tensor, b: tf.Tensor, v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return (a @ b) @ v, (tf.transpose(v) @ a) @ b

    function = rewrite(fn)
    assert len(records(function, a, b, v, status="fired")) == 1  # the second is already optimal
    assert_close(function(a, b, v), fn(a, b, v), tf.float64)

    def two(a: tf.Tensor, b: tf.Tensor, v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return (a @ b) @ v, 2.0 * ((a @ b) @ (2.0 * v))

    function = rewrite(two)
    assert len(records(function, a, b, v, status="fired")) == 2
    assert_close(function(a, b, v), two(a, b, v), tf.float64)


# --- rejections -------------------------------------------------------------------------

def test_rejects_already_optimal(rng: np.random.Generator) -> None:
    args = inputs(rng, [[40, 30], [30, 40], [40, 1]], tf.float64)
    function = rewrite(lambda a, b, v: a @ (b @ v))
    (rejected,) = records(function, *args, status="rejected")
    assert rejected.reason == "already optimal"
    assert rejected.details["order"] == "(a @ (b @ v))"
    assert function.report(*args).status == "unchanged"


def test_rejects_intermediate_used_outside(rng: np.random.Generator) -> None:
    def fn(a: tf.Tensor, b: tf.Tensor, v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        ab = a @ b
        return ab @ v, tf.reduce_sum(ab)

    args = inputs(rng, [[40, 30], [30, 40], [40, 1]], tf.float64)
    function = rewrite(fn)
    (rejected,) = records(function, *args, status="rejected")
    assert rejected.reason.startswith("intermediate matmul used outside the chain (by Sum)")
    assert "(a @ (b @ v))" in rejected.reason
    assert not records(function, *args, status="fired")


def test_rejects_dynamic_shape() -> None:
    concrete = tf.function(lambda a, b, v: (a @ b) @ v).get_concrete_function(
        tf.TensorSpec([None, 30], tf.float32), tf.TensorSpec([30, 40], tf.float32),
        tf.TensorSpec([40, 1], tf.float32))
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True),
                  outputs=[t.name for t in concrete.outputs])
    result = tfmem.PassManager([ReorderMatMulChain()], lint=True).run(graph, tfmem.PassContext(tfmem.Config()))
    (rejected,) = result.records
    assert rejected.status == "rejected"
    assert rejected.reason.startswith("dynamic shape: factor a:0 has shape (None, 30)")


# --- end to end ------------------------------------------------------------------------------

def test_tfmem_function_end_to_end(rng: np.random.Generator) -> None:
    a, b, v = inputs(rng, [[60, 20], [20, 60], [60, 1]], tf.float64)

    @tfmem.function(config={"passes": ["cleanup", "reorder"], "strict": True})
    def predict(a: tf.Tensor, b: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
        return (a @ b) @ v

    assert_close(predict(a, b, v), (a @ b) @ v, tf.float64)
    report = predict.explain(a, b, v)
    assert "reorder_matmul_chain" in {r.pass_name for r in report.fired}
    assert report.memory_after.peak_bytes < report.memory_before.peak_bytes
    assert report.xla_bytes_after is not None and report.xla_bytes_before is not None
    assert report.xla_bytes_after < 60 * 60 * 8  # the [60, 60] product is never planned


# --- property: random chains ---------------------------------------------------------------

@st.composite
def chains(draw: st.DrawFn) -> tuple[list[int], Any, list[bool]]:
    """Factor dims (n+1 of them), a random bracketing of the n factors, and flags:
    which factors are given transposed and which products are transposed explicitly."""
    n = draw(st.integers(3, 6))
    dims = draw(st.lists(st.sampled_from([1, 1, 2, 3, 5, 8, 13]), min_size=n + 1, max_size=n + 1))

    def bracket(first: int, last: int) -> Any:
        if first == last:
            return first
        split = draw(st.integers(first, last - 1))
        return (bracket(first, split), bracket(split + 1, last), draw(st.booleans()))

    transposed = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return dims, bracket(0, n - 1), transposed


def evaluate(tree: Any, values: Sequence[tf.Tensor], transposed: Sequence[bool]) -> tuple[tf.Tensor, bool]:
    """Builds the bracketing with matmul flags and, where drawn, explicit Transpose ops."""
    if isinstance(tree, int):
        return values[tree], transposed[tree]
    left, right, explicit = tree
    (x, tx), (y, ty) = evaluate(left, values, transposed), evaluate(right, values, transposed)
    if explicit:  # (XY) = ((XY)ᵀ)ᵀ: build the transpose and hand it on flagged
        return tf.transpose(tf.linalg.matmul(y, x, transpose_a=not ty, transpose_b=not tx)), False
    return tf.linalg.matmul(x, y, transpose_a=tx, transpose_b=ty), False


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain=chains(), seed=st.integers(0, 2**16), gradient=st.booleans())
def test_property_random_chains(chain: tuple[list[int], Any, list[bool]], seed: int, gradient: bool) -> None:
    """Random chains (and, with `gradient`, their tape gradients, where shared
    intermediates may be recomputed): same values, never a larger estimated peak."""
    dims, tree, transposed = chain
    rng = np.random.default_rng(seed)
    shapes = [(dims[i + 1], dims[i]) if t else (dims[i], dims[i + 1]) for i, t in enumerate(transposed)]
    args = [tf.constant(rng.normal(size=s), tf.float64) for s in shapes]

    def chain_value(*values: tf.Tensor) -> tf.Tensor:
        return evaluate(tree, values, transposed)[0]

    fn = with_gradient(chain_value) if gradient else chain_value
    function = rewrite(fn, jit_compile=False)
    report = function.report(*args)
    assert report.status in ("rewritten", "unchanged"), report.reason
    assert report.memory_after.peak_bytes <= report.memory_before.peak_bytes
    assert_close(function(*args), fn(*args), tf.float64)
