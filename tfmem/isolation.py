"""Run a function in a fresh Python process under a real TensorFlow memory limit.

TensorFlow reads `TF_CPU_ALLOCATOR_USE_BFC` and `TF_CPU_BFC_MEM_LIMIT_IN_MB` once, when
it starts, so every trial needs its own process. The child imports the target by name,
calls it, and reports the allocator's peak, its resident-set high-water mark, the
return value (numpy-converted) and whether it ran out of memory.

Example:
    >>> result = run_isolated("benchmarks.cases:kernel_matmul", n=20000, memory_limit_mb=512)
    >>> result.status, result.peak_bytes
    ('oom', None)
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

Status = Literal["ok", "oom", "error", "timeout"]

_OOM_MARKERS = ("ResourceExhaustedError", "RESOURCE_EXHAUSTED", "Out of memory", "OOM when allocating",
                "MemoryError")


@dataclasses.dataclass(frozen=True)
class IsolatedResult:
    """What a trial in its own process gave.

    Attributes:
        status: "ok", "oom" (TensorFlow's allocator refused, or the process ran out of
            memory), "error" (anything else; see `error`) or "timeout".
        value: the target's return value, tensors converted to numpy ("ok" only).
        peak_bytes: the BFC allocator's peak (`get_memory_info("CPU:0")["peak"]`), if known.
        max_rss_bytes: the child's resident-set high-water mark.
        baseline_rss_bytes: its resident set after importing TensorFlow, before the call.
        error: the error's type and message.
        seconds: wall time of the call itself (not the process start).
    """

    status: Status
    value: Any = None
    peak_bytes: int | None = None
    max_rss_bytes: int | None = None
    baseline_rss_bytes: int | None = None
    error: str | None = None
    seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def oom(self) -> bool:
        return self.status == "oom"


def _target_name(target: str | Callable[..., Any]) -> str:
    if isinstance(target, str):
        if ":" not in target:
            raise ValueError(f"target {target!r}: expected 'module:function'")
        return target
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        raise ValueError(f"target {target!r} must be importable by name (a module-level function "
                         "in an importable module), or given as 'module:function'")
    return f"{module}:{qualname}"


def run_isolated(target: str | Callable[..., Any], *args: Any, memory_limit_mb: int | None = None,
                 timeout: float | None = 600.0, env: Mapping[str, str] | None = None,
                 **kwargs: Any) -> IsolatedResult:
    """Calls `target(*args, **kwargs)` in a new process with TensorFlow's BFC allocator.

    Args:
        target: "module:function", or an importable module-level function.
        memory_limit_mb: the allocator's limit; exceeding it is status "oom". None = no limit.
        timeout: seconds before the child is killed (status "timeout").
        env: extra environment variables for the child.
        *args, **kwargs: passed to the target; must pickle.
    """
    child_env = dict(os.environ)
    child_env.update({"TF_CPU_ALLOCATOR_USE_BFC": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    if memory_limit_mb is not None:
        child_env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(int(memory_limit_mb))
    else:
        child_env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    # The child must import what the parent imports (e.g. the repo's own packages).
    child_env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path[1:], child_env.get("PYTHONPATH", "")])
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="tfmem-isolated-") as tmp:
        request, response = os.path.join(tmp, "request.pkl"), os.path.join(tmp, "response.pkl")
        with open(request, "wb") as f:
            pickle.dump((_target_name(target), args, kwargs), f)
        try:
            proc = subprocess.run([sys.executable, "-m", "tfmem._isolated_worker", request, response],
                                  env=child_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return IsolatedResult("timeout", error=f"no result within {timeout} s")
        if os.path.exists(response):
            with open(response, "rb") as f:
                return IsolatedResult(**pickle.load(f))
    stderr = proc.stderr.strip().splitlines()
    message = stderr[-1] if stderr else f"exit code {proc.returncode}"
    if proc.returncode in (-9, 137) or any(m in proc.stderr for m in _OOM_MARKERS):
        # Killed by the kernel's OOM killer, or died inside the allocator.
        return IsolatedResult("oom", error=f"process died: {message}")
    return IsolatedResult("error", error=f"process died (exit {proc.returncode}): {message}")


def classify_error(err: BaseException) -> Status:
    """"oom" if the exception is an out-of-memory (TF's, the allocator's or Python's), else "error"."""
    text = f"{type(err).__name__}: {err}"
    return "oom" if any(marker in text for marker in _OOM_MARKERS) else "error"


def _child_main(request_path: str, response_path: str) -> None:
    import importlib
    import resource

    import tensorflow as tf

    with open(request_path, "rb") as f:
        name, args, kwargs = pickle.load(f)
    module_name, _, qualname = name.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)

    def rss_bytes() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def peak() -> int | None:
        try:
            return int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
        except (ValueError, tf.errors.OpError):
            return None

    baseline = rss_bytes()
    start = time.perf_counter()
    outcome: dict[str, Any]
    try:
        value = target(*args, **kwargs)
        value = tf.nest.map_structure(lambda v: v.numpy() if hasattr(v, "numpy") else v, value)
        outcome = {"status": "ok", "value": value}
    except BaseException as err:  # noqa: BLE001 - every failure is reported, not raised
        outcome = {"status": classify_error(err), "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    outcome.update(seconds=time.perf_counter() - start, peak_bytes=peak(),
                   max_rss_bytes=rss_bytes(), baseline_rss_bytes=baseline)
    try:
        payload = pickle.dumps(outcome)
    except Exception as err:  # an unpicklable return value is the caller's bug; say so
        outcome.update(status="error", value=None, error=f"cannot pickle the result: {err}")
        payload = pickle.dumps(outcome)
    with open(response_path, "wb") as f:
        f.write(payload)
