"""Tests for `rewrites.solve_not_invert`: products with a triangular inverse, as solves.

The property test compares against TensorFlow's own Cholesky gradient (which forms
`L⁻¹` by solving against `eye(M)`): random SPD matrices, float32 and float64, with and
without batch dimensions.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings

import tfmem
from rewrites import passes_for
from rewrites.solve_not_invert import SolveInsteadOfInverse, identity_reason
from tfmem.graph import Graph
from tfmem.memory import xla_plan
from tfmem.testing import assert_close

PRODUCT_OPS = ("MatMul", "BatchMatMul", "BatchMatMulV2")


def rewrite(fn: Callable[..., Any], passes: list[Any] | None = None) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=passes or [SolveInsteadOfInverse()], lint=True,
                               config={"strict": True})


def records(function: tfmem.TfmemFunction, *args: Any, status: str) -> list[tfmem.RewriteRecord]:
    return [r for r in function.report(*args).records
            if r.status == status and r.pass_name == SolveInsteadOfInverse.name]


def spd(rng: np.random.Generator, batch: tuple[int, ...], m: int, dtype: tf.DType) -> tf.Tensor:
    """A well-conditioned SPD matrix (or batch of them)."""
    x = rng.normal(size=(*batch, m, m))
    return tf.constant(x @ np.swapaxes(x, -1, -2) / m + np.eye(m), dtype)


def cholesky_gradient(a: tf.Tensor, w: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """A weighted sum of the Cholesky factor and its gradient: `_CholeskyGrad` inside."""
    with tf.GradientTape() as tape:
        tape.watch(a)
        loss = tf.reduce_sum(tf.sin(tf.linalg.cholesky(a) * w))
    return loss, tape.gradient(loss, a)


def inverses(graph_def: Any) -> int:
    """How many triangular solves in a graph solve against an identity (form an inverse)."""
    graph = Graph(graph_def)
    return sum(identity_reason(graph, graph.inputs(n.name)[1]) is None for n in graph.find("MatrixTriangularSolve"))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(2, 12), batch=st.sampled_from([(), (2,), (2, 3)]),
       dtype=st.sampled_from([tf.float32, tf.float64]), seed=st.integers(0, 2**16))
def test_the_cholesky_gradient_equals_tensorflows_without_the_inverse(
        m: int, batch: tuple[int, ...], dtype: tf.DType, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, w = spd(rng, batch, m, dtype), tf.constant(rng.normal(size=(*batch, m, m)), dtype)
    function = rewrite(cholesky_gradient)
    (fired,) = records(function, a, w, status="fired")
    assert fired.details["products"] == 2
    assert inverses(function.report(a, w).rewritten_graph_def) == 0
    assert_close(function(a, w), tf.function(cholesky_gradient)(a, w), dtype)


def _inverse(l: tf.Tensor, lower: bool, adjoint: bool) -> tf.Tensor:
    eye = tf.eye(l.shape[-1], batch_shape=l.shape[:-2], dtype=l.dtype)
    return tf.linalg.triangular_solve(l, eye, lower=lower, adjoint=adjoint)


@pytest.mark.parametrize("adjoint", [False, True], ids=["solve", "adjoint_solve"])
@pytest.mark.parametrize("lower", [True, False], ids=["lower", "upper"])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("side", ["left", "right"])
def test_every_product_form_equals_the_inverse_product(side: str, transpose_a: bool, transpose_b: bool,
                                                       lower: bool, adjoint: bool,
                                                       rng: np.random.Generator) -> None:
    m, k = 9, 5
    a = spd(rng, (), m, tf.float64)
    factor = tf.linalg.cholesky(a)
    factor = factor if lower else tf.transpose(factor)
    # op(x) is [m, k] left of the inverse, [k, m] right of it.
    flipped = transpose_b if side == "left" else not transpose_a
    other = tf.constant(rng.normal(size=(k, m) if flipped else (m, k)), tf.float64)

    def fn(l: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
        inverse = _inverse(l, lower, adjoint)
        if side == "left":
            return tf.linalg.matmul(inverse, x, transpose_a=transpose_a, transpose_b=transpose_b)
        return tf.linalg.matmul(x, inverse, transpose_a=transpose_a, transpose_b=transpose_b)

    function = rewrite(fn)
    assert records(function, factor, other, status="fired")
    ops = Graph(function.report(factor, other).rewritten_graph_def).op_counts()
    assert not set(ops) & set(PRODUCT_OPS)
    assert_close(function(factor, other), fn(factor, other), tf.float64)


def _reduced_too(l: tf.Tensor, x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    inverse = _inverse(l, True, False)
    return inverse @ x, tf.reduce_sum(inverse)


def _not_the_identity(l: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
    twos = tf.linalg.diag(tf.fill([l.shape[-1]], tf.constant(2, l.dtype)))  # 2I, not I
    return tf.linalg.triangular_solve(l, twos) @ x


def _wide_on_the_right(l: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
    return tf.transpose(x) @ _inverse(l, True, False)  # x [m, 4m]: [4m, m] @ [m, m]


def _squared(l: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
    inverse = _inverse(l, True, False)
    return inverse @ inverse + x[:, :1]


# name → (function, width of x, the reason's words)
UNSUPPORTED: dict[str, tuple[Callable[..., Any], int, str]] = {
    "inverse_read_elsewhere": (_reduced_too, 3, "is also read by"),
    "not_the_identity": (_not_the_identity, 3, "not of ones"),
    "wide_operand_on_the_right": (_wide_on_the_right, 36, "larger than the inverse"),
    "inverse_times_itself": (_squared, 3, "multiplies the inverse by itself"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_an_unsupported_variant_leaves_the_graph_as_it_was(name: str, rng: np.random.Generator) -> None:
    fn, width, words = UNSUPPORTED[name]
    factor = tf.linalg.cholesky(spd(rng, (), 9, tf.float64))
    x = tf.constant(rng.normal(size=(9, width)), tf.float64)
    function = rewrite(fn)
    assert not records(function, factor, x, status="fired")
    (rejected,) = records(function, factor, x, status="rejected")
    assert words in rejected.reason
    before = tf.function(fn).get_concrete_function(factor, x).graph.as_graph_def()
    after = function.report(factor, x).rewritten_graph_def
    assert Graph(after).op_counts().get("MatrixTriangularSolve") == \
        Graph(before).op_counts().get("MatrixTriangularSolve")
    assert_close(function(factor, x), fn(factor, x), tf.float64)


def test_the_default_pipeline_solves_instead_of_inverting() -> None:
    assert any(isinstance(p, SolveInsteadOfInverse) for p in passes_for(tfmem.Config()))


def test_xla_plans_less_for_a_cholesky_gradient_chained_with_its_inverse_products(
        rng: np.random.Generator) -> None:
    """In XLA's buffer assignment, not only in tfmem's estimate: the identity and the
    inverse are gone from the gradient of logdet(A) + yᵀA⁻¹y (GPR's loss, A = K + σ²I)."""
    m = 300

    def gpr_like(a: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch(a)
            factor = tf.linalg.cholesky(a)
            alpha = tf.linalg.triangular_solve(factor, y)
            loss = tf.reduce_sum(tf.math.log(tf.linalg.diag_part(factor))) + tf.reduce_sum(alpha**2)
        return loss, tape.gradient(loss, a)

    a, y = spd(rng, (), m, tf.float64), tf.constant(rng.normal(size=(m, 1)), tf.float64)
    stock = tf.function(gpr_like, jit_compile=True)
    lean = tfmem.TfmemFunction(gpr_like, passes=passes_for(tfmem.Config(passes=["cleanup", "match_and_replace"])))
    assert records(lean, a, y, status="fired")
    assert_close(lean(a, y), stock(a, y), tf.float64)
    assert xla_plan(lean, a, y).total_bytes < xla_plan(stock, a, y).total_bytes
