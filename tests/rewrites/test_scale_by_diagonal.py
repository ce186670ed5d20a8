"""Tests for `rewrites.scale_by_diagonal`: products with a diagonal matrix, as broadcast scales."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from rewrites.diag_of_product import ContractDiagOfProduct
from rewrites.matmul_chain import ReorderMatMulChain
from rewrites.scale_by_diagonal import ScaleByDiagonal
from tfmem.graph import Graph
from tfmem.testing import assert_close, with_gradient
from tfmem.testing import random_inputs as inputs

PASSES = (ContractDiagOfProduct, ScaleByDiagonal, ReorderMatMulChain)  # the "reorder" stage
DIAG_MATRIX_OPS = ("MatrixDiag", "MatrixDiagV2", "MatrixDiagV3")
N, M = 60, 7


def rewrite(fn: Callable[..., Any]) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[p() for p in PASSES], lint=True, config={"strict": True})


def scale_records(function: tfmem.TfmemFunction, *args: Any, status: str) -> list[tfmem.RewriteRecord]:
    return [r for r in function.report(*args).records
            if r.status == status and r.pass_name == ScaleByDiagonal.name]


def _left_and_right(d: tf.Tensor, x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    matrix = tf.linalg.diag(d)  # [N, N], read by two products: both become scales
    return matrix @ x, tf.transpose(x) @ matrix


# name → (function, input shapes: the diagonal first)
SCALE_CASES: dict[str, tuple[Callable[..., tf.Tensor], list[list[int]]]] = {
    "left": (lambda d, x: tf.linalg.diag(d) @ x, [[N], [N, M]]),
    "right": (lambda d, x: x @ tf.linalg.diag(d), [[N], [M, N]]),
    "left_transposed": (lambda d, x: tf.linalg.matmul(tf.linalg.diag(d), x, transpose_b=True),
                        [[N], [M, N]]),
    "right_transpose_op": (lambda d, x: tf.transpose(x) @ tf.linalg.diag(d), [[N], [N, M]]),
    "batched": (lambda d, x: tf.linalg.diag(d) @ x, [[3, N], [N, M]]),
    "two_uses": (_left_and_right, [[N], [N, M]]),
}


@pytest.mark.parametrize("name", sorted(SCALE_CASES))
def test_scale_by_diagonal_drops_the_matrix(name: str, rng: np.random.Generator) -> None:
    fn, shapes = SCALE_CASES[name]
    args = inputs(rng, shapes, tf.float64)
    function = rewrite(fn)
    (fired,) = scale_records(function, *args, status="fired")
    assert fired.details["matrix_bytes"] == int(np.prod(shapes[0])) * N * 8
    ops = Graph(function.report(*args).rewritten_graph_def).op_counts()
    assert not set(ops) & {*DIAG_MATRIX_OPS, "MatMul", "BatchMatMulV2"}
    assert ops["Mul"] == (2 if name == "two_uses" else 1)
    concrete = tf.function(fn).get_concrete_function(*args)
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    after = tfmem.PassManager([ScaleByDiagonal()], lint=True).run(graph, tfmem.PassContext(tfmem.Config())).graph
    assert tfmem.estimate_memory(after).peak_bytes < tfmem.estimate_memory(graph).peak_bytes


@pytest.mark.parametrize("gradient", [False, True], ids=["value", "gradient"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", sorted(SCALE_CASES))
def test_scale_by_diagonal_numerically_equal(name: str, dtype: tf.DType, gradient: bool,
                                             rng: np.random.Generator) -> None:
    fn, shapes = SCALE_CASES[name]
    fn = with_gradient(fn) if gradient else fn
    args = inputs(rng, shapes, dtype)
    function = rewrite(fn)
    assert scale_records(function, *args, status="fired")
    assert_close(function(*args), fn(*args), dtype)


def test_scale_by_diagonal_rejects_a_matrix_read_elsewhere(rng: np.random.Generator) -> None:
    def fn(d: tf.Tensor, x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        matrix = tf.linalg.diag(d)
        return matrix @ x, tf.reduce_sum(matrix, axis=0)

    args = inputs(rng, [[N], [N, M]], tf.float64)
    (rejected,) = scale_records(rewrite(fn), *args, status="rejected")
    assert rejected.reason == "diagonal matrix diag is also read by Sum: it is materialised anyway"


def test_scale_by_diagonal_rejects_nonzero_padding(rng: np.random.Generator) -> None:
    args = inputs(rng, [[N], [N, M]], tf.float64)
    function = rewrite(lambda d, x: tf.linalg.diag(d, padding_value=1.0) @ x)
    (rejected,) = scale_records(function, *args, status="rejected")
    assert rejected.reason == "off-diagonal padding is 1.0, not 0"
