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
from rewrites.cholesky_gradient import LeanCholeskyGradient
from rewrites.solve_in_place import SolveInPlace, substitute_in_place
from tfmem.graph import Graph
from tfmem.report import XLA_CHECKED_RULE
from tfmem.stages import Rewritten
from tfmem.testing import assert_close


def rewrite(fn: Callable[..., Any], rule: SolveInPlace, *args: tf.Tensor, **config: Any) -> Rewritten:
    """`fn` traced for `args` and rewritten by `rule` alone (`Traced.rewrite` runs it as given;
    `compile_within_budget` would hold it back until a plan does not fit)."""
    traced = tfmem.TfmemFunction(fn).trace(*args)
    return traced.rewrite(tfmem.Config(strict=True, **config), passes=[rule], lint=True)


def records(rewritten: Rewritten, status: str) -> list[tfmem.RewriteRecord]:
    return [r for r in rewritten.records if r.status == status and r.pass_name == SolveInPlace.name]


def with_tensorflows_cholesky_gradient(config: tfmem.Config) -> list[Any]:
    """The passes of `config` but `LeanCholeskyGradient`: TensorFlow's own Cholesky gradient,
    whose two solves (after `SolveInsteadOfInverse`) are what these tests put in place."""
    return [p for p in passes_for(config) if not isinstance(p, LeanCholeskyGradient)]


def triangular(rng: np.random.Generator, batch: tuple[int, ...], n: int, lower: bool, dtype: tf.DType) -> tf.Tensor:
    """A well-conditioned triangular factor: a dominant positive diagonal."""
    x = rng.normal(size=(*batch, n, n)) / np.sqrt(n)
    x = np.tril(x) if lower else np.triu(x)
    return tf.constant(x + 2.0 * np.eye(n), dtype)


def whole_solves(graph: Graph, rhs_shape: tuple[int, ...]) -> int:
    """Top-level triangular solves whose right-hand side is the whole `rhs_shape` one."""
    return sum(tuple(graph.spec(graph.inputs(n.name)[1]).shape.as_list()) == rhs_shape
               for n in graph.find("MatrixTriangularSolve"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block=st.integers(1, 4), blocks=st.integers(2, 12), remainder=st.integers(0, 3), extra_columns=st.integers(0, 4),
       batch=st.sampled_from([(), (2,), (2, 3)]), lower=st.booleans(), adjoint=st.booleans(),
       dtype=st.sampled_from([tf.float32, tf.float64]), seed=st.integers(0, 2**16))
def test_the_loop_equals_tensorflows_solve(block: int, blocks: int, remainder: int, extra_columns: int,
                                           batch: tuple[int, ...], lower: bool, adjoint: bool,
                                           dtype: tf.DType, seed: int) -> None:
    n, m = blocks * block + remainder % block, block + extra_columns  # the rule may take smaller blocks
    rng = np.random.default_rng(seed)
    l, b = triangular(rng, batch, n, lower, dtype), tf.constant(rng.normal(size=(*batch, n, m)), dtype)

    def solve(l: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.linalg.triangular_solve(l, b * 2.0, lower=lower, adjoint=adjoint)

    rule = SolveInPlace(block_rows=block, min_rows=block + 1)
    rewritten = rewrite(solve, rule, l, b)
    (fired,) = records(rewritten, "fired")
    assert fired.details["blocks"] == -(-n // rule.block_for(n))
    assert whole_solves(rewritten.graph, (*batch, n, m)) == 0
    assert_close(rewritten.compile()(l, b), tf.function(solve)(l, b), dtype)


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
    traced = tfmem.TfmemFunction(cholesky_gradient).trace(a, w)
    lean = [p for p in with_tensorflows_cholesky_gradient(tfmem.Config()) if p.stage != "split"]  # solves, not an inverse
    without = traced.rewrite(tfmem.Config(strict=True), passes=lean)
    with_loops = traced.rewrite(tfmem.Config(strict=True), passes=[*lean, SolveInPlace()], lint=True)
    assert len([r for r in with_loops.records if r.pass_name == SolveInPlace.name and r.status == "fired"]) == 2
    assert_close(with_loops.compile()(a, w), tf.function(cholesky_gradient)(a, w), tf.float64)

    before, after = without.compile().xla_plan(a, w), with_loops.compile().xla_plan(a, w)
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

    rewritten = rewrite(solve, SolveInPlace(block_rows=4, min_rows=8), l, b)
    (rejected,) = records(rewritten, "rejected")
    assert reason in rejected.reason
    np.testing.assert_allclose(rewritten.compile()(l, b), solve(l, b), rtol=1e-12)


def test_a_solve_under_min_rows_is_no_candidate() -> None:
    rng = np.random.default_rng(4)
    l, b = triangular(rng, (), 7, True, tf.float64), tf.constant(rng.normal(size=(7, 5)))
    rewritten = rewrite(lambda l, b: tf.linalg.triangular_solve(l, b), SolveInPlace(block_rows=4, min_rows=8), l, b)
    assert not [r for r in rewritten.records if r.pass_name == SolveInPlace.name]
    assert whole_solves(rewritten.graph, (7, 5)) == 1


def test_the_users_split_size_bounds_the_blocks() -> None:
    # A block of rows of the right-hand side is what the loop's body holds.
    rng = np.random.default_rng(5)
    l, b = triangular(rng, (), 64, True, tf.float64), tf.constant(rng.normal(size=(64, 40)))
    rule = SolveInPlace(block_rows=16, min_rows=32)
    plain = rewrite(lambda l, b: tf.linalg.triangular_solve(l, b), rule, l, b)
    assert records(plain, "fired")[0].details["block_rows"] == 8  # at least MIN_BLOCKS blocks
    bounded = rewrite(lambda l, b: tf.linalg.triangular_solve(l, b), rule, l, b,
                      tensor_size_threshold=10**9, tensor_split_size=3 * 40 * 8)
    (fired,) = records(bounded, "fired")
    assert fired.details["block_rows"] == 3 and fired.details["chunk_bytes"] == 3 * 40 * 8, fired.details
    assert_close(bounded.compile()(l, b), tf.linalg.triangular_solve(l, b), tf.float64)


def test_without_xla_tensorflows_own_solve_stays() -> None:
    rng = np.random.default_rng(3)
    l, b = triangular(rng, (), 9, True, tf.float64), tf.constant(rng.normal(size=(9, 5)))
    rewritten = rewrite(lambda l, b: tf.linalg.triangular_solve(l, b), SolveInPlace(block_rows=4, min_rows=8),
                        l, b, jit_compile=False)
    (rejected,) = records(rewritten, "rejected")
    assert "not compiled by XLA" in rejected.reason


@pytest.fixture(scope="module")
def spd_and_weights() -> tuple[tf.Tensor, tf.Tensor]:
    n = 1536
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, n))
    return tf.constant(x @ x.T / n + np.eye(n)), tf.constant(rng.normal(size=(n, n)))


def test_under_a_budget_the_loops_are_tried_once_a_plan_does_not_fit_and_kept_when_xla_plans_less(
        spd_and_weights: tuple[tf.Tensor, tf.Tensor]) -> None:
    a, w = spd_and_weights
    config = tfmem.Config(memory_budget="120MiB")
    wrapped = tfmem.TfmemFunction(cholesky_gradient, config=config, passes=with_tensorflows_cholesky_gradient(config))
    report = wrapped.report(a, w)
    tried, *after = [r for r in report.records if r.rule == XLA_CHECKED_RULE]
    assert tried.status == "info" and tried.reason.startswith("solve_in_place kept: XLA plans"), tried.reason
    # Still over the budget: the plan without the loops was planned around XLA's peaks too.
    assert all("planned around XLA's peaks" in r.reason for r in after), [r.reason for r in after]
    matrix = a.shape[0] * a.shape[1] * 8
    assert tried.details["xla_with_bytes"] <= tried.details["xla_without_bytes"] - matrix // 2, tried.details
    assert len([r for r in report.fired if r.pass_name == SolveInPlace.name]) == 2
    assert_close(wrapped(a, w), tf.function(cholesky_gradient)(a, w), tf.float64)


def test_under_a_budget_the_plan_fits_without_the_loops_holds_them_back(
        spd_and_weights: tuple[tf.Tensor, tf.Tensor]) -> None:
    a, w = spd_and_weights
    config = tfmem.Config(memory_budget="1GiB")
    report = tfmem.TfmemFunction(cholesky_gradient, config=config,
                                 passes=with_tensorflows_cholesky_gradient(config)).report(a, w)
    assert report.fits and not [r for r in report.records if r.pass_name == SolveInPlace.name or
                                r.rule == XLA_CHECKED_RULE], str(report)
