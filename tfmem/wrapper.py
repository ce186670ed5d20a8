"""`tfmem.function`: trace → rewrite → compile → run, with the signature of `tf.function`.

For each input signature (and config), the wrapper traces the user's function once
with `tf.function` (`Traced`), runs the configured passes (`Rewritten`), and imports the
result into a new `tf.function(jit_compile=True)` (`Compiled`); see `tfmem.stages`.
Calls then go straight to that compiled function.

Differentiating *through* a wrapped function from an outer tape uses a custom
gradient: the backward pass is the user's function under a tape, traced and rewritten
by the same pipeline (so it is split like the forward), and recomputes the forward
instead of keeping its intermediates.

Whatever tfmem cannot handle (dynamic shapes, an op XLA cannot compile, a pass that
fails, a graph that does not import) runs the program as written, as stock `tf.function`
with the config's `jit_compile` runs it (so a fallback gives what stock XLA gives), after a
`TfmemWarning` saying why and how it runs; where XLA cannot compile the program as written
either, it runs in graph mode after a second warning. A budget the rewrite cannot meet is
warned about the same way. With `strict`, both raise `TfmemError` instead.

Inside `strategy.run` (see `tfmem.distribute`) each replica's trace is rewritten for its
device, with its share of the budget; replicas whose traces are identical share one run
of the passes. A function TensorFlow cannot trace as a nested function there (a
`merge_call`: an all-reduce or `apply_gradients` inside it) runs inline, unchanged.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops

from tfmem.capture import capture
from tfmem.budget import Budget, resolve_budget
from tfmem.config import Config, active_config, format_size
from tfmem.distribute import Replica, current_replica, replica_budget
from tfmem.errors import TfmemError, first_line, warn
from tfmem.memory import xla_planned_bytes
from tfmem.passes import GraphPass, default_pipeline
from tfmem.plan_cache import PlanCache, checked_plan
from tfmem.report import Report
from tfmem.stages import Compiled, Traced, compile_within_budget, judged_as_the_allocator_is

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Signature:
    """One traced signature under one config: its stages, its report, its state."""

    concrete: Any
    report: Report
    traced: Traced | None = None
    compiled: Compiled | None = None  # None means "run the program as written" (`_run_as_written`)
    inline: bool = False  # run the Python function inline (it cannot be a nested function here)
    called: bool = False
    # Why XLA cannot compile the program as written ("" until it refused; it runs in graph mode since).
    xla_refused: str = ""
    as_written_called: bool = False
    backward: dict[tuple[int, ...], TfmemFunction] = dataclasses.field(default_factory=dict)


class TfmemFunction:
    """A function whose graph tfmem rewrites to fit memory limits. Build with `tfmem.function`."""

    def __init__(self, fn: Callable[..., Any], *, config: Any = None, jit_compile: bool | None = None,
                 input_signature: Any = None, name: str | None = None,
                 passes: list[GraphPass] | None = None, lint: bool = False,
                 rewrites: dict[tuple[str, Config, Budget | None], Compiled] | None = None) -> None:
        self.python_function = fn
        self._config = Config.coerce(config)
        self._jit_compile = jit_compile
        self._input_signature = input_signature
        self._name = name or getattr(fn, "__name__", type(fn).__name__)
        # TF scope names allow only [A-Za-z0-9_.\\/>-]: "<lambda>" would be refused.
        self._scope = re.sub(r"[^A-Za-z0-9_.]", "_", self._name)
        self._passes = passes
        self._lint = lint
        # Stock tf.function: traces for us without XLA (same retracing rules; `_tracer`) and
        # runs the program as written in graph mode.
        self.original = tf.function(fn, input_signature=input_signature)
        self._original_under_xla: Any = None  # stock tf.function(jit_compile=True), made when first needed
        self._signatures: dict[tuple[int, Config], _Signature] = {}
        # Rewrites by (GraphDef digest, config, budget): each replica of a strategy traces
        # its own concrete function, usually with an identical GraphDef; the passes run once.
        self._rewrites = {} if rewrites is None else rewrites
        self._backward_rewrites: dict[tuple[str, Config, Budget | None], Compiled] = {}
        # Strategy name → the signature of a function that cannot be traced as a nested
        # function in that strategy's replicas (it runs inline).
        self._not_nestable: dict[str, _Signature] = {}
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

    # --- the stages, one at a time -------------------------------------------------

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Traces the function for these arguments and takes its graph apart.

        Raises:
            UnsupportedFunction: when tfmem cannot take this function apart (e.g. a
                dynamic shape); the wrapped function itself would fall back instead.
        """
        return self._trace(self._tracer(self.config).get_concrete_function(*args, **kwargs))

    def _trace(self, concrete: Any, trace_seconds: float = 0.0) -> Traced:
        start = time.perf_counter()
        captured = capture(concrete)
        return Traced(self._name, _signature_text(concrete), captured, trace_seconds + time.perf_counter() - start)

    # --- calling ------------------------------------------------------------------

    # AutoGraph converts what a converted function calls (strategy.run converts the replica
    # function): it must call tfmem as it is, not convert tfmem's own code.
    @tf.autograph.experimental.do_not_convert
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signature = self._signature(args, kwargs, self.config)
        if signature.inline:
            return self.python_function(*args, **kwargs)
        if signature.compiled is None:
            return self._run_as_written(signature, args, kwargs)
        if not signature.traced.captured.has_side_effects and record.could_possibly_record():
            return self._call_with_gradient(signature, args, kwargs)
        return self._call(signature, args, kwargs)

    def _call(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if signature.called:
            return signature.compiled(*args, **kwargs)
        signature.called = True
        start = time.perf_counter()
        try:
            result = signature.compiled(*args, **kwargs)
        except tf.errors.ResourceExhaustedError as err:
            if not self._can_ask_xla(signature):
                raise  # a real out-of-memory: the original would not do better
            result = self._run_checked(signature, args, kwargs, err)
        except Exception as err:  # tracing, importing or compiling the rewrite failed
            ran, result = self._run_without_xla(signature, args, kwargs, err)
            if not ran:
                self._fall_back(signature, f"the rewritten graph failed on its first call: "
                                           f"{type(err).__name__}: {first_line(err)}", err)
                return self._run_as_written(signature, args, kwargs)
        signature.report = dataclasses.replace(signature.report, first_run_seconds=time.perf_counter() - start)
        if signature.report.config.verify:
            return self._verify(signature, args, kwargs, result)
        return result

    def _run_without_xla(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                         err: Exception) -> tuple[bool, Any]:
        """Runs a rewrite XLA failed to compile (`err`) in graph mode, without XLA: whether it
        ran, and its result.

        Its plan holds there too (TensorFlow's executor keeps the estimate's order:
        `executor_order.heavy_ops_in_turn`), where the program as written, which XLA refuses
        just as well (a loop's gradient with no bound on its trips), holds every
        whole matrix. Not for a rewrite that changed nothing, nor where it fails in graph
        mode too: then the caller falls back to the program as written.
        """
        compiled, report = signature.compiled, signature.report
        if compiled is None or not compiled.with_xla or report.status != "rewritten":
            return False, None
        try:  # planned again, for TensorFlow's executor (`Budget.graph_mode_plan_bytes`)
            config = dataclasses.replace(report.config, jit_compile=False)
            plain = compile_within_budget(signature.traced, config, args, kwargs, passes=self._passes,
                                          lint=self._lint, budget=report.budget,
                                          input_signature=self._input_signature, name=f"tfmem_{self._scope}")
            result = plain(*args, **kwargs)
        except tf.errors.ResourceExhaustedError:
            raise  # a real out-of-memory: the program as written holds more
        except Exception:  # noqa: BLE001 - it fails without XLA too: the fallback says why (`err`)
            return False, None
        signature.compiled = dataclasses.replace(plain, xla_refusal=f"{type(err).__name__}: {first_line(err)}")
        signature.report = Report.of(signature.traced, signature.compiled, config=report.config, replica=report.replica)
        self._warn_without_xla(signature.report)
        return True, result

    def _warn_without_xla(self, report: Report) -> None:
        warn(f"tfmem: XLA cannot compile the rewritten {self._name}{report.signature}{report.where} "
             f"({report.without_xla}); it runs in graph mode, without XLA, as planned for the budget")

    @staticmethod
    def _can_ask_xla(signature: _Signature) -> bool:
        """Whether the signature runs a plan XLA was not asked about (`compile_within_budget`
        judged it by the estimate alone): an out-of-memory then calls for XLA's plan."""
        compiled, report = signature.compiled, signature.report
        return (compiled is not None and compiled.with_xla and compiled.checked_plan is None
                and report.budget is not None and report.config.jit_compile)

    def _run_checked(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                     err: tf.errors.ResourceExhaustedError) -> Any:
        """Re-plans a signature whose unchecked plan ran out of memory, asking XLA this
        time, and runs it again. XLA allocates a program's memory before running it, so
        the failed call changed nothing."""
        assert signature.traced is not None and signature.compiled is not None
        warn(f"tfmem: {self._name}{signature.report.signature}{signature.report.where} ran out of memory on its "
             f"first call with a plan XLA was not asked about ({first_line(err)}); planning again with XLA's plan")
        config, budget, unchecked = signature.report.config, signature.report.budget, signature.compiled
        signature.compiled = compile_within_budget(
            signature.traced, config, args, kwargs, passes=self._passes, lint=self._lint, budget=budget,
            input_signature=self._input_signature, name=f"tfmem_{self._scope}", ask_xla=True)
        for key, shared in list(self._rewrites.items()):  # replicas yet to build take the new plan
            if shared.rewritten.graph is unchecked.rewritten.graph:
                self._rewrites[key] = signature.compiled
        signature.report = Report.of(signature.traced, signature.compiled, config=config,
                                     replica=signature.report.replica)
        self._warn_about_plan(signature.report)
        return signature.compiled(*args, **kwargs)

    def _verify(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                result: Any) -> Any:
        """`result` if it equals the program's as written (`_run_as_written`: under XLA when the
        config says so, whose random numbers and rounding are XLA's); else that, after a fallback."""
        if signature.traced.captured.has_side_effects:
            warn(f"tfmem: not verifying {self._name}: it writes state, so running it twice would "
                 "change the result")
            return result
        config = signature.report.config
        try:
            expected = self._run_as_written(signature, args, kwargs)
        except tf.errors.ResourceExhaustedError as err:
            # The program as written needs the memory the rewrite was made to save: nothing
            # to compare with, and the rewrite's result is still the one asked for.
            report = signature.report
            warn(f"tfmem: could not verify {self._name}{report.signature}{report.where}: the program as "
                 f"written ran out of memory ({first_line(err)}); the rewrite's result is returned unverified")
            return result
        for got, want in zip(tf.nest.flatten(result, expand_composites=True),
                             tf.nest.flatten(expected, expand_composites=True)):
            if not isinstance(want, tf.Tensor):
                continue
            got_np, want_np = np.asarray(got), np.asarray(want)
            if got_np.shape != want_np.shape or not _agrees(got_np, want_np, config.verify_rtol, config.verify_atol):
                diff = np.max(np.abs(got_np.astype(np.float64) - want_np.astype(np.float64))) \
                    if got_np.shape == want_np.shape else f"shape {got_np.shape} vs {want_np.shape}"
                self._fall_back(signature, f"verification failed: rewritten output differs from the "
                                           f"original by {diff}")
                return expected
        return result

    def _under_xla(self) -> Any:
        """Stock `tf.function(fn, jit_compile=True)`: the program as written, under XLA."""
        if self._original_under_xla is None:
            self._original_under_xla = tf.function(self.python_function, jit_compile=True,
                                                   input_signature=self._input_signature)
        return self._original_under_xla

    def experimental_get_tracing_count(self) -> int:
        """How many times the Python function was traced, as `tf.function`'s method of this name.

        Example:
            >>> f = tfmem.function(lambda x: 2.0 * x)
            >>> _ = f(tf.ones([3])); _ = f(tf.ones([3])); _ = f(tf.ones([4]))
            >>> f.experimental_get_tracing_count()
            2
        """
        return sum(f.experimental_get_tracing_count() for f in (self.original, self._original_under_xla)
                   if f is not None)

    def _tracer(self, config: Config) -> Any:
        """The stock `tf.function` whose trace is rewritten: under XLA when the config compiles
        with XLA, as stock `jit_compile=True` traces. The graph differs there: while_v2 gives
        a loop's gradient accumulators (for a tape around an autograph `for i in tf.range(3)`)
        the loop's trip count as their size in XLA's context only, and XLA refuses lists
        without one."""
        return self._under_xla() if config.jit_compile else self.original

    def _as_written(self, signature: _Signature) -> Any:
        """The stock `tf.function` that runs `signature`'s program as written: with the config's
        `jit_compile`, as the user would run it without tfmem (XLA draws random numbers, and
        orders float arithmetic, its own way), in graph mode once XLA refused it."""
        if signature.report.config.jit_compile and not signature.xla_refused:
            return self._under_xla()
        return self.original

    def _run_as_written(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs the program as written (`_as_written`), after a fallback or to verify a rewrite.

        Where XLA cannot compile it, it runs in graph mode from then on, after a warning. XLA
        compiles on the first call; inside another function's trace that call is only recorded
        (XLA's refusal would come when that function runs, past any fallback), so XLA is asked
        for the program's HLO first.
        """
        function = self._as_written(signature)
        if function is self.original or signature.as_written_called:
            return function(*args, **kwargs)
        signature.as_written_called = True
        try:
            if not tf.executing_eagerly():
                _ask_xla_to_compile(function, args, kwargs)
            return function(*args, **kwargs)
        except tf.errors.ResourceExhaustedError:
            raise  # stock XLA runs out of memory too; graph mode promises nothing better
        except Exception as err:  # noqa: BLE001 - an op or a construct XLA cannot compile
            self._xla_refused(signature, err)
            return self.original(*args, **kwargs)

    def _xla_refused(self, signature: _Signature, err: Exception) -> None:
        """Records and warns that XLA cannot compile the program as written: graph mode from now on."""
        signature.xla_refused = f"{type(err).__name__}: {first_line(err)}"
        report = signature.report
        named = f"{self._name}{report.signature}{report.where}"
        if report.status != "fallback":  # verifying a rewrite that runs: only the reference changes
            warn(f"tfmem: XLA cannot compile {named} as written ({signature.xla_refused}); verifying the "
                 "rewrite against it in graph mode, without XLA")
            return
        runs = _runs_as_written(report.config, signature.xla_refused)
        signature.report = report.fall_back(report.reason, runs)
        warn(f"tfmem: running {named} {runs}")

    def _call_with_gradient(self, signature: _Signature, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> Any:
        flat = tf.nest.flatten((args, kwargs), expand_composites=True)
        positions = [i for i, x in enumerate(flat) if isinstance(x, tf.Tensor)]
        # Only the arguments a tape watches are differentiated: the backward pass then
        # skips, e.g., the gradient of a kernel matrix with respect to its data.
        watched = [i for i in positions if record.should_record_backprop([flat[i]])]
        trainable = [v for v in signature.traced.captured.variables if v.trainable]
        outputs: dict[str, Any] = {}

        @tf.custom_gradient
        def forward(*inputs: tf.Tensor) -> Any:  # the watched arguments
            for variable in trainable:  # the import reads variables by handle; tell the tape
                resource_variable_ops.variable_accessed(variable)
            with record.stop_recording():  # the tape must see only this custom op
                call_args, call_kwargs = _substitute(args, kwargs, flat, watched, inputs)
                result = self._call(signature, call_args, call_kwargs)
            result_flat = tf.nest.flatten(result, expand_composites=True)
            outputs["structure"], outputs["flat"] = result, result_flat
            out_positions = [j for j, r in enumerate(result_flat) if isinstance(r, tf.Tensor)]

            def backward(*upstream: tf.Tensor, variables: Any = None) -> Any:
                variables = list(variables or [])
                grad_fn = self._backward_function(signature, args, kwargs, flat, positions, watched,
                                                  out_positions, variables)
                upstream = [tf.zeros_like(result_flat[j]) if dy is None else dy
                            for dy, j in zip(upstream, out_positions)]
                # Every tensor argument is passed (a captured one would be stale on the next call).
                current = dict(zip(watched, inputs))
                grads = grad_fn([current.get(i, flat[i]) for i in positions], upstream)
                return grads[:len(inputs)], grads[len(inputs):]

            return [result_flat[j] for j in out_positions], backward

        tensor_outputs = iter(forward(*[flat[i] for i in watched]))
        result_flat = [next(tensor_outputs) if isinstance(r, tf.Tensor) else r for r in outputs["flat"]]
        return tf.nest.pack_sequence_as(outputs["structure"], result_flat, expand_composites=True)

    def _backward_function(self, signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                           flat: list[Any], positions: list[int], watched: list[int],
                           out_positions: list[int], variables: list[tf.Variable]) -> TfmemFunction:
        """The vector-Jacobian product of the user's function, itself a tfmem function.

        It takes every tensor argument (at `positions`) and the upstream gradients, and
        returns the gradients of the `watched` arguments, then of `variables`.
        """
        key = (*watched, -1, *(id(v) for v in variables), -1, *out_positions)
        if key in signature.backward:
            return signature.backward[key]
        fn = self.python_function
        differentiated = [positions.index(i) for i in watched]

        def vjp(tensors: list[tf.Tensor], upstream: list[tf.Tensor]) -> list[tf.Tensor]:
            sources = [tensors[k] for k in differentiated] + list(variables)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(sources)
                call_args, call_kwargs = _substitute(args, kwargs, flat, positions, tensors)
                result_flat = tf.nest.flatten(fn(*call_args, **call_kwargs), expand_composites=True)
            targets = [result_flat[j] for j in out_positions]
            # A Python value the function returns (an int, a string) is a tensor only in the
            # traced forward: here it is the value itself, and has no gradient either way.
            pairs = [(t, dy) for t, dy in zip(targets, upstream)
                     if tf.is_tensor(t) and (t.dtype.is_floating or t.dtype.is_complex)]
            grads = tape.gradient([t for t, _ in pairs], sources, output_gradients=[dy for _, dy in pairs],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [g if x.dtype.is_floating or x.dtype.is_complex else None for g, x in zip(grads, sources)]

        # The backward runs under the forward's config (its budget, if any, was resolved
        # for the same device), sharing rewrites between replicas like the forward.
        backward = TfmemFunction(vjp, config=self.config, name=f"{self._name}_vjp", passes=self._passes,
                                 lint=self._lint, rewrites=self._backward_rewrites)
        signature.backward[key] = backward
        return backward

    # --- rewriting, with fallback -------------------------------------------------

    def _signature(self, args: tuple[Any, ...], kwargs: dict[str, Any], config: Config) -> _Signature:
        replica = current_replica()
        if replica is not None and replica.strategy in self._not_nestable:
            return self._not_nestable[replica.strategy]
        start = time.perf_counter()
        try:
            concrete = self._tracer(config).get_concrete_function(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - e.g. a merge_call inside a nested function
            if replica is None:
                raise  # the user's own error: tf.function would raise it too
            return self._cannot_nest(replica, config, err)
        key = (id(concrete), config)
        signature = self._signatures.get(key)
        if signature is None or signature.concrete is not concrete:
            # Tracing is timed from here: a cached trace costs nothing to look up.
            signature = self._build(concrete, config, args, kwargs, replica, time.perf_counter() - start)
            self._signatures[key] = signature
        return signature

    def _build(self, concrete: Any, config: Config, args: tuple[Any, ...], kwargs: dict[str, Any],
               replica: Replica | None = None, trace_seconds: float = 0.0) -> _Signature:
        """All three stages for one signature; on any failure, a fallback to the original.

        `trace_seconds`: how long TensorFlow took to trace `concrete`, counted in `Traced.seconds`.
        """
        text = _signature_text(concrete)
        signature = _Signature(concrete, Report(self._name, text, config, replica=replica))
        try:
            signature.traced = self._trace(concrete, trace_seconds)
            signature.compiled = self._compile(signature.traced, config, args, kwargs, replica)
        except Exception as err:  # any failure: keep the user's program running
            self._fall_back(signature, f"{type(err).__name__}: {first_line(err)}", err)
            return signature
        signature.report = Report.of(signature.traced, signature.compiled, config=config, replica=replica)
        if signature.report.without_xla:
            self._warn_without_xla(signature.report)
        self._warn_about_plan(signature.report)
        return signature

    def _compile(self, traced: Traced, config: Config, args: tuple[Any, ...], kwargs: dict[str, Any],
                 replica: Replica | None) -> Compiled:
        """`compile_within_budget`, once per distinct program: replicas share the rewrite."""
        budget = replica_budget(config, replica) if replica is not None else None
        key = (_digest(traced.captured.graph_def), config, budget)
        shared = self._rewrites.get(key)
        if shared is not None:
            again = shared.rewritten.for_trace(traced).compile(input_signature=self._input_signature,
                                                               name=f"tfmem_{self._scope}")
            return judged_as_the_allocator_is(dataclasses.replace(
                again, checked_plan=shared.checked_plan, xla_overshoot=shared.xla_overshoot, held=shared.held))
        if config.plan_cache is not None and self._passes is None:
            compiled = self._compile_cached(traced, config, args, kwargs, budget, key[0])
        else:
            compiled = compile_within_budget(traced, config, args, kwargs, passes=self._passes, lint=self._lint,
                                             budget=budget, input_signature=self._input_signature,
                                             name=f"tfmem_{self._scope}")
        self._rewrites[key] = compiled
        return compiled

    def _compile_cached(self, traced: Traced, config: Config, args: tuple[Any, ...], kwargs: dict[str, Any],
                        budget: Budget | None, digest: str) -> Compiled:
        """`compile_within_budget` through `config.plan_cache`: a plan made by an earlier
        process for the same trace, config and budget is compiled as it is."""
        cache = PlanCache(config.plan_cache)
        budget = budget if budget is not None else resolve_budget(config)
        pipeline = [f"{type(p).__module__}.{type(p).__qualname__}" for p in default_pipeline(config)]
        key = cache.key(digest, config, budget, pipeline)
        found = cache.load(key, traced, config, budget)
        name = f"tfmem_{self._scope}"
        if found is not None:
            rewritten, xla = found
            plan, overshoot, held = checked_plan(xla)
            return judged_as_the_allocator_is(dataclasses.replace(
                rewritten.compile(input_signature=self._input_signature, name=name),
                checked_plan=plan, xla_overshoot=overshoot, held=held))
        compiled = compile_within_budget(traced, config, args, kwargs, passes=None, lint=self._lint,
                                         budget=budget, input_signature=self._input_signature, name=name)
        try:
            cache.store(key, compiled)
        except OSError as err:  # a read-only or full disk costs the next process time, not this one its run
            warn(f"tfmem: could not keep the plan of {self._name} in plan_cache {config.plan_cache!r}: {err}")
        return compiled

    def _cannot_nest(self, replica: Replica, config: Config, err: Exception) -> _Signature:
        """The signature of a function that runs inline in `replica`'s strategy: TF cannot trace it there."""
        cause = (f"it cannot be traced as a nested function inside {replica.strategy}.run "
                 f"({type(err).__name__}: {first_line(err)})")
        reason = f"{cause}; it runs inline, unchanged"
        report = Report(self._name, "(...)", config, fallback_reason=reason, replica=replica)
        if config.strict:  # it raises: nothing runs inline
            raise TfmemError(f"tfmem: cannot run {self._name}{report.where} rewritten (strict=True, so it does "
                             f"not run inline either): {cause}") from err
        warn(f"tfmem: running {self._name}{report.where} unchanged: {reason}")
        signature = _Signature(concrete=None, report=report, inline=True)
        self._not_nestable[replica.strategy] = signature
        return signature

    def _warn_about_plan(self, report: Report) -> None:
        """Warns (raises, when strict) if the program may not fit its budget; warns if a
        threshold gave way to the budget: the user asked for something that was not done,
        though the budget, the promise, holds (so no strict raise for that alone)."""
        verdict = report.verdict
        # Only the user's split size: without XLA tfmem caps chunks itself (`Budget.graph_mode_split_bytes`).
        if verdict is not None and verdict.split_size_dropped and report.config.tensor_split_size:
            warn(f"tfmem: {self._name}{report.signature}{report.where}: tensor_split_size not honoured within "
                 f"the memory budget {report.budget}: {verdict.split_size_dropped}")
        if report.panels_over_split_size:
            warn(f"tfmem: {self._name}{report.signature}{report.where}: tensor_split_size "
                 f"{format_size(report.config.tensor_split_size)} not honoured by "
                 f"{'; '.join(report.panels_over_split_size)} (a panel is at least one row)")
        if report.fits is not False:
            if verdict is not None and verdict.threshold_dropped:
                warn(f"tfmem: {self._name}{report.signature}{report.where}: tensor_size_threshold not honoured "
                     f"within the memory budget {report.budget}: {verdict.threshold_dropped}")
            return
        message = (f"tfmem: {self._name}{report.signature}{report.where} may not fit its memory budget "
                   f"{report.budget}: {report.summary()}")
        if verdict is not None and verdict.threshold_dropped:
            message += f" (tensor_size_threshold not honoured either: {verdict.threshold_dropped})"
        elif report.config.tensor_size_threshold is not None:
            message += (f" (with tensor_size_threshold {format_size(report.config.tensor_size_threshold)}; "
                        "the threshold only adds splits, it does not lift the budget)")
        if verdict is not None and verdict.reason and verdict.reason not in message:
            message += f" ({verdict.reason})"
        if report.config.strict:
            raise TfmemError(message)
        warn(message)

    def _fall_back(self, signature: _Signature, reason: str, cause: BaseException | None = None) -> None:
        runs = _runs_as_written(signature.report.config, signature.xla_refused)
        signature.report = signature.report.fall_back(reason, runs)
        signature.compiled = None
        named = f"{self._name}{signature.report.signature}{signature.report.where}"
        if signature.report.config.strict:  # it raises: nothing runs, unchanged or otherwise
            raise TfmemError(f"tfmem: cannot run {named} rewritten (strict=True, so it does not run "
                             f"unchanged either): {reason}") from cause
        warn(f"tfmem: running {named} {runs}: {reason}{_budget_as_written(signature.report)}")

    # --- inspection ---------------------------------------------------------------

    def report(self, *args: Any, **kwargs: Any) -> Report:
        """The Report for this signature (rewriting it if not yet done), without running."""
        return self._signature(args, kwargs, self.config).report

    def reports(self) -> list[Report]:
        """The reports of every signature rewritten so far, oldest first (one per replica under a
        strategy), each followed by those of its backward functions (`<name>_vjp`)."""
        reports = []
        for signature in self._signatures.values():
            reports.append(signature.report)
            reports.extend(r for backward in signature.backward.values() for r in backward.reports())
        return reports + [s.report for s in self._not_nestable.values()]

    def explain(self, *args: Any, **kwargs: Any) -> Report:
        """Like `report`, plus XLA's planned bytes for stock `jit_compile=True` and for tfmem.

        Compiles both (so it costs two XLA compilations), runs neither. Called inside
        `strategy.run`, it reports this replica's rewrite, with its per-replica budget.
        """
        signature = self._signature(args, kwargs, self.config)
        report = signature.report
        if signature.inline:
            return report
        if report.xla_bytes_before is None:
            report = dataclasses.replace(report, xla_bytes_before=xla_planned_bytes(self._under_xla(), *args,
                                                                                    **kwargs))
        if report.xla_bytes_after is None and signature.compiled is not None:
            report = dataclasses.replace(report, explained_xla_plan=signature.compiled.xla_plan(*args, **kwargs))
        signature.report = report
        return report

    def compiled(self, *args: Any, **kwargs: Any) -> Compiled | None:
        """This signature's last stage (rewriting it if not yet done), or None after a fallback.

        It holds the others: `.rewritten` (graph, records, verdict), `.rewritten.traced`;
        call it to run the rewritten program, or ask it for XLA's plan (`.xla_plan(*args)`).
        """
        return self._signature(args, kwargs, self.config).compiled

    def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        """The concrete function of the rewritten graph; after a fallback, of the program as
        written as it runs (under XLA when the config says so, until XLA refused it)."""
        signature = self._signature(args, kwargs, self.config)
        function = signature.compiled.function if signature.compiled is not None else self._as_written(signature)
        return function.get_concrete_function(*args, **kwargs)


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


def _budget_as_written(report: Report) -> str:
    """After a fallback, what its budget means now: nothing was planned for the program as
    written, and a verdict shown before was the rewritten program's."""
    if report.budget is None or report.memory_before is None:
        return ""
    return (f"; the memory budget {report.budget} is not planned for as written (estimated peak "
            f"{format_size(report.memory_before.peak_bytes)}): what tfmem said of the budget was for the "
            "rewritten program")


# The tightest relative tolerance a verification asks of an output, in machine epsilons of
# its dtype: float32 sums round far above 1e-6 (kNN's ‖x‖² + ‖y‖² − 2xyᵀ differed from the
# naive distances by 5.8e-6, fuzz 15).
_VERIFY_EPSILONS = 100


def _agrees(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> bool:
    """Whether a rewritten output equals the original's: every element within `atol` plus
    `rtol` times the output's largest magnitude (a rewrite moves rounding between
    elements: an expanded distance near zero errs by the norms' rounding, not its own),
    `rtol` at least `_VERIFY_EPSILONS` epsilons of a floating dtype. Other dtypes exactly.

    Example:
        >>> _agrees(np.array([1e-4, 20.0], np.float32), np.array([0.0, 20.0], np.float32), 1e-6, 1e-8)
        True
        >>> _agrees(np.array([1e-4, 20.0]), np.array([0.0, 20.0]), 1e-6, 1e-8)
        False
    """
    if not np.issubdtype(want.dtype, np.floating) and not np.issubdtype(want.dtype, np.complexfloating):
        return bool(np.array_equal(got, want))
    if want.size == 0:
        return True
    rtol = max(rtol, _VERIFY_EPSILONS * float(np.finfo(want.dtype).eps))
    scale = float(np.nanmax(np.abs(want))) if not np.all(np.isnan(want)) else 0.0
    return bool(np.allclose(got, want, rtol=0.0, atol=atol + rtol * scale, equal_nan=True))


def _runs_as_written(config: Config, xla_refused: str = "") -> str:
    """How the program runs after a fallback, in words (warnings and `Report.summary` say it)."""
    if not config.jit_compile:
        return "unchanged, without XLA (jit_compile=False)"
    if xla_refused:
        return f"unchanged in graph mode, without XLA: XLA cannot compile it either ({xla_refused})"
    return "unchanged, under XLA (as tf.function(jit_compile=True))"


def _ask_xla_to_compile(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raises where XLA cannot compile `function` (a `tf.function(jit_compile=True)`) for
    these arguments; asked eagerly, from their specs, when called inside another trace.

    A shape not fully known is left to XLA when it runs (it compiles for the shapes it meets).
    """
    def spec(value: Any) -> Any:
        return tf.TensorSpec.from_tensor(value) if isinstance(value, tf.Tensor) else value

    specs_args, specs_kwargs = tf.nest.map_structure(spec, (args, kwargs))
    specs = [s for s in tf.nest.flatten((specs_args, specs_kwargs)) if isinstance(s, tf.TensorSpec)]
    if not all(s.shape.is_fully_defined() for s in specs):
        return
    with tf.init_scope():
        function.experimental_get_compiler_ir(*specs_args, **specs_kwargs)(stage="hlo")


def _signature_text(concrete: Any) -> str:
    args, kwargs = concrete.structured_input_signature

    def show(value: Any) -> str:
        if isinstance(value, tf.TensorSpec):
            return f"{value.dtype.name}{value.shape.as_list() if value.shape.rank is not None else '[?]'}"
        return repr(value)

    parts = [show(a) for a in tf.nest.flatten(args)] + [f"{k}={show(v)}" for k, v in
                                                          sorted(kwargs.items())]
    return f"({', '.join(parts)})"


_GRADIENT_OP_TYPE = "_gradient_op_type"


def _digest(graph_def: Any) -> str:
    """A hash of the GraphDef that identical traces share.

    Each trace numbers its custom gradients anew (`_gradient_op_type: "CustomGradient-<uid>"`,
    e.g. GPflow's parameter transforms), so replicas' traces differ only there; the
    passes do not read that attribute.
    """
    digest = hashlib.sha256()
    # Node by node, copying only the few nodes with the attribute (not, say, GPflow's
    # data held as constants).
    for node in graph_def.node:
        if _GRADIENT_OP_TYPE in node.attr:
            node = copy.deepcopy(node)
            del node.attr[_GRADIENT_OP_TYPE]
        data = node.SerializeToString(deterministic=True)
        digest.update(len(data).to_bytes(8, "little") + data)
    digest.update(graph_def.library.SerializeToString(deterministic=True))
    digest.update(graph_def.versions.SerializeToString(deterministic=True))
    return digest.hexdigest()
