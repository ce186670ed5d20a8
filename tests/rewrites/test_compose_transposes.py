"""Tests for `rewrites.compose_transposes`: Transpose(Transpose(x, p), q) → Transpose(x, p[q])."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from rewrites.compose_transposes import ComposeTransposes
from tfmem.graph import Graph
from tfmem.testing import assert_close, with_gradient
from tfmem.testing import random_inputs as inputs

SHAPE = [4, 5, 6]


def rewrite(fn: Callable[..., Any]) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[ComposeTransposes()], lint=True,
                               config={"strict": True, "jit_compile": False})


# (inner perm, outer perm): the composed perm is inner[outer]
PAIRS = [([1, 0, 2], [0, 2, 1]), ([2, 0, 1], [2, 0, 1]), ([0, 2, 1], [1, 0, 2]), ([1, 2, 0], [2, 0, 1])]


@pytest.mark.parametrize("inner, outer", PAIRS)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=["f32", "f64"])
def test_one_transpose_with_the_composed_permutation(inner: list[int], outer: list[int], dtype: tf.DType,
                                                     rng: np.random.Generator) -> None:
    fn = lambda x: tf.exp(tf.transpose(tf.transpose(x, inner), outer))  # noqa: E731
    (x,) = inputs(rng, [SHAPE], dtype)
    function = rewrite(fn)
    assert [(r.rule, r.status) for r in function.report(x).records] == [("ComposeTransposes", "fired")]
    graph = Graph(function.report(x).rewritten_graph_def)
    transposes = list(graph.find("Transpose"))
    composed = np.asarray(inner)[np.asarray(outer)]
    if np.array_equal(composed, np.arange(3)):  # the pair cancels out
        assert transposes == []
    else:
        (transpose,) = transposes
        assert graph.constant_value(graph.inputs(transpose.name)[1]).tolist() == composed.tolist()
    assert_close(function(x), fn(x), dtype)


def test_gradient_through_the_pair(rng: np.random.Generator) -> None:
    fn = with_gradient(lambda x: tf.transpose(tf.transpose(x, [1, 0, 2]), [0, 2, 1]) ** 2)
    (x,) = inputs(rng, [SHAPE], tf.float64)
    function = rewrite(fn)
    assert {r.status for r in function.report(x).records} == {"fired"}  # forward and backward pairs
    assert_close(function(x), fn(x), tf.float64)


def test_memory_estimate_loses_the_intermediate_copy(rng: np.random.Generator) -> None:
    fn = lambda x: tf.reduce_sum(tf.transpose(tf.transpose(x, [1, 0, 2]), [0, 2, 1]), -1)  # noqa: E731
    (x,) = inputs(rng, [[40, 50, 60]], tf.float64)
    report = rewrite(fn).report(x)
    copy = 40 * 50 * 60 * 8  # x, then two copies of it at once; after, one
    assert report.memory_before.peak_bytes >= 3 * copy
    assert report.memory_after.peak_bytes < 2 * copy + copy // 10


def test_rejects_an_inner_transpose_read_elsewhere(rng: np.random.Generator) -> None:
    def fn(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        inner = tf.transpose(x, [1, 0, 2])
        return tf.transpose(inner, [0, 2, 1]), tf.exp(inner)

    (x,) = inputs(rng, [SHAPE], tf.float64)
    function = rewrite(fn)
    (record,) = function.report(x).records
    assert (record.status, record.reason) == ("rejected", "not self-contained: transpose:0 is also read by Exp")
    assert len(list(Graph(function.report(x).rewritten_graph_def).find("Transpose"))) == 2


def test_runs_in_the_default_pipeline(rng: np.random.Generator) -> None:
    fn = lambda x: tf.transpose(tf.transpose(x, [1, 0, 2]), [0, 2, 1]) + 1.0  # noqa: E731
    (x,) = inputs(rng, [SHAPE], tf.float64)
    function = tfmem.function(fn, config={"strict": True})
    assert "ComposeTransposes" in {r.rule for r in function.report(x).fired}
    assert_close(function(x), fn(x), tf.float64)
