"""Tests for `rewrites.add_diagonal`: a diagonal matrix added to a matrix, as a diagonal update."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings

import tfmem
from rewrites.add_diagonal import AddDiagonal
from tfmem.graph import Graph
from tfmem.testing import assert_close, with_gradient
from tfmem.testing import random_inputs as inputs

DIAG_MATRIX_OPS = ("MatrixDiag", "MatrixDiagV2", "MatrixDiagV3")
N = 7


def rewrite(fn: Callable[..., Any]) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[AddDiagonal()], lint=True, config={"strict": True})


def records(function: tfmem.TfmemFunction, *args: Any, status: str) -> list[tfmem.RewriteRecord]:
    return [r for r in function.report(*args).records if r.status == status and r.pass_name == AddDiagonal.name]


def _eye(x: tf.Tensor) -> tf.Tensor:
    return tf.eye(x.shape[-1], batch_shape=x.shape[:-2], dtype=x.dtype)


# name → (function of (x [.., N, N], d [.., N]), batch dims, diagonal terms rewritten)
CASES: dict[str, tuple[Callable[..., tf.Tensor], tuple[int, ...], int]] = {
    "matrix_plus_diag": (lambda x, d: x + tf.linalg.diag(d), (), 1),
    "diag_plus_matrix": (lambda x, d: tf.linalg.diag(d) + x, (), 1),
    "jitter": (lambda x, d: x @ tf.transpose(x) * tf.reduce_sum(d) + 1e-3 * _eye(x), (), 1),
    "scaled_on_the_right": (lambda x, d: x + tf.linalg.diag(d) * tf.reduce_sum(d), (), 1),
    "add_n_two_diagonals": (lambda x, d: tf.add_n([x, tf.linalg.diag(d), tf.sin(x), tf.linalg.diag(d * d)]), (), 2),
    "batched": (lambda x, d: x + tf.linalg.diag(d), (3,), 1),
}


@pytest.mark.parametrize("gradient", [False, True], ids=["value", "gradient"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_add_diagonal_equals_the_sum_without_the_diagonal_matrix(name: str, dtype: tf.DType, gradient: bool,
                                                                 rng: np.random.Generator) -> None:
    fn, batch, terms = CASES[name]
    x, d = inputs(rng, [[*batch, N, N], [*batch, N]], dtype)
    program = with_gradient(fn) if gradient else fn
    function = rewrite(program)
    fired = records(function, x, d, status="fired")
    assert sum(r.details["diagonal_terms"] for r in fired) >= terms
    if not gradient:
        ops = Graph(function.report(x, d).rewritten_graph_def).op_counts()
        assert not set(ops) & set(DIAG_MATRIX_OPS)
    assert_close(function(x, d), program(x, d), dtype)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 9), terms=st.integers(1, 3), diagonals=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_any_mix_of_matrices_and_diagonals_sums_the_same(n: int, terms: int, diagonals: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    xs = inputs(rng, [[n, n]] * terms + [[n]] * diagonals, tf.float64)

    def fn(*args: tf.Tensor) -> tf.Tensor:
        matrices, diags = args[:terms], args[terms:]
        order = [*matrices, *(tf.linalg.diag(d) for d in diags)]
        order = [order[i] for i in np.random.default_rng(seed).permutation(len(order))]
        return order[0] + order[1] if len(order) == 2 else tf.add_n(order)

    function = rewrite(fn)
    assert records(function, *xs, status="fired")
    assert_close(function(*xs), fn(*xs), tf.float64)


# name → (function, shapes, the reason's words)
UNSUPPORTED: dict[str, tuple[Callable[..., tf.Tensor], list[list[int]], str]] = {
    "only_diagonals": (lambda x, d: tf.linalg.diag(d) + tf.linalg.diag(x[0]), [[N, N], [N]], "every term"),
    "broadcast": (lambda x, d: x + tf.linalg.diag(d), [[2, N, N], [N]], "broadcasts"),
    "off_diagonal": (lambda x, d: x + tf.linalg.diag(d[:-1], k=1), [[N, N], [N]], "main diagonal"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_an_unsupported_sum_is_left_as_it_was(name: str, rng: np.random.Generator) -> None:
    fn, shapes, words = UNSUPPORTED[name]
    args = inputs(rng, shapes, tf.float64)
    function = rewrite(fn)
    assert not records(function, *args, status="fired")
    (rejected,) = records(function, *args, status="rejected")
    assert words in rejected.reason
    assert_close(function(*args), fn(*args), tf.float64)


def test_the_default_pipeline_adds_diagonals_in_place() -> None:
    from rewrites import passes_for

    assert any(isinstance(p, AddDiagonal) for p in passes_for(tfmem.Config()))
