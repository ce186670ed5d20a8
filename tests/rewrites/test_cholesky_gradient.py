"""Tests for `rewrites.cholesky_gradient`: TensorFlow's Cholesky gradient, in place in one matrix.

The property tests compare against TensorFlow's own Cholesky gradient (random SPD matrices,
float32 and float64, batch dimensions, every block size); memory is checked in XLA's buffer
assignment; what the rule leaves alone, it says why.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings

import tfmem
from rewrites import passes_for
from rewrites.cholesky_gradient import LeanCholeskyGradient, block_for, cholesky_gradient_in_place
from tests import background
from tfmem.graph import TensorRef
from tfmem.testing import assert_close

RULE = "LeanCholeskyGradient"


def spd(rng: np.random.Generator, batch: tuple[int, ...], n: int, dtype: tf.DType = tf.float64) -> tf.Tensor:
    """A well-conditioned SPD matrix (or batch of them)."""
    x = rng.normal(size=(*batch, n, n))
    return tf.constant(x @ np.swapaxes(x, -1, -2) / n + np.eye(n), dtype)


def cholesky_gradient(a: tf.Tensor, w: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """A loss of the Cholesky factor and its gradient: TensorFlow's `_CholeskyGrad` inside.
    The sine makes the gradient with respect to L dense, upper triangle included."""
    with tf.GradientTape() as tape:
        tape.watch(a)
        loss = tf.reduce_sum(tf.sin(tf.linalg.cholesky(a) * w))
    return loss, tape.gradient(loss, a)


def tensorflows_gradient(l_input: tf.Tensor, grad: tf.Tensor) -> tf.Tensor:
    """TensorFlow's registered gradient of `cholesky(a)` for an output gradient `grad`."""
    with tf.GradientTape() as tape:
        tape.watch(l_input)
        l = tf.linalg.cholesky(l_input)
    return tape.gradient(l, l_input, output_gradients=grad)


def rewrite(fn: Callable[..., Any], *args: tf.Tensor, min_rows: int = 8, **config: Any) -> tfmem.Rewritten:
    """`fn` traced for `args` and rewritten by the rule alone (it is held back from a plain
    call: `LeanCholeskyGradient.xla_checked`)."""
    traced = tfmem.TfmemFunction(fn).trace(*args)
    return traced.rewrite(tfmem.Config(strict=True, **config), passes=[LeanCholeskyGradient(min_rows=min_rows)],
                          lint=True)


def records(rewritten: tfmem.Rewritten, status: str) -> list[tfmem.RewriteRecord]:
    return [r for r in rewritten.records if r.rule == RULE and r.status == status]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), block=st.integers(1, 16), batch=st.sampled_from([(), (2,), (2, 3)]),
       dtype=st.sampled_from([tf.float32, tf.float64]), seed=st.integers(0, 2**16))
def test_the_blocked_gradient_equals_tensorflows(n: int, block: int, batch: tuple[int, ...], dtype: tf.DType,
                                                 seed: int) -> None:
    """Any block size (a remainder block or none), any batch, a dense output gradient."""
    rng = np.random.default_rng(seed)
    a = spd(rng, batch, n, dtype)
    grad = tf.constant(rng.normal(size=(*batch, n, n)), dtype)
    got = cholesky_gradient_in_place(tf.linalg.cholesky(a), grad, block=min(block, n))
    assert_close(got, tensorflows_gradient(a, grad), dtype)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_under_xla_the_loop_equals_tensorflows_gradient(dtype: tf.DType, rng: np.random.Generator) -> None:
    n, block = 53, 8  # a remainder block of 5 rows
    a = spd(rng, (3,), n, dtype)
    grad = tf.constant(rng.normal(size=(3, n, n)), dtype)
    compiled = tf.function(lambda a, g: cholesky_gradient_in_place(tf.linalg.cholesky(a), g, block=block),
                           jit_compile=True)
    assert_close(compiled(a, grad), tensorflows_gradient(a, grad), dtype)


def test_the_rule_replaces_tensorflows_gradient_and_the_program_equals_stock(rng: np.random.Generator) -> None:
    a, w = spd(rng, (), 64), tf.constant(rng.normal(size=(64, 64)))
    rewritten = rewrite(cholesky_gradient, a, w)
    (fired,) = records(rewritten, "fired")
    assert fired.details == {"blocks": 8, "block_rows": 8, "chunk_bytes": 8 * 64 * 8, "matrix_bytes": 64 * 64 * 8}
    ops = rewritten.graph.op_counts()
    assert "MatrixSetDiagV3" not in ops and "Transpose" not in ops  # TensorFlow's rule is gone
    assert_close(rewritten.compile()(a, w), tf.function(cholesky_gradient, jit_compile=True)(a, w), tf.float64)


def test_the_users_split_size_bounds_the_loops_panels(rng: np.random.Generator) -> None:
    # A [block, n] panel is what the loop's body holds: with tensor_split_size it holds no
    # more than that (fuzz 15: 250-row panels of 3.8 MiB against a 2 MiB split size).
    a, w = spd(rng, (), 64), tf.constant(rng.normal(size=(64, 64)))
    rewritten = rewrite(cholesky_gradient, a, w, tensor_size_threshold=10**9, tensor_split_size=3 * 64 * 8)
    (fired,) = records(rewritten, "fired")
    assert fired.details["block_rows"] == 3 and fired.details["chunk_bytes"] <= 3 * 64 * 8, fired.details
    assert_close(rewritten.compile()(a, w), tf.function(cholesky_gradient, jit_compile=True)(a, w), tf.float64)
    assert block_for(2000, split_size=2 * 2**20) * 2000 * 8 <= 2 * 2**20 and block_for(2000, split_size=1) == 1


def test_a_split_size_under_one_row_is_not_honoured_and_the_user_is_told(rng: np.random.Generator) -> None:
    # A panel is at least one row: 600 float64 are 4.7 KiB, over a 1 KiB split size. Before,
    # only the planner's loops said so, and this said nothing.
    a, w = spd(rng, (), 600), tf.constant(rng.normal(size=(600, 600)))
    wrapped = tfmem.function(cholesky_gradient, config=tfmem.Config(memory_budget="8MiB", tensor_split_size="1KiB"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = wrapped.report(a, w)
    (fired,) = [r for r in report.records if r.rule == RULE and r.status == "fired"]
    assert fired.details["block_rows"] == 1, fired.details
    told = [str(c.message) for c in caught if "not honoured" in str(c.message)]
    assert len(told) == 1 and "tensor_split_size 1.0 KiB not honoured by LeanCholeskyGradient" in told[0], told
    assert "panels of one row of 4.7 KiB" in told[0], told[0]
    roomy = tfmem.function(cholesky_gradient, config=tfmem.Config(memory_budget="8MiB", tensor_split_size="8KiB"))
    assert not roomy.report(a, w).panels_over_split_size


def test_the_rule_is_held_back_from_a_call_without_a_budget(rng: np.random.Generator) -> None:
    a, w = spd(rng, (), 64), tf.constant(rng.normal(size=(64, 64)))
    report = tfmem.TfmemFunction(cholesky_gradient, passes=[LeanCholeskyGradient(min_rows=8)]).report(a, w)
    assert not [r for r in report.records if r.rule == RULE]


def _written_out(l: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """TensorFlow's formula written out (the gradient, and the inverse it forms)."""
    inverse = tf.linalg.triangular_solve(l, tf.eye(l.shape[-1], dtype=l.dtype))
    middle = tf.matmul(l, g, adjoint_a=True)
    middle = tf.linalg.band_part(tf.linalg.set_diag(middle, 0.5 * tf.linalg.diag_part(middle)), -1, 0)
    grad_a = tf.matmul(tf.matmul(inverse, middle, adjoint_a=True), inverse)
    return (grad_a + tf.linalg.adjoint(grad_a)) * 0.5, inverse


def _hand_written(l: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """The formula on any matrix (not a Cholesky factor)."""
    return _written_out(l, g)[0]


def _inverse_read_elsewhere(a: tf.Tensor, w: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    gradient, inverse = _written_out(tf.linalg.cholesky(a), w)
    return gradient, tf.reduce_sum(inverse)


# name → (function, keyword config, the reason's words)
LEFT_ALONE: dict[str, tuple[Callable[..., Any], dict[str, Any], str]] = {
    "without_xla": (cholesky_gradient, {"jit_compile": False}, "not compiled by XLA"),
    "too_small": (cholesky_gradient, {"min_rows": 100}, "fewer than 100"),
    "not_a_cholesky_factor": (_hand_written, {}, "not a Cholesky factor"),
}


@pytest.mark.parametrize("name", sorted(LEFT_ALONE))
def test_what_the_rule_leaves_alone_it_says_why(name: str, rng: np.random.Generator) -> None:
    fn, config, words = LEFT_ALONE[name]
    n = 24
    a, w = spd(rng, (), n), tf.constant(rng.normal(size=(n, n)))
    rewritten = rewrite(fn, a, w, **config)
    (rejected,) = records(rewritten, "rejected")
    assert words in rejected.reason
    assert not records(rewritten, "fired")
    assert_close(rewritten.compile()(a, w), fn(a, w), tf.float64)


def test_a_batch_of_factors_is_left_as_it_was(rng: np.random.Generator) -> None:
    """XLA does not update a batch in place in the loop: it planned 2.5× TensorFlow's rule
    for [1, 520, 520] (found by a fuzzing run)."""
    a, w = spd(rng, (2,), 24), tf.constant(rng.normal(size=(2, 24, 24)))
    rewritten = rewrite(cholesky_gradient, a, w)
    (rejected,) = records(rewritten, "rejected")
    assert "a batch of factors" in rejected.reason
    assert not records(rewritten, "fired")
    assert_close(rewritten.compile()(a, w), cholesky_gradient(a, w), tf.float64)


def test_a_gradient_whose_inverse_is_read_elsewhere_is_left_as_it_was(rng: np.random.Generator) -> None:
    # The solve against eye is shared: TensorFlow's own subgraph, but not self-contained.
    n = 24
    a, w = spd(rng, (), n), tf.constant(rng.normal(size=(n, n)))
    rewritten = rewrite(_inverse_read_elsewhere, a, w)
    (rejected,) = records(rewritten, "rejected")
    assert "not self-contained" in rejected.reason
    assert_close(rewritten.compile()(a, w), _inverse_read_elsewhere(a, w), tf.float64)


def test_xla_plans_at_least_one_matrix_less_for_a_gp_loss(rng: np.random.Generator) -> None:
    """A GP's negative log likelihood and its gradient with respect to the inputs: XLA's
    plan of the Cholesky gradient in place holds L, the gradient matrix and panels."""
    n = 600

    def gp_loss(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            sq = tf.reduce_sum(x * x, 1)
            k = tf.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * x @ tf.transpose(x))) + tf.eye(n, dtype=x.dtype)
            l = tf.linalg.cholesky(k)
            loss = tf.reduce_sum(tf.linalg.triangular_solve(l, y) ** 2) + tf.reduce_sum(
                tf.math.log(tf.linalg.diag_part(l)))
        return loss, tape.gradient(loss, x)

    x, y = tf.constant(rng.normal(size=(n, 3))), tf.constant(rng.normal(size=(n, 1)))
    passes = passes_for(tfmem.Config(passes=["cleanup", "match_and_replace"]))  # the rule before the solves'
    traced = tfmem.TfmemFunction(gp_loss).trace(x, y)
    with_rule = traced.rewrite(tfmem.Config(), passes=passes)
    without = traced.rewrite(tfmem.Config(), passes=[p for p in passes if not isinstance(p, LeanCholeskyGradient)])
    assert records(with_rule, "fired")
    assert_close(with_rule.compile()(x, y), tf.function(gp_loss, jit_compile=True)(x, y), tf.float64)
    matrix = n * n * 8
    planned, before = with_rule.compile().xla_planned_bytes(x, y), without.compile().xla_planned_bytes(x, y)
    assert planned is not None and before is not None
    assert planned <= before - matrix, (planned / matrix, before / matrix)


def test_under_a_budget_the_rule_is_tried_once_a_plan_does_not_fit_and_kept_when_xla_plans_less() -> None:
    """GPflow's GPR loss and gradients (code nobody here wrote)."""
    import gpflow

    n = 900
    rng = np.random.default_rng(7)
    x = rng.uniform(-3, 3, size=(n, 3))
    model = gpflow.models.GPR((x, np.sin(x).sum(-1, keepdims=True)), gpflow.kernels.SquaredExponential())

    def step() -> tuple[tf.Tensor, Any]:
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)

    wrapped = tfmem.function(step, config=tfmem.Config(memory_budget=f"{int(2.8 * n * n * 8)}B"))
    report = wrapped.report()
    assert [r for r in report.fired if r.rule == RULE], report.summary()
    (tried,) = [r for r in report.records if r.rule == "WithXlaCheckedPasses"]
    assert tried.status == "info" and RULE in tried.reason and " kept" in tried.reason, tried.reason
    assert tried.details["xla_with_bytes"] < tried.details["xla_without_bytes"], tried.details
    want = tf.function(step, jit_compile=True)()
    for got, expected in zip(tf.nest.flatten(wrapped()), tf.nest.flatten(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-9)


def test_blocks_are_at_most_256_rows_and_at_least_eight() -> None:
    assert block_for(600) == 75 and block_for(2048) == 256 and block_for(4700) == 256 and block_for(5) == 1


def compile_time_allocation(n: int) -> int:
    """What the allocator's peak grows by while XLA compiles the gradient for [n, n] (run
    isolated, under BFC)."""
    zeros = tf.zeros([n, n], tf.float64)
    before = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    compiled = tf.function(lambda l, g: cholesky_gradient_in_place(l, g), jit_compile=True)
    compiled.experimental_get_compiler_ir(zeros, zeros)(stage="hlo")
    return int(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)


@background.job("cholesky_gradient_compile_allocation")
def compile_allocation_job() -> int:
    result = tfmem.run_isolated("tests.rewrites.test_cholesky_gradient:compile_time_allocation", 3000,
                                memory_limit_mb=1024)
    assert result.ok, result.error
    return result.value


@pytest.mark.background("cholesky_gradient_compile_allocation")
def test_compiling_the_loop_allocates_no_panel_sized_constants() -> None:
    """TensorFlow folds a zero-filled `[b, n]` loop accumulator into a constant while XLA
    compiles the program, in the allocator the program then runs in: the regions it grows
    stay, and the program's own block found no room beside them (GPflow's GPR at n=4,700
    under 512 MiB: 71.7 MiB allocated by the compile, then out of memory)."""
    grown = background.result("cholesky_gradient_compile_allocation")
    assert grown < 256 * 3000 * 8, grown / 2**20  # less than one [256, 3000] panel (5.9 MiB; 36.3 MiB before)


def test_grappler_builds_no_panel_of_zeros_for_the_first_block(rng: np.random.Generator) -> None:
    """The first block (a remainder, at column 0) has nothing left of it. Written as a
    select of the columns left of 0, Grappler's constant folding turns the all-false select
    into an [h, n] constant of zeros, built on the host in the allocator the program then
    runs in (SGPR M=3,800: 6.3 MiB, and the allocator's peak before the call 16.9 MiB
    instead of 2.4), and handed to XLA as a literal."""
    from tfmem.host_folding import LARGE_TENSOR_BYTES

    n = 1100  # blocks of 138 rows: a first block of 134, [134, 1100] float64 = 1.1 MiB
    assert n % block_for(n) and (n % block_for(n)) * n * 8 > LARGE_TENSOR_BYTES
    a, w = spd(rng, (), n), tf.constant(rng.normal(size=(n, n)))
    passes = passes_for(tfmem.Config(passes=["cleanup", "match_and_replace"]))
    rewritten = tfmem.TfmemFunction(cholesky_gradient).trace(a, w).rewrite(tfmem.Config(), passes=passes)
    assert records(rewritten, "fired")
    graph = rewritten.graph
    large = [(node.name, graph.spec(TensorRef(node.name)).shape) for node in graph.find("Const")
             if (graph.nbytes(TensorRef(node.name)) or 0) > LARGE_TENSOR_BYTES]
    assert not large, large
    assert_close(rewritten.compile()(a, w), tf.function(cholesky_gradient, jit_compile=True)(a, w), tf.float64)
