"""Tests for `rewrites.bands_as_selects`: band parts of large matrices as selects, under XLA."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from rewrites.bands_as_selects import BandsAsSelects
from tfmem.graph import Graph

N = 600  # a [600, 600] float64 matrix: 2.7 MiB, over MIN_BYTES


def two_bands_around_a_loop(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """A lower band, a Cholesky factor held through a loop of solves, then another band:
    the shape of GPflow SGPR's gradient (its triangular solves' and Cholesky's bands)."""
    first = tf.linalg.band_part(a @ tf.transpose(a), -1, 0)
    factor = tf.linalg.cholesky(first + tf.transpose(first) + N * tf.eye(N, dtype=a.dtype))

    def body(i: tf.Tensor, total: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        column = tf.linalg.triangular_solve(factor, b[:, :1] * tf.cast(i + 1, b.dtype))
        return i + 1, total + tf.reduce_sum(column)

    _, total = tf.while_loop(lambda i, _: i < 3, body, (0, tf.constant(0.0, a.dtype)))
    second = tf.linalg.band_part(b @ tf.transpose(b) + total, -1, 0)
    return tf.reduce_sum(second * factor)


def inputs() -> tuple[tf.Tensor, tf.Tensor]:
    rng = np.random.default_rng(3)
    return tf.constant(rng.normal(size=(N, 8))), tf.constant(rng.normal(size=(N, 8)))


def rewrite(fn, *, jit_compile: bool = True) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[BandsAsSelects()], lint=True,
                               config={"strict": True, "jit_compile": jit_compile})


def stored_masks(function, *args) -> list[str]:
    """XLA's buffers of `pred[N, N]` alive at its peak."""
    peak = tfmem.memory.xla_plan(function, *args).peak
    return [str(b) for b in peak.live_at_peak if f"bool[{N}, {N}]" in str(b)]


def test_the_bands_become_selects_and_equal_stock() -> None:
    wrapped = rewrite(two_bands_around_a_loop)
    report = wrapped.report(*inputs())
    assert [r.status for r in report.records if r.rule == "BandAsSelect"] == ["fired", "fired"]
    assert "MatrixBandPart" not in Graph(report.rewritten_graph_def).op_counts()
    want = tf.function(two_bands_around_a_loop, jit_compile=True)(*inputs())
    np.testing.assert_allclose(wrapped(*inputs()).numpy(), want.numpy(), rtol=1e-12)


def test_xla_stores_no_mask_for_the_selects_where_it_stores_one_for_the_bands() -> None:
    # XLA merges the two bands' masks into one and keeps it from the first band to the
    # second, across the loop; the selects' masks are fused into each select.
    stock = tf.function(two_bands_around_a_loop, jit_compile=True)
    assert stored_masks(stock, *inputs()), "XLA stores no mask for band_part here: the test shows nothing"
    assert not stored_masks(rewrite(two_bands_around_a_loop).compiled(*inputs()), *inputs())
    # In the whole pipeline too (its later rounds merge the two selects' iotas into one).
    assert not stored_masks(tfmem.function(two_bands_around_a_loop).compiled(*inputs()), *inputs())


def test_without_xla_the_bands_stay() -> None:
    report = rewrite(two_bands_around_a_loop, jit_compile=False).report(*inputs())
    [record] = [r for r in report.records if r.rule == "BandAsSelect"]
    assert record.status == "rejected" and "not compiled by XLA" in record.reason
    assert Graph(report.rewritten_graph_def).op_counts()["MatrixBandPart"] == 2


@pytest.mark.parametrize("lower, upper", [(-1, 0), (0, -1), (3, 5), (0, 0), (-1, -1), (40, 2)])
def test_every_band_equals_band_part(lower: int, upper: int) -> None:
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 520, 530)))

    def program(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.exp(tf.linalg.band_part(x, lower, upper)) ** 2)
        return y, tape.gradient(y, x)

    wrapped = rewrite(program)
    assert "MatrixBandPart" not in Graph(wrapped.report(x).rewritten_graph_def).op_counts()
    for got, want in zip(wrapped(x), tf.function(program, jit_compile=True)(x)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
