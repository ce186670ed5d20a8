"""What XLA reduced at its peak is reduced before what it ran beside (`rewrites.split.earlier`).

A loss term no gradient waits for (GPflow VGP's `fvar = Σ (L·q_sqrt)²` under a Gaussian
likelihood) may run anywhere in XLA's schedule; XLA ran it after the gradient's own
`[N, N]` matrices and peaked there. tfmem then makes the first of those wait for the
term's small result. Checked here: which tensor waits, that the graph keeps no cycle and
computes the same bits, the reasons it refuses, and on GPflow's VGP (code nobody here
wrote) that XLA's plan falls and the numbers equal stock XLA's.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfmem
from benchmarks.cases import vgp_loss_and_gradients
from rewrites.split.earlier import reduce_before_xla_peak, small_results
from tfmem.capture import capture
from tfmem.testing import run_graph, xla_peak_holding

EARLIER = "ReduceBeforeXlaPeak"
N = 200


def loss_term_beside_gradient(a, q, g):
    """`Σ (a q)²`, a value only the loss needs, beside `(a q) ⊙ g`, a gradient's matrix."""
    p = tf.matmul(a, q)
    value = tf.reduce_sum(tf.square(p))
    return value, tf.reduce_sum(tf.matmul(p * g, q), 0)


def _captured(fn=loss_term_beside_gradient):
    spec = tf.TensorSpec([N, N], tf.float64)
    concrete = tf.function(fn).get_concrete_function(spec, spec, spec)
    return capture(concrete).to_graph(), concrete


def _inputs(rng):
    return [tf.constant(rng.normal(size=(N, N))) for _ in range(3)]


def test_the_small_result_is_made_before_the_matrix_xla_ran_it_beside(rng):
    graph, concrete = _captured()
    # XLA's order: the product, the gradient's matrix, then the square at the peak.
    peak = xla_peak_holding("Square", ["MatMul", "mul", "Square"], ["MatMul", "mul", "Square", "Sum", "MatMul_1"], n=N)
    [record] = reduce_before_xla_peak(graph, peak, "test")
    assert record.status == "fired", record
    assert (record.details["before"], record.details["results"]) == ("mul", "Sum:0")
    graph.topological_order()  # no cycle
    assert "Sum" in graph.ancestors("mul") and "Square" in graph.ancestors("mul")
    values = _inputs(rng)
    want = concrete(*values)
    for got, expected in zip(run_graph(graph, concrete, values), want):
        np.testing.assert_array_equal(got, expected.numpy())  # an exact zero: the same bits


def test_what_the_reduction_needs_is_never_made_to_wait_for_it():
    graph, _ = _captured()
    # The only other matrix XLA holds there is the product the square reads.
    peak = xla_peak_holding("Square", ["MatMul", "Square"], ["MatMul", "Square", "Sum", "mul", "MatMul_1"], n=N)
    [record] = reduce_before_xla_peak(graph, peak, "test")
    assert record.status == "rejected" and "made after the op's inputs were ready" in record.reason, record


def test_a_big_result_is_not_moved():
    # The peak's op feeds a product (not a cheap map or reduction): nothing small to make first.
    graph, _ = _captured()
    peak = xla_peak_holding("mul", ["MatMul", "mul"], ["MatMul", "mul", "MatMul_1"], n=N)
    [record] = reduce_before_xla_peak(graph, peak, "test")
    assert record.status == "rejected" and "is read by MatMul_1 (MatMul)" in record.reason, record


def test_small_results_follow_cheap_maps_to_reductions():
    def fn(a, q, g):
        p = tf.matmul(a, q)
        return tf.reduce_sum(tf.exp(p) * 2.0, -1), tf.reduce_max(p)

    graph, _ = _captured(fn)
    found = small_results(graph, "MatMul", small=N * 8)
    assert not isinstance(found, str), found
    results, _ = found
    assert sorted(ref.name for ref in results) == ["Max:0", "Sum:0"]
    assert "output of the program" in small_results(graph, "MatMul", small=N * 8 - 1)  # Sum's [N] is big now


def test_gpflow_vgp_variance_term_is_reduced_first_and_xla_plans_less():
    """GPflow's VGP, Gaussian likelihood: XLA squares `L·q_sqrt` for the loss's variance
    term after the gradient's `[N, N]` matrices (TF 2.21 on the CPU, N=1,500: 6.13 whole
    `[N, N]` planned, 5.83 with the term reduced first)."""
    n = 1500
    step = vgp_loss_and_gradients(n, 2)
    whole = n * n * 8
    wrapped = tfmem.function(step, config=tfmem.Config(memory_budget=f"{int(5.5 * whole)}B"))
    report = wrapped.explain()
    fired = [r for r in report.records if r.rule == EARLIER and r.status == "fired"]
    assert fired and fired[0].details["tensor"].startswith("Square"), report.summary()
    kept = [r for r in report.records if r.pass_name == "compile_within_budget" and r.status == "info"
            and r.reason.startswith("kept:") and "reduced before" in r.reason]
    assert kept, [str(r) for r in report.records if r.pass_name == "compile_within_budget"]
    # The last round kept is what runs (a later round may fold VGP's q_sqrt gradient first too).
    assert report.xla_bytes_after == kept[-1].details["xla_with_bytes"]
    assert kept[0].details["xla_with_bytes"] < kept[0].details["xla_without_bytes"]
    assert report.xla_bytes_after <= kept[0].details["xla_without_bytes"] - 0.25 * whole, kept[0].reason
    assert "reduced before XLA makes" in report.summary()
    want = tf.function(step, jit_compile=True)()
    got = wrapped()
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9 * float(tf.reduce_max(tf.abs(w))))
