"""Tests for `rewrites.solve_in_place`: triangular solves as loops over blocks of rows.

The property test compares the loop with TensorFlow's own `MatrixTriangularSolve`:
random triangular factors, lower and upper, with and without `adjoint`, float32 and
float64, with and without batch dimensions, remainders of every size. The memory test
reads XLA's buffer assignment: the Cholesky gradient's two solves keep one output-sized
buffer fewer.
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
from rewrites.solve_in_place import SolveInPlace, substitute_in_place
from tfmem.graph import Graph
from tfmem.testing import assert_close


def rewrite(fn: Callable[..., Any], rule: SolveInPlace, **config: Any) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[rule], lint=True, config={"strict": True, **config})


def records(function: tfmem.TfmemFunction, *args: Any, status: str) -> list[tfmem.RewriteRecord]:
    return [r for r in function.report(*args).records if r.status == status and r.pass_name == SolveInPlace.name]


def triangular(rng: np.random.Generator, batch: tuple[int, ...], n: int, lower: bool, dtype: tf.DType) -> tf.Tensor:
    """A well-conditioned triangular factor: a dominant positive diagonal."""
    x = rng.normal(size=(*batch, n, n)) / np.sqrt(n)
    x = np.tril(x) if lower else np.triu(x)
    return tf.constant(x + 2.0 * np.eye(n), dtype)


def whole_solves(graph_def: Any, rhs_shape: tuple[int, ...]) -> int:
    """Top-level triangular solves whose right-hand side is the whole `rhs_shape` one."""
    graph = Graph(graph_def)
    return sum(tuple(graph.spec(graph.inputs(n.name)[1]).shape.as_list()) == rhs_shape
               for n in graph.find("MatrixTriangularSolve"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block=st.integers(1, 4), blocks=st.integers(2, 12), remainder=st.integers(0, 3), extra_columns=st.integers(0, 4),
       batch=st.sampled_from([(), (2,), (2, 3)]), lower=st.booleans(), adjoint=st.booleans(),
       dtype=st.sampled_from([tf.float32, tf.float64]), seed=st.integers(0, 2**16))
def test_the_loop_equals_tensorflows_solve(block: int, blocks: int, remainder: int, extra_columns: int,
                                           batch: tuple[int, ...], lower: bool, adjoint: bool,
                                           dtype: tf.DType, seed: int) -> None:
    n, m = blocks * block + remainder % block if block > 1 else blocks, block + extra_columns
    rng = np.random.default_rng(seed)
    l, b = triangular(rng, batch, n, lower, dtype), tf.constant(rng.normal(size=(*batch, n, m)), dtype)

    def solve(l: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.linalg.triangular_solve(l, b * 2.0, lower=lower, adjoint=adjoint)

    rule = SolveInPlace(block_rows=block, min_rows=block + 1)
    function = rewrite(solve, rule)
    (fired,) = records(function, l, b, status="fired")
    assert fired.details["blocks"] == -(-n // rule.block_for(n))
    assert whole_solves(function.report(l, b).rewritten_graph_def, (*batch, n, m)) == 0
    assert_close(function(l, b), tf.function(solve)(l, b), dtype)


@pytest.mark.parametrize("jit_compile", [True, False], ids=["xla", "tensorflow"])
def test_substitution_runs_with_and_without_xla(jit_compile: bool) -> None:
    rng = np.random.default_rng(0)
    l, b = triangular(rng, (), 11, True, tf.float64), tf.constant(rng.normal(size=(11, 5)))
    solve = tf.function(lambda l, b: substitute_in_place(l, b, lower=True, adjoint=True, block=3),
                        jit_compile=jit_compile, autograph=False)
    np.testing.assert_allclose(solve(l, b), tf.linalg.triangular_solve(l, b, adjoint=True), rtol=1e-12)


def cholesky_gradient(a: tf.Tensor, w: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """A weighted sum of the Cholesky factor and its gradient: two [n, n] solves inside."""
    with tf.GradientTape() as tape:
        tape.watch(a)
        loss = tf.reduce_sum(tf.sin(tf.linalg.cholesky(a) * w))
    return loss, tape.gradient(loss, a)


def test_the_cholesky_gradient_keeps_one_matrix_fewer_under_xla() -> None:
    """XLA's own solve holds its result twice (the blocks, and the result grown by concatenation)."""
    n = 1536  # eight blocks of 192
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, n))
    a, w = tf.constant(x @ x.T / n + np.eye(n)), tf.constant(rng.normal(size=(n, n)))
    lean = [p for p in passes_for(tfmem.Config()) if p.stage != "split"]  # solves, not an inverse
    without = tfmem.TfmemFunction(cholesky_gradient, passes=lean, config={"strict": True})
    function = tfmem.TfmemFunction(cholesky_gradient, passes=[*lean, SolveInPlace()], config={"strict": True})
    assert len(records(function, a, w, status="fired")) == 2
    assert_close(function(a, w), tf.function(cholesky_gradient)(a, w), tf.float64)

    before, after = without.compiled(a, w).xla_plan(a, w), function.compiled(a, w).xla_plan(a, w)
    matrix = n * n * 8
    assert before is not None and after is not None
    assert after.total_bytes <= before.total_bytes - matrix // 2, (after.total_bytes / matrix,
                                                                   before.total_bytes / matrix)


@pytest.mark.parametrize("case,reason", [
    ("narrow", "fewer than a block's 2 rows"),
    ("broadcast", "batch dims"),
    ("complex", "dtype complex128 is not float32 or float64"),
])
def test_what_the_rule_leaves_alone_it_says_why(case: str, reason: str) -> None:
    rng = np.random.default_rng(2)
    n, m, batch, dtype = {"narrow": (9, 1, (), tf.float64),
                          "broadcast": (9, 5, (2,), tf.float64), "complex": (9, 5, (), tf.complex128)}[case]
    l = tf.cast(triangular(rng, (), n, True, tf.float64), dtype)
    b = tf.cast(tf.constant(rng.normal(size=(*batch, n, m))), dtype)

    def solve(l: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.linalg.triangular_solve(l, b)

    function = rewrite(solve, SolveInPlace(block_rows=4, min_rows=8))
    (rejected,) = records(function, l, b, status="rejected")
    assert reason in rejected.reason
    np.testing.assert_allclose(function(l, b), solve(l, b), rtol=1e-12)


def test_a_solve_under_min_rows_is_no_candidate() -> None:
    rng = np.random.default_rng(4)
    l, b = triangular(rng, (), 7, True, tf.float64), tf.constant(rng.normal(size=(7, 5)))
    function = rewrite(lambda l, b: tf.linalg.triangular_solve(l, b), SolveInPlace(block_rows=4, min_rows=8))
    assert not [r for r in function.report(l, b).records if r.pass_name == SolveInPlace.name]
    assert whole_solves(function.report(l, b).rewritten_graph_def, (7, 5)) == 1


def test_without_xla_tensorflows_own_solve_stays() -> None:
    rng = np.random.default_rng(3)
    l, b = triangular(rng, (), 9, True, tf.float64), tf.constant(rng.normal(size=(9, 5)))
    function = rewrite(lambda l, b: tf.linalg.triangular_solve(l, b), SolveInPlace(block_rows=4, min_rows=8),
                       jit_compile=False)
    (rejected,) = records(function, l, b, status="rejected")
    assert "not compiled by XLA" in rejected.reason
