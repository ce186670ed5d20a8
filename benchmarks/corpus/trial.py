"""What one isolated process does for one corpus program.

`tfmem.run_isolated` calls these in a fresh Python whose BFC allocator is limited to the
program's budget; each step catches its own failure, so one process reports every step:

    stock_trial(name)        stock `tf.function(jit_compile=True)` at `big` (expected: "oom")
    tfmem_trial(name)        XLA's planned bytes for stock at `big` (compiled, not run), tfmem
                             at `big` under the limit (status, real peak, static estimate),
                             and tfmem vs stock at `small` (max relative error) under the
                             budget and under a tight one that forces splits

tfmem's config is `Config(memory_budget=<budget>)` and nothing else. `mode="expert"` adds
`tensor_size_threshold = budget / 16`, the expert override that today's engine needs;
it is a diagnostic of the split engine, never what the acceptance test runs.
`mode="graph"` adds `jit_compile: false`: the plan runs on TensorFlow's executor, without XLA.

Example:
    >>> result = tfmem.run_isolated("benchmarks.corpus.trial:tfmem_trial", "kxx_expanded_matmul",
    ...                             memory_limit_mb=128)
    >>> result.value["big"]["status"], result.value["equality"]["tight"]["max_rel_err"] < 1e-10
    ('ok', True)
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.isolation import classify_error
from tfmem.xla_heaps import suggested_heap_bytes

from benchmarks.corpus.programs import PROGRAMS, Program

MODES = ("budget", "expert", "graph")
_ERROR_CHARS = 1500


def tfmem_config(budget: int, mode: str = "budget") -> tfmem.Config:
    """The config a trial runs under: the budget alone, or (diagnostic) with an expert threshold."""
    if mode == "budget":
        return tfmem.Config(memory_budget=budget)
    if mode == "expert":
        return tfmem.Config(memory_budget=budget, tensor_size_threshold=budget // 16)
    if mode == "graph":  # without XLA: TensorFlow's executor runs the plan
        return tfmem.Config(memory_budget=budget, jit_compile=False)
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def call(program: Program, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Calls `function` as the program's user does: plainly, or under an outer tape.

    With an outer tape the result is (outputs, gradients of their sum w.r.t. every float arg).
    """
    if not program.outer_tape:
        return function(*args)
    with tf.GradientTape() as tape:
        tape.watch([a for a in args if a.dtype.is_floating])
        out = function(*args)
    return out, tape.gradient(out, [a for a in args if a.dtype.is_floating])


def _numpy(value: Any) -> list[np.ndarray | None]:
    return [None if v is None else np.asarray(v) for v in tf.nest.flatten(value)]


def _peak() -> int | None:
    try:
        return int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    except (ValueError, tf.errors.OpError):
        return None


def _error(err: BaseException) -> dict[str, Any]:
    return {"status": classify_error(err), "error": f"{type(err).__name__}: {str(err)[:_ERROR_CHARS]}"}


def _measured(program: Program, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[dict[str, Any], Any]:
    """Runs one call with the allocator's peak reset first: (record, numpy outputs or None).

    The peak then counts the inputs and the model's data (allocated before) and the call.
    """
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = time.perf_counter()
    try:
        value = _numpy(call(program, function, args))
        record: dict[str, Any] = {"status": "ok"}
    except Exception as err:  # noqa: BLE001 - an out-of-memory or error is the measurement
        value, record = None, _error(err)
    record.update(seconds=time.perf_counter() - start, peak_bytes=_peak())
    return record, value


def _report_summary(report: Any, budget: int) -> dict[str, Any]:
    """The report's verdict: its static estimate, whether that claims to fit, and why not."""
    estimate = report.memory_after.peak_bytes if report.memory_after is not None else None
    unsplit = sorted({f"{r.rule}: {r.reason}" for r in report.rejected if r.kind == "split"})
    return {
        "report_status": report.status,
        "report_reason": report.reason,
        "estimate_before_bytes": report.memory_before.peak_bytes if report.memory_before is not None else None,
        "estimate_bytes": estimate,
        "claims_fit": bool(report.fits),
        # Without XLA: the peak TensorFlow's allocator reaches, replayed over the estimate's allocations.
        "replayed_peak_bytes": report.allocator_replay.peak_bytes if report.allocator_replay is not None else None,
        "xla_bytes": report.xla_bytes_after,
        "xla_heap_bytes": list(report.xla_plan_after.heap_bytes) if report.xla_plan_after is not None else None,
        # What the summary suggests where XLA's one block finds no room in one piece.
        "suggested_heap_bytes": (suggested_heap_bytes(report.xla_plan_after)
                                 if report.xla_plan_after is not None and not report.fits else None),
        "splits": len(report.splits),
        "unsplit": unsplit[:8],
        "pipeline_seconds": report.pipeline_seconds,
    }


def _tfmem_call(program: Program, fn: Callable[..., Any], args: tuple[Any, ...], budget: int,
                mode: str) -> tuple[dict[str, Any], list[np.ndarray | None] | None]:
    """tfmem under `budget`: rewrite (the report), then one measured call."""
    record: dict[str, Any] = {"budget_bytes": budget}
    try:
        wrapped = tfmem.function(fn, config=tfmem_config(budget, mode))
        record.update(_report_summary(wrapped.report(*args), budget))
    except Exception as err:  # noqa: BLE001 - e.g. the budget-only config is refused
        return {**record, **_error(err)}, None
    measured, value = _measured(program, wrapped, args)
    return {**record, **measured}, value


def _stock_planned(program: Program, fn: Callable[..., Any], args: tuple[Any, ...]) -> dict[str, Any]:
    """XLA's planned bytes for stock at `big`: compiled, not run.

    For an outer-tape program this is the forward function alone, which must run whole
    before any gradient: a lower bound on what the stock program needs.
    """
    try:
        planned = tfmem.xla_planned_bytes(tf.function(fn, jit_compile=True), *args)
    except Exception as err:  # noqa: BLE001
        return {"size": program.big, **_error(err)}
    return {"size": program.big, "status": "ok" if planned is not None else "error", "planned_bytes": planned,
            "forward_only": program.outer_tape}


def _big_steps(program: Program, mode: str, steps: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Stock's planned bytes and the tfmem run at `big`, on one build of the program.

    One build: a second GPflow model alive beside the first would count against the limit.
    """
    try:
        fn, args = program.build(program.big)
    except Exception as err:  # noqa: BLE001 - e.g. the data alone does not fit the limit
        failed = {"size": program.big, **_error(err)}
        failed["error"] = f"building the program: {failed['error']}"
        return {step: failed for step in ("stock_planned", "big") if step in steps}
    result = {}
    if "stock_planned" in steps:
        result["stock_planned"] = _stock_planned(program, fn, args)
    if "big" in steps:
        result["big"], _ = _tfmem_call(program, fn, args, program.budget_bytes, mode)
        result["big"]["size"] = program.big
    return result


# An output whose every entry is below this many rounding errors of the program's largest
# float output is zero in working precision on both sides: what it holds is rounding noise.
ROUNDING_NOISE_ULPS = 1000
# A program whose answer amplifies rounding (conjugate gradients, Lanczos: ill-conditioned
# and stopped early) differs between stock TensorFlow's kernels and stock XLA by more
# than its rtol; tfmem's answer counts as equal within `SPREAD_FACTOR` times stock's
# spread, and never beyond `SPREAD_LIMIT` times the rtol. The spread is the largest of
# several samples of how far rounding moves stock's answer: TensorFlow's kernels against
# XLA's, and stock XLA on the inputs moved by one rounding error each
# (`SPREAD_PERTURBATIONS` draws). One sample alone is no bound: on 15 CG steps on
# (K + ½I) α = y at n=1,000, TensorFlow is 7.2e-5 from XLA here and was 2.8e-5 on CI, where
# a tfmem plan (chunked K·p) 2.0e-4 away failed; tfmem's plans of it have been 6.4e-5 to
# 2.6e-4 away, and the four moved inputs move XLA's answer by 1.3e-5 to 8.4e-5 here.
# Against a long-double reference, tfmem's plan here is 3.1e-5 off and stock XLA 9.3e-5:
# the difference is rounding.
SPREAD_FACTOR = 4.0
SPREAD_LIMIT = 1e5
SPREAD_PERTURBATIONS = 4


def compare(got: list[np.ndarray | None], want: list[np.ndarray | None], program: Program, *,
            spread: float | None = None) -> dict[str, Any]:
    """Max relative error over float outputs (max |got − want| / max |want|, per output) and,
    for integer outputs, the fraction of entries that differ.

    A float output that is zero in working precision on both sides — every entry of stock's
    and of tfmem's under `ROUNDING_NOISE_ULPS` rounding errors of the largest float output
    of the program — counts as equal: its relative error compares two draws of rounding
    noise. (GPflow's VGP at its initial q(u) = N(0, I): the loss does not depend on the
    lengthscales, and their gradients are ~1e-14 next to other gradients of ~1e3, differing
    by 28% between stock TensorFlow and stock XLA.) Anything larger than that floor on
    either side is compared relatively, as before.

    `spread`: how far rounding moves stock XLA's answer on this program (the same measure;
    `_stock_spread`); the tolerance is then `max(rtol, SPREAD_FACTOR · spread)`, capped at
    `SPREAD_LIMIT · rtol`: tfmem is equal when it is as close to XLA as rounding moves it.
    """
    if len(got) != len(want):
        return {"equal": False, "max_rel_err": float("inf"), "index_mismatch": 1.0,
                "detail": f"{len(got)} outputs, stock has {len(want)}"}
    floats = [w for w in want if w is not None and w.dtype.kind == "f" and w.size]
    largest = max((float(np.max(np.abs(w))) for w in floats), default=0.0)
    worst, mismatch, detail = 0.0, 0.0, ""
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None:
            if (g is None) != (w is None):
                worst, detail = float("inf"), f"output {i}: None on one side only"
            continue
        if g.shape != w.shape:
            worst, detail = float("inf"), f"output {i}: shape {g.shape}, stock {w.shape}"
            continue
        if w.dtype.kind in "iub":
            fraction = float(np.mean(g != w)) if w.size else 0.0
            mismatch = max(mismatch, fraction)
            continue
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        diff = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) if w.size else 0.0
        noise = ROUNDING_NOISE_ULPS * float(np.finfo(w.dtype).eps) * largest
        if w.size and scale <= noise and float(np.max(np.abs(g))) <= noise:
            continue  # zero in working precision on both sides
        error = diff / scale if scale > 0 else diff
        if not np.isfinite(error):
            error = float("inf")
        if error > worst:
            worst, detail = error, f"output {i} {w.dtype}{list(w.shape)}"
    tolerance = program.rtol
    if spread is not None:
        tolerance = min(max(tolerance, SPREAD_FACTOR * spread), SPREAD_LIMIT * program.rtol)
    return {"equal": worst <= tolerance and mismatch <= program.index_mismatch, "max_rel_err": worst,
            "index_mismatch": mismatch, "detail": detail, "tolerance": tolerance}


def moved_by_one_rounding(args: tuple[Any, ...], seed: int) -> tuple[Any, ...]:
    """`args` with every nonzero entry of every float tensor moved one ulp up or down.

    The sign is drawn per entry (`seed`); integer tensors, zeros and anything that is not
    a tensor stay as they are. Example: `moved_by_one_rounding((tf.constant([1.0, 0.0]),), 0)`
    is `([1 ± 2.2e-16, 0.0],)` in float64.
    """
    rng = np.random.default_rng(seed)
    moved = []
    for arg in args:
        value = arg.numpy() if isinstance(arg, tf.Tensor) else None
        if value is None or value.dtype not in (np.float16, np.float32, np.float64):
            moved.append(arg)
            continue
        toward = np.where(rng.random(value.shape) < 0.5, -np.inf, np.inf).astype(value.dtype)
        moved.append(tf.constant(np.where(value == 0, value, np.nextafter(value, toward))))
    return tuple(moved)


def _stock_spread(program: Program, fn: Callable[..., Any], xla: Callable[..., Any], args: tuple[Any, ...],
                  want: list[np.ndarray | None]) -> dict[str, Any]:
    """How far rounding moves stock XLA's answer: {"stock_spread": the largest sample, "stock_spreads": each}.

    The samples: stock TensorFlow without XLA on `args`, and stock XLA (`xla`, compiled
    already) on `args` moved by one rounding (`SPREAD_PERTURBATIONS` draws). A sample that
    could not run is recorded as such, under "stock_spread_error" when none ran.
    """
    spreads: dict[str, float] = {}
    errors: list[str] = []
    plain_record, plain = _measured(program, tf.function(fn), args)
    if plain is not None:
        spreads["tensorflow"] = compare(plain, want, program)["max_rel_err"]
    else:
        errors.append(f"tensorflow: {plain_record.get('error')}")
    for seed in range(SPREAD_PERTURBATIONS):
        moved = moved_by_one_rounding(args, seed)
        if all(m is a for m, a in zip(moved, args)):
            break  # no float input to move
        moved_record, got = _measured(program, xla, moved)
        if got is not None:
            spreads[f"moved_{seed}"] = compare(got, want, program)["max_rel_err"]
        else:
            errors.append(f"moved_{seed}: {moved_record.get('error')}")
    record: dict[str, Any] = {"stock_spreads": spreads}
    if spreads:
        record["stock_spread"] = max(spreads.values())
    if errors and not spreads:
        record["stock_spread_error"] = "; ".join(errors)
    return record


def _equality(program: Program, mode: str) -> dict[str, Any]:
    """tfmem vs stock XLA at `small`, on the same inputs (and the same GPflow model).

    Twice: under the program's budget ("budget", which `small` may fit without any
    split), and under a tight budget ("tight": half of tfmem's static estimate of the
    unchanged program), so that the split code paths are compared too.
    """
    fn, args = program.build(program.small)
    xla = tf.function(fn, jit_compile=True)
    stock, want = _measured(program, xla, args)
    record: dict[str, Any] = {"size": program.small, "stock": stock}
    if want is None:
        return {**record, "status": "error", "error": f"stock failed at the small size: {stock.get('error')}"}
    # Stock's own spread is measured beside stock, before tfmem's calls hold or fragment
    # the allocator: taken after them, it depended on what they left, and a reference that
    # could not run counted as no spread at all.
    record.update(_stock_spread(program, fn, xla, args, want))
    unchanged = tfmem.function(fn, config=tfmem.Config()).report(*args).memory_before
    for key, budget in (("budget", program.budget_bytes), ("tight", unchanged.peak_bytes // 2)):
        record[key], got = _tfmem_call(program, fn, args, budget, mode)
        if got is None:
            continue
        compared = compare(got, want, program)
        if not compared["equal"] and compared["max_rel_err"] <= program.rtol * SPREAD_LIMIT:
            compared = compare(got, want, program, spread=record.get("stock_spread"))
        record[key].update(compared)
    return record


def tfmem_trial(name: str, mode: str = "budget", steps: tuple[str, ...] = ("stock_planned", "big", "equality"),
                xla_heaps: int | None = None) -> dict[str, Any]:
    """Stock's planned bytes and tfmem at `big`, then tfmem vs stock at `small`.

    `big` runs first, on a fresh allocator: after the small size's calls, TensorFlow's
    BFC allocator keeps the regions it grew, and a later large block may no longer fit
    (measured: SGPR's 114 MiB block then fails under 192 MiB, and runs when first;
    `Budget.xla_overshoot` now accounts for such regions, but only from the allocator's
    peak, which the small size's calls would raise for no reason of the big program).
    A process that dies in the big step loses the rest: `run.tfmem_record` then runs
    the steps again, each group in its own process.

    `xla_heaps`: XLA's temporaries in heaps of at most these bytes, for the whole process
    (`tfmem.limit_xla_heaps`, before anything compiles; stock's plan is then made so too).
    """
    if xla_heaps is not None:
        tfmem.limit_xla_heaps(xla_heaps)
    program = PROGRAMS[name]
    result: dict[str, Any] = {"program": name, "mode": mode, "budget_bytes": program.budget_bytes}
    result.update(_big_steps(program, mode, steps))
    if "equality" in steps:
        try:
            result["equality"] = _equality(program, mode)
        except Exception as err:  # noqa: BLE001 - building or rewriting at the small size failed
            result["equality"] = {"size": program.small, **_error(err)}
    return result


def stock_trial(name: str, size: str = "big") -> dict[str, Any]:
    """Stock `tf.function(jit_compile=True)` at the program's `big` (or `small`) size, run for real."""
    program = PROGRAMS[name]
    fn, args = program.build(getattr(program, size))
    record, _ = _measured(program, tf.function(fn, jit_compile=True), args)
    return {"program": name, "size": getattr(program, size), **record}
