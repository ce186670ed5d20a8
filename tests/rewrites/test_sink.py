"""Loop invariants recomputed in chunks inside the loop that reads them (`rewrites.split.sink`).

Each program forms a kernel matrix K [n, n] outside a loop whose body reads it (conjugate
gradients, power iteration). Under a budget that cannot hold K, tfmem must recompute K
chunk by chunk in the body, and give stock's answer; where that cannot be done (the
condition reads K, the body needs K whole) the program runs as
it was, with the reason recorded. Memory is checked by bounds: the static estimate and
XLA's plan of the rewritten program stay under one whole K.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from rewrites.split.diagonals import lower_diagonals
from tfmem.graph import Graph
from tfmem.testing import run_graph

SINK = "RecomputeLoopInvariant"
COLLECT = "CollectOuterProducts"


def _kernel(x: tf.Tensor) -> tf.Tensor:
    sq = tf.reduce_sum(x * x, 1)
    return tf.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)))


def conjugate_gradients(steps: int, jitter: float):
    def solve(x, y):
        n = x.shape[0]
        a = _kernel(x) + jitter * tf.eye(n, dtype=x.dtype)

        def body(i, sol, r, p, rr):
            ap = a @ p
            alpha = rr / tf.reduce_sum(p * ap)
            sol, r = sol + alpha * p, r - alpha * ap
            rr_new = tf.reduce_sum(r * r)
            return i + 1, sol, r, r + (rr_new / rr) * p, rr_new

        # maximum_iterations: XLA differentiates a while loop only with a bound on its trips.
        _, sol, *_ = tf.while_loop(lambda i, *_: i < steps, body, (tf.constant(0), tf.zeros_like(y), y, y,
                                                                    tf.reduce_sum(y * y)), maximum_iterations=steps)
        return sol
    return solve


def power_iteration(x):
    k = _kernel(x)
    v = tf.ones([x.shape[0], 1], x.dtype)
    for _ in tf.range(6):  # AutoGraph: a while loop that reads k
        v = k @ v
        v = v / tf.norm(v)
    return tf.reduce_sum(v * (k @ v)), v  # k is read after the loop too


def _records(report: tfmem.Report, rule: str, status: str = "fired") -> list:
    return [r for r in report.records if r.rule == rule and r.status == status]


def _points(rng: np.random.Generator, n: int, d: int = 3, dtype=np.float64) -> tf.Tensor:
    return tf.constant(rng.normal(size=(n, d)) * 0.7, dtype)


def _budget(n: int, dtype=tf.float64) -> str:
    return f"{n * n * dtype.size // 3}B"  # a third of one whole K


def test_conjugate_gradients_recompute_k_in_chunks_and_equal_stock(rng):
    n = 400
    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    fn = conjugate_gradients(steps=8, jitter=2.0)
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=_budget(n)))
    report = wrapped.explain(x, y)
    [sunk] = _records(report, SINK)
    assert sunk.details["bytes"] == n * n * 8 and sunk.details["shape"] == f"float64[{n}, {n}]"
    assert "x:0" in sunk.reason  # recomputed from the points, not from K
    assert any(r.details.get("in_loop") == sunk.details["recomputed_in"] for r in _records(report, "SplitOversizedRegions"))
    assert report.memory_after.peak_bytes < n * n * 8  # never one whole K: not in tfmem's estimate,
    assert report.xla_bytes_after < n * n * 8  # nor in XLA's plan
    assert report.xla_bytes_before > n * n * 8  # (stock holds K)
    want = tf.function(fn, jit_compile=True)(x, y)
    np.testing.assert_allclose(wrapped(x, y), want, rtol=1e-9, atol=1e-12 * float(tf.reduce_max(tf.abs(want))))


def jacobi_preconditioned_cg(steps: int, jitter: float, *, residual: bool = False):
    """CG on (K + cI) α = y preconditioned by 1 / diag(K + cI), computed before the loop;
    with `residual`, also ‖y − (K + cI) α‖, which reads K again after the loop."""
    def solve(x, y):
        a = _kernel(x) + jitter * tf.eye(x.shape[0], dtype=x.dtype)
        m_inv = 1.0 / tf.linalg.diag_part(a)[:, None]

        def body(i, sol, r, p, rz):
            ap = a @ p
            alpha = rz / tf.reduce_sum(p * ap)
            sol, r = sol + alpha * p, r - alpha * ap
            rz_new = tf.reduce_sum(r * m_inv * r)
            return i + 1, sol, r, m_inv * r + (rz_new / rz) * p, rz_new

        _, sol, *_ = tf.while_loop(lambda i, *_: i < steps, body, (tf.constant(0), tf.zeros_like(y), y, m_inv * y,
                                                                    tf.reduce_sum(y * m_inv * y)),
                                   maximum_iterations=steps)
        return (sol, tf.norm(y - a @ sol)) if residual else sol
    return solve


@pytest.mark.parametrize("jitter", [0.5, 2.0])
def test_a_jacobi_preconditioner_reads_the_diagonal_of_k_from_the_points_and_k_is_recomputed(rng, jitter):
    """diag(K + cI) read outside the loop is taken of K's operands (DiagOfElementwise): nothing
    outside the loop reads K whole, so K is recomputed in chunks inside it (fuzz 9: K held)."""
    n = 400
    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    fn = jacobi_preconditioned_cg(steps=8, jitter=jitter)
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=_budget(n)))
    report = wrapped.explain(x, y)
    assert len(_records(report, SINK)) == 1, report.summary()
    assert [r for r in report.records if r.rule == "DiagOfElementwise" and r.status == "fired"]
    assert report.memory_after.peak_bytes < n * n * 8 and report.xla_bytes_after < n * n * 8
    want = tf.function(fn, jit_compile=True)(x, y)
    np.testing.assert_allclose(wrapped(x, y), want, rtol=1e-9, atol=1e-12 * float(tf.reduce_max(tf.abs(want))))


def test_a_preconditioned_solve_read_again_after_its_loop_recomputes_k_in_both_places(rng):
    """Fuzz 12's cg_while: the jitter's diagonal mask is a large tensor made from constants
    alone. Made early, it was held across the loop, the program's peak rose when K was sunk
    (206.2 → 214.8 MiB at n = 3000) and K stayed whole; made just before its reader, K is
    recomputed in the loop and in chunks for the residual after it."""
    n = 1100  # the mask: 1.2 MiB, over `LARGE_TENSOR_BYTES`
    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    fn = jacobi_preconditioned_cg(steps=8, jitter=0.5, residual=True)
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=_budget(n)))
    report = wrapped.explain(x, y)
    assert len(_records(report, SINK)) == 1, str(report)
    assert report.fits, report.summary()
    assert report.memory_after.peak_bytes < n * n * 8 and report.xla_bytes_after < n * n * 8
    assert report.xla_bytes_before > n * n * 8  # (stock holds K)
    want = tf.function(fn, jit_compile=True)(x, y)
    for got, expected in zip(wrapped(x, y), want):
        np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12 * float(tf.reduce_max(tf.abs(expected))))


def test_power_iteration_sinks_k_and_splits_its_read_after_the_loop(rng):
    n = 400
    x = _points(rng, n)
    wrapped = tfmem.function(power_iteration, config=tfmem.Config(memory_budget=_budget(n)))
    report = wrapped.explain(x)
    assert len(_records(report, SINK)) == 1
    assert report.xla_bytes_after < n * n * 8
    want = tf.function(power_iteration, jit_compile=True)(x)
    for got, expected in zip(wrapped(x), want):
        np.testing.assert_allclose(got, expected, rtol=1e-9)


def _while_nodes(graph_def) -> list:
    """Every While node of a GraphDef, in its functions (loop bodies) too."""
    nodes = list(graph_def.node) + [node for f in graph_def.library.function for node in f.node_def]
    return [node for node in nodes if node.op in ("While", "StatelessWhile")]


def test_every_loop_tfmem_builds_or_rebuilds_runs_one_trip_at_a_time(rng):
    # TensorFlow's executor (jit_compile off) starts up to `parallel_iterations` trips at
    # once, each holding its chunk; the plan counts one. The user's loop wrote 10 (the
    # default); once its body makes K in chunks, it runs one trip at a time too.
    n = 400
    x = _points(rng, n)
    config = tfmem.Config(memory_budget=_budget(n), strict=True)
    report = tfmem.function(power_iteration, config=config).report(x)
    assert len(_records(report, SINK)) == 1, str(report)
    loops = _while_nodes(report.rewritten_graph_def)
    assert len(loops) >= 2  # the user's loop, rebuilt, and the chunked loops in and after it
    assert all(node.attr["parallel_iterations"].i == 1 for node in loops), \
        [(node.name, node.attr["parallel_iterations"].i) for node in loops]


def test_an_invariant_the_budget_can_hold_is_not_sunk(rng):
    n = 200
    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    fn = conjugate_gradients(steps=5, jitter=1.0)
    report = tfmem.function(fn, config=tfmem.Config(memory_budget="64MiB")).report(x, y)
    assert not _records(report, SINK)


def test_a_body_that_needs_the_invariant_whole_runs_unchanged(rng):
    n = 300

    def fn(x):
        k = _kernel(x) + tf.eye(n, dtype=x.dtype)

        def body(i, acc):  # Cholesky reads K whole: recomputing it per trip would hold it anyway
            return i + 1, acc + tf.reduce_sum(tf.linalg.cholesky(k * tf.cast(i + 1, k.dtype)))

        return tf.while_loop(lambda i, _: i < 3, body, (tf.constant(0), tf.constant(0.0, tf.float64)))[1]

    x = _points(rng, n)
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=_budget(n)))
    report = wrapped.report(x)
    assert not _records(report, SINK)
    assert any("does not lower" in r.reason for r in report.records if r.status == "rejected")
    np.testing.assert_allclose(wrapped(x), tf.function(fn, jit_compile=True)(x), rtol=1e-9)


def test_a_condition_that_reads_the_invariant_keeps_it(rng):
    n = 300

    def fn(x):
        k = _kernel(x)

        def body(i, v):
            return i + 1, k @ v / float(n)

        def cond(i, v):
            return tf.logical_and(i < 4, tf.reduce_sum(v) < tf.reduce_sum(k))

        return tf.while_loop(cond, body, (tf.constant(0), tf.ones([n, 1], x.dtype)))[1]

    x = _points(rng, n)
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=_budget(n)))
    report = wrapped.report(x)
    assert not _records(report, SINK)
    assert any("its condition reads" in r.reason for r in report.records if r.status == "rejected")
    np.testing.assert_allclose(wrapped(x), tf.function(fn, jit_compile=True)(x), rtol=1e-9)


def _gradient_of(loss, wrt=None):
    """`(loss(x, y), its gradient)` with respect to `x`, or to the variable `wrt`."""
    def loss_and_grad(x, y):
        with tf.GradientTape() as tape:
            if wrt is None:
                tape.watch(x)
            value = loss(x, y)
        return value, tape.gradient(value, x if wrt is None else wrt)
    return loss_and_grad


def _loss_and_grad(solve):
    return _gradient_of(lambda x, y: tf.reduce_sum(solve(x, y) ** 2))


def test_a_gradient_through_the_loop_recomputes_k_in_both_loops(rng):
    """TensorFlow's gradient loop reads K too, and sums dK = Σ g pᵀ whole: K is recomputed
    in both loops, the sum is collected as outer products and formed after the loop in
    chunks, and no [n, n] matrix is held."""
    n = 600
    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    loss_and_grad = _loss_and_grad(conjugate_gradients(steps=4, jitter=2.0))
    wrapped = tfmem.function(loss_and_grad, config=tfmem.Config(memory_budget=_budget(n)))
    report = wrapped.explain(x, y)
    assert len(_records(report, SINK)) == 2  # the forward loop and its gradient loop
    [collected] = _records(report, COLLECT)
    assert (collected.details["trips"], collected.details["width"]) == (4, 1)
    assert report.fits, report.summary()
    assert report.xla_bytes_after < n * n * 8  # less than one K
    want = tf.function(loss_and_grad, jit_compile=True)(x, y)
    for got, expected in zip(wrapped(x, y), want):
        np.testing.assert_allclose(got, expected, rtol=1e-9)


def _lengthscale_gradient(n: int):
    """CG differentiated with respect to a lengthscale variable (GPflow's parameters)."""
    lengthscale = tf.Variable(1.3, dtype=tf.float64)
    solve = conjugate_gradients(steps=5, jitter=2.0)
    return _gradient_of(lambda x, y: tf.reduce_sum(solve(x / lengthscale, y) * y), wrt=lengthscale)


def _power_iteration_gradient(n: int):
    """K read inside the loop and after it: dK sums the loop's and the reader's parts."""
    def loss(x, y):
        k = _kernel(x)
        v = tf.while_loop(lambda i, v: i < 6, lambda i, v: (i + 1, (k @ v) / tf.norm(k @ v)), (0, y),
                          maximum_iterations=6)[1]
        return tf.reduce_sum(v * (k @ v))
    return _gradient_of(loss)


def _lanczos_gradient(n: int):
    """Lanczos, its coefficients in a TensorArray the loop carries, differentiated."""
    def loss(x, y):
        k = _kernel(x)

        def body(i, v, v_prev, beta, alphas):
            w = k @ v - beta * v_prev
            alpha = tf.reduce_sum(w * v)
            w = w - alpha * v
            return i + 1, w / tf.norm(w), v, tf.norm(w), alphas.write(i, alpha)

        start = (0, y / tf.norm(y), tf.zeros_like(y), tf.constant(0.0, tf.float64), tf.TensorArray(tf.float64, 6))
        alphas = tf.while_loop(lambda i, *_: i < 6, body, start, maximum_iterations=6)[4]
        return tf.reduce_sum(alphas.stack() ** 2)
    return _gradient_of(loss)


@pytest.mark.parametrize("program", [_lengthscale_gradient, _power_iteration_gradient, _lanczos_gradient])
def test_other_gradients_through_loops_collect_and_equal_stock(rng, program):
    n = 500
    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    fn = program(n)
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=_budget(n)))
    report = wrapped.explain(x, y)
    assert _records(report, COLLECT) and len(_records(report, SINK)) >= 2, report.summary()
    assert report.xla_bytes_after < n * n * 8  # less than one K
    want = tf.function(fn, jit_compile=True)(x, y)
    for got, expected in zip(wrapped(x, y), want):
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12 * float(np.max(np.abs(expected))))


@settings(max_examples=3, deadline=None, derandomize=True)
@given(n=st.integers(200, 700), steps=st.integers(1, 5), jitter=st.sampled_from([0.5, 2.0]),
       share=st.sampled_from([2, 3, 5]), dtype=st.sampled_from([tf.float32, tf.float64]))
def test_property_gradients_through_sunk_loops_equal_stock(n, steps, jitter, share, dtype):
    rng = np.random.default_rng(n * 17 + steps)
    x = tf.constant(rng.normal(size=(n, 3)) * 0.7, dtype)
    y = tf.constant(rng.normal(size=(n, 1)), dtype)
    fn = _loss_and_grad(conjugate_gradients(steps, jitter))
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=f"{n * n * dtype.size // share}B"))
    assert _records(wrapped.report(x, y), COLLECT), "the example must exercise the rewrite"
    want = tf.function(fn, jit_compile=True)(x, y)
    rtol = 1e-9 if dtype == tf.float64 else 2e-4
    for got, expected in zip(wrapped(x, y), want):
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * float(tf.reduce_max(tf.abs(expected))))


@settings(max_examples=4, deadline=None, derandomize=True)
@given(n=st.integers(250, 420), steps=st.integers(1, 6), jitter=st.sampled_from([0.5, 2.0]),
       share=st.sampled_from([2, 3, 5]), dtype=st.sampled_from([tf.float32, tf.float64]))
def test_property_sunk_conjugate_gradients_equal_stock(n, steps, jitter, share, dtype):
    rng = np.random.default_rng(n * 31 + steps)
    x = tf.constant(rng.normal(size=(n, 3)) * 0.7, dtype)
    y = tf.constant(rng.normal(size=(n, 1)), dtype)
    fn = conjugate_gradients(steps, jitter)
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=f"{n * n * dtype.size // share}B"))
    assert _records(wrapped.report(x, y), SINK), "the example must exercise the rewrite"
    want = tf.function(fn, jit_compile=True)(x, y)
    rtol = 1e-9 if dtype == tf.float64 else 2e-4
    np.testing.assert_allclose(wrapped(x, y), want, rtol=rtol, atol=rtol * float(tf.reduce_max(tf.abs(want))))


def _set_diag_v1(a, d):
    return tf.raw_ops.MatrixSetDiag(input=a, diagonal=d)


def _diag_part_v1(a):
    return tf.raw_ops.MatrixDiagPart(input=a)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("batch", [(), (2,)])
@pytest.mark.parametrize("set_diag, diag_part, ops", [
    (tf.linalg.set_diag, tf.linalg.diag_part, ("MatrixSetDiagV3", "MatrixDiagPartV3")),
    (_set_diag_v1, _diag_part_v1, ("MatrixSetDiag", "MatrixDiagPart")),  # an old graph's first versions
], ids=["v3", "v1"])
def test_lowered_diagonal_ops_give_the_same_bits(rng, dtype, batch, set_diag, diag_part, ops):
    n = 7
    a = tf.constant(rng.normal(size=(*batch, n, n)), dtype)
    d = tf.constant(rng.normal(size=(*batch, n)), dtype)

    def fn(a, d):
        added = set_diag(a, diag_part(a) + d)  # AddDiagonal's form
        return added, set_diag(a, d), diag_part(a * 2.0)

    concrete = tf.function(fn).get_concrete_function(a, d)
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    lowered = lower_diagonals(graph, limit=0)
    assert set(ops) <= {n.op for n in concrete.graph.as_graph_def().node}
    assert not [n for n in graph.nodes if n.op in ops]
    assert len(lowered) == 3
    out = run_graph(graph, concrete, [a, d])
    for got, want in zip(out, fn(a, d)):
        np.testing.assert_array_equal(got, want)


def test_two_invariants_of_one_loop_and_a_loop_in_a_loop_are_both_recomputed(rng):
    n = 300

    def two_kernels(x, y):
        k1, k2 = _kernel(x), _kernel(2.0 * x)

        def body(i, v):
            return i + 1, (k1 @ v + k2 @ v) / float(n)

        return tf.while_loop(lambda i, _: i < 3, body, (tf.constant(0), y))[1]

    def nested(x, y):
        k = _kernel(x)

        def outer(i, v):
            inner = tf.while_loop(lambda j, _: j < 2, lambda j, w: (j + 1, k @ w / float(n) + v), (tf.constant(0), v))
            return i + 1, inner[1]

        return tf.while_loop(lambda i, _: i < 2, outer, (tf.constant(0), y))[1]

    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    for fn, sunk in ((two_kernels, 2), (nested, 1)):
        wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=_budget(n)))
        report = wrapped.explain(x, y)
        assert len(_records(report, SINK)) >= sunk, fn.__name__
        assert report.xla_bytes_after < n * n * 8, fn.__name__
        np.testing.assert_allclose(wrapped(x, y), tf.function(fn, jit_compile=True)(x, y), rtol=1e-9)


def test_the_summary_says_what_is_recomputed_where(rng):
    n = 300
    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    summary = tfmem.function(conjugate_gradients(3, 2.0), config=tfmem.Config(memory_budget=_budget(n))
                             ).report(x, y).summary()
    assert f"float64[{n}, {n}] recomputed inside loop while, not held" in summary, summary


def test_a_threshold_alone_recomputes_an_invariant_over_it(rng):
    n = 300
    x, y = _points(rng, n), tf.constant(rng.normal(size=(n, 1)))
    fn = conjugate_gradients(3, 2.0)
    wrapped = tfmem.function(fn, config=tfmem.Config(tensor_size_threshold=f"{n * n * 8 // 4}B", memory_budget="off"))
    report = wrapped.explain(x, y)
    assert len(_records(report, SINK)) == 1
    assert all(r.details["chunk_bytes"] <= n * n * 8 // 4 for r in _records(report, "SplitOversizedRegions"))
    assert report.xla_bytes_after < n * n * 8
    np.testing.assert_allclose(wrapped(x, y), tf.function(fn, jit_compile=True)(x, y), rtol=1e-9)
