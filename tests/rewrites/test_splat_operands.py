"""Tests for `rewrites.splat_operands`: elementwise ops read a splat's scalar, not the splat."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from tfmem.testing import assert_close, with_gradient
from rewrites.splat_operands import ScalarForSplatOperand
from rewrites.splats import CanonicalizeSplats
from tfmem.host_folding import LARGE_TENSOR_BYTES

N = 600  # an [N, N] float32 splat is over LARGE_TENSOR_BYTES

_BINARY = {
    "add": tf.add, "sub": tf.subtract, "mul": tf.multiply, "div": tf.math.truediv, "max": tf.maximum,
    "min": tf.minimum, "sqdiff": tf.math.squared_difference, "pow": lambda a, b: tf.pow(tf.abs(a) + 0.5, b),
}


def rewrite(fn):
    return tfmem.TfmemFunction(fn, passes=[CanonicalizeSplats(), ScalarForSplatOperand()], lint=True,
                               config={"strict": True, "jit_compile": True})


def _large_splats(wrapped, *args) -> list[str]:
    graph = tfmem.Graph(wrapped.report(*args).rewritten_graph_def)
    return [node.name for node in graph.nodes if node.op in ("Fill", "BroadcastTo", "ZerosLike", "OnesLike")
            and (graph.nbytes(tfmem.TensorRef(node.name)) or 0) > LARGE_TENSOR_BYTES]


@settings(deadline=None, max_examples=24, derandomize=True, database=None)
@given(op=st.sampled_from(sorted(_BINARY)), splat_first=st.booleans(), spelling=st.sampled_from(["fill", "broadcast"]),
       dtype=st.sampled_from([np.float32, np.float64]), gradient=st.booleans(), seed=st.integers(0, 2**16))
def test_binary_ops_of_a_computed_splat_equal_stock(op, splat_first, spelling, dtype, gradient, seed):
    """`K ∘ fill(v)` and `fill(v) ∘ K` with a computed `v` (GPflow's Constant kernel): the
    same bits as stock XLA, and no [N, N] splat left (with gradients: the same values)."""
    def fn(x, c):
        k = tf.exp(-tf.square(x))
        v = tf.reduce_mean(c) + 0.25  # computed, so no constant folding can take it
        shape = tf.shape(k)
        splat = tf.fill(shape, v) if spelling == "fill" else tf.broadcast_to(v, shape)
        out = _BINARY[op](splat, k) if splat_first else _BINARY[op](k, splat)
        return tf.reduce_sum(out, axis=0)

    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(N, N)).astype(dtype))
    c = tf.constant(rng.uniform(0.1, 1.0, size=(3,)).astype(dtype))
    program = with_gradient(fn) if gradient else fn
    wrapped = rewrite(program)
    want = tf.function(program, jit_compile=True)(x, c)
    if gradient:
        assert_close(wrapped(x, c), want, tf.as_dtype(dtype))
    else:
        np.testing.assert_array_equal(wrapped(x, c).numpy(), want.numpy())
        assert not _large_splats(wrapped, x, c)


@settings(deadline=None, max_examples=12, derandomize=True, database=None)
@given(terms=st.integers(2, 4), position=st.integers(0, 3), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**16))
def test_an_add_n_with_a_splat_keeps_its_order_and_equals_stock(terms, position, dtype, seed):
    """`add_n` with a splat among its terms (GPflow's `Sum` kernel with a Constant part) sums
    in the same order: the same bits as stock XLA."""
    position = min(position, terms - 1)

    def fn(xs, c):
        parts = [tf.exp(-tf.square(xs[i])) * (i + 1) for i in range(terms - 1)]
        parts.insert(position, tf.fill([N, N], tf.reduce_sum(c)))
        return tf.add_n(parts)[::7]

    rng = np.random.default_rng(seed)
    xs = tf.constant(rng.normal(size=(terms - 1, N, N)).astype(dtype))
    c = tf.constant(rng.uniform(0.1, 1.0, size=(3,)).astype(dtype))
    wrapped = rewrite(fn)
    np.testing.assert_array_equal(wrapped(xs, c).numpy(), tf.function(fn, jit_compile=True)(xs, c).numpy())
    assert not _large_splats(wrapped, xs, c)


@pytest.mark.parametrize("case", ["splat gives the shape", "both splats", "small splat", "matmul reads it"])
def test_a_splat_an_op_needs_whole_stays(rng, case):
    """A splat that sets the result's shape (a row broadcast down it), that is small, or that
    a non-elementwise op reads is left alone; of two splats that meet, one stays to shape it."""
    def fn(x, c):
        v = tf.reduce_sum(c)
        if case == "splat gives the shape":
            return tf.fill([N, N], v) * x[0]
        if case == "both splats":
            return tf.fill([N, N], v) * tf.fill([N, N], v + 1.0)
        if case == "small splat":
            return tf.fill([10, 10], v) * x[:10, :10]
        return tf.fill([N, N], v) @ x

    x = tf.constant(rng.normal(size=(N, N)))
    c = tf.constant([0.5, 0.25], tf.float64)
    wrapped = rewrite(fn)
    if case == "both splats":
        assert len(_large_splats(wrapped, x, c)) == 1
    else:
        assert not [r for r in wrapped.report(x, c).records if r.rule == "ScalarForSplatOperand"]
    np.testing.assert_array_equal(wrapped(x, c).numpy(), tf.function(fn, jit_compile=True)(x, c).numpy())


@pytest.mark.parametrize("combination", ["product", "sum"])
def test_gpflow_constant_kernel_forms_no_square_fill(combination):
    """GPR with `SE * Constant` / `Matern32 + Constant`, loss and gradients through the whole
    pipeline: no [n, n] fill left, and the values equal stock XLA's."""
    gpflow = pytest.importorskip("gpflow")
    rng = np.random.default_rng(3)
    x = rng.uniform(-2, 2, (N, 2))
    y = np.sin(x).sum(1, keepdims=True)
    constant = gpflow.kernels.Constant(0.7)
    kernel = (gpflow.kernels.SquaredExponential() * constant if combination == "product"
              else gpflow.kernels.Matern32() + constant)
    model = gpflow.models.GPR((x, y), kernel, noise_variance=0.1)

    def step():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)

    wrapped = tfmem.function(step, config=tfmem.Config(strict=True))
    assert [r for r in wrapped.report().fired if r.rule == "ScalarForSplatOperand"]
    assert not [name for name in _large_splats(wrapped) if "Fill" in name]
    assert_close(wrapped(), tf.function(step, jit_compile=True)(), tf.float64)
