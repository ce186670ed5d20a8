"""Tests for `rewrites.diag_of_elementwise`: the diagonal of an elementwise expression."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from tfmem.testing import assert_close, with_gradient
from rewrites.add_diagonal import AddDiagonal
from rewrites.diag_of_elementwise import DiagOfElementwise
from rewrites.diag_of_product import ContractDiagOfProduct

N = 40


def rewrite(fn: Callable[..., Any]) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[DiagOfElementwise(), ContractDiagOfProduct()], lint=True,
                               config={"strict": True, "jit_compile": True})


def square_matrices(function: tfmem.TfmemFunction, *args: Any) -> list[str]:
    """The computed [..., N, N] tensors left in the rewritten graph."""
    graph = function.report(*args).rewritten.graph
    return [node.name for node in graph.nodes if node.op not in ("Placeholder", "Const")
            for spec in graph.output_specs(node.name) if spec.shape.rank and spec.shape.rank >= 2
            and spec.shape[-2:] == [N, N]]


def rewritten_equals_stock(fn: Callable[..., Any], shapes: list[tuple[int, ...]], dtype: Any, gradient: bool,
                           seed: int) -> tuple[tfmem.TfmemFunction, list[tf.Tensor]]:
    """`fn` (with its gradients, if asked) rewritten, checked against stock XLA on random
    arguments of these shapes; the rewritten function and the arguments."""
    rng = np.random.default_rng(seed)
    args = [tf.constant(rng.normal(size=shape).astype(dtype)) for shape in shapes]
    program = with_gradient(fn) if gradient else fn
    wrapped = rewrite(program)
    assert_close(wrapped(*args), tf.function(program, jit_compile=True)(*args), tf.as_dtype(dtype))
    return wrapped, args


def predictive_variance(kss_points, x, a):
    """GPflow's full covariance, tiled over one latent GP, then only its diagonal: `Kss − AᵀA`."""
    d2 = tf.reduce_sum(kss_points ** 2, -1)[:, None] + tf.reduce_sum(kss_points ** 2, -1)[None, :] \
        - 2.0 * tf.matmul(kss_points, kss_points, transpose_b=True)
    kss = 1.5 * tf.exp(-0.5 * d2)
    cov = tf.tile((kss - tf.matmul(a, a, transpose_a=True))[None], [1, 1, 1])
    return tf.linalg.diag_part(cov[0]) + tf.reduce_sum(x)


def test_a_predictive_variance_forms_no_square_matrix(rng):
    args = [tf.constant(rng.normal(size=shape)) for shape in ((N, 2), (3,), (7, N))]
    wrapped = rewrite(predictive_variance)
    np.testing.assert_allclose(wrapped(*args).numpy(), tf.function(predictive_variance, jit_compile=True)(*args),
                               rtol=1e-12, atol=1e-12)
    fired = [r.rule for r in wrapped.report(*args).records if r.status == "fired"]
    assert "DiagOfElementwise" in fired and "ContractDiagOfProduct" in fired, fired
    assert square_matrices(wrapped, *args) == []


def test_the_diagonal_of_a_sum_kernel_forms_no_square_matrix(rng):
    """GPflow's `Sum` kernel adds its parts with `AddN`: the diagonal goes into each part."""
    def variance(xs, a):
        squared = tf.reduce_sum(tf.square(xs[:, None, :] - xs[None, :, :]), -1)
        kss = tf.add_n([tf.exp(-0.5 * squared), tf.matmul(xs, xs, transpose_b=True), 1.0 / (1.0 + squared)])
        return tf.linalg.diag_part(kss - tf.matmul(a, a, transpose_a=True))

    xs, a = tf.constant(rng.normal(size=(N, 3))), tf.constant(rng.normal(size=(7, N)))
    wrapped = rewrite(variance)
    assert "AddN" in [r.details.get("op") for r in wrapped.report(xs, a).fired]
    assert square_matrices(wrapped, xs, a) == []
    assert_close(wrapped(xs, a), tf.function(variance, jit_compile=True)(xs, a), tf.float64)


def test_a_matrix_read_elsewhere_is_formed_for_that_reader_only(rng):
    def fn(x, y):
        k = tf.exp(x - y)
        return tf.linalg.diag_part(k), tf.reduce_sum(k, 0)

    args = [tf.constant(rng.normal(size=(N, N))) for _ in range(2)]
    wrapped = rewrite(fn)
    statuses = [r.status for r in wrapped.report(*args).records if r.rule == "DiagOfElementwise"]
    assert statuses and set(statuses) == {"fired"}, statuses
    assert len(square_matrices(wrapped, *args)) <= 2  # x - y and k, for the column sums alone
    for got, want in zip(wrapped(*args), tf.function(fn, jit_compile=True)(*args)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_a_matrix_whose_diagonal_is_set_keeps_the_diagonal_it_reads(rng):
    """`K + ½I`, which `AddDiagonal` writes `set_diag(K, diag_part(K) + ½)`: that diagonal stays
    with K, for the splitter to recompute both in a loop's chunks (the corpus's CG solve fits
    128 MiB so; with the diagonal taken of K's operands nothing was split: 824 MiB)."""
    def fn(x, y):
        return tf.exp(x - y) + 0.5 * tf.eye(N, dtype=x.dtype)

    args = [tf.constant(rng.normal(size=(N, N))) for _ in range(2)]
    wrapped = tfmem.TfmemFunction(fn, passes=[AddDiagonal(), DiagOfElementwise()], lint=True,
                                  config={"strict": True, "jit_compile": True})
    [record] = [r for r in wrapped.report(*args).records if r.rule == "DiagOfElementwise"]
    assert record.status == "rejected" and "has its diagonal set by" in record.reason, record
    np.testing.assert_array_equal(wrapped(*args).numpy(), tf.function(fn, jit_compile=True)(*args).numpy())


@pytest.mark.parametrize("read", [tf.linalg.diag_part, tf.linalg.trace], ids=["diag_part", "trace"])
def test_the_diagonal_of_a_kernel_plus_jitter_forms_no_square_matrix(rng, read):
    """`diag(K + c·I)` and `trace(K + c·I)` (a noise or jitter term): `AddDiagonal` writes
    `set_diag(K, diag_part(K) + c)`, whose diagonal is the one set; K's own diagonal is then
    taken of its operands once the set_diag is gone. Before: K and K + c·I whole."""
    def fn(x, y):
        return read(tf.exp(x - y) + 0.5 * tf.eye(N, dtype=x.dtype))

    args = [tf.constant(rng.normal(size=(N, N))) for _ in range(2)]
    wrapped = tfmem.TfmemFunction(fn, passes=[AddDiagonal(), DiagOfElementwise()], lint=True,
                                  config={"strict": True, "jit_compile": True})
    fired = [r.details["op"] for r in wrapped.report(*args).fired if r.rule == "DiagOfElementwise"]
    assert "MatrixSetDiagV3" in fired and "Exp" in fired, fired
    assert square_matrices(wrapped, *args) == []
    np.testing.assert_array_equal(wrapped(*args).numpy(), tf.function(fn, jit_compile=True)(*args).numpy())


def test_a_returned_matrix_keeps_its_diagonal(rng):
    def fn(x, y):
        k = tf.exp(x - y)
        return tf.linalg.diag_part(k), k

    args = [tf.constant(rng.normal(size=(N, N))) for _ in range(2)]
    [record] = [r for r in rewrite(fn).report(*args).records if r.rule == "DiagOfElementwise"]
    assert record.status == "rejected" and "one of the program's outputs" in record.reason


def test_a_kernel_read_by_its_diagonal_and_a_product_is_split_under_a_budget(rng):
    """`K @ v` beside `diag(K)` and `trace(K)`: the diagonals no longer read K whole, so K is
    made in row chunks for the product alone (before, its diagonal kept it whole: 17 MiB)."""
    def fn(x, v):
        sq = tf.reduce_sum(x * x, -1)
        k = tf.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)))
        return k @ v, tf.linalg.diag_part(k) + tf.linalg.trace(k)

    x, v = tf.constant(rng.normal(size=(1500, 3))), tf.constant(rng.normal(size=(1500, 4)))
    wrapped = tfmem.TfmemFunction(fn, config={"memory_budget": "4MiB", "strict": True}, lint=True)
    report = wrapped.report(x, v)
    assert report.fits and report.splits, report.summary()
    assert_close(wrapped(x, v), tf.function(fn, jit_compile=True)(x, v), tf.float64)


@pytest.mark.parametrize("cut", [lambda m: m[:, 1:, 1:], lambda m: m[..., 1:, 1:], lambda m: m[None, ..., ::-1]],
                         ids=["slice", "after_ellipsis", "reversed_after_ellipsis"])
def test_a_slice_of_the_matrix_dimensions_stays(rng, cut):
    def fn(x):
        return tf.linalg.diag_part(cut(tf.exp(x)))

    x = tf.constant(rng.normal(size=(2, N + 1, N + 1)))
    wrapped = rewrite(fn)
    [record] = [r for r in wrapped.report(x).records if r.rule == "DiagOfElementwise"]
    assert record.status == "rejected" and "slices the matrix dimensions" in record.reason, record
    np.testing.assert_array_equal(wrapped(x).numpy(), tf.function(fn, jit_compile=True)(x).numpy())


def test_matrices_joined_along_a_matrix_dimension_stay(rng):
    def fn(x):
        k = tf.exp(x)
        return tf.linalg.diag_part(tf.concat([k[:, :N // 2], -k[:, N // 2:]], axis=-2))

    x = tf.constant(rng.normal(size=(2, N, N)))
    wrapped = rewrite(fn)
    [record] = [r for r in wrapped.report(x).records if r.rule == "DiagOfElementwise"]
    assert record.status == "rejected" and "along a matrix dimension" in record.reason, record
    np.testing.assert_array_equal(wrapped(x).numpy(), tf.function(fn, jit_compile=True)(x).numpy())


# Operand shapes as an elementwise op broadcasts them to [2, N, N].
SHAPES = {"matrix": (N, N), "batch": (2, N, N), "column": (N, 1), "row": (1, N), "batch_column": (2, N, 1),
          "vector_row": (N,), "scalar": (), "one_by_one": (1, 1)}
UNARY = {"exp": tf.exp, "neg": tf.negative, "square": tf.square, "tanh": tf.tanh, "softplus": tf.nn.softplus,
         "identity": tf.identity, "abs": tf.abs,
         "cast_round_trip": lambda a: tf.cast(tf.cast(a, tf.float32 if a.dtype == tf.float64 else tf.float64), a.dtype)}
BINARY = {"add": tf.add, "sub": tf.subtract, "mul": tf.multiply, "div": lambda a, b: a / (1.5 + tf.abs(b)),
          "max": tf.maximum, "squared_difference": tf.math.squared_difference,
          "where": lambda a, b: tf.where(a > b, a, -b),
          "add_n": lambda a, b: tf.add_n([a + b, a * b, tf.maximum(a, b)])}


@st.composite
def expressions(draw: Any, shapes: dict[str, tuple[int, ...]] = SHAPES, depth: int = 3) -> Any:
    """("leaf", shape name) | ("unary", name, e) | ("binary", name, e, e), leaves named in `shapes`."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return ("leaf", draw(st.sampled_from(sorted(shapes))))
    if draw(st.booleans()):
        return ("unary", draw(st.sampled_from(sorted(UNARY))), draw(expressions(shapes, depth - 1)))
    return ("binary", draw(st.sampled_from(sorted(BINARY))), draw(expressions(shapes, depth - 1)),
            draw(expressions(shapes, depth - 1)))


def leaves(expression: Any) -> list[str]:
    if expression[0] == "leaf":
        return [expression[1]]
    return [shape for child in expression[2:] for shape in leaves(child)]


def evaluate(expression: Any, tensors: list[tf.Tensor]) -> tf.Tensor:
    if expression[0] == "leaf":
        return tensors.pop(0)
    if expression[0] == "unary":
        return UNARY[expression[1]](evaluate(expression[2], tensors))
    left = evaluate(expression[2], tensors)
    return BINARY[expression[1]](left, evaluate(expression[3], tensors))


@settings(deadline=None, max_examples=40, derandomize=True, database=None)
@given(expression=expressions(), arrange=st.sampled_from(["none", "slice", "tile", "expand", "new_axis",
                                                          "ellipsis_new_axis", "ellipsis_index", "stack", "concat",
                                                          "jitter", "set_diag"]),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_diagonals_of_random_expressions_equal_stock(expression, arrange, dtype, seed):
    """Random elementwise expressions over operands of every broadcast shape (plus a matrix, so
    the result is [2, N, N]), arranged over leading dimensions, then their diagonal: the same
    values as stock XLA's (the same operations on the same numbers)."""
    shapes = [SHAPES[name] for name in leaves(expression)] + [SHAPES["matrix"]]

    def fn(*tensors):
        matrix = evaluate(expression, list(tensors[:-1])) + tensors[-1] * tf.ones([2, 1, 1], tensors[-1].dtype)
        if arrange == "slice":
            matrix = matrix[1]
        elif arrange == "tile":
            matrix = tf.tile(matrix, [2, 1, 1])
        elif arrange == "expand":
            matrix = tf.expand_dims(matrix, 0)
        elif arrange == "new_axis":
            matrix = matrix[None, :1]
        elif arrange == "ellipsis_new_axis":  # GPflow's `var[None, ...]`
            matrix = matrix[None, ...]
        elif arrange == "ellipsis_index":
            matrix = matrix[1, ..., :, :]
        elif arrange == "stack":  # GPflow's SeparateIndependent: one covariance per latent GP
            matrix = tf.stack([matrix, tf.exp(-matrix)], axis=-3)
        elif arrange == "concat":
            matrix = tf.concat([matrix, tf.square(matrix[:1])], axis=0)
        elif arrange == "jitter":  # `K + ½I` as AddDiagonal writes it
            matrix = tf.linalg.set_diag(matrix, tf.linalg.diag_part(matrix) + 0.5)
        elif arrange == "set_diag":
            matrix = tf.linalg.set_diag(matrix, tf.exp(tf.linalg.diag_part(matrix)))
        return tf.linalg.diag_part(matrix)

    rng = np.random.default_rng(seed)
    args = [tf.constant(rng.normal(size=shape).astype(dtype)) for shape in shapes]
    wrapped = rewrite(fn)
    got, want = wrapped(*args).numpy(), tf.function(fn, jit_compile=True)(*args).numpy()
    assert got.shape == want.shape
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * max(1.0, np.max(np.abs(want))))
    # (With `jitter` the first look at K's own diagonal is refused while the set_diag reads it.)
    assert "fired" in [r.status for r in wrapped.report(*args).records if r.rule == "DiagOfElementwise"]
    assert square_matrices(wrapped, *args) == []


# Pairwise expressions: operands broadcast to [B, N, N, D] by the matrix dimensions (third and
# second from last) and reduced over the last axis, as a kernel matrix written with broadcasts.
D = 3
PAIR_SHAPES = {"rows": (N, 1, D), "cols": (1, N, D), "batch_rows": (2, N, 1, D), "full": (N, N, D),
               "features": (D,), "scalar": (), "column_features": (N, D)}
REDUCTIONS = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max, "min": tf.reduce_min,
              "prod": lambda t, axis: tf.reduce_prod(tf.tanh(t) + 1.5, axis)}


@settings(deadline=None, max_examples=30, derandomize=True, database=None)
@given(expression=expressions(PAIR_SHAPES), reduction=st.sampled_from(sorted(REDUCTIONS)),
       reader=st.sampled_from(["diag_part", "trace"]), dtype=st.sampled_from([np.float32, np.float64]),
       gradient=st.booleans(), seed=st.integers(0, 2**16))
def test_diagonals_of_random_pairwise_reductions_equal_stock(expression, reduction, reader, dtype, gradient, seed):
    """A kernel-like matrix `R_d f(x[:, None, :], y[None, :, :], ...)` over random elementwise
    expressions, reduced over the features, then its diagonal or trace: the same values as
    stock XLA's, and (in the forward) no [N, N] matrix or [N, N, D] expression is formed."""
    shapes = [PAIR_SHAPES[name] for name in leaves(expression)] + [(N, D), (N, D)]

    def fn(*tensors):
        x, y = tensors[-2:]
        pairs = x[:, None, :] - y[None, :, :]
        matrix = REDUCTIONS[reduction](evaluate(expression, list(tensors[:-2])) * pairs, -1)
        if matrix.shape.rank == 2:
            matrix = matrix[None]
        return tf.linalg.trace(matrix) if reader == "trace" else tf.linalg.diag_part(matrix)

    wrapped, args = rewritten_equals_stock(fn, shapes, dtype, gradient, seed)
    if not gradient:
        statuses = [r.status for r in wrapped.report(*args).records if r.rule == "DiagOfElementwise"]
        assert "fired" in statuses, statuses
        graph = wrapped.report(*args).rewritten.graph
        formed = [node.name for node in graph.nodes for spec in graph.output_specs(node.name)
                  if node.op not in ("Placeholder", "Const") and spec.shape.rank and spec.shape.rank >= 2
                  and N in spec.shape.as_list()[-3:-1] and spec.shape.as_list().count(N) >= 2]
        assert formed == [], formed


def test_a_kernel_diagonal_written_with_broadcasts_forms_no_matrix(rng):
    """The fuzz round's predictive variance: `diag(Kss − AᵀA)` with Kss written as
    exp(−½ Σ (x[:, None] − x[None])²), kept unexpanded for its 2 features."""
    def variance(xs, a):
        kss = tf.exp(-0.5 * tf.reduce_sum((xs[:, None, :] - xs[None, :, :]) ** 2, -1))
        return tf.linalg.diag_part(kss - tf.matmul(a, a, transpose_a=True))

    args = [tf.constant(rng.uniform(-3, 3, size=(N, 2))), tf.constant(rng.normal(size=(7, N)))]
    wrapped = rewrite(variance)
    np.testing.assert_allclose(wrapped(*args).numpy(), tf.function(variance, jit_compile=True)(*args).numpy(),
                               rtol=1e-12, atol=1e-12)
    assert square_matrices(wrapped, *args) == []


def test_a_reduction_over_a_matrix_dimension_is_left_alone(rng):
    def fn(t):
        return tf.linalg.diag_part(tf.reduce_sum(tf.exp(t), 0))

    t = tf.constant(rng.normal(size=(3, N, N)))
    wrapped = rewrite(fn)
    [record] = [r for r in wrapped.report(t).records if r.rule == "DiagOfElementwise"]
    assert record.status == "rejected" and "last axis" in record.reason
    np.testing.assert_allclose(wrapped(t).numpy(), tf.function(fn, jit_compile=True)(t).numpy(), rtol=1e-12)


def test_several_diagonals_of_one_matrix_form_none(rng):
    """The fuzz round's diagonals (`diag_part_of_products_and_elementwise_f64`): a product P and a
    kernel K each reach several diagonals, one of them through Pᵀ. Pushed down, the diagonals of
    each meet at one matrix; merged, it has one reader, and neither is formed."""
    def fn(a, b, x):
        p = a @ tf.transpose(b)
        k = tf.exp(-0.5 * tf.reduce_sum((x[:, None, :] - x[None, :, :]) ** 2, -1))
        return (tf.linalg.diag_part(p), tf.linalg.diag_part(k * p - 2.0 * k),
                tf.linalg.diag_part(tf.exp(-p / 40.0) + tf.transpose(p)))

    args = [tf.constant(rng.normal(size=shape)) for shape in ((N, 5), (N, 5), (N, 2))]
    wrapped = rewrite(fn)
    assert_close(wrapped(*args), tf.function(fn, jit_compile=True)(*args), tf.float64)
    assert square_matrices(wrapped, *args) == []


TRANSPOSES = {"none": lambda m: m, "matrix_transpose": tf.linalg.matrix_transpose,
              "batch_kept": lambda m: tf.transpose(m, [0, 2, 1]), "batch_moved": lambda m: tf.transpose(m, [1, 0, 2])}


@settings(deadline=None, max_examples=25, derandomize=True, database=None)
@given(first=expressions(), second=expressions(), transpose=st.sampled_from(sorted(TRANSPOSES)),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_random_diagonals_sharing_a_matrix_equal_stock(first, second, transpose, dtype, seed):
    """Two random elementwise expressions over one shared [2, N, N] matrix (and their own
    operands), one of them through a transpose, and a diagonal of each: the same values as
    stock XLA's; a transpose that moves a batch dimension is left alone."""
    shapes = [SHAPES[name] for name in leaves(first) + leaves(second)] + [SHAPES["batch"]]

    def fn(*tensors):
        shared = tf.exp(tensors[-1])
        own = list(tensors[:-1])
        one = evaluate(first, own[:len(leaves(first))]) + shared
        two = TRANSPOSES[transpose](evaluate(second, own[len(leaves(first)):]) * shared)
        return tf.linalg.diag_part(one), tf.linalg.diag_part(two)

    rng = np.random.default_rng(seed)
    args = [tf.constant(rng.normal(size=shape).astype(dtype)) for shape in shapes]
    wrapped = rewrite(fn)
    for got, want in zip(wrapped(*args), tf.function(fn, jit_compile=True)(*args)):
        tolerance = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=tolerance,
                                   atol=tolerance * max(1.0, np.max(np.abs(want.numpy()))))
    if transpose != "batch_moved":
        assert square_matrices(wrapped, *args) == []


OTHER_READERS = {"column_sums": lambda m: tf.reduce_sum(m, -2), "row_max": lambda m: tf.reduce_max(m, -1),
                 "product": lambda m: m @ tf.ones([N, 2], m.dtype), "returned_part": lambda m: m[..., :3, :]}


@settings(deadline=None, max_examples=25, derandomize=True, database=None)
@given(expression=expressions(), reader=st.sampled_from(sorted(OTHER_READERS)),
       dtype=st.sampled_from([np.float32, np.float64]), gradient=st.booleans(), seed=st.integers(0, 2**16))
def test_random_diagonals_of_matrices_read_elsewhere_equal_stock(expression, reader, dtype, gradient, seed):
    """A random elementwise matrix read by its diagonal and by another op: the diagonal is
    taken of its operands, the matrix is still formed for the other reader, and both
    results (and their gradients) equal stock XLA's."""
    shapes = [SHAPES[name] for name in leaves(expression)] + [SHAPES["matrix"]]

    def fn(*tensors):
        matrix = evaluate(expression, list(tensors[:-1])) + tensors[-1] * tf.ones([2, 1, 1], tensors[-1].dtype)
        return tf.linalg.diag_part(matrix), OTHER_READERS[reader](matrix)

    wrapped, args = rewritten_equals_stock(fn, shapes, dtype, gradient, seed)
    if not gradient:
        statuses = [r.status for r in wrapped.report(*args).records if r.rule == "DiagOfElementwise"]
        assert statuses[0] == "fired", statuses
