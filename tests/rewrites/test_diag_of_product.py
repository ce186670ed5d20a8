"""Tests for `rewrites.diag_of_product`: diag_part / trace of a product, contracted."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.testing import assert_close, with_gradient
from tfmem.testing import random_inputs as inputs
from rewrites.diag_of_product import ContractDiagOfProduct
from rewrites.matmul_chain import ReorderMatMulChain
from rewrites.scale_by_diagonal import ScaleByDiagonal
from tfmem.graph import Graph, TensorRef

PASSES = (ContractDiagOfProduct, ScaleByDiagonal, ReorderMatMulChain)  # the "reorder" stage
DIAG_OPS = ("MatrixDiagPart", "MatrixDiagPartV2", "MatrixDiagPartV3", "DiagPart")
N, M = 60, 7


def rewrite(fn: Callable[..., Any]) -> tfmem.TfmemFunction:
    return tfmem.TfmemFunction(fn, passes=[p() for p in PASSES], lint=True, config={"strict": True})


def records(function: tfmem.TfmemFunction, *args: Any, status: str,
            pass_name: str = ContractDiagOfProduct.name) -> list[tfmem.RewriteRecord]:
    return [r for r in function.report(*args).records
            if r.status == status and r.pass_name == pass_name]


def largest_tensor(graph: Graph) -> int:
    """Elements of the largest non-input tensor of a graph."""
    return max((graph.spec(TensorRef(n.name)).shape.num_elements() or 0 for n in graph.nodes
                if n.op not in ("Placeholder", "Const") and graph.output_specs(n.name)), default=0)




# name → (function, input shapes, the contraction the record names, Transpose ops after).
# diag(P @ Q) for upright P [N, M] and Q [M, N] needs one of them transposed ([N, M]
# copy); a factor that is already transposed in the graph needs none.
CASES: dict[str, tuple[Callable[..., tf.Tensor], list[list[int]], str, int]] = {
    "predictive_variance": (lambda a, b: tf.linalg.diag_part(a @ b @ tf.transpose(a)),
                            [[N, M], [M, M]], "Σ_j (a ∘ (a @ bᵀ))", 0),
    "right_bracketed": (lambda a, b: tf.linalg.diag_part(a @ (b @ tf.transpose(a))),
                        [[N, M], [M, M]], "Σ_j (a ∘ (a @ bᵀ))", 0),
    "two_factors": (lambda p, q: tf.linalg.diag_part(p @ q), [[N, M], [M, N]], "Σ_j (p ∘ qᵀ)", 1),
    # Pᵀ is stored upright: Σ over rows of (P ∘ Q) needs no transpose copy.
    "transposed_factor": (lambda p, q: tf.linalg.diag_part(tf.linalg.matmul(p, q, transpose_a=True)),
                          [[M, N], [M, N]], "Σ_i (p ∘ q)", 0),
    "trace": (lambda a, b: tf.linalg.trace(a @ b), [[N, M], [M, N]], "Σ_j (a ∘ bᵀ)", 1),
    "trace_of_gram": (lambda a, b: tf.linalg.trace(tf.linalg.matmul(a, b, transpose_b=True)),
                      [[N, M], [N, M]], "Σ_j (a ∘ b)", 0),
    "batched": (lambda a, b: tf.linalg.diag_part(a @ b @ tf.linalg.matrix_transpose(a)),
                [[3, N, M], [M, M]], "Σ_j (a ∘ (a @ bᵀ))", 0),
    "non_square": (lambda p, q: tf.linalg.diag_part(p @ q), [[N, M], [M, N // 2]], "Σ_j (p ∘ qᵀ)", 1),
    "tensor_diag_part": (lambda p, q: tf.linalg.tensor_diag_part(p @ q), [[N, M], [M, N]],
                         "Σ_j (p ∘ qᵀ)", 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_contracts_without_the_product(name: str, rng: np.random.Generator) -> None:
    fn, shapes, contraction, transposes = CASES[name]
    args = inputs(rng, shapes, tf.float64)
    function = rewrite(fn)
    (fired,) = records(function, *args, status="fired")
    assert fired.details["after"] == contraction
    graph = Graph(function.report(*args).rewritten_graph_def)
    ops = graph.op_counts()
    assert not set(ops) & set(DIAG_OPS)
    assert ops.get("Transpose", 0) == transposes
    assert ops["Mul"] == 1 and ops["Sum"] >= 1
    original = Graph(function.report(*args).original_graph_def)
    assert largest_tensor(original) >= N * N // 2
    assert largest_tensor(graph) <= max(int(np.prod(s)) for s in shapes)  # never beyond the inputs


@pytest.mark.parametrize("gradient", [False, True], ids=["value", "gradient"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_numerically_equal(name: str, dtype: tf.DType, gradient: bool, rng: np.random.Generator) -> None:
    fn, shapes, _, _ = CASES[name]
    fn = with_gradient(fn) if gradient else fn
    args = inputs(rng, shapes, dtype)
    function = rewrite(fn)
    assert records(function, *args, status="fired")  # the forward diagonal is contracted
    assert_close(function(*args), fn(*args), dtype)


@pytest.mark.parametrize("name", sorted(CASES))
def test_memory_estimate_goes_down(name: str, rng: np.random.Generator) -> None:
    fn, shapes, _, _ = CASES[name]
    args = inputs(rng, shapes, tf.float64)
    concrete = tf.function(fn).get_concrete_function(*args)
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    result = tfmem.PassManager([p() for p in PASSES], lint=True).run(graph, tfmem.PassContext(tfmem.Config()))
    before, after = tfmem.estimate_memory(graph), tfmem.estimate_memory(result.graph)
    assert after.peak_bytes < before.peak_bytes
    assert all(t.nbytes < N * N * 8 // 2 for t in after.live_at_peak)


def test_predictive_variance_never_plans_n_by_n(rng: np.random.Generator) -> None:
    """The issue's scale check, small: static estimate and XLA's plan stay O(N·M)."""
    n, m = 2000, 20
    knm, qinv = inputs(rng, [[n, m], [m, m]], tf.float64)

    @tfmem.function(config={"passes": ["cleanup", "reorder"], "strict": True})
    def predictive_variance(knm: tf.Tensor, qinv: tf.Tensor) -> tf.Tensor:
        return tf.linalg.diag_part(knm @ qinv @ tf.transpose(knm))  # [n]

    report = predictive_variance.explain(knm, qinv)
    assert ContractDiagOfProduct.name in {r.pass_name for r in report.fired}
    assert report.memory_before.peak_bytes >= n * n * 8
    assert report.memory_after.peak_bytes < n * n * 8 // 10
    assert report.xla_bytes_after is not None and report.xla_bytes_after < n * n * 8 // 10
    assert report.xla_bytes_before >= n * n * 8  # stock XLA does build the [n, n] product
    want = np.einsum("nm,mk,nk->n", knm.numpy(), qinv.numpy(), knm.numpy())
    np.testing.assert_allclose(predictive_variance(knm, qinv).numpy(), want, rtol=1e-10)


# --- rejections -------------------------------------------------------------------------------

def test_rejects_product_used_elsewhere(rng: np.random.Generator) -> None:
    def fn(a: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        gram = a @ tf.transpose(a)
        return tf.linalg.diag_part(gram), tf.reduce_max(gram)

    (a,) = inputs(rng, [[N, M]], tf.float64)
    function = rewrite(fn)
    (rejected,) = records(function, a, status="rejected")
    assert rejected.reason == ("product matmul is also read by Max: it is materialised anyway, "
                               "so contracting saves nothing")
    assert not records(function, a, status="fired")


def test_rejects_off_diagonal(rng: np.random.Generator) -> None:
    p, q = inputs(rng, [[N, M], [M, N]], tf.float64)
    function = rewrite(lambda p, q: tf.linalg.diag_part(p @ q, k=1))
    (rejected,) = records(function, p, q, status="rejected")
    assert rejected.reason == "only the main diagonal is handled, k=1"


def test_rejects_when_the_product_is_smaller(rng: np.random.Generator) -> None:
    p, q = inputs(rng, [[3, 100], [100, 3]], tf.float64)
    function = rewrite(lambda p, q: tf.linalg.diag_part(p @ q))
    (rejected,) = records(function, p, q, status="rejected")
    assert rejected.reason.startswith("no saving: the product [3, 3] peaks at")


def test_rejects_dynamic_shape() -> None:
    concrete = tf.function(lambda p, q: tf.linalg.diag_part(p @ q)).get_concrete_function(
        tf.TensorSpec([None, M], tf.float32), tf.TensorSpec([M, N], tf.float32))
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    result = tfmem.PassManager([ContractDiagOfProduct()], lint=True).run(graph, tfmem.PassContext(tfmem.Config()))
    (rejected,) = result.records
    assert rejected.reason == "dynamic shape: factor p:0 has shape (None, 7)"


def test_diag_of_something_else_is_not_a_match(rng: np.random.Generator) -> None:
    (a,) = inputs(rng, [[N, N]], tf.float64)
    function = rewrite(lambda a: tf.linalg.diag_part(tf.exp(a)))
    assert function.report(a).records == ()


def test_predictive_variance_gradient_never_plans_n_by_n(rng: np.random.Generator) -> None:
    """With a tape, diag_part's gradient is an [n, n] MatrixDiag: also gone."""
    n, m = 2000, 20
    knm, qinv = inputs(rng, [[n, m], [m, m]], tf.float64)

    def loss_and_gradients(knm: tf.Tensor, qinv: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            tape.watch([knm, qinv])
            loss = tf.reduce_sum(tf.sqrt(1.0 + tf.linalg.diag_part(knm @ qinv @ tf.transpose(knm)) ** 2))
        return loss, tape.gradient(loss, [knm, qinv])

    function = tfmem.function(loss_and_gradients, config={"passes": ["cleanup", "reorder"], "strict": True})
    report = function.explain(knm, qinv)
    assert {ContractDiagOfProduct.name, ScaleByDiagonal.name} <= {r.pass_name for r in report.fired}
    assert report.memory_before.peak_bytes >= n * n * 8
    assert report.memory_after.peak_bytes < n * n * 8 // 10
    assert report.xla_bytes_before >= n * n * 8
    assert report.xla_bytes_after < n * n * 8 // 10
    assert_close(function(knm, qinv), loss_and_gradients(knm, qinv), tf.float64)
