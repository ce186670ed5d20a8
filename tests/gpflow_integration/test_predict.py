"""Batched predictions through tfmem equal GPflow's own, whatever the batch split."""
from __future__ import annotations

import gpflow
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from gpflow_integration import BatchedPredictor, predict_f, predict_y

RTOL = 1e-6


def make_model(kind: str, data: tuple[np.ndarray, np.ndarray]) -> gpflow.models.GPModel:
    X, _ = data  # noqa: N806
    kernel = gpflow.kernels.Matern52(lengthscales=np.ones(X.shape[1]))
    if kind == "gpr":
        return gpflow.models.GPR(data, kernel, noise_variance=0.1)
    return gpflow.models.SGPR(data, kernel, inducing_variable=X[:20].copy(), noise_variance=0.1)


@pytest.mark.parametrize("kind", ["gpr", "sgpr"])
@pytest.mark.parametrize("batch_size", [16, 77, 500], ids=["uneven", "odd", "one-batch"])
def test_batched_predictions_match_gpflow(regression_data, rng, kind, batch_size):
    model = make_model(kind, regression_data)
    X_test = rng.standard_normal((77, 3))  # noqa: N806 - 77 is not a multiple of 16
    Y_test = rng.standard_normal((77, 1))  # noqa: N806
    predictor = BatchedPredictor(model, batch_size=batch_size, config={"strict": True})

    for got, want in zip(predictor.predict_f(X_test), model.predict_f(X_test)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want.numpy(), rtol=RTOL, atol=1e-10)
    for got, want in zip(predictor.predict_y(X_test), model.predict_y(X_test)):
        np.testing.assert_allclose(got, want.numpy(), rtol=RTOL, atol=1e-10)
    np.testing.assert_allclose(predictor.predict_log_density(X_test, Y_test),
                               model.predict_log_density((X_test, Y_test)).numpy(), rtol=RTOL)


def test_each_method_is_traced_once_for_many_batches(regression_data, rng):
    model = make_model("sgpr", regression_data)
    predictor = BatchedPredictor(model, batch_size=10, config={"strict": True})
    predictor.predict_y(rng.standard_normal((95, 3)))  # 10 batches, the last one padded
    function = predictor.functions["predict_y"]
    assert function.experimental_get_tracing_count() == 1

def test_stock_compiler_for_baselines(regression_data, rng):
    model = make_model("sgpr", regression_data)
    X_test = rng.standard_normal((30, 3))  # noqa: N806
    stock = BatchedPredictor(model, batch_size=8, compiler=lambda f: tf.function(f, jit_compile=True))
    np.testing.assert_allclose(stock.predict_y(X_test)[0], model.predict_y(X_test)[0].numpy(), rtol=RTOL)


def test_module_level_helpers(regression_data, rng):
    model = make_model("gpr", regression_data)
    X_test = rng.standard_normal((40, 3))  # noqa: N806
    np.testing.assert_allclose(predict_f(model, X_test, batch_size=16)[0],
                               model.predict_f(X_test)[0].numpy(), rtol=RTOL)
    np.testing.assert_allclose(predict_y(model, X_test, batch_size=16)[1],
                               model.predict_y(X_test)[1].numpy(), rtol=RTOL)


def test_bad_inputs(regression_data):
    model = make_model("gpr", regression_data)
    with pytest.raises(ValueError, match="batch_size"):
        BatchedPredictor(model, batch_size=0)
    with pytest.raises(ValueError, match="different numbers of rows"):
        BatchedPredictor(model).predict_log_density(np.zeros((3, 3)), np.zeros((2, 1)))


def test_batched_predictions_with_splitting(regression_data, rng):
    model = make_model("sgpr", regression_data)
    X_test = rng.standard_normal((250, 3))  # noqa: N806
    # [20, 100] float64 is 16 KB: an 8KB threshold splits the per-batch [M, B] tensors.
    predictor = BatchedPredictor(model, batch_size=100, config={"strict": True, "tensor_size_threshold": "8KB"})
    for got, want in zip(predictor.predict_y(X_test), model.predict_y(X_test)):
        np.testing.assert_allclose(got, want.numpy(), rtol=RTOL, atol=1e-10)
    report = predictor.functions["predict_y"].report(tf.constant(X_test[:100]))
    assert report.splits, str(report)


@pytest.mark.parametrize("kind", ["gpr", "sgpr"])
def test_variances_read_from_a_full_covariance_form_no_test_by_test_matrix(regression_data, rng, kind):
    """`diag_part(cov[0])` and `trace(cov[0])` of `predict_f(full_cov=True)` with a sum kernel:
    GPflow adds the kernels with `AddN` and SGPR adds the latent axis with `var[None, ...]`;
    the diagonal goes through both, so no [n*, n*] matrix is formed."""
    model = make_model(kind, regression_data)
    model.kernel = model.kernel + gpflow.kernels.RationalQuadratic(lengthscales=2.0)
    n_test = 300
    x_test = tf.constant(rng.standard_normal((n_test, 3)))

    def variances(xs):
        _, cov = model.predict_f(xs, full_cov=True)
        return tf.linalg.diag_part(cov[0]), tf.linalg.trace(cov[0])

    wrapped = tfmem.function(variances)
    graph = wrapped.report(x_test).rewritten.graph
    formed = [node.name for node in graph.nodes for spec in graph.output_specs(node.name)
              if spec.shape.rank and spec.shape.as_list()[-2:] == [n_test, n_test]]
    assert formed == [], formed
    for got, want in zip(wrapped(x_test), variances(x_test)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL)
