"""Data-parallel SGPR and SVGP equal single-device stock GPflow.

The two-replica scenarios run once, in a fresh process whose CPU is split into two
logical devices (`two_cpu_scenarios`); the tests check what it returned. Each compares
against stock GPflow on one device in the same process, started from the same parameters.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gpflow
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_probability as tfp

import tfmem
from gpflow_integration import (DataParallelSGPR, DataParallelSVGP, collapsed_elbo, sgpr_statistics,
                                shard_rows)
from tests import background
from tfmem.distribute import split_cpu
from tfmem.testing import run_scenarios, scenario_outcome

SGPR_CONFIG = {"tensor_size_threshold": "32kB", "memory_budget": "1MB"}  # [M, N/2] = 100 kB is split
SVGP_CONFIG = {"tensor_size_threshold": "4kB"}


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))  # noqa: N806
    Y = np.sin(2 * X[:, :1]) + 0.5 * X[:, 1:2] + 0.1 * rng.normal(size=(n, 1))  # noqa: N806
    return X, Y


def make_sgpr(data: tuple[np.ndarray, np.ndarray], num_inducing: int = 25) -> gpflow.models.SGPR:
    """SE kernel (ARD), a constant mean and a prior on the variance: every term of the loss."""
    X, _ = data  # noqa: N806
    model = gpflow.models.SGPR(data, gpflow.kernels.SquaredExponential(lengthscales=[1.0, 0.8, 1.2]),
                               inducing_variable=X[:num_inducing].copy(), noise_variance=0.1,
                               mean_function=gpflow.mean_functions.Constant(0.3))
    model.kernel.variance.prior = tfp.distributions.Gamma(np.float64(2.0), np.float64(2.0))
    return model


def make_svgp(data: tuple[np.ndarray, np.ndarray], num_inducing: int = 20) -> gpflow.models.SVGP:
    X, _ = data  # noqa: N806
    return gpflow.models.SVGP(gpflow.kernels.SquaredExponential(lengthscales=[1.0, 0.8, 1.2]),
                              gpflow.likelihoods.Gaussian(0.1), inducing_variable=X[:num_inducing].copy(),
                              num_data=len(X))


def rel_err(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def stock_loss_and_gradients(model: gpflow.models.GPModel, data: Any = None) -> tuple[float, list[np.ndarray]]:
    with tf.GradientTape() as tape:
        loss = model.training_loss() if data is None else model.training_loss(data)
    return float(loss), [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


# --- in this process ----------------------------------------------------------------


def test_bound_from_statistics_equals_gpflow_elbo_and_gradients() -> None:
    data = make_data(300)
    model = make_sgpr(data)
    X, Y = (tf.constant(a) for a in data)  # noqa: N806
    with tf.GradientTape() as tape:
        halves = [sgpr_statistics(model, X[:140], Y[:140]), sgpr_statistics(model, X[140:], Y[140:])]
        summed = tf.nest.map_structure(lambda a, b: a + b, *halves)
        elbo = collapsed_elbo(summed, num_outputs=1)
    grads = tape.gradient(elbo, model.trainable_variables)
    with tf.GradientTape() as tape:
        want = model.elbo()
    want_grads = tape.gradient(want, model.trainable_variables)
    assert rel_err(elbo, want) < 1e-12
    for got, expected in zip(grads, want_grads):
        assert rel_err(got, expected) < 1e-10


def test_one_device_strategy_equals_gpflow() -> None:
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    data = make_data(200)
    with strategy.scope():
        model = make_sgpr(data)
    sgpr = DataParallelSGPR(model, strategy, config=SGPR_CONFIG)
    loss, grads = sgpr.loss_and_gradients()
    want_loss, want_grads = stock_loss_and_gradients(model)
    assert rel_err(loss, want_loss) < 1e-10
    assert rel_err(sgpr.elbo(), model.elbo()) < 1e-10
    for got, want in zip(grads, want_grads):
        assert rel_err(got, want) < 1e-10
    statistics, vjp = sgpr.reports()
    assert (statistics.function_name, vjp.function_name) == ("sgpr_statistics", "sgpr_statistics_vjp")
    for report in (statistics, vjp):
        assert report.replica.strategy == "OneDeviceStrategy" and report.status == "rewritten"


def test_checks_its_arguments() -> None:
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    data = make_data(50)
    with pytest.raises(TypeError, match="SGPR"):
        DataParallelSGPR(make_svgp(data), strategy)
    with pytest.raises(TypeError, match="SVGP"):
        DataParallelSVGP(make_sgpr(data), strategy)
    svgp = gpflow.models.SVGP(gpflow.kernels.SquaredExponential(), gpflow.likelihoods.Gaussian(), data[0][:5])
    with pytest.raises(ValueError, match="num_data"):
        DataParallelSVGP(svgp, strategy)
    with pytest.raises(ValueError, match="different numbers of rows"):
        shard_rows(strategy, data[0], data[1][:10])


# --- on two logical CPU devices, in a fresh process ------------------------------------


def two_cpu_scenarios() -> dict[str, Any]:
    """Every two-replica scenario's results (or traceback); run in a fresh process."""
    return run_scenarios(SCENARIOS, tf.distribute.MirroredStrategy(split_cpu(2)))


def _describe(reports: list[tfmem.Report]) -> list[dict[str, Any]]:
    return [{"function": r.function_name, "status": r.status, "reason": r.reason,
             "replica_id": r.replica.replica_id if r.replica else None,
             "budget": r.budget.nbytes if r.budget else None, "splits": len(r.splits),
             "signature": r.signature} for r in reports]


def _sgpr(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    """The ELBO, the loss and its gradients, then 10 Adam steps, against stock GPflow."""
    data = make_data(1001)  # 500 and 501 rows: the replicas trace different shapes
    with strategy.scope():
        model = make_sgpr(data)
        adam = tf.keras.optimizers.Adam(0.05)
    sgpr = DataParallelSGPR(model, strategy, config=SGPR_CONFIG)
    loss, grads = sgpr.loss_and_gradients()
    stock, stock_adam = make_sgpr(data), tf.keras.optimizers.Adam(0.05)
    want_loss, want_grads = stock_loss_and_gradients(stock)
    shards = [x.shape[0] for x in strategy.experimental_local_results(sgpr.X)]
    outcome = {"elbo": rel_err(sgpr.elbo(), stock.elbo()), "loss": rel_err(loss, want_loss),
               "grads": [rel_err(g, w) for g, w in zip(grads, want_grads)], "shards": shards}

    @tf.function
    def stock_step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = stock.training_loss()
        stock_adam.apply_gradients(zip(tape.gradient(loss, stock.trainable_variables), stock.trainable_variables))
        return loss

    step = sgpr.training_step(adam)
    losses = [float(step()) for _ in range(10)]
    want = [float(stock_step()) for _ in range(10)]
    return outcome | {
        "adam_losses": rel_err(losses, want), "moved": rel_err(losses[-1], losses[0]),
        "adam_parameters": [rel_err(a.numpy(), b.numpy()) for a, b in zip(model.trainable_variables,
                                                                          stock.trainable_variables)],
        "reports": _describe(sgpr.reports())}


def _svgp_adam(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    data = make_data(1000)
    with strategy.scope():
        model = make_svgp(data)
        adam = tf.keras.optimizers.Adam(0.05)
    svgp = DataParallelSVGP(model, strategy, config=SVGP_CONFIG)
    step = svgp.training_step(adam)
    stock, stock_adam = make_svgp(data), tf.keras.optimizers.Adam(0.05)

    @tf.function
    def stock_step(X: tf.Tensor, Y: tf.Tensor) -> tf.Tensor:  # noqa: N803
        with tf.GradientTape() as tape:
            loss = stock.training_loss((X, Y))
        stock_adam.apply_gradients(zip(tape.gradient(loss, stock.trainable_variables), stock.trainable_variables))
        return loss

    rng = np.random.default_rng(1)
    losses, want = [], []
    for _ in range(20):
        batch = rng.choice(len(data[0]), size=64, replace=False)  # the global batch; 32 per replica
        X, Y = data[0][batch], data[1][batch]  # noqa: N806
        losses.append(float(step(*shard_rows(strategy, X, Y))))
        want.append(float(stock_step(tf.constant(X), tf.constant(Y))))
    return {"losses": rel_err(losses, want), "moved": rel_err(losses[-1], losses[0]),
            "parameters": [rel_err(a.numpy(), b.numpy()) for a, b in zip(model.trainable_variables,
                                                                         stock.trainable_variables)],
            "reports": _describe(svgp.reports()),
            # Distinct pass-pipeline runs: GPflow's traces differ per replica only in their
            # custom-gradient ids, so the two replicas share one.
            "rewrites": len(svgp.local_elbo._rewrites)}


def _unmirrored_model(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    try:
        DataParallelSGPR(make_sgpr(make_data(20), num_inducing=5), strategy)
    except ValueError as err:
        return {"message": str(err)}
    return {"message": None}


SCENARIOS: dict[str, Callable[[tf.distribute.Strategy], dict[str, Any]]] = {
    "sgpr": _sgpr,
    "svgp_adam": _svgp_adam,
    "unmirrored_model": _unmirrored_model,
}


@background.job("two_cpus")
def two_cpu_run() -> dict[str, Any]:
    """Every scenario in one process whose CPU is split in two (beside the other tests)."""
    result = tfmem.run_isolated("tests.gpflow_integration.test_distributed:two_cpu_scenarios", timeout=1800)
    assert result.ok, result.error
    return result.value


@pytest.fixture(scope="module")
def two_cpus() -> dict[str, Any]:
    return background.result("two_cpus")


@pytest.mark.background("two_cpus")
def test_sgpr_elbo_and_gradients_equal_single_device_gpflow(two_cpus: dict[str, Any]) -> None:
    outcome = scenario_outcome(two_cpus, "sgpr")
    assert outcome["shards"] == [500, 501]
    assert outcome["elbo"] <= 1e-8 and outcome["loss"] <= 1e-8
    assert max(outcome["grads"]) <= 1e-8
    reports = outcome["reports"]
    # Each replica's statistics and their vector-Jacobian product, its [M, N/2] tensors split.
    assert sorted((r["function"], r["replica_id"]) for r in reports) == [
        ("sgpr_statistics", 0), ("sgpr_statistics", 1), ("sgpr_statistics_vjp", 0), ("sgpr_statistics_vjp", 1)]
    for report in reports:
        assert report["status"] == "rewritten" and report["splits"] >= 1
        assert report["budget"] == tfmem.Config(**SGPR_CONFIG).memory_budget


@pytest.mark.background("two_cpus")
def test_sgpr_adam_steps_equal_single_device_gpflow(two_cpus: dict[str, Any]) -> None:
    outcome = scenario_outcome(two_cpus, "sgpr")
    assert outcome["moved"] > 1e-3  # training changed the loss
    assert outcome["adam_losses"] <= 1e-8
    assert max(outcome["adam_parameters"]) <= 1e-8


@pytest.mark.background("two_cpus")
def test_svgp_20_adam_steps_equal_single_device_gpflow(two_cpus: dict[str, Any]) -> None:
    outcome = scenario_outcome(two_cpus, "svgp_adam")
    assert outcome["moved"] > 1e-3
    assert outcome["losses"] <= 1e-6
    assert max(outcome["parameters"]) <= 1e-6
    assert sorted((r["function"], r["replica_id"]) for r in outcome["reports"]) == [
        ("svgp_elbo", 0), ("svgp_elbo", 1), ("svgp_elbo_vjp", 0), ("svgp_elbo_vjp", 1)]
    assert all(r["status"] in ("rewritten", "unchanged") for r in outcome["reports"])
    assert outcome["rewrites"] == 1


@pytest.mark.background("two_cpus")
def test_model_outside_strategy_scope_is_refused(two_cpus: dict[str, Any]) -> None:
    message = scenario_outcome(two_cpus, "unmirrored_model")["message"]
    assert message is not None and "strategy.scope()" in message
