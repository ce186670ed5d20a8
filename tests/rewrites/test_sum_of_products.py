"""Sums of squares and of products over the last axis, as contractions (`rewrites.sum_of_products`).

Checked: the values equal the reduction's (hypothesis, over ranks, axes, `keepdims`,
`Sum`/`Mean`, `Square`/`Mul`, float32/float64), XLA plans one tensor fewer where the
operand is held anyway, and what the rule leaves (with its reason).
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import rewrites.sum_of_products as sum_of_products
import tfmem
from rewrites.sum_of_products import SumOfProductsAsContraction
from tfmem.capture import capture, import_as_function
from tfmem.config import Config
from tfmem.context import PassContext
from tfmem.memory import xla_plan
from tfmem.passes import PassManager
from tfmem.testing import run_graph

RULE = "SumOfProductsAsContraction"


def _rewritten(fn, *specs, min_bytes: int | None = 0):
    """The rule run on `fn`'s graph; `min_bytes` its size floor (0: none, for small examples;
    None: the rule's own)."""
    concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
    graph = capture(concrete).to_graph()
    with pytest.MonkeyPatch.context() as patch:
        if min_bytes is not None:
            patch.setattr(sum_of_products, "MIN_BYTES", min_bytes)
        result = PassManager([SumOfProductsAsContraction()], lint=True).run(graph, PassContext(Config()))
    return result, concrete


@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from([(33, 33), (3, 50, 50), (2, 3, 40, 40), (64, 64)]),  # square: b @ a and a @ b
       extra_axes=st.sets(st.integers(0, 2)), keepdims=st.booleans(), mean=st.booleans(),
       square=st.booleans(), dtype=st.sampled_from([tf.float32, tf.float64]), seed=st.integers(0, 2**16))
def test_property_the_contraction_equals_the_reduction(shape, extra_axes, keepdims, mean, square, dtype, seed):
    rank = len(shape)
    axes = sorted({a for a in extra_axes if a < rank - 1} | {rank - 1})
    reduce = tf.reduce_mean if mean else tf.reduce_sum

    def fn(a, b):
        x, y = tf.matmul(a, b), tf.matmul(b, a)  # products: formed whole anyway
        product = tf.square(x) if square else x * y
        return reduce(product, axes, keepdims=keepdims)

    specs = [tf.TensorSpec(shape, dtype)] * 2
    result, concrete = _rewritten(fn, *specs)
    assert [r.status for r in result.records if r.rule == RULE] == ["fired"], result.records
    rng = np.random.default_rng(seed)
    values = [tf.constant(rng.normal(size=s.shape).astype(dtype.as_numpy_dtype)) for s in specs]
    [got] = run_graph(result.graph, concrete, values)
    want = concrete(*values).numpy()
    assert got.shape == want.shape
    # Summing reordered, a result is exact to a few ulps of the sum of its terms' sizes
    # (`x * y` cancels: the sum can be far smaller than its terms).
    a, b = (v.numpy() for v in values)
    x, y = a @ b, b @ a
    sizes = np.abs(x * x if square else x * y).sum(tuple(axes), keepdims=keepdims)
    if mean:
        sizes = sizes / np.prod([shape[axis] for axis in axes])
    eps = np.finfo(dtype.as_numpy_dtype).eps
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * eps * np.max(sizes))


@pytest.mark.parametrize("fn, why", [
    (lambda a: tf.reduce_sum(tf.square(a @ a), 0), "does not reduce the last axis"),
    (lambda a: tf.reduce_sum(tf.square(tf.exp(a)), -1), "made by Exp, which XLA fuses into its readers"),
    (lambda a: (tf.reduce_sum(tf.square(a @ a), -1), tf.square(a @ a)[0]), None),  # two squares: each its own
    (lambda a: tf.reduce_sum(tf.square(a @ a)[:, :16], -1), "not of an elementwise"),
    (lambda a: tf.reduce_sum(a @ a * a[0], -1), "broadcasts its operands"),
    (lambda a: tf.reduce_max(tf.square(a @ a), -1), "no record"),
])
def test_what_is_not_a_sum_of_products_over_the_last_axis_is_left(fn, why):
    result, _ = _rewritten(fn, tf.TensorSpec([48, 48], tf.float64))
    records = [r for r in result.records if r.rule == RULE]
    if why is None:
        assert any(r.status == "fired" for r in records), records
    elif why == "no record":
        assert not records
    elif why == "not of an elementwise":
        assert not any(r.status == "fired" for r in records), records
    else:
        assert records and all(r.status == "rejected" for r in records) and why in records[0].reason, records


def test_a_square_shared_with_another_reader_is_formed_anyway():
    def fn(a):
        square = tf.square(a @ a)
        return tf.reduce_sum(square, -1), square[0]

    result, _ = _rewritten(fn, tf.TensorSpec([48, 48], tf.float64))
    [record] = [r for r in result.records if r.rule == RULE]
    assert record.status == "rejected" and "formed anyway" in record.reason, record


def test_small_tensors_and_short_rows_are_left():
    result, _ = _rewritten(lambda a: tf.reduce_sum(tf.square(a @ a), -1), tf.TensorSpec([48, 48], tf.float64),
                           min_bytes=None)
    [record] = [r for r in result.records if r.rule == RULE]
    assert record.status == "rejected" and f"under {sum_of_products.MIN_BYTES}" in record.reason
    result, _ = _rewritten(lambda a, b: tf.reduce_sum(tf.square(a @ b), -1),
                           tf.TensorSpec([40000, 8], tf.float64), tf.TensorSpec([8, 32], tf.float64), min_bytes=None)
    [record] = [r for r in result.records if r.rule == RULE]
    assert record.status == "rejected" and "XLA fuses the product into the reduction" in record.reason


def test_xla_plans_one_matrix_fewer_for_the_row_sums_of_squares_of_a_matrix_it_returns(rng):
    """x = a @ b is returned, so XLA holds it; its rows' sums of squares formed `x²` beside it
    (XLA's CPU tree reduction fuses nothing into its `reduce-window`)."""
    n = 600

    def fn(a, b):
        x = a @ b
        return x, tf.reduce_sum(tf.square(x), -1)

    a, b = (tf.constant(rng.normal(size=(n, n))) for _ in range(2))
    stock = xla_plan(tf.function(fn, jit_compile=True), a, b).total_bytes
    # The rule alone, run as the pipeline runs it under a budget that stock does not fit
    # (an `xla_checked` rule runs only then).
    traced = tfmem.TfmemFunction(fn).report(a, b).traced
    rewritten = traced.rewrite(Config(), passes=[SumOfProductsAsContraction()])
    assert [r.status for r in rewritten.records] == ["fired"]
    compiled = import_as_function(traced.captured, rewritten.graph, jit_compile=True)
    planned = xla_plan(compiled, a, b).total_bytes
    matrix = n * n * 8
    assert planned <= stock - matrix + matrix // 8, (planned, stock)  # one [n, n] fewer
    for got, want in zip(compiled(a, b), tf.function(fn, jit_compile=True)(a, b)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
