"""Tests for `rewrites.merge_duplicates`: equal nodes on equal inputs are one node."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from rewrites.merge_duplicates import MergeDuplicates
from tfmem.graph import Graph
from tfmem.testing import assert_close


def rewrite(fn: Callable[..., Any]) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[MergeDuplicates()], lint=True,
                               config={"strict": True, "jit_compile": False})


def rewritten_ops(function: tfmem.TfmemFunction, *args: Any) -> dict[str, int]:
    return Graph(function.report(*args).rewritten_graph_def).op_counts()


UNARY = {"exp": tf.exp, "sin": tf.sin, "square": tf.square, "tanh": tf.tanh}


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.sampled_from(sorted(UNARY)), min_size=1, max_size=4), copies=st.integers(2, 3),
       scale=st.sampled_from([1.0, 2.0]), seed=st.integers(0, 2**16))
def test_copies_of_one_chain_are_computed_once(ops: list[str], copies: int, scale: float, seed: int) -> None:
    def chain(x):
        for op in ops:
            x = UNARY[op](x) * scale
        return x

    def fn(x):  # the chain written out `copies` times, each copy with its own constants
        return tf.add_n([tf.reduce_sum(chain(x), axis=0) for _ in range(copies)])

    x = tf.constant(np.random.default_rng(seed).normal(size=(5, 5)))
    function = rewrite(fn)
    (record,) = function.report(x).records
    assert record.status == "fired" and record.details["reads"] == 0
    counts = rewritten_ops(function, x)
    for op in set(ops):
        assert counts[op.capitalize()] == ops.count(op), (op, counts)
    assert counts["Sum"] == 1  # the reductions merged too
    assert_close(function(x), fn(x), tf.float64)


def test_reads_of_a_variable_the_function_only_reads_are_one_read() -> None:
    v = tf.Variable(tf.random.normal([4, 4], dtype=tf.float64, seed=1))

    def fn():
        return tf.reduce_sum(tf.linalg.band_part(v * 2.0, -1, 0)) + tf.reduce_sum(tf.linalg.band_part(v * 2.0, -1, 0))

    function = rewrite(fn)
    (record,) = function.report().records
    assert record.details["reads"] == 1, record
    counts = rewritten_ops(function)
    assert counts["MatrixBandPart"] == 1 and counts["Mul"] == 1
    assert_close(function(), fn(), tf.float64)


def test_reads_around_a_variable_write_stay_apart() -> None:
    v = tf.Variable(tf.ones([3], tf.float64))

    def fn():
        before = tf.reduce_sum(v * 2.0)
        v.assign_add(tf.ones([3], tf.float64))
        return before + tf.reduce_sum(v * 2.0)

    function = tfmem.TfmemFunction(fn, passes=[MergeDuplicates()], config={"jit_compile": False})
    report = function.report()
    (rejected,) = [r for r in report.records if r.status == "rejected"]
    assert rejected.reason == ("variable reads not merged: AssignAddVariableOp (AssignAddVariableOp) is handed a "
                               "variable and may change one between two reads")
    assert rewritten_ops(function)["ReadVariableOp"] >= 2
    v.assign(tf.ones([3], tf.float64))
    assert float(function()) == 6.0 + 12.0  # the second read sees the write


def test_stateful_ops_are_never_merged() -> None:
    fn = lambda: tf.random.uniform([1000], seed=None) - tf.random.uniform([1000], seed=None)  # noqa: E731
    function = rewrite(fn)
    assert rewritten_ops(function)["RandomUniform"] == 2
    assert float(tf.reduce_max(tf.abs(function()))) > 0.0


@pytest.mark.parametrize("kernel", ["matern52"])
def test_gpflow_vgp_fills_its_triangular_parameter_once(kernel: str) -> None:
    from benchmarks.corpus.programs import PROGRAMS

    fn, args = PROGRAMS[f"vgp_{kernel}_grad"].build(50)
    function = tfmem.TfmemFunction(fn, config={"jit_compile": False})
    graph = Graph(function.report(*args).rewritten_graph_def)
    fills = [n.name for n in graph.find("ConcatV2") if "fill_triangular" in n.name]
    assert len(fills) == 1, fills  # q_sqrt's KL and likelihood terms read one fill
    unrewritten = tfmem.TfmemFunction(fn, config={"jit_compile": False, "passes": []})
    assert len([n for n in Graph(unrewritten.report(*args).rewritten_graph_def).find("ConcatV2")
                if "fill_triangular" in n.name]) == 2
    for got, want in zip(tf.nest.flatten(function(*args)), tf.nest.flatten(fn(*args))):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-12)
