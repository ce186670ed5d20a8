"""A factorization's input is made whole in a loop before XLA's peak there
(`rewrites.split.whole_input`).

XLA's blocked Cholesky computes each block of a fused input from the input's operands:
a Matérn-5/2 kernel matrix is never written out, and XLA holds `XXᵀ`, `r` and `e^{-√5·r}`
through the whole factorization. Made in a loop of one trip, K is written once and its
operands die. Checked by XLA's own plan (a bound), and values against stock.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from rewrites.split.whole_input import whole_input_before_xla_peak
from tfmem.capture import capture, import_as_function
from tfmem.memory import MemoryEstimate
from tfmem.testing import pairwise_distances, run_graph, whole_masks_into_loops, xla_peak_holding

WHOLE = "WholeInputBeforeXlaPeak"
N = 1000
SQRT5 = np.sqrt(5.0)


def matern52_logdet(x: tf.Tensor) -> tf.Tensor:
    r = pairwise_distances(x)
    k = (1.0 + SQRT5 * r + 5.0 / 3.0 * tf.square(r)) * tf.exp(-SQRT5 * r)
    chol = tf.linalg.cholesky(k + 1e-3 * tf.eye(x.shape[0], dtype=x.dtype))
    return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol)))


def se_logdet(x: tf.Tensor) -> tf.Tensor:
    sq = tf.reduce_sum(x * x, 1)
    k = tf.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)))
    chol = tf.linalg.cholesky(k + 1e-3 * tf.eye(x.shape[0], dtype=x.dtype))
    return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol)))


def _graph(fn, n=N):
    return _captured(fn, n)[0]


def _captured(fn, n=N):
    concrete = tf.function(fn).get_concrete_function(tf.TensorSpec([n, 3], tf.float64))
    return capture(concrete).to_graph(), concrete


def _xla_peak(graph, at_op: str, held_ops: list[str], n=N) -> MemoryEstimate:
    """XLA's live set at its peak at the graph's `at_op`, holding the `[n, n]` outputs of
    its `held_ops` (the first node of each op), which run before it."""
    at = next(node.name for node in graph.find(at_op))
    held = [next(node.name for node in graph.find(op)) for op in held_ops]
    return xla_peak_holding(at, held, [*held, at], n=n)


def test_a_matern_kernel_matrix_is_made_whole_before_the_cholesky_and_xla_plans_two_matrices_less():
    x = tf.constant(np.random.default_rng(0).uniform(0, 1, (N, 3)))
    stock = tf.function(matern52_logdet, jit_compile=True)
    stock_bytes = tfmem.xla_planned_bytes(stock, x)
    whole = N * N * 8
    # Stock XLA holds XXᵀ, r, e^{-√5·r} and the factor at its peak (133.8 MiB at n=2000).
    assert stock_bytes >= 4 * whole, stock_bytes
    wrapped = tfmem.function(matern52_logdet, config=tfmem.Config(memory_budget=f"{int(3.6 * whole)}B"))
    report = wrapped.report(x)
    [fired] = [r for r in report.records if r.rule == WHOLE and r.status == "fired"]
    assert fired.details["before"] == "Cholesky", fired
    assert "made whole in a loop before Cholesky" in report.summary()
    # K and its factor, and the factorization's blocks (72.7 MiB at n=2000, 20.2 MB at 1000).
    assert report.xla_bytes_after <= min(2.75 * whole, stock_bytes - 1.5 * whole), (report.xla_bytes_after,
                                                                                     stock_bytes)
    assert report.fits, report.summary()
    np.testing.assert_allclose(float(wrapped(x)), float(stock(x)), rtol=1e-12)


def test_a_kernel_matrix_xla_makes_from_one_held_tensor_is_left_as_it_is():
    graph = _graph(se_logdet)
    before = graph.to_graph_def().SerializeToString(deterministic=True)
    [record] = whole_input_before_xla_peak(graph, _xla_peak(graph, "Cholesky", ["MatMul"]), "test")
    assert record.status == "rejected" and "XLA holds 1 tensor of" in record.reason, record
    assert graph.to_graph_def().SerializeToString(deterministic=True) == before


def test_a_peak_at_an_op_that_is_no_factorization_changes_nothing():
    graph = _graph(matern52_logdet)
    [record] = whole_input_before_xla_peak(graph, _xla_peak(graph, "Exp", ["MatMul", "Sqrt"]), "test")
    assert record.status == "rejected" and "not a factorization" in record.reason, record


def test_the_input_is_made_in_a_loop_its_held_operands_feed_no_more():
    graph, concrete = _captured(matern52_logdet)
    peak = _xla_peak(graph, "Cholesky", ["MatMul", "Sqrt", "Exp"])
    [record] = whole_input_before_xla_peak(graph, peak, "test")
    assert record.status == "fired", record
    [chol] = graph.find("Cholesky")
    assert graph.inputs(chol.name)[0].node.startswith("tfmem_whole/"), graph.inputs(chol.name)
    assert len(list(graph.find(("While", "StatelessWhile")))) == 1
    # The kernel's big ops outside the loop are gone: nothing else read them.
    assert not [n.name for n in graph.find(("Sqrt", "Exp", "MatMul"))], graph.op_counts()
    graph.topological_order()  # no cycle
    x = tf.constant(np.random.default_rng(1).uniform(0, 1, (N, 3)))
    [got] = run_graph(graph, concrete, [x])
    assert got == float(concrete(x))  # the same ops on the same values, in a loop


def tapered_logdet(x: tf.Tensor) -> tf.Tensor:
    """A Matérn-1/2 kernel tapered to a band of 50 diagonals each side (a band part in the
    cone), made positive definite by a large diagonal."""
    r = pairwise_distances(x)
    k = tf.linalg.band_part(tf.exp(-r), 50, 50) + 200.0 * tf.eye(x.shape[0], dtype=x.dtype)
    return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(tf.linalg.cholesky(k))))


def test_a_band_part_in_the_cone_is_masked_in_the_loop_and_no_whole_mask_enters_it():
    # XLA builds a band part's mask from iotas; made of constants, it would hoist the mask
    # out of the loop and hold it whole until the loop runs. Offset by the trip count, it
    # is made in the loop.
    n = 300
    concrete = tf.function(tapered_logdet).get_concrete_function(tf.TensorSpec([n, 3], tf.float64))
    captured = capture(concrete)
    graph = captured.to_graph()
    [record] = whole_input_before_xla_peak(graph, _xla_peak(graph, "Cholesky", ["MatMul", "Sqrt", "Exp"], n=n),
                                           "test")
    assert record.status == "fired", record
    assert not list(graph.find("MatrixBandPart")), graph.op_counts()
    x = tf.constant(np.random.default_rng(4).uniform(0, 1, (n, 3)))
    function = import_as_function(captured, graph, jit_compile=True)
    assert not whole_masks_into_loops(function, [x], n)
    np.testing.assert_allclose(float(function(x)), float(tf.function(tapered_logdet, jit_compile=True)(x)), rtol=1e-12)


@pytest.mark.parametrize("n", [500, 701])
def test_programs_with_the_input_made_whole_equal_stock(n):
    x = tf.constant(np.random.default_rng(n).uniform(0, 1, (n, 3)))
    config = tfmem.Config(memory_budget=f"{int(3.6 * n * n * 8)}B")
    wrapped = tfmem.function(matern52_logdet, config=config)
    report = wrapped.report(x)
    assert [r for r in report.records if r.rule == WHOLE and r.status == "fired"], report.summary()
    np.testing.assert_allclose(float(wrapped(x)), float(tf.function(matern52_logdet, jit_compile=True)(x)),
                               rtol=1e-12)


def test_an_input_sized_by_a_variable_is_made_in_a_loop_reading_that_term_whole():
    # GPflow VGP's `eye(num_data)`, num_data a variable: XLA knows its size when it compiles
    # the program, not inside a loop's body. The term sized by the variable is made outside
    # the loop and read whole; the kernel's operands still die in the loop.
    num_data = tf.Variable(N)

    def jittered_logdet(x):
        r = pairwise_distances(x)
        k = (1.0 + SQRT5 * r) * tf.exp(-SQRT5 * r) + 1e-3 * tf.eye(tf.convert_to_tensor(num_data), dtype=x.dtype)
        return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(tf.linalg.cholesky(k))))

    graph = _graph(jittered_logdet)
    [record] = whole_input_before_xla_peak(graph, _xla_peak(graph, "Cholesky", ["MatMul", "Sqrt", "Exp"]), "test")
    assert record.status == "fired", record
    [loop] = list(graph.find(("While", "StatelessWhile")))
    assert any(not graph.spec(ref).shape.is_fully_defined() for ref in graph.inputs(loop.name)), graph.inputs(loop.name)
    assert not [n.name for n in graph.find(("Sqrt", "Exp", "MatMul"))], graph.op_counts()
    # The values, and XLA, which must compile the loop's body with the term's size.
    x = tf.constant(np.random.default_rng(3).uniform(0, 1, (N, 3)))
    wrapped = tfmem.function(jittered_logdet, config=tfmem.Config(memory_budget=f"{int(3.6 * N * N * 8)}B"))
    report = wrapped.report(x)
    assert [r for r in report.records if r.rule == WHOLE and r.status == "fired"], report.summary()
    np.testing.assert_allclose(float(wrapped(x)), float(tf.function(jittered_logdet, jit_compile=True)(x)),
                               rtol=1e-12)


def matern32_logdet_plus_trace(x: tf.Tensor) -> tf.Tensor:
    """A Matérn-3/2 kernel with its own jitter, and a second reader of the factor."""
    r = pairwise_distances(x / 0.7)
    k = (1.0 + np.sqrt(3.0) * r) * tf.exp(-np.sqrt(3.0) * r)
    chol = tf.linalg.cholesky(k + 0.05 * tf.eye(x.shape[0], dtype=x.dtype))
    return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol))) + tf.reduce_sum(chol ** 2)


@settings(max_examples=3, deadline=None, derandomize=True)  # each compiles ~3 programs
@given(n=st.integers(400, 900), program=st.sampled_from([matern52_logdet, matern32_logdet_plus_trace]),
       share=st.sampled_from([3.2, 3.6]))
def test_property_programs_with_a_factorizations_input_made_whole_equal_stock(n, program, share):
    x = tf.constant(np.random.default_rng(n).uniform(0, 1, (n, 3)))
    wrapped = tfmem.function(program, config=tfmem.Config(memory_budget=f"{int(share * n * n * 8)}B"))
    report = wrapped.report(x)
    assert [r for r in report.records if r.rule == WHOLE and r.status == "fired"], report.summary()
    np.testing.assert_allclose(float(wrapped(x)), float(tf.function(program, jit_compile=True)(x)), rtol=1e-12)
