"""GPflow training steps that run through `tfmem.function`.

Two ways to train a GPflow model with tfmem, matching GPflow's two ways to train:

- `Scipy`: a drop-in for `gpflow.optimizers.Scipy`. Its compiled loss-and-gradient
  function (the one GPflow would wrap in `tf.function`) is wrapped in
  `tfmem.function` instead; everything else (packing variables, L-BFGS-B, callbacks,
  the compile cache) is GPflow's own code.
- `training_step` / `training_loop`: for Keras/TF optimizers (`tf.keras.optimizers.Adam`
  and friends). One step computes the loss and its gradients under a tape and applies
  them to the model's trainable variables, all inside one tfmem-wrapped function, so
  the forward, the backward and the update form one graph that tfmem rewrites.

tfmem computes tensors over the config's `tensor_size_threshold` in chunks and runs
the result under XLA; a graph with nothing to split runs as it is under XLA. Where
tfmem cannot rewrite a graph it runs the stock `tf.function` after a warning.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import gpflow
import numpy as np
import tensorflow as tf
from gpflow.models.training_mixins import ExternalDataTrainingLossMixin, InternalDataTrainingLossMixin
from gpflow.optimizers.scipy import _compute_loss_and_gradients

import tfmem

logger = logging.getLogger(__name__)

ConfigLike = Any  # tfmem.Config | Mapping[str, Any] | str | os.PathLike | None
Batch = tuple[Any, Any]

# `tf_fun_args` GPflow passes to `tf.function` that have a `tfmem.function` equivalent.
_TFMEM_FUN_ARGS = frozenset({"jit_compile", "input_signature", "name"})


def _uncompiled(closure: Callable[..., Any]) -> Callable[..., Any]:
    """The Python function inside a `tf.function`-wrapped closure, else the closure.

    GPflow's `model.training_loss_closure()` compiles by default. Inside tfmem's trace a
    nested `tf.function` becomes one opaque call node whose body the passes cannot see
    (nor split), so we trace the Python function directly; the numbers are the same.
    """
    inner = getattr(closure, "python_function", None)
    if inner is not None and callable(inner):
        logger.info("tfmem: tracing %s without its own tf.function so its ops are visible to tfmem",
                    getattr(inner, "__name__", inner))
        return inner
    return closure


class Scipy(gpflow.optimizers.Scipy):
    """`gpflow.optimizers.Scipy` whose compiled loss-and-gradient step runs through tfmem.

    A drop-in replacement: same constructor arguments plus `config`, same `minimize`.
    With `compile=True` (GPflow's default) the evaluation function is wrapped in
    `tfmem.function(..., config=config)` where GPflow would use `tf.function`;
    `tf_fun_args` may set `jit_compile` (overriding the config's), `input_signature` and
    `name`. With `compile=False` nothing is compiled and tfmem is not involved.

    Args:
        config: a `tfmem.Config`, a mapping of its keys, or a YAML path; None uses the
            active config (`tfmem.config_scope`, else `TFMEM_*` environment variables).
        compile_cache_size: as for `gpflow.optimizers.Scipy`.

    Example:
        >>> model = gpflow.models.SGPR((X, Y), gpflow.kernels.SquaredExponential(), Z)
        >>> before = float(model.training_loss())
        >>> opt = gpflow_integration.Scipy(config={"tensor_size_threshold": "256MB"})
        >>> result = opt.minimize(model.training_loss, model.trainable_variables,
        ...                       options={"maxiter": 100})
        >>> result.fun < before, opt.reports()[0].status != "fallback"
        (True, True)
    """

    def __init__(self, config: ConfigLike = None, compile_cache_size: int = 2) -> None:
        super().__init__(compile_cache_size=compile_cache_size)
        self.config = tfmem.Config.coerce(config)
        self._functions: list[tfmem.TfmemFunction] = []
        # The latest argument of each function, by id: what `reports` asks about.
        self._arguments: dict[int, tf.Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_functions"], state["_arguments"] = [], {}  # compiled functions do not pickle
        return state

    def eval_func(self, closure: Callable[[], tf.Tensor], variables: Sequence[tf.Variable],
                  tf_fun_args: Mapping[str, Any], compile: bool = True,
                  allow_unused_variables: bool = False) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """GPflow's `eval_func`, compiled with `tfmem.function` instead of `tf.function`."""
        if not compile:
            return super().eval_func(closure, variables, tf_fun_args=tf_fun_args, compile=False,
                                     allow_unused_variables=allow_unused_variables)
        unknown = sorted(set(tf_fun_args) - _TFMEM_FUN_ARGS)
        if unknown:
            raise ValueError(f"tf_fun_args {unknown} have no tfmem.function equivalent; "
                             f"supported: {sorted(_TFMEM_FUN_ARGS)}")
        loss_closure = _uncompiled(closure)
        first_call = True

        # The body is GPflow's `_tf_eval`: assign the flat parameter vector, then loss and
        # gradients. Only the wrapper that compiles it differs.
        def _tf_eval(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            nonlocal first_call
            self.assign_tensors(variables, self.unpack_tensors(variables, x))
            if first_call:  # runs at trace time: check for unconnected gradients once
                loss, grads = _compute_loss_and_gradients(loss_closure, variables,
                                                          tf.UnconnectedGradients.NONE)
                grads = self._filter_unused_variables(variables, grads, allow_unused_variables)
                first_call = False
            else:
                loss, grads = _compute_loss_and_gradients(loss_closure, variables,
                                                          tf.UnconnectedGradients.ZERO)
            return loss, self.pack_tensors(grads)

        key = (closure, tuple(id(v) for v in variables), frozenset(tf_fun_args.items()),
               allow_unused_variables)
        compiled = self.compile_cache.get(key) if self.compile_cache_size > 0 else None
        if compiled is None:
            compiled = tfmem.function(_tf_eval, config=self.config,
                                      jit_compile=tf_fun_args.get("jit_compile"),
                                      input_signature=tf_fun_args.get("input_signature"),
                                      name=tf_fun_args.get("name", "scipy_loss_and_gradient"))
            self._functions.append(compiled)
            if self.compile_cache_size > 0:
                if len(self.compile_cache) >= self.compile_cache_size:
                    self.compile_cache.popitem(last=False)
                self.compile_cache[key] = compiled

        def _eval(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            argument = tf.convert_to_tensor(x)
            self._arguments[id(compiled)] = argument
            loss, grad = compiled(argument)
            return loss.numpy().astype(np.float64), grad.numpy().astype(np.float64)

        return _eval

    @property
    def functions(self) -> list[tfmem.TfmemFunction]:
        """The tfmem-wrapped evaluation functions this optimizer built, oldest first."""
        return list(self._functions)

    def reports(self) -> list[tfmem.Report]:
        """The tfmem report of each evaluation function called so far, oldest first."""
        return [f.report(self._arguments[id(f)]) for f in self._functions if id(f) in self._arguments]


def _build_optimizer(optimizer: Any, variables: Sequence[tf.Variable]) -> None:
    """Creates the optimizer's slot variables before tracing.

    A function that creates variables traces differently on its first call; building
    the slots eagerly keeps the traced step a plain read-and-update of existing state,
    which is what tfmem captures and re-binds.
    """
    if hasattr(optimizer, "build") and not getattr(optimizer, "built", False):
        optimizer.build(list(variables))  # Keras 3 and tf_keras optimizers
    elif hasattr(optimizer, "_create_all_weights"):
        optimizer._create_all_weights(list(variables))  # tf_keras legacy optimizers


def training_step(model: gpflow.models.GPModel, optimizer: Any, *, config: ConfigLike = None,
                  variables: Sequence[tf.Variable] | None = None,
                  jit_compile: bool | None = None) -> tfmem.TfmemFunction:
    """One optimisation step of a GPflow model (loss, gradients, update) as a tfmem function.

    For models that own their data (GPR, SGPR, ...) the step takes no arguments; for
    models trained on minibatches (SVGP) it takes the batch: `step(X, Y)`. Each call
    returns the loss before the update. Keep batch shapes fixed (e.g. `drop_remainder`)
    so that the step is traced and rewritten once.

    Args:
        model: the GPflow model.
        optimizer: a Keras or TF optimizer with `apply_gradients` (e.g. `tf.keras.optimizers.Adam`).
        config: the tfmem config (a `tfmem.Config`, a mapping or a YAML path; None = active).
        variables: what to train; defaults to `model.trainable_variables`.
        jit_compile: overrides the config's `jit_compile`.

    Raises:
        TypeError: for a model without a GPflow training loss or an optimizer without
            `apply_gradients`.

    Example:
        >>> model = gpflow.models.SGPR((X, Y), gpflow.kernels.Matern52(), Z)
        >>> step = gpflow_integration.training_step(model, tf.keras.optimizers.Adam(0.01))
        >>> losses = [float(step()) for _ in range(100)]
        >>> losses[-1] < losses[0]
        True
    """
    if not hasattr(optimizer, "apply_gradients"):
        raise TypeError(f"optimizer {type(optimizer).__name__} has no apply_gradients; use a Keras/TF "
                        "optimizer here, or gpflow_integration.Scipy for L-BFGS")
    variables = tuple(model.trainable_variables if variables is None else variables)
    _build_optimizer(optimizer, variables)

    def gradients(loss_fn: Callable[[], tf.Tensor]) -> tf.Tensor:
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(variables)
            loss = loss_fn()
        grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    if isinstance(model, InternalDataTrainingLossMixin):
        def step() -> tf.Tensor:
            return gradients(model.training_loss)
    elif isinstance(model, ExternalDataTrainingLossMixin):
        def step(X: tf.Tensor, Y: tf.Tensor) -> tf.Tensor:  # noqa: N803 - GPflow's names
            return gradients(lambda: model.training_loss((X, Y)))
    else:
        raise TypeError(f"{type(model).__name__} has no GPflow training loss; expected a model with "
                        "InternalDataTrainingLossMixin (GPR, SGPR) or ExternalDataTrainingLossMixin (SVGP)")
    return tfmem.function(step, config=config, jit_compile=jit_compile,
                          name=f"{type(model).__name__.lower()}_training_step")


def training_loop(model: gpflow.models.GPModel, optimizer: Any, iterations: int, *,
                  data: Batch | Iterable[Batch] | None = None, config: ConfigLike = None,
                  variables: Sequence[tf.Variable] | None = None,
                  jit_compile: bool | None = None) -> list[float]:
    """Runs `iterations` steps of `training_step` and returns the loss of each.

    Args:
        model, optimizer, config, variables, jit_compile: as for `training_step`.
        iterations: the number of steps.
        data: for minibatch models (SVGP): one `(X, Y)` batch used at every step, or an
            iterable of batches (e.g. `iter(dataset.batch(b, drop_remainder=True).repeat())`).
            Must be None for models that own their data.

    Example:
        >>> model = gpflow.models.SVGP(gpflow.kernels.SquaredExponential(), gpflow.likelihoods.Gaussian(),
        ...                            Z, num_data=N)
        >>> batches = iter(tf.data.Dataset.from_tensor_slices((X, Y)).repeat()
        ...                .shuffle(N).batch(64, drop_remainder=True))
        >>> losses = gpflow_integration.training_loop(model, tf.keras.optimizers.Adam(0.01), 50,
        ...                                           data=batches)
        >>> len(losses)
        50
    """
    step = training_step(model, optimizer, config=config, variables=variables, jit_compile=jit_compile)
    external = isinstance(model, ExternalDataTrainingLossMixin)
    if external and data is None:
        raise ValueError(f"{type(model).__name__} is trained on minibatches: pass data=(X, Y) or an "
                         "iterable of (X, Y) batches")
    if not external and data is not None:
        raise ValueError(f"{type(model).__name__} owns its data; do not pass data")
    batches: Iterator[Batch] | None = None
    if external:
        batches = _repeat(data) if isinstance(data, tuple) else iter(data)  # type: ignore[arg-type]
    losses = []
    for _ in range(iterations):
        loss = step(*next(batches)) if batches is not None else step()
        losses.append(float(loss))
    return losses


def _repeat(batch: Batch) -> Iterator[Batch]:
    X, Y = (tf.convert_to_tensor(batch[0]), tf.convert_to_tensor(batch[1]))  # noqa: N806
    while True:
        yield X, Y
