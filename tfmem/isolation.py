"""Run a function in a fresh Python process under a real TensorFlow memory limit.

TensorFlow reads `TF_CPU_ALLOCATOR_USE_BFC` and `TF_CPU_BFC_MEM_LIMIT_IN_MB` once, when
it starts, so every trial needs its own process. The child imports the target by name,
calls it, and reports the allocator's peak, its resident-set high-water mark, the
return value (numpy-converted) and whether it ran out of memory.

Time limits scale with the machine: the child times its own TensorFlow import and
tells the parent, and the limit on the rest of the trial is `timeout` multiplied by how
much slower that import was than on an unloaded machine (`REFERENCE_STARTUP_SECONDS`).
A busy shared machine gets proportionally more time instead of spurious timeouts.

Example:
    >>> result = run_isolated("tfmem.examples:allocate", 16, memory_limit_mb=64)
    >>> result.status, result.value
    ('ok', 4194304.0)
    >>> run_isolated("tfmem.examples:allocate", 256, memory_limit_mb=64).status
    'oom'
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any, Literal

Status = Literal["ok", "oom", "error", "timeout"]

# Seconds a fresh Python takes to import TensorFlow 2.21 on an unloaded 2-core machine
# (measured 2.4-3.9 s); a slower start-up means a busier machine, and longer limits.
REFERENCE_STARTUP_SECONDS = 3.0
# A start-up this many times slower than that means a stuck child, not a busy machine.
STARTUP_SLOWDOWN_LIMIT = 20

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
        startup_seconds: how long the child took to import TensorFlow (None if it never did).
        time_limit_seconds: the limit applied to the trial after start-up (`timeout`
            scaled by the measured start-up), None without a limit.
    """

    status: Status
    value: Any = None
    peak_bytes: int | None = None
    max_rss_bytes: int | None = None
    baseline_rss_bytes: int | None = None
    error: str | None = None
    seconds: float | None = None
    startup_seconds: float | None = None
    time_limit_seconds: float | None = None

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
            On a machine with a GPU the trial runs there, under a logical device with this
            `memory_limit`; otherwise on the CPU, under `TF_CPU_BFC_MEM_LIMIT_IN_MB`.
        timeout: seconds the trial may take on an unloaded machine. After the child's
            own TensorFlow start-up (which may take up to `STARTUP_SLOWDOWN_LIMIT` times
            the usual, or `timeout` if longer), the rest gets
            `timeout * max(1, startup / REFERENCE_STARTUP_SECONDS)`. Past either limit
            the child is killed and the status is "timeout". None = no limit.
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
            pickle.dump((_target_name(target), args, kwargs, memory_limit_mb), f)
        # Files, not pipes, take the child's output: nothing blocks while we watch the clock.
        with open(os.path.join(tmp, "stdout"), "w+") as out, open(os.path.join(tmp, "stderr"), "w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", "tfmem._isolated_worker", request, response],
                                    env=child_env, stdout=out, stderr=err, text=True)
            startup_limit = None if timeout is None else \
                max(timeout, STARTUP_SLOWDOWN_LIMIT * REFERENCE_STARTUP_SECONDS)
            startup, limit, expired = _wait(proc, Path(response + ".started"), timeout, startup_limit)
            if expired is not None:
                return IsolatedResult("timeout", error=expired, startup_seconds=startup,
                                      time_limit_seconds=limit)
            err.seek(0)
            stderr_text = err.read()
        if os.path.exists(response):
            with open(response, "rb") as f:
                outcome = pickle.load(f)
            return IsolatedResult(**outcome, startup_seconds=startup, time_limit_seconds=limit)
    stderr = stderr_text.strip().splitlines()
    message = stderr[-1] if stderr else f"exit code {proc.returncode}"
    if proc.returncode in (-9, 137) or any(m in stderr_text for m in _OOM_MARKERS):
        # Killed by the kernel's OOM killer, or died inside the allocator.
        return IsolatedResult("oom", error=f"process died: {message}", startup_seconds=startup)
    return IsolatedResult("error", error=f"process died (exit {proc.returncode}): {message}",
                          startup_seconds=startup)


def _wait(proc: subprocess.Popen[str], started: Path, timeout: float | None,
          startup_limit: float | None) -> tuple[float | None, float | None, str | None]:
    """Waits for the child: `(startup seconds, limit after start-up, why it was killed or None)`.

    The child writes its TensorFlow import time to `started`; until then the limit is
    `startup_limit`, afterwards `timeout` scaled by how slow that start-up was.
    """
    begin = time.monotonic()
    startup: float | None = None
    while True:
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if startup is None and started.exists():  # the child renames it into place whole
            startup = float(started.read_text())
        limit = None if timeout is None or startup is None else \
            timeout * max(1.0, startup / REFERENCE_STARTUP_SECONDS)
        if proc.returncode is not None:
            return startup, limit, None
        elapsed = time.monotonic() - begin
        if startup_limit is not None and startup is None and elapsed > startup_limit:
            why = f"TensorFlow did not start within {startup_limit:.0f} s"
        elif limit is not None and startup is not None and elapsed - startup > limit:
            why = (f"no result within {limit:.0f} s after start-up ({timeout:.0f} s, scaled by the "
                   f"measured start-up of {startup:.1f} s)")
        else:
            continue
        proc.kill()
        proc.wait()
        return startup, limit, why


def classify_error(err: BaseException) -> Status:
    """"oom" if the exception is an out-of-memory (TF's, the allocator's or Python's), else "error"."""
    text = f"{type(err).__name__}: {err}"
    return "oom" if any(marker in text for marker in _OOM_MARKERS) else "error"


def _limit_gpu(tf: Any, memory_limit_mb: int | None) -> str:
    """The device a trial measures: the first GPU (limited to `memory_limit_mb` through a
    logical device, before TensorFlow initialises it) if there is one, else the CPU."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "CPU:0"
    if memory_limit_mb is not None:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(memory_limit_mb))])
    return "GPU:0"


def _child_main(request_path: str, response_path: str) -> None:
    import importlib
    import resource

    begin = time.perf_counter()
    import tensorflow as tf

    # Tell the parent how long start-up took: it scales the trial's time limit.
    started = Path(response_path + ".started")
    started.with_suffix(".tmp").write_text(f"{time.perf_counter() - begin:.3f}")
    started.with_suffix(".tmp").replace(started)

    with open(request_path, "rb") as f:
        name, args, kwargs, memory_limit_mb = pickle.load(f)
    device = _limit_gpu(tf, memory_limit_mb)
    module_name, _, qualname = name.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)

    def rss_bytes() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def peak() -> int | None:
        try:
            return int(tf.config.experimental.get_memory_info(device)["peak"])
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
