"""A cheap whole matrix held across the peak is made again for its late readers
(`rewrites.split.recompute`).

A Gaussian-process loss reads its kernel matrix K early (K + σ²I → Cholesky) and its
gradient reads K again late (dθ = Σ dK ⊙ ∂K/∂θ). Under a budget, tfmem must not hold K
across the Cholesky gradient's peak when K is cheap to make again from the inputs, must
give stock's numbers, and must leave alone what is not cheap (a Cholesky factor, a product
over many terms). Memory is checked by bounds: XLA's plan of the rewritten program.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from rewrites import passes_for
from rewrites.solve_in_place import SolveInPlace
from rewrites.split.order import computed_after, input_to_tie
from rewrites.split.recompute import MAX_INNER, cheap_cone, recompute_across_xla_peak, recompute_for
from tfmem.capture import capture
from tfmem.graph import GraphError, TensorRef
from tfmem.memory import estimate_memory, graph_node_for
from tfmem.testing import run_graph, xla_peak_holding

RECOMPUTE = "RecomputeForLateReaders"


def _kernel(x: tf.Tensor) -> tf.Tensor:
    sq = tf.reduce_sum(x * x, 1)
    return tf.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)))


def gp_loss_and_grads(x, y, lengthscales):
    """A GP's negative log marginal likelihood (up to constants) and its gradient with
    respect to the lengthscales: the gradient reads K again after the Cholesky gradient."""
    with tf.GradientTape() as tape:
        tape.watch(lengthscales)
        k = _kernel(x / lengthscales)
        chol = tf.linalg.cholesky(k + 0.1 * tf.eye(x.shape[0], dtype=x.dtype))
        alpha = tf.linalg.triangular_solve(chol, y)
        loss = 0.5 * tf.reduce_sum(alpha ** 2) + tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol)))
    return loss, tape.gradient(loss, lengthscales)


def _data(rng: np.random.Generator, n: int, dtype=tf.float64):
    return (tf.constant(rng.normal(size=(n, 3)), dtype), tf.constant(rng.normal(size=(n, 1)), dtype),
            tf.constant([1.0, 1.5, 0.7], dtype))


def _records(report: tfmem.Report, status: str = "fired") -> list:
    return [r for r in report.records if r.rule == RECOMPUTE and r.status == status]


def _regression_data(n: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, size=(n, d))
    return x, np.sin(x).sum(-1, keepdims=True) + 0.1 * rng.normal(size=(n, 1))


def _loss_and_gradients(model):
    """A GPflow model's training loss and its gradients, the tape inside the function."""
    def step():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)
    return step


def test_the_kernel_matrix_is_made_again_for_the_gradient_and_xla_holds_fewer_matrices(rng):
    n = 600
    x, y, lengthscales = _data(rng, n)
    whole = n * n * 8
    wrapped = tfmem.function(gp_loss_and_grads, config=tfmem.Config(memory_budget=f"{int(3.5 * whole)}B"))
    report = wrapped.explain(x, y, lengthscales)
    fired = _records(report)
    assert fired, report.summary()
    assert all(r.details["shape"] == f"float64[{n}, {n}]" for r in fired)
    assert "truediv:0" in fired[0].reason  # made from the scaled points, not from K
    assert "made again for its late readers, not held" in report.summary()
    # Stock XLA holds K across the Cholesky gradient (7 whole matrices); tfmem's plan has
    # at least two fewer.
    assert report.xla_bytes_after <= report.xla_bytes_before - 2 * whole, (report.xla_bytes_before / whole,
                                                                          report.xla_bytes_after / whole)
    want = tf.function(gp_loss_and_grads, jit_compile=True)(x, y, lengthscales)
    got = wrapped(x, y, lengthscales)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-8)


def test_a_budget_that_holds_everything_recomputes_nothing(rng):
    x, y, lengthscales = _data(rng, 300)
    wrapped = tfmem.function(gp_loss_and_grads, config=tfmem.Config(memory_budget="1GiB"))
    assert not _records(wrapped.report(x, y, lengthscales))


@settings(max_examples=3, deadline=None, derandomize=True)
@given(n=st.integers(150, 500), share=st.sampled_from([2.5, 3.5, 5.0]),
       dtype=st.sampled_from([tf.float32, tf.float64]))
def test_property_recomputed_programs_equal_stock(n, share, dtype):
    rng = np.random.default_rng(n)
    x, y, lengthscales = _data(rng, n, dtype)
    budget = f"{int(share * n * n * dtype.size)}B"
    wrapped = tfmem.function(gp_loss_and_grads, config=tfmem.Config(memory_budget=budget))
    want = tf.function(gp_loss_and_grads, jit_compile=True)(x, y, lengthscales)
    got = wrapped(x, y, lengthscales)
    tolerance = 1e-9 if dtype == tf.float64 else 2e-3
    np.testing.assert_allclose(got[0], want[0], rtol=tolerance)
    np.testing.assert_allclose(got[1], want[1], rtol=tolerance * 10, atol=tolerance * float(tf.reduce_max(tf.abs(want[1]))))


def _graph(fn, *specs):
    return capture(tf.function(fn).get_concrete_function(*specs)).to_graph()


def test_the_cone_of_a_kernel_matrix_is_its_small_inputs():
    graph = _graph(lambda x: tf.sqrt(_kernel(x)), tf.TensorSpec([500, 3], tf.float64))
    [root] = [n.name for n in graph.find("Sqrt")]
    cone = cheap_cone(graph, TensorRef(root), leaf_limit=500 * 500 * 8 // 16)
    assert not isinstance(cone, str), cone
    assert "x:0" in [leaf.name for leaf in cone.leaves]  # and ‖x‖² as rows and columns
    assert all(graph.nbytes(leaf) <= 500 * 3 * 8 for leaf in cone.leaves)
    assert "MatMul" in {graph.node(name).op for name in cone.nodes}


@pytest.mark.parametrize("make, op", [
    (lambda x: tf.linalg.cholesky(_kernel(x) + tf.eye(400, dtype=x.dtype)), "Cholesky"),
    (lambda x: tf.matmul(tf.tile(x, [1, 100]), tf.tile(x, [1, 100]), transpose_b=True), "MatMul"),
])
def test_what_is_not_cheap_is_not_recomputed(make, op):
    graph = _graph(make, tf.TensorSpec([400, 3], tf.float64))
    [root] = [n.name for n in graph.find(op)]
    reason = cheap_cone(graph, TensorRef(root), leaf_limit=400 * 400 * 8 // 16)
    assert isinstance(reason, str) and op in reason
    if op == "MatMul":
        assert MAX_INNER < 300 and "300 terms" in reason


@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64])
def test_the_leaves_pass_through_bit_for_bit_whatever_the_tie_holds(dtype):
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -3.5]
    leaf = tf.constant(np.array(special), dtype)
    for tie in ([np.nan, 1.0], [np.inf], [-0.0], [2.0]):
        [passed] = computed_after(tf.constant(tie, dtype), leaf)
        got, want = passed.numpy(), leaf.numpy()
        assert got.tobytes() == want.tobytes(), (tie, got, want)


def test_the_input_read_through_a_tie_is_the_smallest_float_or_the_one_a_preferred_op_makes():
    def program(a, row, ids):
        return tf.exp(a) + tf.matmul(row, a), tf.cast(ids, tf.float64)  # [40, 40] + [1, 40]; a cast of ints

    graph = capture(tf.function(program).get_concrete_function(
        tf.TensorSpec([40, 40], tf.float64), tf.TensorSpec([1, 40], tf.float64),
        tf.TensorSpec([8], tf.int32))).to_graph()
    [add] = [node.name for node in graph.nodes if node.op == "AddV2"]
    [cast] = [node.name for node in graph.nodes if node.op == "Cast"]
    assert [graph.node(ref.node).op for ref in graph.inputs(add)] == ["Exp", "MatMul"]
    assert input_to_tie(graph, add) == 1  # the smaller: fewer elements take the zero
    assert input_to_tie(graph, add, prefer_made_by={"Exp"}) == 0  # a cheap op fuses the zero
    assert input_to_tie(graph, cast) is None  # it reads no float


@pytest.mark.parametrize("kernel", ["SquaredExponential", "Matern52"])
def test_gpflow_gpr_gradients_hold_fewer_matrices_and_equal_stock(kernel):
    """GPflow's GPR loss and gradients (code nobody here wrote): its kernel matrix is read
    again by the lengthscale and variance gradients."""
    import gpflow

    n = 500
    model = gpflow.models.GPR(_regression_data(n, 3, seed=3), getattr(gpflow.kernels, kernel)(lengthscales=[1.0] * 3))
    step = _loss_and_gradients(model)

    whole = n * n * 8
    wrapped = tfmem.function(step, config=tfmem.Config(memory_budget=f"{int(3.5 * whole)}B"))
    report = wrapped.explain()
    assert _records(report), report.summary()
    assert report.xla_bytes_after <= report.xla_bytes_before - whole, (report.xla_bytes_before / whole,
                                                                      report.xla_bytes_after / whole)
    want = tf.function(step, jit_compile=True)()
    got = wrapped()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-8)


# --- What orders a copy (`recompute._tie`) -------------------------------------------------


def _late_reader_graph(join_with_other_reader: bool):
    """K = exp(-sqdist(x, x)) read early by a product and late by `K × 2` (its other input a
    constant, as a loss gradient's seed is), whose result meets `K @ v` only downstream;
    with `join_with_other_reader`, it meets a second late reader's result instead."""
    def fn(x, v):
        k = _kernel(x)
        early = tf.matmul(k, v)
        late = k * tf.constant(2.0, tf.float64)
        if join_with_other_reader:
            return tf.reduce_sum(late + (k + 1.0) * tf.reduce_sum(early))
        return tf.reduce_sum(late * tf.matmul(early, v, transpose_b=True))
    graph = _graph(fn, tf.TensorSpec([300, 3], tf.float64), tf.TensorSpec([300, 8], tf.float64))
    [k] = [n.name for n in graph.find("Exp")]
    readers = [(name, slot) for name, slot in graph.consumers(TensorRef(k)) if graph.node(name).op != "MatMul"]
    return graph, TensorRef(k), readers


def test_a_reader_of_constants_gets_a_copy_ordered_by_what_its_result_meets():
    # `K × 2` reads nothing but K and a constant: a copy tied to the constant is one XLA
    # folds back into K (GPflow VGP's KL gradient; held across the peak all the same).
    graph, k, readers = _late_reader_graph(join_with_other_reader=False)
    [(late, _)] = readers
    cone = cheap_cone(graph, k, leaf_limit=300 * 300 * 8 // 16)
    copy = recompute_for(graph, cone, readers, estimate_memory(graph))
    graph.topological_order()  # no cycle
    # (K v) vᵀ, the product `late`'s result meets; not x xᵀ in K or in its copy.
    [meets] = [n.name for n in graph.find("MatMul") if n.name not in graph.ancestors(k.node)
               and not n.name.startswith("tfmem_recompute") and graph.spec(TensorRef(n.name)).shape[0] == 300
               and graph.spec(TensorRef(n.name)).shape[1] == 300]
    assert meets in graph.ancestors(copy.node) and late in graph.descendants(copy.node)


def test_a_copy_is_never_ordered_by_what_another_of_its_readers_makes():
    graph, k, readers = _late_reader_graph(join_with_other_reader=True)
    assert len(readers) == 2
    cone = cheap_cone(graph, k, leaf_limit=300 * 300 * 8 // 16)
    try:
        copy = recompute_for(graph, cone, readers, estimate_memory(graph))
    except GraphError as err:  # nothing else orders it: refused, and said why
        assert "nothing orders a copy" in str(err)
        return
    graph.topological_order()  # no cycle
    assert not any(reader in graph.ancestors(copy.node) for reader, _ in readers)


def test_gpflow_vgp_fills_q_sqrt_again_for_its_kl_gradient_and_xla_plans_less():
    """GPflow's VGP (code nobody here wrote) fills its triangular `q_sqrt` from a variable
    (TFP's `fill_triangular`: a concatenation, a reshape, a band part), multiplies it early,
    and reads it again in the KL term's gradient, whose other input is the loss's seed."""
    import gpflow

    n = 600
    model = gpflow.models.VGP(_regression_data(n, 2, seed=6), gpflow.kernels.Linear(),
                              gpflow.likelihoods.Gaussian(variance=0.1))
    step = _loss_and_gradients(model)

    whole = n * n * 8
    wrapped = tfmem.function(step, config=tfmem.Config(memory_budget=f"{5 * whole}B"))
    report = wrapped.explain()
    # The KL term's gradient reads the filled q_sqrt: made again from the variable.
    assert [r for r in _records(report) if "ReadVariableOp" in r.reason
            and r.details["shape"] == f"float64[1, {n}, {n}]"], report.summary()
    # As written, XLA plans 9.0 whole [n, n] matrices; rewritten 6.1 (7.1 while the copy's
    # tie was the seed, which XLA folded; TF 2.21 on the CPU).
    assert report.xla_bytes_after <= report.xla_bytes_before - 2.5 * whole, (report.xla_bytes_before / whole,
                                                                            report.xla_bytes_after / whole)
    want = tf.function(step, jit_compile=True)()
    got = wrapped()
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9 * float(tf.reduce_max(tf.abs(w))))


# --- What XLA holds across its own peak (`recompute_across_xla_peak`) ----------------------

XLA_PEAK = "RecomputeAcrossXlaPeak"


def held_factor(z, g):
    """A factor L₁ read early, held across a second factorization and its solve (where
    XLA peaks, not reading L₁), and read again late: GPflow SGPR's gradient, in small."""
    m = z.shape[0]
    l1 = tf.linalg.cholesky(_kernel(z) + 1e-6 * tf.eye(m, dtype=z.dtype))
    x = tf.linalg.triangular_solve(l1, g)
    l2 = tf.linalg.cholesky(tf.matmul(x, x, transpose_b=True) + m * tf.eye(m, dtype=z.dtype))
    y = tf.linalg.triangular_solve(l2, tf.linalg.band_part(g, -1, 0), adjoint=True)
    return tf.reduce_sum(tf.linalg.triangular_solve(l1, y))


def with_xla_solves(config: tfmem.Config) -> list:
    """The passes of `config` but `SolveInPlace`: with XLA's own solves, which hold their
    result twice, XLA peaks in the second one (with the solves in place it peaks elsewhere,
    and holds nothing across it; `test_solve_in_place` tests that)."""
    return [p for p in passes_for(config) if not isinstance(p, SolveInPlace)]


def test_a_factor_xla_holds_across_its_peak_is_made_again_and_xla_plans_less(rng):
    m = 1000
    z, g = tf.constant(rng.uniform(-3, 3, (m, 3))), tf.constant(rng.normal(size=(m, m)))
    config = tfmem.Config(memory_budget="40MiB")  # under what XLA plans for the static plan
    wrapped = tfmem.TfmemFunction(held_factor, config=config, passes=with_xla_solves(config))
    report = wrapped.report(z, g)
    fired = [r for r in report.records if r.rule == XLA_PEAK and r.status == "fired"]
    assert [r.details["tensor"] for r in fired] == ["Cholesky:0"], report.summary()
    kept = [r for r in report.records if r.rule == XLA_PEAK and r.pass_name == "compile_within_budget"]
    assert kept and kept[0].status == "info" and kept[0].reason.startswith("kept:"), kept
    assert "Cholesky:0 float64[1000, 1000] made again for its late readers" in report.summary()
    # The static plan alone, compiled: XLA plans a [1000, 1000] matrix more for it
    # (39.3 against 34.5 MiB, TF 2.21 on the CPU).
    static = wrapped.trace(z, g).rewrite(config, passes=with_xla_solves(config)).compile().xla_plan(z, g)
    assert report.xla_bytes_after <= static.total_bytes - m * m * 8 * 0.5, (report.xla_bytes_after, static.total_bytes)
    # Made again from the same inputs by the same ops: the same bits.
    assert float(wrapped(z, g)) == float(tf.function(held_factor, jit_compile=True)(z, g))
    # Only the late reader reads the copy: the early solve keeps the original factor.
    solves = [n.input[0] for n in report.rewritten_graph_def.node if n.op == "MatrixTriangularSolve"]
    assert solves.count("Cholesky") == 1 and any(s.startswith("tfmem_recompute") for s in solves), solves


def test_nothing_is_made_again_for_xla_when_the_program_fits(rng):
    m = 1000
    z, g = tf.constant(rng.uniform(-3, 3, (m, 3))), tf.constant(rng.normal(size=(m, m)))
    config = tfmem.Config(memory_budget="80MiB")
    report = tfmem.TfmemFunction(held_factor, config=config, passes=with_xla_solves(config)).report(z, g)
    assert report.fits and not [r for r in report.records if r.rule == XLA_PEAK], report.summary()


@settings(max_examples=2, deadline=None, derandomize=True)  # each compiles ~5 programs; the fixed test above is a third
@given(m=st.integers(800, 1200), share=st.sampled_from([4.5, 5.0, 5.5]))
def test_property_programs_with_what_xla_held_made_again_equal_stock(m, share):
    rng = np.random.default_rng(m)
    z, g = tf.constant(rng.uniform(-3, 3, (m, 3))), tf.constant(rng.normal(size=(m, m)))
    config = tfmem.Config(memory_budget=f"{int(share * m * m * 8)}B")
    wrapped = tfmem.TfmemFunction(held_factor, config=config, passes=with_xla_solves(config))
    report = wrapped.report(z, g)
    kept = [r for r in report.records if r.rule == XLA_PEAK and r.pass_name == "compile_within_budget"]
    assert kept and kept[0].reason.startswith("kept:"), report.summary()  # the path under test
    assert float(wrapped(z, g)) == float(tf.function(held_factor, jit_compile=True)(z, g))


def test_a_copy_xla_plans_more_for_is_not_kept_and_the_gradient_equals_stock(rng):
    # With the gradient, L₁'s copy is read by the gradient's solves too, and XLA plans
    # more with it than without (measured): the plan without it is kept, and says so.
    def held_factor_and_gradient(z, g):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = held_factor(z, g)
        return value, tape.gradient(value, z)

    m = 500
    z, g = tf.constant(rng.uniform(-3, 3, (m, 3))), tf.constant(rng.normal(size=(m, m)))
    wrapped = tfmem.function(held_factor_and_gradient, config=tfmem.Config(memory_budget=f"{int(4.5 * m * m * 8)}B"))
    report = wrapped.report(z, g)
    notes = [r for r in report.records if r.rule == XLA_PEAK and r.pass_name == "compile_within_budget"]
    assert notes and notes[0].status == "rejected" and notes[0].reason.startswith("not kept:"), report.summary()
    assert not [r for r in report.records if r.rule == XLA_PEAK and r.status == "fired"]  # its records went with it
    want = tf.function(held_factor_and_gradient, jit_compile=True)(z, g)
    got = wrapped(z, g)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-9)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-8, atol=1e-9 * float(tf.reduce_max(tf.abs(want[1]))))


def test_each_xla_peak_is_acted_on_only_by_the_rules_its_plan_was_kept_with():
    # A round that keeps one rule alone on a peak (the others raised XLA's plan with it)
    # must not see the others act on that peak again in the next round.
    from rewrites.split import _ActOnXlaPeaks
    from tfmem.context import PassContext
    from tfmem.memory import MemoryEstimate

    seen: list[str] = []

    class Recorder(_ActOnXlaPeaks):
        name = "recorder"

        @staticmethod
        def act(graph, peak, pass_name):
            seen.append(peak.peak_node)
            return []

    older, newer = MemoryEstimate(1, "older", ()), MemoryEstimate(2, "newer", ())
    graph = capture(tf.function(lambda x: x + 1.0).get_concrete_function(tf.ones([2]))).to_graph()
    for rules, acted_on in [((), ["older", "newer"]),
                            ((frozenset({"other"}),), ["newer"]),
                            ((None, frozenset({"other"})), ["older"]),
                            ((frozenset({"recorder"}), frozenset({"other", "recorder"})), ["older", "newer"])]:
        seen.clear()
        context = PassContext(tfmem.Config(), xla_peaks=(older, newer), peak_rules=rules)
        Recorder().run(graph, context)
        assert seen == acted_on, (rules, seen)


def held_through_a_fused_map(x, g):
    """`a = 1 + 2r` is read early (beside e^{-r}) and late (by the product after the peak):
    XLA writes out only r, computes `a` inside both readers, and so holds r across the
    peak for the late one."""
    r = tf.sqrt(x * x + 1.0)
    a = 1.0 + 2.0 * r
    early = tf.reduce_sum(a * tf.exp(-r))
    p = tf.matmul(g, g)
    return early, tf.reduce_sum(p * a)


def test_what_xla_holds_for_a_late_reader_of_a_map_it_fused_is_made_again_for_that_reader(rng):
    n = 300
    spec = tf.TensorSpec([n, n], tf.float64)
    concrete = tf.function(held_through_a_fused_map).get_concrete_function(spec, spec)
    graph = capture(concrete).to_graph()
    [sqrt], [matmul] = graph.find("Sqrt"), graph.find("MatMul")
    [early_sum, late_sum] = list(graph.find("Sum"))
    late = next(reader for reader, _ in graph.consumers(TensorRef(matmul.name)))
    # XLA's steps: r, the early sum, the product (its peak), the late product and sum.
    peak = xla_peak_holding(matmul.name, [sqrt.name], [sqrt.name, early_sum.name, matmul.name, late, late_sum.name],
                            n=n)
    records = recompute_across_xla_peak(graph, peak, "test")
    fired = [r for r in records if r.status == "fired"]
    assert len(fired) == 1 and graph.node(fired[0].details["tensor"].split(":")[0]).op == "AddV2", records
    assert fired[0].details["recomputed_for"] == late
    # The late product reads a copy of `a`; the original `a` stays with the early reader.
    [copy] = [ref for ref in graph.inputs(late) if ref.node != matmul.name]
    assert copy.node.startswith("tfmem_recompute"), copy
    graph.topological_order()  # no cycle
    x, g = (tf.constant(rng.normal(size=(n, n))) for _ in range(2))
    got, want = run_graph(graph, concrete, [x, g]), concrete(x, g)
    assert [float(v) for v in got] == [float(v) for v in want]


def test_an_xla_name_a_late_pass_made_in_a_nodes_scope_stands_for_that_node():
    graph = _graph(lambda x: tf.linalg.band_part(x @ x, -1, 0), tf.TensorSpec([4, 4], tf.float64))
    [band] = graph.find("MatrixBandPart")
    assert graph_node_for(graph, f"tfmem_f/{band.name}_as_select/SelectV2") == band.name
    assert graph_node_for(graph, f"tfmem_f/{band.name}_lowered/Select") == band.name
    assert graph_node_for(graph, f"tfmem_f/{band.name}_as_select") is None  # the scope alone is no op
    assert graph_node_for(graph, "tfmem_f/elsewhere_as_select/SelectV2") is None


def test_a_cone_grows_through_a_matrix_sized_by_a_variable():
    # GPflow's `eye(num_data)` with num_data a variable: [None, None] until it runs.
    num_data = tf.Variable(200)

    def jittered(x):
        return tf.exp(tf.matmul(x, x, transpose_b=True)) + 1e-6 * tf.eye(tf.convert_to_tensor(num_data), dtype=x.dtype)

    graph = _graph(jittered, tf.TensorSpec([200, 3], tf.float64))
    [add] = graph.find("AddV2")
    cone = cheap_cone(graph, TensorRef(add.name), leaf_limit=200 * 200 * 8 // 16)
    assert not isinstance(cone, str), cone
    assert "MatrixDiagV3" in {graph.node(name).op for name in cone.nodes}  # the eye, made again
    assert all(graph.nbytes(leaf) is not None for leaf in cone.leaves)
