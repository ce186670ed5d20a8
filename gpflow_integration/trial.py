"""One `tfmem compare` trial: train and evaluate SGPR with M inducing points, one method.

`sgpr_trial` is what `tfmem.run_isolated` calls in a fresh process under the memory
budget, so everything it needs arrives as plain, picklable values and it returns a
plain dict. It can also be called in-process for debugging:

Example:
    >>> result = sgpr_trial({"method": "tfmem", "num_inducing": 50, "dataset": "synthetic",
    ...                      "num_train": 500, "num_test": 100, "input_dim": 2, "seed": 0,
    ...                      "test_fraction": 0.1, "optimizer": "scipy", "iterations": 5,
    ...                      "learning_rate": 0.01, "predict_batch_size": 100, "tfmem_config": {}})
    >>> result["method"], result["num_inducing"], result["rmse"] < 1  # better than the mean
    ('tfmem', 50, True)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _compiler(method: str, config: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    import tensorflow as tf

    import tfmem

    if method == "tf_function":
        return tf.function
    if method == "tf_function_jit":
        return lambda fn: tf.function(fn, jit_compile=True)
    if method == "tfmem":
        return lambda fn: tfmem.function(fn, config=config)
    raise ValueError(f"unknown method {method!r}")


def sgpr_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """Trains SGPR on the spec's data with one method, then predicts the test set.

    Args:
        spec: method ("tf_function", "tf_function_jit" or "tfmem"), num_inducing, the
            data keys of `gpflow_integration.load_dataset` (dataset, num_train, num_test,
            input_dim, test_fraction, seed), optimizer ("scipy" or "adam"), iterations,
            learning_rate, predict_batch_size, and tfmem_config (a mapping of
            `tfmem.Config` keys).

    Returns:
        final_loss (the training loss, i.e. -ELBO, at the optimiser's last point),
        evaluations, compile_seconds (first loss-and-gradient call, including tracing
        and compilation), step_seconds (mean of later calls), rmse and nlpd on the
        standardised test targets, and for tfmem its report status. The loss comes from
        the method's own compiled step: an eager `model.elbo()` would need more memory
        than the step it checks and could run out where the step did not.
    """
    import gpflow
    import numpy as np
    import tensorflow as tf

    import tfmem
    from gpflow_integration.data import load_dataset
    from gpflow_integration.optimizers import Scipy, training_step
    from gpflow_integration.predict import BatchedPredictor

    method, num_inducing = spec["method"], int(spec["num_inducing"])
    data = load_dataset(spec["dataset"], num_train=spec["num_train"], num_test=spec["num_test"],
                        input_dim=spec["input_dim"], test_fraction=spec["test_fraction"], seed=spec["seed"])
    config = tfmem.Config.from_mapping(spec.get("tfmem_config") or {})
    compile_fn = _compiler(method, config)

    rng = np.random.default_rng(spec["seed"])
    Z = data.X_train[rng.permutation(len(data.X_train))[:num_inducing]].copy()  # noqa: N806 - [M, D]
    kernel = gpflow.kernels.SquaredExponential(lengthscales=np.ones(data.input_dim))
    model = gpflow.models.SGPR((data.X_train, data.Y_train), kernel, inducing_variable=Z,
                               noise_variance=0.1)
    variables = model.trainable_variables

    result: dict[str, Any] = {"method": method, "num_inducing": num_inducing,
                              "num_train": len(data.X_train), "num_test": len(data.X_test)}
    if spec["optimizer"] == "scipy":
        if method == "tfmem":
            optimizer: Any = Scipy(config=config)
            fun_args: dict[str, Any] = {}
        else:
            optimizer = gpflow.optimizers.Scipy()
            fun_args = {"jit_compile": True} if method == "tf_function_jit" else {}
        evaluate = optimizer.eval_func(model.training_loss, variables, tf_fun_args=fun_args, compile=True)
        x0 = optimizer.initial_parameters(variables).numpy()
        start = time.perf_counter()
        evaluate(x0)  # traces and compiles; `minimize` below reuses it from the compile cache
        result["compile_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        outcome = optimizer.minimize(model.training_loss, variables, tf_fun_args=fun_args,
                                     options={"maxiter": int(spec["iterations"])})
        result["train_seconds"] = time.perf_counter() - start
        result["evaluations"] = int(outcome.nfev)
        result["final_loss"] = float(outcome.fun)
        result["step_seconds"] = result["train_seconds"] / max(1, int(outcome.nfev))
        if method == "tfmem":
            reports = optimizer.reports()
            if reports:
                result.update(_report_summary(reports[0]))
    else:
        keras_optimizer = tf.keras.optimizers.Adam(float(spec["learning_rate"]))
        step = training_step(model, keras_optimizer, config=config)
        run = step if method == "tfmem" else compile_fn(step.python_function)
        start = time.perf_counter()
        run()
        result["compile_seconds"] = time.perf_counter() - start
        iterations = int(spec["iterations"])
        start = time.perf_counter()
        for _ in range(iterations):
            loss = run()
        result["final_loss"] = float(loss)  # also waits for the last step
        result["train_seconds"] = time.perf_counter() - start
        result["evaluations"] = iterations + 1
        result["step_seconds"] = result["train_seconds"] / iterations
        if method == "tfmem":
            result.update(_report_summary(step.report()))


    predictor = BatchedPredictor(model, batch_size=min(int(spec["predict_batch_size"]), len(data.X_test)),
                                 compiler=compile_fn)
    mean, var = predictor.predict_y(data.X_test)  # [N_test, 1] each
    # SGPR's likelihood is Gaussian, so the predictive density is N(y | mean, var): the
    # same number as `predict_log_density`, without compiling a second program.
    log_density = -0.5 * (np.log(2 * np.pi * var) + (data.Y_test - mean) ** 2 / var)  # [N_test, 1]
    result["rmse"] = float(np.sqrt(np.mean((mean - data.Y_test) ** 2)))
    result["nlpd"] = float(-np.mean(log_density))
    return result


def _report_summary(report: Any) -> dict[str, Any]:
    """What tfmem did to the training step: status, splits, static peak before and after."""
    return {
        "tfmem_status": report.status,
        "tfmem_reason": report.reason,
        "tfmem_summary": report.summary(),
        "tfmem_splits": len(report.splits),
        "tfmem_unsplit": sum(1 for r in report.rejected if r.kind == "split"),
        "tfmem_static_peak_before": report.memory_before.peak_bytes if report.memory_before else None,
        "tfmem_static_peak_after": report.memory_after.peak_bytes if report.memory_after else None,
    }
