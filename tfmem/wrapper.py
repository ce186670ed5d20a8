"""`tfmem.function`: trace → rewrite → re-import → run, with the signature of `tf.function`.

For each input signature (and config), the wrapper traces the user's function once
with `tf.function`, takes the GraphDef apart (`capture`), runs the configured passes,
and imports the result into a new `tf.function(jit_compile=True)`. Calls then go
straight to that compiled function.

Differentiating *through* a wrapped function from an outer tape uses a custom
gradient: the backward pass is the user's function under a tape, traced and rewritten
by the same pipeline (so it is split like the forward), and recomputes the forward
instead of keeping its intermediates.

Whatever tfmem cannot handle (dynamic shapes, an op XLA cannot compile, a pass that
fails) runs the original `tf.function` unchanged after one logged warning, unless the
config says `strict`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops

from tfmem.capture import CapturedFunction, UnsupportedFunction, capture, import_as_function
from tfmem.config import Config, active_config
from tfmem.memory import estimate_memory, xla_planned_bytes
from tfmem.passes import GraphPass, PassManager
from tfmem.report import Report

logger = logging.getLogger(__name__)

# Errors a *compiler* raises for a graph it cannot take; on a first call they mean
# "fall back", while a ResourceExhaustedError is a real out-of-memory and is raised.
_COMPILE_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError,
                   tf.errors.NotFoundError, tf.errors.InternalError)


class TfmemError(RuntimeError):
    """Raised in strict mode where tfmem would otherwise fall back to the original function."""


def _resolve_config(config: Config | Mapping[str, Any] | str | os.PathLike[str] | None) -> Config | None:
    if config is None or isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_mapping(config)
    return Config.from_yaml(config)


def _default_passes(config: Config) -> list[GraphPass]:
    from rewrites import passes_for  # the passes live in `rewrites/`; imported late to avoid a cycle

    return passes_for(config)


@dataclasses.dataclass
class _Signature:
    """The rewrite of one traced signature under one config."""

    concrete: Any
    report: Report
    captured: CapturedFunction | None = None
    compiled: Any = None  # the rewritten tf.function; None means "run the original"
    called: bool = False
    backward: dict[tuple[int, ...], TfmemFunction] = dataclasses.field(default_factory=dict)


class TfmemFunction:
    """A function whose graph tfmem rewrites to fit memory limits. Build with `tfmem.function`."""

    def __init__(self, fn: Callable[..., Any], *, config: Any = None, jit_compile: bool | None = None,
                 input_signature: Any = None, name: str | None = None,
                 passes: list[GraphPass] | None = None, lint: bool = False) -> None:
        self.python_function = fn
        self._config = _resolve_config(config)
        self._jit_compile = jit_compile
        self._input_signature = input_signature
        self._name = name or getattr(fn, "__name__", type(fn).__name__)
        # TF scope names allow only [A-Za-z0-9_.\\/>-]: "<lambda>" would be refused.
        self._scope = re.sub(r"[^A-Za-z0-9_.]", "_", self._name)
        self._passes = passes
        self._lint = lint
        # Stock tf.function: traces for us (same retracing rules) and is the fallback.
        self.original = tf.function(fn, input_signature=input_signature)
        self._signatures: dict[tuple[int, Config], _Signature] = {}
        functools.update_wrapper(self, fn, updated=())

    def __repr__(self) -> str:
        return f"<tfmem.function {self._name}>"

    @property
    def config(self) -> Config:
        """The config in force: the one given at wrap time, else the active one."""
        config = self._config or active_config()
        if self._jit_compile is not None and self._jit_compile != config.jit_compile:
            config = dataclasses.replace(config, jit_compile=self._jit_compile)
        return config

    # --- calling ------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signature = self._signature(args, kwargs, self.config)
        if signature.compiled is None:
            return self.original(*args, **kwargs)
        if not signature.captured.has_side_effects and record.could_possibly_record():
            return self._call_with_gradient(signature, args, kwargs)
        return self._call(signature, args, kwargs)

    def _call(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if signature.called:
            return signature.compiled(*args, **kwargs)
        signature.called = True
        try:
            result = signature.compiled(*args, **kwargs)
        except _COMPILE_ERRORS as err:
            self._fall_back(signature, f"the rewritten graph failed on its first call: "
                                       f"{type(err).__name__}: {_first_line(err)}", err)
            return self.original(*args, **kwargs)
        if signature.report.config.verify:
            self._verify(signature, args, kwargs, result)
        return result

    def _verify(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                result: Any) -> None:
        if signature.captured.has_side_effects:
            logger.warning("tfmem: not verifying %s: it writes state, so running it twice would "
                           "change the result", self._name)
            return
        config = signature.report.config
        expected = self.original(*args, **kwargs)
        for got, want in zip(tf.nest.flatten(result, expand_composites=True),
                             tf.nest.flatten(expected, expand_composites=True)):
            if not isinstance(want, tf.Tensor):
                continue
            got_np, want_np = np.asarray(got), np.asarray(want)
            if got_np.shape != want_np.shape or not np.allclose(
                    got_np, want_np, rtol=config.verify_rtol, atol=config.verify_atol, equal_nan=True):
                diff = np.max(np.abs(got_np.astype(np.float64) - want_np.astype(np.float64))) \
                    if got_np.shape == want_np.shape else f"shape {got_np.shape} vs {want_np.shape}"
                self._fall_back(signature, f"verification failed: rewritten output differs from the "
                                           f"original by {diff}")
                return

    def _call_with_gradient(self, signature: _Signature, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> Any:
        flat = tf.nest.flatten((args, kwargs), expand_composites=True)
        positions = [i for i, x in enumerate(flat) if isinstance(x, tf.Tensor)]
        trainable = [v for v in signature.captured.variables if v.trainable]
        outputs: dict[str, Any] = {}

        @tf.custom_gradient
        def forward(*tensors: tf.Tensor) -> Any:
            for variable in trainable:  # the import reads variables by handle; tell the tape
                resource_variable_ops.variable_accessed(variable)
            with record.stop_recording():  # the tape must see only this custom op
                call_args, call_kwargs = _substitute(args, kwargs, flat, positions, tensors)
                result = self._call(signature, call_args, call_kwargs)
            result_flat = tf.nest.flatten(result, expand_composites=True)
            outputs["structure"], outputs["flat"] = result, result_flat
            out_positions = [j for j, r in enumerate(result_flat) if isinstance(r, tf.Tensor)]

            def backward(*upstream: tf.Tensor, variables: Any = None) -> Any:
                variables = list(variables or [])
                grad_fn = self._backward_function(signature, args, kwargs, flat, positions,
                                                  out_positions, variables)
                upstream = [tf.zeros_like(result_flat[j]) if dy is None else dy
                            for dy, j in zip(upstream, out_positions)]
                grads = grad_fn(list(tensors), upstream)
                return grads[:len(tensors)], grads[len(tensors):]

            return [result_flat[j] for j in out_positions], backward

        tensor_outputs = iter(forward(*[flat[i] for i in positions]))
        result_flat = [next(tensor_outputs) if isinstance(r, tf.Tensor) else r for r in outputs["flat"]]
        return tf.nest.pack_sequence_as(outputs["structure"], result_flat, expand_composites=True)

    def _backward_function(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                           flat: list[Any], positions: list[int], out_positions: list[int],
                           variables: list[tf.Variable]) -> TfmemFunction:
        """The vector-Jacobian product of the user's function, itself a tfmem function."""
        key = (*(id(v) for v in variables), -1, *out_positions)
        if key in signature.backward:
            return signature.backward[key]
        fn = self.python_function

        def vjp(tensors: list[tf.Tensor], upstream: list[tf.Tensor]) -> list[tf.Tensor]:
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(tensors)
                for variable in variables:
                    tape.watch(variable)
                call_args, call_kwargs = _substitute(args, kwargs, flat, positions, tensors)
                result_flat = tf.nest.flatten(fn(*call_args, **call_kwargs), expand_composites=True)
            targets = [result_flat[j] for j in out_positions]
            pairs = [(t, dy) for t, dy in zip(targets, upstream) if t.dtype.is_floating or t.dtype.is_complex]
            grads = tape.gradient([t for t, _ in pairs], list(tensors) + list(variables),
                                  output_gradients=[dy for _, dy in pairs],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [g if x.dtype.is_floating or x.dtype.is_complex else None
                    for g, x in zip(grads, list(tensors) + list(variables))]

        backward = TfmemFunction(vjp, config=signature.report.config, name=f"{self._name}_vjp",
                                 passes=self._passes, lint=self._lint)
        signature.backward[key] = backward
        return backward

    # --- rewriting ----------------------------------------------------------------

    def _signature(self, args: tuple[Any, ...], kwargs: dict[str, Any], config: Config) -> _Signature:
        concrete = self.original.get_concrete_function(*args, **kwargs)
        key = (id(concrete), config)
        signature = self._signatures.get(key)
        if signature is None or signature.concrete is not concrete:
            signature = self._rewrite(concrete, config)
            self._signatures[key] = signature
        return signature

    def _rewrite(self, concrete: Any, config: Config) -> _Signature:
        text = _signature_text(concrete)
        report = Report(function_name=self._name, signature=text, config=config)
        signature = _Signature(concrete=concrete, report=report)
        start = time.perf_counter()
        try:
            captured = capture(concrete)
            graph = captured.to_graph()
            report.original_graph_def = captured.graph_def
            report.nodes_before = len(graph)
            report.memory_before = estimate_memory(graph)
            passes = self._passes if self._passes is not None else _default_passes(config)
            result = PassManager(passes, lint=self._lint).run(graph, config)
            report.records, report.pass_seconds = result.records, result.seconds
            rewritten = result.graph.to_graph_def()
            report.rewritten_graph_def = rewritten
            report.nodes_after = len(result.graph)
            report.memory_after = estimate_memory(result.graph)
            signature.captured = captured
            signature.compiled = import_as_function(
                captured, rewritten, result.graph.outputs, jit_compile=config.jit_compile,
                input_signature=self._input_signature, name=f"tfmem_{self._scope}")
            report.status = "rewritten" if result.modified else "unchanged"
        except Exception as err:  # any failure: keep the user's program running
            report.status, report.reason = "fallback", f"{type(err).__name__}: {_first_line(err)}"
            if config.strict:
                raise TfmemError(f"tfmem cannot rewrite {self._name}{text}: {report.reason}") from err
            logger.warning("tfmem: running %s%s unchanged: %s", self._name, text, report.reason)
        report.pipeline_seconds = time.perf_counter() - start
        return signature

    def _fall_back(self, signature: _Signature, reason: str, cause: BaseException | None = None) -> None:
        report = signature.report
        report.status, report.reason = "fallback", reason
        signature.compiled = None
        if report.config.strict:
            raise TfmemError(f"tfmem: {self._name}{report.signature}: {reason}") from cause
        logger.warning("tfmem: running %s%s unchanged: %s", self._name, report.signature, reason)

    # --- inspection ---------------------------------------------------------------

    def report(self, *args: Any, **kwargs: Any) -> Report:
        """The Report for this signature (rewriting it if not yet done), without running."""
        return self._signature(args, kwargs, self.config).report

    def explain(self, *args: Any, **kwargs: Any) -> Report:
        """Like `report`, plus XLA's planned bytes for stock `jit_compile=True` and for tfmem.

        Compiles both (so it costs two XLA compilations), runs neither.
        """
        signature = self._signature(args, kwargs, self.config)
        report = signature.report
        if report.xla_bytes_before is None:
            stock = tf.function(self.python_function, jit_compile=True,
                                input_signature=self._input_signature)
            report.xla_bytes_before = xla_planned_bytes(stock, *args, **kwargs)
        if report.xla_bytes_after is None and signature.compiled is not None and report.config.jit_compile:
            report.xla_bytes_after = xla_planned_bytes(signature.compiled, *args, **kwargs)
        return report

    def rewritten_graph_def(self, *args: Any, **kwargs: Any) -> Any:
        """The rewritten GraphDef for this signature (None after a fallback)."""
        return self.report(*args, **kwargs).rewritten_graph_def

    def compiled(self, *args: Any, **kwargs: Any) -> Any:
        """The `tf.function` that runs the rewritten graph for this signature."""
        return self._signature(args, kwargs, self.config).compiled

    def xla_planned_bytes(self, *args: Any, **kwargs: Any) -> int | None:
        """XLA's planned bytes for the rewritten function (None if not compiled with XLA)."""
        compiled = self.compiled(*args, **kwargs)
        return xla_planned_bytes(compiled, *args, **kwargs) if compiled is not None else None

    def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        """The concrete function of the rewritten graph (the original's after a fallback)."""
        compiled = self.compiled(*args, **kwargs)
        return (compiled or self.original).get_concrete_function(*args, **kwargs)


def function(fn: Callable[..., Any] | None = None, *, config: Any = None, jit_compile: bool | None = None,
             input_signature: Any = None, name: str | None = None) -> Any:
    """Wraps `fn` like `tf.function`, rewriting its graph to respect memory limits.

    Args:
        fn: the function; omit to use as a decorator with arguments.
        config: a `tfmem.Config`, a mapping of config keys, or a YAML path; None uses the
            active config (`tfmem.config_scope`, else `TFMEM_*` environment variables).
        jit_compile: overrides the config's `jit_compile`.
        input_signature: as for `tf.function`.
        name: for logs and reports; defaults to `fn.__name__`.

    Example:
        >>> @tfmem.function(config={"tensor_size_threshold": "100MB"})
        ... def kernel_times(x, v):
        ...     d = tf.reduce_sum((x[:, None] - x[None]) ** 2, -1)   # [n, n]
        ...     return tf.exp(-0.5 * d) @ v                        # [n, k]
        >>> kernel_times(tf.random.normal([20000, 3], dtype=tf.float64),
        ...              tf.ones([20000, 16], tf.float64)).shape
        TensorShape([20000, 16])
        >>> print(kernel_times.explain(x, v))                   # what was rewritten, and why
    """
    def wrap(inner: Callable[..., Any]) -> TfmemFunction:
        return TfmemFunction(inner, config=config, jit_compile=jit_compile,
                             input_signature=input_signature, name=name)

    return wrap if fn is None else wrap(fn)


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Rewrites `fn` for these arguments and reports what happened, without running it.

    `fn` may be a plain Python function (wrapped with the active config) or a
    `tfmem.function`. Example: `print(tfmem.explain(loss_fn, x, y))`.
    """
    wrapped = fn if isinstance(fn, TfmemFunction) else TfmemFunction(fn)
    return wrapped.explain(*args, **kwargs)


def _substitute(args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], positions: list[int],
                tensors: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) with the tensors at `positions` of their flattening replaced."""
    new_flat = list(flat)
    for position, tensor in zip(positions, tensors):
        new_flat[position] = tensor
    new_args, new_kwargs = tf.nest.pack_sequence_as((args, kwargs), new_flat, expand_composites=True)
    return tuple(new_args), dict(new_kwargs)


def _signature_text(concrete: Any) -> str:
    args, kwargs = concrete.structured_input_signature

    def show(value: Any) -> str:
        if isinstance(value, tf.TensorSpec):
            return f"{value.dtype.name}{value.shape.as_list() if value.shape.rank is not None else '[?]'}"
        return repr(value)

    parts = [show(a) for a in tf.nest.flatten(args)] + [f"{k}={show(v)}" for k, v in
                                                          sorted(kwargs.items())]
    return f"({', '.join(parts)})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
