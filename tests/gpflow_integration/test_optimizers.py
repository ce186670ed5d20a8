"""Training GPflow models through tfmem changes nothing numerically.

tfmem compiles with XLA by default, and XLA rounds differently from TensorFlow's graph
executor. So each result is compared twice: tfmem with `jit_compile: false` against
stock `tf.function` (same arithmetic), and tfmem with XLA against stock
`tf.function(jit_compile=True)`. Both must agree to 1e-6 relative.
"""
from __future__ import annotations

import gpflow
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from gpflow_integration import Scipy, elbo_function, training_loop, training_step

RTOL = 1e-6


def make_sgpr(data: tuple[np.ndarray, np.ndarray]) -> gpflow.models.SGPR:
    X, Y = data  # noqa: N806
    return gpflow.models.SGPR(data, gpflow.kernels.SquaredExponential(lengthscales=np.ones(X.shape[1])),
                              inducing_variable=X[:20].copy(), noise_variance=0.1)


def make_svgp(data: tuple[np.ndarray, np.ndarray]) -> gpflow.models.SVGP:
    X, _ = data  # noqa: N806
    return gpflow.models.SVGP(gpflow.kernels.SquaredExponential(), gpflow.likelihoods.Gaussian(),
                              inducing_variable=X[:20].copy(), num_data=len(X))


def parameters(model: gpflow.models.GPModel) -> np.ndarray:
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_scipy_matches_stock_gpflow(regression_data, jit_compile):
    X, _ = regression_data  # noqa: N806
    stock, wrapped = make_sgpr(regression_data), make_sgpr(regression_data)
    stock_result = gpflow.optimizers.Scipy().minimize(
        stock.training_loss, stock.trainable_variables, options={"maxiter": 50},
        tf_fun_args={"jit_compile": True} if jit_compile else {})
    optimizer = Scipy(config={"jit_compile": jit_compile, "strict": True})
    result = optimizer.minimize(wrapped.training_loss, wrapped.trainable_variables, options={"maxiter": 50})

    assert result.nfev == stock_result.nfev
    np.testing.assert_allclose(parameters(wrapped), parameters(stock), rtol=RTOL)
    np.testing.assert_allclose(wrapped.elbo().numpy(), stock.elbo().numpy(), rtol=RTOL)
    for got, want in zip(wrapped.predict_y(X[:50]), stock.predict_y(X[:50])):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL)
    [report] = optimizer.reports()
    assert report.status in ("rewritten", "unchanged")  # it really ran through tfmem


def test_scipy_with_xla_is_close_to_stock_graph_execution(regression_data):
    """Against GPflow's default (no XLA): the fitted model agrees; parameters within rounding."""
    X, _ = regression_data  # noqa: N806
    stock, wrapped = make_sgpr(regression_data), make_sgpr(regression_data)
    gpflow.optimizers.Scipy().minimize(stock.training_loss, stock.trainable_variables, options={"maxiter": 50})
    Scipy(config={"strict": True}).minimize(wrapped.training_loss, wrapped.trainable_variables,
                                            options={"maxiter": 50})
    np.testing.assert_allclose(wrapped.elbo().numpy(), stock.elbo().numpy(), rtol=RTOL)
    np.testing.assert_allclose(wrapped.predict_y(X)[0].numpy(), stock.predict_y(X)[0].numpy(), rtol=RTOL,
                               atol=1e-8)
    # XLA's rounding, carried through 50 L-BFGS steps, moves weakly determined
    # parameters (inducing inputs) by a few parts in a million.
    np.testing.assert_allclose(parameters(wrapped), parameters(stock), rtol=1e-4)


def test_scipy_accepts_compiled_closure(regression_data):
    """`model.training_loss_closure()` is a tf.function; tfmem traces through it."""
    stock, wrapped = make_sgpr(regression_data), make_sgpr(regression_data)
    gpflow.optimizers.Scipy().minimize(stock.training_loss_closure(), stock.trainable_variables,
                                       options={"maxiter": 5})
    Scipy(config={"jit_compile": False, "strict": True}).minimize(
        wrapped.training_loss_closure(), wrapped.trainable_variables, options={"maxiter": 5})
    np.testing.assert_allclose(parameters(wrapped), parameters(stock), rtol=RTOL)


def test_scipy_without_compile_is_plain_gpflow(regression_data):
    stock, wrapped = make_sgpr(regression_data), make_sgpr(regression_data)
    gpflow.optimizers.Scipy().minimize(stock.training_loss, stock.trainable_variables, compile=False,
                                       options={"maxiter": 3})
    optimizer = Scipy()
    optimizer.minimize(wrapped.training_loss, wrapped.trainable_variables, compile=False,
                       options={"maxiter": 3})
    np.testing.assert_array_equal(parameters(wrapped), parameters(stock))
    assert optimizer.functions == []


def test_scipy_rejects_tf_fun_args_without_tfmem_equivalent(regression_data):
    model = make_sgpr(regression_data)
    with pytest.raises(ValueError, match="reduce_retracing"):
        Scipy().minimize(model.training_loss, model.trainable_variables,
                         tf_fun_args={"reduce_retracing": True})


def stock_adam_losses(model: gpflow.models.GPModel, steps: int, jit_compile: bool,
                      batch: tuple[tf.Tensor, tf.Tensor] | None = None) -> list[float]:
    optimizer = tf.keras.optimizers.Adam(0.01)
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function(jit_compile=jit_compile)
    def step(*data: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(variables)
            loss = model.training_loss(data) if data else model.training_loss()
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    return [float(step(*(batch or ()))) for _ in range(steps)]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_keras_training_loop_matches_stock(regression_data, jit_compile):
    stock, wrapped = make_sgpr(regression_data), make_sgpr(regression_data)
    want = stock_adam_losses(stock, 20, jit_compile)
    got = training_loop(wrapped, tf.keras.optimizers.Adam(0.01), 20,
                        config={"jit_compile": jit_compile, "strict": True})
    np.testing.assert_allclose(got, want, rtol=RTOL)
    np.testing.assert_allclose(parameters(wrapped), parameters(stock), rtol=RTOL)


def test_keras_training_loop_on_svgp_minibatches(regression_data):
    X, Y = regression_data  # noqa: N806
    batch = (tf.constant(X[:64]), tf.constant(Y[:64]))
    stock, wrapped = make_svgp(regression_data), make_svgp(regression_data)
    want = stock_adam_losses(stock, 10, jit_compile=True, batch=batch)
    got = training_loop(wrapped, tf.keras.optimizers.Adam(0.01), 10, data=batch, config={"strict": True})
    np.testing.assert_allclose(got, want, rtol=RTOL)
    np.testing.assert_allclose(parameters(wrapped), parameters(stock), rtol=RTOL)


def test_training_step_reports_through_tfmem(regression_data):
    step = training_step(make_sgpr(regression_data), tf.keras.optimizers.Adam(0.01),
                         config={"strict": True})
    assert isinstance(step, tfmem.TfmemFunction)
    step()
    assert step.report().status in ("rewritten", "unchanged")


def test_training_loop_checks_data_against_model(regression_data):
    X, Y = regression_data  # noqa: N806
    with pytest.raises(ValueError, match="minibatches"):
        training_loop(make_svgp(regression_data), tf.keras.optimizers.Adam(0.01), 1)
    with pytest.raises(ValueError, match="owns its data"):
        training_loop(make_sgpr(regression_data), tf.keras.optimizers.Adam(0.01), 1, data=(X, Y))
    with pytest.raises(TypeError, match="apply_gradients"):
        training_step(make_sgpr(regression_data), gpflow.optimizers.Scipy())


def test_svgp_minibatch_elbo_matches_stock(regression_data):
    X, Y = regression_data  # noqa: N806
    model = make_svgp(regression_data)
    elbo = elbo_function(model, config={"strict": True})
    for start in (0, 50):
        batch = (tf.constant(X[start:start + 50]), tf.constant(Y[start:start + 50]))
        np.testing.assert_allclose(elbo(*batch).numpy(), model.elbo(batch).numpy(), rtol=RTOL)


def test_sgpr_elbo_function_matches_stock(regression_data):
    model = make_sgpr(regression_data)
    np.testing.assert_allclose(elbo_function(model, config={"strict": True})().numpy(),
                               model.elbo().numpy(), rtol=RTOL)


# [20, 200] float64 matrices are 32 KB: a 16KB threshold makes tfmem split SGPR's [M, N] tensors.
SPLIT = {"strict": True, "tensor_size_threshold": "16KB"}


def test_scipy_with_splitting_matches_stock(regression_data):
    stock, wrapped = make_sgpr(regression_data), make_sgpr(regression_data)
    stock_opt, optimizer = gpflow.optimizers.Scipy(), Scipy(config=SPLIT)
    x0 = optimizer.initial_parameters(wrapped.trainable_variables).numpy()
    want_loss, want_grad = stock_opt.eval_func(stock.training_loss, stock.trainable_variables,
                                               tf_fun_args={"jit_compile": True})(x0)
    got_loss, got_grad = optimizer.eval_func(wrapped.training_loss, wrapped.trainable_variables,
                                             tf_fun_args={})(x0)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-12)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-9, atol=1e-12)
    [report] = optimizer.reports()
    assert report.splits, str(report)
    assert report.memory_after.peak_bytes < report.memory_before.peak_bytes

    stock_opt.minimize(stock.training_loss, stock.trainable_variables, options={"maxiter": 50},
                       tf_fun_args={"jit_compile": True})
    optimizer.minimize(wrapped.training_loss, wrapped.trainable_variables, options={"maxiter": 50})
    np.testing.assert_allclose(wrapped.elbo().numpy(), stock.elbo().numpy(), rtol=RTOL)
    X, _ = regression_data  # noqa: N806
    np.testing.assert_allclose(wrapped.predict_y(X)[0].numpy(), stock.predict_y(X)[0].numpy(),
                               rtol=1e-4, atol=1e-6)  # chunked sums round differently; L-BFGS amplifies it


def test_keras_training_loop_with_splitting_matches_stock(regression_data):
    stock, wrapped = make_sgpr(regression_data), make_sgpr(regression_data)
    want = stock_adam_losses(stock, 20, jit_compile=True)
    step = training_step(wrapped, tf.keras.optimizers.Adam(0.01), config=SPLIT)
    got = [float(step()) for _ in range(20)]
    assert step.report().splits
    np.testing.assert_allclose(got, want, rtol=RTOL)
    np.testing.assert_allclose(parameters(wrapped), parameters(stock), rtol=RTOL)
