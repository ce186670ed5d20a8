"""Property tests for the product rewrites: random programs, rewritten and as written, agree.

Each test draws programs of one family — two-operand einsums (`einsum_matmul`), diagonals
and traces of matrix chains (`diag_of_product`, with the rest of the reorder stage), and
products with a diagonal matrix (`scale_by_diagonal`) — with random transposes (flags,
adjoints, explicit `Transpose` ops), batch dimensions (shared and broadcast), sizes
(including 1) and dtypes, with and without a gradient, and compares tfmem with only those
passes against stock XLA. A program a rule declines must still run, unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from rewrites.diag_of_product import ContractDiagOfProduct
from rewrites.einsum_matmul import EinsumAsMatMul, product_of
from rewrites.matmul_chain import ReorderMatMulChain
from rewrites.scale_by_diagonal import ScaleByDiagonal
from tfmem.testing import assert_close, with_gradient

PROPERTY = settings(deadline=None, max_examples=25, derandomize=True, database=None)
DTYPES = st.sampled_from([tf.float32, tf.float64])


def rewritten(fn: Callable[..., Any], passes: list[Any]) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=passes, lint=True, config={"strict": True, "jit_compile": True})


def statuses(function: tfmem.TfmemFunction, args: list[tf.Tensor], rule: str) -> list[str]:
    return [r.status for r in function.report(*args).records if r.rule == rule]


def check(fn: Callable[..., Any], args: list[tf.Tensor], passes: list[Any], dtype: tf.DType,
          gradient: bool) -> tfmem.TfmemFunction:
    """tfmem with `passes` equals stock XLA on `fn` (and on its gradients when `gradient`)."""
    program = with_gradient(fn) if gradient else fn
    function = rewritten(program, passes)
    assert_close(function(*args), tf.function(program, jit_compile=True)(*args), dtype)
    return function


def operand(rng: np.random.Generator, shape: list[int], dtype: tf.DType) -> tf.Tensor:
    return tf.constant(rng.normal(size=shape), dtype)


# --- einsum_matmul ---------------------------------------------------------------------------

@st.composite
def einsum_programs(draw: Any) -> tuple[str, dict[str, int]]:
    """A two-operand equation over letters of random sizes: a product (batch letters, one
    summed letter, one free letter per operand, in any order) or one of its near misses."""
    letters = draw(st.permutations("abcdefg"))
    batch = list(letters[:draw(st.integers(0, 2))])
    summed, free_a, free_b = letters[len(batch):len(batch) + 3]
    a = batch + draw(st.permutations([free_a, summed]))
    b = batch + draw(st.permutations([free_b, summed]))
    out = batch + draw(st.permutations([free_a, free_b]))
    miss = draw(st.sampled_from(["none", "none", "none", "batch_order", "keep_summed", "drop_batch", "outer"]))
    if miss == "batch_order" and len(batch) == 2:
        b = [batch[1], batch[0]] + b[2:]
    elif miss == "keep_summed":
        out = out + [summed]
    elif miss == "drop_batch" and batch:
        out = out[1:]
    elif miss == "outer":
        a, b, out = batch + [free_a], batch + [free_b], batch + [free_a, free_b]
    sizes = {c: draw(st.sampled_from([1, 2, 5])) for c in letters}
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}", sizes


@PROPERTY
@given(program=einsum_programs(), dtype=DTYPES, gradient=st.booleans(), seed=st.integers(0, 2**16))
def test_random_einsums_equal_stock(program: tuple[str, dict[str, int]], dtype: tf.DType, gradient: bool,
                                    seed: int) -> None:
    equation, sizes = program
    rng = np.random.default_rng(seed)
    args = [operand(rng, [sizes[c] for c in side], dtype) for side in equation.split("->")[0].split(",")]

    def fn(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.einsum(equation, a, b)

    function = check(fn, args, [EinsumAsMatMul()], dtype, gradient)
    fired = "fired" in statuses(function, args, EinsumAsMatMul.rule)
    # Every product the rule recognises in the forward is rewritten; a near miss never is.
    assert fired == (not isinstance(product_of(equation), str)) or gradient


# --- diag_of_product (with the reorder stage) --------------------------------------------------

@st.composite
def diagonal_programs(draw: Any) -> dict[str, Any]:
    """diag_part / trace of a chain of 2–3 factors [n, k] @ ([k, k] @) [k, l], each factor
    stored upright or transposed and multiplied through a flag, an adjoint or a Transpose
    op, with an optional batch dimension on some factors (size 3, or 1 to broadcast)."""
    n, k, l = draw(st.sampled_from([1, 2, 24])), draw(st.sampled_from([1, 3, 30])), draw(st.sampled_from([2, 24]))
    dims = [(n, k), (k, k), (k, l)] if draw(st.booleans()) else [(n, k), (k, l)]
    factors = []
    for rows, cols in dims:
        stored = draw(st.sampled_from(["upright", "flag", "adjoint", "transpose_op"]))
        batch = draw(st.sampled_from([[], [], [3], [1]]))
        factors.append({"shape": batch + ([cols, rows] if stored != "upright" else [rows, cols]), "stored": stored})
    return {"factors": factors, "reduce": draw(st.sampled_from(["diag_part", "trace", "diag_part_of_transpose"]))}


def chain(tensors: list[tf.Tensor], factors: list[dict[str, Any]]) -> tf.Tensor:
    """The product of `tensors` as `factors` say each is stored and read."""
    def upright(t: tf.Tensor, stored: str) -> tf.Tensor:
        return tf.linalg.matrix_transpose(t) if stored == "transpose_op" else t

    result = upright(tensors[0], factors[0]["stored"])
    first_flag = factors[0]["stored"] in ("flag", "adjoint")
    for t, factor in zip(tensors[1:], factors[1:]):
        stored = factor["stored"]
        result = tf.linalg.matmul(result, upright(t, stored), transpose_a=first_flag and factors[0]["stored"] == "flag",
                                  adjoint_a=first_flag and factors[0]["stored"] == "adjoint",
                                  transpose_b=stored == "flag", adjoint_b=stored == "adjoint")
        first_flag = False
    return result


@PROPERTY
@given(program=diagonal_programs(), dtype=DTYPES, gradient=st.booleans(), seed=st.integers(0, 2**16))
def test_random_diagonals_of_chains_equal_stock(program: dict[str, Any], dtype: tf.DType, gradient: bool,
                                                seed: int) -> None:
    rng = np.random.default_rng(seed)
    args = [operand(rng, f["shape"], dtype) for f in program["factors"]]

    def fn(*tensors: tf.Tensor) -> tf.Tensor:
        product = chain(list(tensors), program["factors"])
        if program["reduce"] == "trace":
            return tf.linalg.trace(product)
        if program["reduce"] == "diag_part_of_transpose":
            return tf.linalg.diag_part(tf.linalg.matrix_transpose(product))
        return tf.linalg.diag_part(product)

    check(fn, args, [ContractDiagOfProduct(), ScaleByDiagonal(), ReorderMatMulChain()], dtype, gradient)


def test_a_large_diagonal_of_two_factors_is_contracted(rng: np.random.Generator) -> None:
    """The property above must not pass by never firing: its plainest case fires."""
    args = [operand(rng, [24, 3], tf.float64), operand(rng, [3, 24], tf.float64)]
    function = check(lambda p, q: tf.linalg.diag_part(p @ q), args, [ContractDiagOfProduct()], tf.float64, False)
    assert statuses(function, args, ContractDiagOfProduct.rule) == ["fired"]


# --- scale_by_diagonal --------------------------------------------------------------------------

@st.composite
def diagonal_products(draw: Any) -> dict[str, Any]:
    """diag(d) @ X or X @ diag(d), X read through a flag, an adjoint or upright, with batch
    dimensions on d, X, both or neither (X's of size 1 broadcasts), diag made by
    `tf.linalg.diag` with or without its explicit defaults."""
    n, m = draw(st.sampled_from([1, 5])), draw(st.sampled_from([1, 4]))
    side = draw(st.sampled_from(["left", "right"]))
    read = draw(st.sampled_from(["upright", "flag", "adjoint"]))
    d_batch, x_batch = draw(st.sampled_from([([], []), ([3], []), ([], [3]), ([3], [3]), ([3], [1])]))
    rows, cols = (n, m) if side == "left" else (m, n)
    return {"side": side, "read": read, "explicit": draw(st.booleans()), "d": d_batch + [n],
            "x": x_batch + ([cols, rows] if read != "upright" else [rows, cols])}


@PROPERTY
@given(program=diagonal_products(), dtype=DTYPES, gradient=st.booleans(), seed=st.integers(0, 2**16))
def test_random_products_with_a_diagonal_equal_stock(program: dict[str, Any], dtype: tf.DType, gradient: bool,
                                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    args = [operand(rng, program["d"], dtype), operand(rng, program["x"], dtype)]
    flags = {"flag": {"transpose": True}, "adjoint": {"adjoint": True}, "upright": {}}[program["read"]]

    def fn(d: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
        matrix = tf.linalg.diag(d, k=0, num_rows=-1, num_cols=-1, padding_value=0) if program["explicit"] \
            else tf.linalg.diag(d)
        if program["side"] == "left":
            return tf.linalg.matmul(matrix, x, **{f"{key}_b": value for key, value in flags.items()})
        return tf.linalg.matmul(x, matrix, **{f"{key}_a": value for key, value in flags.items()})

    function = check(fn, args, [ScaleByDiagonal()], dtype, gradient)
    assert "fired" in statuses(function, args, ScaleByDiagonal.rule)
