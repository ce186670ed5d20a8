"""Predictions and ELBOs of GPflow models through `tfmem.function`, over large inputs.

`BatchedPredictor` runs `predict_f` / `predict_y` / `predict_log_density` over a test set
of any size in fixed-size batches. Every batch has the same shape (the last one is
padded and the padding dropped from the results), so each method is traced, rewritten
and compiled once, however many test points there are.

`elbo_function` wraps an SVGP's minibatch ELBO, or a GPR/SGPR objective, the same way.

Example:
    >>> predictor = BatchedPredictor(sgpr, batch_size=32, config="configs/sgpr.yaml")
    >>> mean, var = predictor.predict_y(X_test)          # numpy, [N_test, P] each
    >>> mean.shape, var.shape
    ((50, 1), (50, 1))
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import gpflow
import numpy as np
import tensorflow as tf
from gpflow.models.training_mixins import ExternalDataTrainingLossMixin, InternalDataTrainingLossMixin

import tfmem
from gpflow_integration.optimizers import ConfigLike

logger = logging.getLogger(__name__)

# How to compile a batch function: tfmem by default; stock wrappers for baselines.
Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]


class BatchedPredictor:
    """Batched, compiled predictions of a GPflow model.

    Args:
        model: a GPflow model with `predict_f` (GPR, SGPR, SVGP, ...).
        batch_size: test points per compiled call; memory grows with it.
        config: the tfmem config (a `tfmem.Config`, mapping or YAML path; None = active).
        compiler: replaces `tfmem.function` for baselines, e.g. `tf.function` or
            `lambda f: tf.function(f, jit_compile=True)`.

    Only marginal (`full_cov=False`) predictions are batched: a full covariance couples
    test points across batches.

    Example:
        >>> predictor = BatchedPredictor(sgpr, batch_size=32)
        >>> mean, var = predictor.predict_f(X_test)
        >>> nlpd = -predictor.predict_log_density(X_test, Y_test).mean()
        >>> bool(np.isfinite(nlpd))
        True
    """

    def __init__(self, model: gpflow.models.GPModel, *, batch_size: int = 1000,
                 config: ConfigLike = None, compiler: Compiler | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.batch_size = int(batch_size)
        config = tfmem.Config.coerce(config)
        self._compile: Compiler = compiler or (lambda fn: tfmem.function(fn, config=config))
        self._functions: dict[str, Callable[..., Any]] = {}

    def _function(self, name: str, body: Callable[..., Any]) -> Callable[..., Any]:
        if name not in self._functions:
            self._functions[name] = self._compile(body)
        return self._functions[name]

    @property
    def functions(self) -> dict[str, Callable[..., Any]]:
        """The compiled batch functions built so far, by method name."""
        return dict(self._functions)

    def predict_f(self, Xnew: Any) -> tuple[np.ndarray, np.ndarray]:  # noqa: N803 - GPflow's names
        """Latent mean and marginal variance at `Xnew` ([N, D]); each result is [N, P]."""
        def predict_f(X: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:  # noqa: N803
            return self.model.predict_f(X)  # [B, P], [B, P]

        return self._map(self._function("predict_f", predict_f), Xnew)

    def predict_y(self, Xnew: Any) -> tuple[np.ndarray, np.ndarray]:  # noqa: N803
        """Mean and marginal variance of held-out observations at `Xnew`; each [N, P]."""
        def predict_y(X: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:  # noqa: N803
            return self.model.predict_y(X)  # [B, P], [B, P]

        return self._map(self._function("predict_y", predict_y), Xnew)

    def predict_log_density(self, X: Any, Y: Any) -> np.ndarray:  # noqa: N803
        """Log predictive density of each held-out pair, [N]."""
        def predict_log_density(X: tf.Tensor, Y: tf.Tensor) -> tf.Tensor:  # noqa: N803
            return self.model.predict_log_density((X, Y))  # [B]

        return self._map(self._function("predict_log_density", predict_log_density), X, Y)

    def _map(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        dtype = gpflow.config.default_float()
        arrays = tuple(np.asarray(a, dtype=dtype) for a in arrays)
        n = arrays[0].shape[0]
        if any(a.shape[0] != n for a in arrays):
            raise ValueError(f"inputs have different numbers of rows: {[a.shape[0] for a in arrays]}")
        if n == 0:
            raise ValueError("no test points")
        pieces: list[Any] = []
        for start in range(0, n, self.batch_size):
            stop = min(start + self.batch_size, n)
            # Pad the last batch to the full size so its shape (and compiled program) is shared.
            batch = [_pad_rows(a[start:stop], self.batch_size) for a in arrays]
            result = fn(*[tf.constant(b) for b in batch])
            pieces.append(tf.nest.map_structure(lambda t: np.asarray(t)[: stop - start], result))
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *pieces)


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with its last row repeated up to `rows` rows."""
    missing = rows - array.shape[0]
    if missing <= 0:
        return array
    return np.concatenate([array, np.repeat(array[-1:], missing, axis=0)], axis=0)


def predict_y(model: gpflow.models.GPModel, Xnew: Any, *, batch_size: int = 1000,  # noqa: N803
              config: ConfigLike = None) -> tuple[np.ndarray, np.ndarray]:
    """`model.predict_y(Xnew)` over any number of points, in batches, through tfmem.

    Example:
        >>> mean, var = gpflow_integration.predict_y(sgpr, X_test, batch_size=32)
        >>> np.allclose(mean, sgpr.predict_y(X_test)[0])
        True
    """
    return BatchedPredictor(model, batch_size=batch_size, config=config).predict_y(Xnew)


def predict_f(model: gpflow.models.GPModel, Xnew: Any, *, batch_size: int = 1000,  # noqa: N803
              config: ConfigLike = None) -> tuple[np.ndarray, np.ndarray]:
    """`model.predict_f(Xnew)` (marginals) over any number of points, in batches, through tfmem.

    Example:
        >>> mean, var = gpflow_integration.predict_f(gpr, X_test, batch_size=32)
        >>> np.allclose(var, gpr.predict_f(X_test)[1])
        True
    """
    return BatchedPredictor(model, batch_size=batch_size, config=config).predict_f(Xnew)


def elbo_function(model: gpflow.models.GPModel, *, config: ConfigLike = None,
                  jit_compile: bool | None = None) -> tfmem.TfmemFunction:
    """The model's training objective as a tfmem function.

    For SVGP (and other minibatch models) the function takes a batch and returns the
    ELBO estimate for it: `elbo(X_batch, Y_batch)`. For models that own their data
    (SGPR: the ELBO; GPR: the log marginal likelihood) it takes no arguments.

    Example:
        >>> elbo = gpflow_integration.elbo_function(svgp)
        >>> value = elbo(X[:64], Y[:64])
        >>> np.allclose(value, svgp.elbo((X[:64], Y[:64])))
        True
    """
    if isinstance(model, ExternalDataTrainingLossMixin):
        def objective(X: tf.Tensor, Y: tf.Tensor) -> tf.Tensor:  # noqa: N803
            return model.maximum_log_likelihood_objective((X, Y))
    elif isinstance(model, InternalDataTrainingLossMixin):
        def objective() -> tf.Tensor:  # type: ignore[misc]
            return model.maximum_log_likelihood_objective()
    else:
        raise TypeError(f"{type(model).__name__} has no GPflow training objective")
    return tfmem.function(objective, config=tfmem.Config.coerce(config), jit_compile=jit_compile,
                          name=f"{type(model).__name__.lower()}_objective")
