"""Tests for `rewrites.compose_band_parts`: band_part(band_part(x, a, b), c, d) → one band part."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from rewrites.compose_band_parts import ComposeBandParts
from tfmem.graph import Graph
from tfmem.testing import assert_close, with_gradient

SHAPE = [2, 6, 5]  # a batch of two 6×5 matrices
bands = st.integers(min_value=-1, max_value=5)  # -1: the whole side; 5: every diagonal of a 6×5 matrix


def rewrite(fn: Callable[..., Any], *, jit_compile: bool = False) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[ComposeBandParts()], lint=True,
                               config={"strict": True, "jit_compile": jit_compile})


def band_parts_left(function: tfmem.TfmemFunction, *args: Any) -> list[tuple[int, int]]:
    """The (lower, upper) bands of the band parts in the rewritten graph."""
    graph = Graph(function.report(*args).rewritten_graph_def)
    return [tuple(int(graph.constant_value(ref)) for ref in graph.inputs(node.name)[1:])
            for node in graph.find("MatrixBandPart")]


@settings(max_examples=30, deadline=None)
@given(inner=st.tuples(bands, bands), outer=st.tuples(bands, bands),
       dtype=st.sampled_from([tf.float32, tf.float64]), seed=st.integers(0, 2**16))
def test_one_band_part_keeps_what_both_keep(inner: tuple[int, int], outer: tuple[int, int], dtype: tf.DType,
                                            seed: int) -> None:
    fn = lambda x: tf.exp(tf.linalg.band_part(tf.linalg.band_part(x, *inner), *outer))  # noqa: E731
    x = tf.constant(np.random.default_rng(seed).normal(size=SHAPE), dtype)
    function = rewrite(fn)
    assert [(r.rule, r.status) for r in function.report(x).records] == [("ComposeBandParts", "fired")]
    (left,) = band_parts_left(function, x)
    whole = lambda band: float("inf") if band < 0 else band  # noqa: E731
    if whole(outer[0]) >= whole(inner[0]) and whole(outer[1]) >= whole(inner[1]):
        assert left == inner  # the outer one kept everything: dropped
    else:
        assert [whole(b) for b in left] == [min(whole(i), whole(o)) for i, o in zip(inner, outer)]
    assert_close(function(x), fn(x), dtype)


def test_the_gradient_stack_composes_too(rng: np.random.Generator) -> None:
    # The gradient of a band part is the same band part of the gradient: two in the backward.
    fn = with_gradient(lambda x: tf.linalg.band_part(tf.linalg.band_part(x, -1, 0), -1, 0) ** 2)
    x = tf.constant(rng.normal(size=SHAPE))
    function = rewrite(fn)
    assert [r.status for r in function.report(x).records] == ["fired", "fired"]
    assert band_parts_left(function, x) == [(-1, 0), (-1, 0)]
    for got, want in zip(function(x), fn(x)):
        assert_close(got, want, tf.float64)


def test_an_outer_band_part_that_keeps_everything_is_dropped_whoever_reads_the_inner(rng) -> None:
    def fn(x):
        lower = tf.linalg.band_part(x, -1, 0)
        return tf.reduce_sum(tf.linalg.band_part(lower, -1, 1)) + tf.reduce_sum(tf.exp(lower))

    x = tf.constant(rng.normal(size=SHAPE))
    function = rewrite(fn, jit_compile=True)
    assert [r.status for r in function.report(x).records] == ["fired"]
    assert band_parts_left(function, x) == [(-1, 0)]
    assert_close(function(x), fn(x), tf.float64)


def test_a_narrower_band_of_an_inner_band_part_read_elsewhere_is_left(rng) -> None:
    def fn(x):
        lower = tf.linalg.band_part(x, -1, 0)
        return tf.reduce_sum(tf.linalg.band_part(lower, 1, 0)) + tf.reduce_sum(tf.exp(lower))

    x = tf.constant(rng.normal(size=SHAPE))
    function = tfmem.TfmemFunction(fn, passes=[ComposeBandParts()], config={"jit_compile": False})
    (record,) = function.report(x).records
    assert record.status == "rejected" and "also read by Exp" in record.reason, record
    assert sorted(band_parts_left(function, x)) == [(-1, 0), (1, 0)]
    assert_close(function(x), fn(x), tf.float64)


def test_bands_that_are_not_constants_are_no_match(rng) -> None:
    fn = lambda x, k: tf.linalg.band_part(tf.linalg.band_part(x, k, 0), -1, 0)  # noqa: E731
    x, k = tf.constant(rng.normal(size=SHAPE)), tf.constant(2, tf.int64)
    function = tfmem.TfmemFunction(fn, passes=[ComposeBandParts()], config={"jit_compile": False})
    assert list(function.report(x, k).records) == []
    graph = Graph(function.report(x, k).rewritten_graph_def)
    assert len(list(graph.find("MatrixBandPart"))) == 2
    assert_close(function(x, k), fn(x, k), tf.float64)


@pytest.mark.parametrize("kernel", ["linear"])
def test_gpflow_vgp_masks_its_triangular_parameter_once(kernel: str) -> None:
    from benchmarks.corpus.programs import PROGRAMS

    fn, args = PROGRAMS[f"vgp_{kernel}_grad"].build(50)
    function = tfmem.TfmemFunction(fn, config={"jit_compile": False})
    fired = [r for r in function.report(*args).records if r.rule == "ComposeBandParts" and r.status == "fired"]
    assert len(fired) >= 2, fired  # q_sqrt's mask in the loss, and its gradient's
    for got, want in zip(tf.nest.flatten(function(*args)), tf.nest.flatten(fn(*args))):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-12)
