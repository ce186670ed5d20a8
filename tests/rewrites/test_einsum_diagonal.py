"""Tests for `rewrites.einsum_diagonal`: a one-operand einsum that is a diagonal or a trace."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from tfmem.testing import assert_close, with_gradient
from rewrites.diag_of_elementwise import DiagOfElementwise
from rewrites.diag_of_product import ContractDiagOfProduct
from rewrites.einsum_diagonal import EinsumAsDiagonal, diagonal_of

N = 30


def rewrite(fn):
    return tfmem.TfmemFunction(fn, passes=[EinsumAsDiagonal(), DiagOfElementwise(), ContractDiagOfProduct()],
                               lint=True, config={"strict": True, "jit_compile": True})


@settings(deadline=None, max_examples=20, derandomize=True, database=None)
@given(batch=st.integers(0, 2), ellipsis=st.booleans(), reading=st.sampled_from(["diag_part", "trace"]),
       dtype=st.sampled_from([np.float32, np.float64]), gradient=st.booleans(), seed=st.integers(0, 2**16))
def test_diagonals_and_traces_spelled_with_einsum_equal_stock(batch, ellipsis, reading, dtype, gradient, seed):
    """`einsum("[...|ab]ii->[...|ab]i")` and `einsum("[...|ab]ii->[...|ab]")` of an elementwise
    matrix, with batch letters or a leading ellipsis: the same values as stock XLA's, and
    the einsum is gone."""
    letters = "..." if ellipsis and batch else "ab"[:batch]
    equation = f"{letters}ii->{letters}" + ("i" if reading == "diag_part" else "")
    shape = (2, 3)[:batch] + (N, N)
    assert diagonal_of(equation) == reading

    def fn(x, y):
        return tf.einsum(equation, tf.exp(x) - y)

    rng = np.random.default_rng(seed)
    args = [tf.constant(rng.normal(size=shape).astype(dtype)) for _ in range(2)]
    program = with_gradient(fn) if gradient else fn
    wrapped = rewrite(program)
    assert_close(wrapped(*args), tf.function(program, jit_compile=True)(*args), tf.as_dtype(dtype))
    if not gradient:
        statuses = [r.status for r in wrapped.report(*args).records if r.rule == "EinsumAsDiagonal"]
        assert statuses == ["fired"], statuses
        graph = tfmem.Graph(wrapped.report(*args).rewritten_graph_def)
        assert graph.op_counts().get("Einsum", 0) == 0


@pytest.mark.parametrize("equation, shape", [("ij->i", (N, N)), ("iij->ij", (N, N, 3)), ("bii->ib", (2, N, N))])
def test_einsums_that_are_not_a_diagonal_stay(rng, equation, shape):
    def fn(x):
        return tf.einsum(equation, tf.exp(x))

    x = tf.constant(rng.normal(size=shape))
    wrapped = rewrite(fn)
    [record] = [r for r in wrapped.report(x).records if r.rule == "EinsumAsDiagonal"]
    assert record.status == "rejected" and record.reason == diagonal_of(equation), record
    np.testing.assert_array_equal(wrapped(x).numpy(), tf.function(fn, jit_compile=True)(x).numpy())


def test_a_kernel_diagonal_spelled_with_einsum_forms_no_matrix(rng):
    """The fuzz round's `einsum("ii->i", K ∘ AAᵀ)`: read as a diagonal, it is pushed into the
    kernel and the product like `diag_part`, and fits a budget a quarter of the matrix."""
    def fn(x, a):
        k = tf.exp(-tf.reduce_sum(tf.abs(x[:, None, :] - x[None, :, :]), -1))
        return tf.einsum("ii->i", k * (a @ tf.transpose(a)))

    x, a = tf.constant(rng.normal(size=(1000, 2))), tf.constant(rng.normal(size=(1000, 8)))
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget="2MiB", strict=True))
    assert wrapped.report(x, a).fits, wrapped.report(x, a).summary()  # [1000, 1000] float64: 7.6 MiB
    assert_close(wrapped(x, a), tf.function(fn, jit_compile=True)(x, a), tf.float64)
