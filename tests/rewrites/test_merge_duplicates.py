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
from tfmem.stages import Rewritten
from tfmem.testing import assert_close


def rewrite(fn: Callable[..., Any], *args: Any, strict: bool = True) -> Rewritten:
    """`fn` traced and rewritten by MergeDuplicates alone (`Traced.rewrite`: a pass XLA
    decides on is not held back there)."""
    traced = tfmem.TfmemFunction(fn).trace(*args)
    return traced.rewrite(tfmem.Config(strict=strict, jit_compile=False), passes=[MergeDuplicates()], lint=strict)


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
    rewritten = rewrite(fn, x)
    (record,) = rewritten.records
    # 5×5 tensors: merged, said as "info" (nothing XLA's plan would show)
    assert record.status == "info" and record.details["reads"] == 0 and record.details["merged"] > 0
    counts = rewritten.graph.op_counts()
    for op in set(ops):
        assert counts[op.capitalize()] == ops.count(op), (op, counts)
    assert counts["Sum"] == 1  # the reductions merged too
    assert_close(rewritten.compile()(x), fn(x), tf.float64)


def test_reads_of_a_variable_the_function_only_reads_are_one_read() -> None:
    v = tf.Variable(tf.random.normal([4, 4], dtype=tf.float64, seed=1))

    def fn():
        return tf.reduce_sum(tf.linalg.band_part(v * 2.0, -1, 0)) + tf.reduce_sum(tf.linalg.band_part(v * 2.0, -1, 0))

    rewritten = rewrite(fn)
    (record,) = rewritten.records
    assert record.details["reads"] == 1, record
    counts = rewritten.graph.op_counts()
    assert counts["MatrixBandPart"] == 1 and counts["Mul"] == 1
    assert_close(rewritten.compile()(), fn(), tf.float64)


def test_a_merged_tensor_of_a_mebibyte_or_more_is_a_firing() -> None:
    x = tf.constant(np.ones((512, 512)))  # 2 MiB
    rewritten = rewrite(lambda x: tf.reduce_sum(tf.exp(x) @ tf.exp(x)), x)
    (record,) = rewritten.records
    assert record.status == "fired" and rewritten.graph.op_counts()["Exp"] == 1


def test_reads_around_a_variable_write_stay_apart() -> None:
    v = tf.Variable(tf.ones([3], tf.float64))

    def fn():
        before = tf.reduce_sum(v * 2.0)
        v.assign_add(tf.ones([3], tf.float64))
        return before + tf.reduce_sum(v * 2.0)

    rewritten = rewrite(fn, strict=False)
    (rejected,) = [r for r in rewritten.records if r.status == "rejected"]
    assert rejected.reason == ("variable reads not merged: AssignAddVariableOp (AssignAddVariableOp) is handed a "
                               "variable and may change one between two reads")
    assert rewritten.graph.op_counts()["ReadVariableOp"] >= 2
    v.assign(tf.ones([3], tf.float64))
    assert float(rewritten.compile()()) == 6.0 + 12.0  # the second read sees the write


def test_stateful_ops_are_never_merged() -> None:
    fn = lambda: tf.random.uniform([1000], seed=None) - tf.random.uniform([1000], seed=None)  # noqa: E731
    rewritten = rewrite(fn)
    assert rewritten.graph.op_counts()["RandomUniform"] == 2
    assert float(tf.reduce_max(tf.abs(rewritten.compile()()))) > 0.0


@pytest.mark.parametrize("kernel", ["matern52"])
def test_gpflow_vgp_fills_its_triangular_parameter_once(kernel: str) -> None:
    from benchmarks.corpus.programs import PROGRAMS

    fn, args = PROGRAMS[f"vgp_{kernel}_grad"].build(50)
    traced = tfmem.TfmemFunction(fn).trace(*args)

    def fills(rewritten: Rewritten) -> list[str]:
        return [n.name for n in rewritten.graph.find("ConcatV2") if "fill_triangular" in n.name]

    merged = traced.rewrite(tfmem.Config(jit_compile=False))  # every pass
    assert len(fills(merged)) == 1, fills(merged)  # q_sqrt's KL and likelihood terms read one fill
    assert len(fills(traced.rewrite(tfmem.Config(jit_compile=False), xla_checked=False))) == 2
    for got, want in zip(tf.nest.flatten(merged.compile()(*args)), tf.nest.flatten(fn(*args))):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-12)


def test_held_back_until_a_plan_without_it_does_not_fit() -> None:
    v = tf.Variable(tf.ones([3], tf.float64))
    fn = lambda: tf.reduce_sum(tf.exp(v)) + tf.reduce_sum(tf.exp(v))  # noqa: E731
    function = tfmem.TfmemFunction(fn, config={"memory_budget": "1GiB"})
    assert not [r for r in function.report().records if r.pass_name == "merge_duplicates"]
    assert float(function()) == pytest.approx(6 * np.e)
