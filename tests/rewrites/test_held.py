"""What XLA held across its peak only to fold it later is folded before (`rewrites.split.held`).

GPflow's VGP folds the gradient of its `[N, N]` `q_sqrt` into the triangular parameter
vector with cheap ops that XLA fused into the parameter's final gradient sum, run after
the Cholesky gradient: the `[N, N]` stayed alive across that gradient's peak. tfmem puts
the fold in a loop of one trip that the op at the peak waits for. Checked here: what the
fold is (`find_fold`), which op waits, that the graph keeps no cycle and computes the same
numbers (for float32 and float64, over fold shapes), the reasons it refuses, and on
GPflow's VGP (code nobody here wrote) that XLA's plan falls and the numbers equal stock.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from benchmarks.cases import vgp_loss_and_gradients
from rewrites.split.held import find_fold, reduce_held_before_xla_peak
from tfmem.capture import capture, import_as_function
from tfmem.graph import TensorRef
from tfmem.testing import run_graph, whole_masks_into_loops, xla_peak_holding

HELD = "ReduceHeldBeforeXlaPeak"
N = 64


def fold_beside_peak(a, q, w):
    """`d = a q` folded late (its lower triangle, half of it summed with another term, and
    its largest element), beside `w a`, where XLA peaks."""
    n = a.shape[0]
    half = n * n // 2
    d = tf.matmul(a, q)
    p = tf.matmul(w, a)
    flat = tf.reshape(tf.linalg.band_part(d, -1, 0), [-1])
    return flat[:half] + tf.reshape(w, [-1])[:half], tf.reduce_max(d) * tf.reduce_sum(p)


def fold_into_addn(a, q, w):
    """Two slices of `d = a q` summed with a third term from elsewhere (an `AddN`)."""
    n = a.shape[0]
    half = n * n // 2
    d = tf.matmul(a, q)
    p = tf.matmul(w, a)
    flat = tf.reshape(d, [-1])
    return tf.add_n([flat[:half], tf.reverse(flat[half:2 * half], [0]), tf.reshape(p, [-1])[:half]]),


def fold_to_sums(a, q, w):
    """`d = a q` reduced to row sums and a scalar, read after `w a`."""
    d = tf.matmul(a, q)
    p = tf.matmul(w, a)
    return tf.reduce_sum(tf.exp(d * 1e-3), -1) + tf.reduce_sum(p, -1), tf.reduce_min(d)


def _diagonal_set_back(d, w):
    shifted = tf.linalg.set_diag(d, tf.linalg.diag_part(d) + w[0])
    return tf.reduce_sum(shifted, -1), tf.matmul(w, w)


def _captured(fn, n=N, dtype=tf.float64):
    spec = tf.TensorSpec([n, n], dtype)
    concrete = tf.function(fn).get_concrete_function(spec, spec, spec)
    return capture(concrete).to_graph(), concrete


def _inputs(rng, n=N, dtype=np.float64):
    return [tf.constant(rng.normal(size=(n, n)).astype(dtype)) for _ in range(3)]


def test_a_fold_runs_to_small_results_and_to_the_sum_it_is_part_of():
    graph, _ = _captured(fold_beside_peak)
    fold = find_fold(graph, TensorRef("MatMul"), small=N * 8)
    assert not isinstance(fold, str), fold
    assert [ref.name for ref in fold.small] == ["Max:0"]
    [(summed, slots)] = fold.sums.items()
    assert graph.node(summed).op == "AddV2" and slots == (0,)
    assert {graph.node(name).op for name in fold.nodes} == {"MatrixBandPart", "Reshape", "StridedSlice", "Max"}
    assert fold.nbytes(graph) == N * N // 2 * 8 + 8  # half the matrix, and a scalar


def test_the_held_tensor_is_folded_before_the_op_at_xlas_peak(rng):
    graph, concrete = _captured(fold_beside_peak)
    peak = xla_peak_holding("MatMul_1", ["MatMul", "MatMul_1"], ["MatMul", "MatMul_1", "add", "mul"], n=N)
    [record] = reduce_held_before_xla_peak(graph, peak, "test")
    assert record.status == "fired", record
    assert (record.details["tensor"], record.details["before"]) == ("MatMul", "MatMul_1")
    graph.topological_order()  # no cycle
    loop = [node.name for node in graph.nodes if node.op in ("While", "StatelessWhile")]
    assert loop and set(loop) <= graph.ancestors("MatMul_1")  # the peak's op waits for the fold
    # The loop is the held tensor's last reader (its trip count reads one element before it): it dies there.
    graph.prune()
    readers = {reader for reader, _ in graph.consumers(TensorRef("MatMul"))}
    assert set(loop) <= readers and readers - set(loop) <= graph.ancestors(*loop)
    values = _inputs(rng)
    for got, expected in zip(run_graph(graph, concrete, values), concrete(*values)):
        np.testing.assert_array_equal(got, expected.numpy())  # the same ops, an exact zero: the same bits


def test_xla_makes_a_folded_band_mask_in_the_loop_and_carries_no_whole_mask_into_it(rng):
    """A band part in the fold lowers to a select whose row iota the loop offsets: XLA then
    fuses the mask into the select in the loop. With constant limits it hoisted the mask
    out of the loop, made it before, and carried a bool [n, n] into the loop (GPflow VGP,
    N=2,000: 3.8 MiB held across XLA's peak)."""
    spec = tf.TensorSpec([N, N], tf.float64)
    concrete = tf.function(fold_beside_peak).get_concrete_function(spec, spec, spec)
    captured = capture(concrete)
    graph = captured.to_graph()
    peak = xla_peak_holding("MatMul_1", ["MatMul", "MatMul_1"], ["MatMul", "MatMul_1", "add", "mul"], n=N)
    [record] = reduce_held_before_xla_peak(graph, peak, "test")
    assert record.status == "fired", record
    assert not any(node.op == "MatrixBandPart" for node in graph.nodes)
    values = _inputs(rng)
    function = import_as_function(captured, graph, jit_compile=True)
    assert not whole_masks_into_loops(function, values, N)
    stock = tf.function(fold_beside_peak, jit_compile=True)
    for got, expected in zip(function(*values), stock(*values)):
        scale = np.max(np.abs(expected.numpy()))
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=1e-13 * scale)


@settings(max_examples=12, deadline=None)
@given(program=st.sampled_from([fold_beside_peak, fold_into_addn, fold_to_sums]),
       dtype=st.sampled_from([tf.float32, tf.float64]), n=st.sampled_from([8, 33, 64]),
       seed=st.integers(0, 2**16))
def test_folding_first_computes_what_the_program_computes(program, dtype, n, seed):
    graph, concrete = _captured(program, n, dtype)
    peak = xla_peak_holding("MatMul_1", ["MatMul", "MatMul_1"], ["MatMul", "MatMul_1"], n=n, dtype=dtype)
    [record] = reduce_held_before_xla_peak(graph, peak, "test")
    assert record.status == "fired", record
    rng = np.random.default_rng(seed)
    values = _inputs(rng, n, dtype.as_numpy_dtype)
    for got, expected in zip(run_graph(graph, concrete, values), concrete(*values)):
        # An AddN summed in another order: within a few roundings of the largest term.
        scale = np.max(np.abs(expected.numpy())) + 1.0
        np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=8 * np.finfo(dtype.as_numpy_dtype).eps * scale)


@pytest.mark.parametrize("program, at, why", [
    # The fold's big tensor is an output of the program: nothing smaller to fold it to.
    (lambda a, q, w: (tf.reshape(tf.matmul(a, q), [-1]), tf.matmul(w, a)), "MatMul_1",
     "is an output of the program"),
    # A product reads it: not a cheap fold.
    (lambda a, q, w: (tf.reduce_sum(tf.matmul(tf.matmul(a, q), w)), tf.matmul(w, a)), "MatMul_2",
     "is read by MatMul_1 (MatMul)"),
    # Its diagonal is read off, summed with a term from elsewhere and set back on it (`K + c·I`
    # as `AddDiagonal` writes it): a loop before that sum cannot read what the sum makes.
    (lambda a, q, w: _diagonal_set_back(tf.matmul(a, q), w), "MatMul_1", "fold reads what its own results make"),
])
def test_what_is_not_a_cheap_fold_is_left(program, at, why):
    graph, _ = _captured(program)
    peak = xla_peak_holding(at, ["MatMul", at], ["MatMul", at], n=N)
    [record] = reduce_held_before_xla_peak(graph, peak, "test")
    assert record.status == "rejected" and why in record.reason, record


def test_a_tensor_xla_makes_after_its_peak_is_not_what_it_holds_there():
    graph, _ = _captured(fold_beside_peak)
    # XLA ran the product after the op at its peak: the fold cannot be what it held there.
    peak = xla_peak_holding("MatMul_1", ["MatMul", "MatMul_1"], ["MatMul_1", "MatMul"], n=N)
    [record] = reduce_held_before_xla_peak(graph, peak, "test")
    assert record.status == "rejected", record


def test_the_op_at_the_peak_is_never_made_to_wait_for_what_reads_it():
    # The peak's own op is `d = a q`'s reader: folding `d` first would need the peak first.
    def program(a, q, w):
        d = tf.matmul(a, q)
        p = tf.matmul(w, a) + tf.reduce_max(d)
        return tf.reshape(tf.linalg.band_part(d, -1, 0), [-1])[:N] + tf.reshape(p, [-1])[:N],

    graph, _ = _captured(program)
    peak = xla_peak_holding("add", ["MatMul", "MatMul_1"], ["MatMul", "MatMul_1", "add"], n=N)
    [record] = reduce_held_before_xla_peak(graph, peak, "test")
    assert record.status == "rejected", record
    graph.topological_order()


def test_gpflow_vgp_folds_its_triangular_gradient_first_and_xla_plans_less():
    """GPflow's VGP, Linear kernel, N=1,200 (TF 2.21 on the CPU): XLA held `dq`
    (`Lᵀ·dLTA`, `[N, N]`) across the Cholesky gradient's first product to fold it into
    `q_sqrt`'s gradient; folded first, it plans 56.4 MiB instead of 63.6."""
    n = 1200
    step = vgp_loss_and_gradients(n, 3)
    wrapped = tfmem.function(step, config=tfmem.Config(memory_budget=f"{int(5.5 * n * n * 8)}B"))
    report = wrapped.explain()
    fired = [r for r in report.records if r.rule == HELD and r.status == "fired"]
    assert fired, report.summary()
    assert fired[0].details["tensor"] == "gradient_tape/MatMul_2/MatMul_1", fired[0]
    kept = [r for r in report.records if r.pass_name == "compile_within_budget" and r.status == "info"
            and r.reason.startswith("kept:") and "folded before" in r.reason]
    assert kept, [str(r) for r in report.records if r.pass_name == "compile_within_budget"]
    assert kept[0].details["xla_with_bytes"] < kept[0].details["xla_without_bytes"]
    assert report.xla_bytes_after == kept[0].details["xla_with_bytes"]
    got = tf.nest.flatten(wrapped())
    want = tf.nest.flatten(tf.function(step, jit_compile=True)())
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=0, atol=1e-9 * np.max(np.abs(w.numpy())))
