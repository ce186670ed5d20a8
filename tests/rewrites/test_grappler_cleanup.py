"""GrapplerCleanup: Grappler from Python, then no-op folds; placeholders, outputs and effects survive."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from rewrites.grappler_cleanup import GrapplerCleanup, no_op_folds, run_grappler
from tfmem.capture import capture, import_as_function
from tfmem.config import Config
from tfmem.context import PassContext
from tfmem.graph import Graph, GraphError
from tfmem.passes import PassManager
from tfmem.pattern import RuleSet
from tfmem.wrapper import TfmemFunction
from tfmem.isolation import run_isolated

SPEC = tf.TensorSpec([4, 3], tf.float32)


def captured_of(fn, *specs):
    return capture(tf.function(fn, autograph=False).get_concrete_function(*specs))


def cleaned(fn, *specs) -> tuple[Graph, Graph, object]:
    captured = captured_of(fn, *specs)
    graph = captured.to_graph()
    result = PassManager([GrapplerCleanup()], lint=True).run(graph, PassContext(Config()))
    return graph, result.graph, result


def noisy(x, y):
    """Identities, a reshape to the same shape via tf.shape, shape arithmetic, a same-type cast."""
    z = tf.identity(tf.identity(x) * 2.0)
    z = tf.reshape(z, tf.shape(x))
    z = tf.cast(z, tf.float32)
    z = tf.expand_dims(z, 0)  # a real shape change: stays
    width = tf.shape(x)[1] * 2 - 3  # constant shape arithmetic
    return tf.reduce_sum(z, [0]) * tf.cast(width, tf.float32)


@pytest.mark.parametrize("dtype", [tf.float32])
def test_folds_identities_noop_reshapes_casts_and_shape_arithmetic(rng, dtype):
    before, after, result = cleaned(noisy, SPEC, SPEC)
    ops = after.op_counts()
    assert "Shape" not in ops and "StridedSlice" not in ops and "Cast" not in ops
    assert ops.get("Identity", 0) <= len(after.outputs)  # only the function's own output identity
    assert ops.get("Reshape", 0) == 0
    assert len(after) < len(before)
    assert any(r.rule == "Grappler" and r.status == "fired" for r in result.records)
    assert not after.lint() and all(n.attr["_output_shapes"].list.shape for n in after.nodes)


def test_results_unchanged_and_placeholders_and_outputs_preserved(rng):
    captured = captured_of(noisy, SPEC, SPEC)
    graph = captured.to_graph()
    after = PassManager([GrapplerCleanup()], lint=True).run(graph, PassContext(Config())).graph
    # y is unused, yet its placeholder is an argument of the function and must stay
    assert {n.name for n in after.find("Placeholder")} == {"x", "y"}
    assert after.outputs == graph.outputs
    x, y = (rng.normal(size=(4, 3)).astype(np.float32) for _ in range(2))
    got = import_as_function(captured, after, jit_compile=False)(x, y)
    np.testing.assert_allclose(got, noisy(tf.constant(x), tf.constant(y)), rtol=1e-6)


def reassociable(x, y):
    """Arithmetic Grappler's constant folding reorders around its constants (real-number algebra)."""
    one = tf.cast(tf.constant(1.0, tf.float64), tf.float32)  # folds to a constant too (GPflow's to_default_float)
    return (x - y) + 1.0, 3.0 * (2.0 * x), (x + 1e-3) - y, 2.0 - (y + x), (x * 0.5) / 3.0, (x - y) + one


def test_floating_point_arithmetic_keeps_the_programs_order(rng):
    """Cleaned, the program computes what stock XLA computes, bit for bit: Grappler rewrote
    `(x - y) + 1` as `x + (1 - y)` (0 where the program says 1 for x = y = 1e8 in float32;
    a `+ 1e-9` guard inside a distance lost, and NaN gradients, in a program nobody here wrote)."""
    captured = captured_of(reassociable, SPEC, SPEC)
    after = PassManager([GrapplerCleanup()], lint=True).run(captured.to_graph(), PassContext(Config())).graph
    x = rng.normal(size=(4, 3)).astype(np.float32) * 1e8
    x[0] = 1e8
    y = x.copy()
    y[1:] += rng.normal(size=(3, 3)).astype(np.float32)
    got = import_as_function(captured, after, jit_compile=True)(x, y)
    want = tf.function(reassociable, jit_compile=True)(x, y)
    assert float(got[0][0, 0]) == float(got[5][0, 0]) == 1.0
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w.numpy())


def branch_gradient(x, which):
    """A gradient through `tf.cond` and `tf.switch_case`: Grappler specialises their branches."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        d2 = tf.reduce_sum((x[:, None] - x[None]) ** 2, -1)
        kernel = tf.cond(which > 0, lambda: tf.exp(-0.5 * d2), lambda: 1.0 / (1.0 + d2))
        picked = tf.switch_case(which, [lambda: tf.reduce_sum(kernel), lambda: tf.reduce_mean(kernel)])
    return picked, tape.gradient(picked, x)


@pytest.mark.parametrize("which", [0, 1])
def test_gradients_through_branches_run_cleaned(rng, which):
    """The functions Grappler specialises for a branch's gradient ("…_tfg_region_specialized_…")
    are carried into the library: without them the cleaned program failed on its first call
    (found by a program nobody here wrote), and tfmem ran it unrewritten."""
    x = tf.constant(rng.normal(size=(30, 3)))
    wrapped = TfmemFunction(branch_gradient, config={"strict": True, "jit_compile": True},
                            passes=[GrapplerCleanup()], lint=True)
    got, want = wrapped(x, tf.constant(which)), tf.function(branch_gradient, jit_compile=True)(x, tf.constant(which))
    assert wrapped.report(x, tf.constant(which)).status == "rewritten"
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12)


def test_lint_names_a_function_the_library_lacks():
    captured = captured_of(branch_gradient, tf.TensorSpec([5, 3], tf.float64), tf.TensorSpec([], tf.int32))
    graph = captured.to_graph()
    assert graph.lint() == []
    del graph.library.function[:]
    problems = graph.lint()
    assert problems and all("which the library does not define" in p for p in problems)


def test_variable_write_survives_cleanup_through_tfmem_function(rng):
    variable = tf.Variable(tf.zeros([3]))

    def step(x):
        variable.assign_add(tf.reduce_sum(tf.identity(x), 0))
        return tf.reshape(x, [4, 3]) * 2.0

    wrapped = TfmemFunction(step, config={"strict": True, "jit_compile": False},
                            passes=[GrapplerCleanup()], lint=True)
    x = tf.constant(rng.normal(size=(4, 3)).astype(np.float32))
    np.testing.assert_allclose(wrapped(x), 2.0 * x.numpy(), rtol=1e-6)
    wrapped(x)
    np.testing.assert_allclose(variable.numpy(), 2.0 * x.numpy().sum(0), rtol=1e-5)
    assert wrapped.report(x).status == "rewritten"


def test_gradients_through_variables_keep_static_shapes(rng):
    variable = tf.Variable(rng.normal(size=(3, 2)).astype(np.float32))

    def loss_and_grad(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.matmul(x, variable)))
        return loss, tape.gradient(loss, variable)

    captured = captured_of(loss_and_grad, SPEC)
    after = run_grappler(captured.to_graph())
    assert not after.lint()
    reads = list(after.find("ReadVariableOp"))
    assert reads and all(after.spec(f"{r.name}:0").shape == [3, 2] for r in reads)


def test_failure_leaves_the_graph_unchanged_with_a_reason(monkeypatch):
    from tensorflow.python.grappler import tf_optimizer

    def broken(*args, **kwargs):
        raise RuntimeError("grappler exploded")

    monkeypatch.setattr(tf_optimizer, "OptimizeGraph", broken)
    captured = captured_of(noisy, SPEC, SPEC)
    graph = captured.to_graph()
    result = GrapplerCleanup().run(graph.copy(), PassContext(Config()))
    (record,) = result.records
    assert record.status == "rejected" and "grappler exploded" in record.reason
    assert not result.modified
    assert [(n.name, n.op, list(n.input)) for n in result.graph.nodes] == \
        [(n.name, n.op, list(n.input)) for n in graph.nodes]


def test_run_grappler_refuses_a_result_that_lost_a_placeholder(monkeypatch):
    from tensorflow.python.grappler import tf_optimizer

    real = tf_optimizer.OptimizeGraph

    def drops_y(config, meta_graph, **kwargs):
        graph_def = real(config, meta_graph, **kwargs)
        kept = [n for n in graph_def.node if n.name != "y"]
        del graph_def.node[:]
        graph_def.node.extend(kept)
        return graph_def

    monkeypatch.setattr(tf_optimizer, "OptimizeGraph", drops_y)
    with pytest.raises(GraphError, match="dropped 'y'"):
        run_grappler(captured_of(noisy, SPEC, SPEC).to_graph())


def test_no_op_folds_leave_real_reshapes(rng):
    captured = captured_of(lambda x: tf.reshape(tf.reshape(x, [3, 4]), [3, 4]) + 1.0, SPEC)
    result = RuleSet(no_op_folds()).run(captured.to_graph(), PassContext(Config()))
    assert [r.rule for r in result.records] == ["FoldNoOpReshape"]
    assert result.graph.op_counts()["Reshape"] == 1


def test_reaches_a_fixed_point():
    captured = captured_of(noisy, SPEC, SPEC)
    result = PassManager([GrapplerCleanup()], lint=True).run(captured.to_graph(), PassContext(Config()))
    assert result.iterations <= 2


def test_cleanup_never_builds_a_large_tensor_on_the_host() -> None:
    # 2.4 GB per [20000, 15000] float64 tensor: an argument, a zeros_like of it, a ones and
    # an [M, M] eye. Grappler folds splats into constants after building them on the host,
    # and feeds every placeholder a made-up tensor of its shape; the cleanup stage hides
    # them from it. A fresh process, so the resident-set high-water mark is the stage's own.
    rows, cols = 20_000, 15_000
    result = run_isolated("tfmem.testing:cleanup_host_memory", rows, cols, timeout=None)
    assert result.ok, result.error
    assert result.value["rss_growth_bytes"] < 200 * 2**20, result.value
    ops = result.value["ops"]
    # The splats stay splats (or become the scalars elementwise ops read), never constants.
    assert result.value["largest_const_bytes"] < 2**20 and ops.get("Placeholder") == 1, result.value


def test_grappler_folds_no_large_product_of_small_constants_on_the_allocator() -> None:
    # A Laplace GP classifier's Newton step from f = 0: Grappler's push-down gathers the
    # constant factors of sW ∘ K ∘ sWᵀ and evaluated sW ∘ sWᵀ, [1500, 1500] float64 (17 MiB),
    # on the allocator the program then ran on: under a 76 MiB limit the program, which runs
    # as stock XLA, ran out of memory after tfmem's cleanup had grown a 32 MiB region.
    result = run_isolated("tfmem.testing:cleanup_allocator_peak", 1500, timeout=None)
    assert result.ok, result.error
    assert result.value["peak_bytes"] < 4 * 2**20, result.value
