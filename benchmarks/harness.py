"""OOM-point and speed benchmarks: stock TensorFlow, stock XLA, tfmem, hand-chunked and peers.

Every trial is one call of `benchmarks.cases.run_trial` in its own process under a
real allocator limit (`tfmem.run_isolated`), so an out-of-memory is TensorFlow's own
`ResourceExhaustedError`, not an estimate. For each (case, method, budget) the
harness searches the *OOM point*, the largest size that still runs:

1. grow the size geometrically (× `--growth_factor`) from the plan's start size until
   a trial does not succeed (or the plan's size cap is reached);
2. if that was an out-of-memory, bisect a few steps between the last size that ran and
   the first that ran out of memory.

A trial stopped by the time cap is *not* an out-of-memory: the method's OOM point is
then reported as "≥ last size that ran (time cap)", and likewise for the size cap.
Time caps are seconds on an unloaded machine: `tfmem.run_isolated` stretches each
one by how much slower the trial's own TensorFlow start-up was than usual, so a busy
machine gets more time rather than spurious time caps (each record keeps the
stretched limit as `time_limit_s`).
After the searches, every method is timed at sizes all of them can run — all methods
of one size in one process, their calls interleaved (`cases.run_speed`), so that the
machine's slow spells hit every method alike — and the step-time ratios against stock
XLA (and the hand-chunked version) are computed.

Results go to a JSON file, rewritten after every trial (a killed run keeps what it
finished, and `--resume` reuses finished trials). `benchmarks/report.py` turns it into
`RESULTS.md` and plots.

Run:
    python -m benchmarks.harness --quick --out /tmp/quick.json   # < 2 min end-to-end check
    python -m benchmarks.harness --full                           # ≈ 45 min on 2 cores
    python -m benchmarks.report                                   # RESULTS.md + plots

Example (in code):
    >>> plan = QUICK_PLANS[0]
    >>> point = search_oom_point(plan, "tfmem", Budget(64, "8MB"), Settings(time_cap_s=60))
    >>> point.label
    '≥ 4000 (size cap)'
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Run the < 2 minute end-to-end check (tiny budget, one case).")
flags.DEFINE_bool("full", False, "Run the full benchmark under a 1 GiB budget.")
flags.DEFINE_string("out", None, "JSON output (default: benchmarks/results.json, or "
                    "$TMPDIR/tfmem-bench-quick/results.json with --quick, so that a check never "
                    "overwrites the committed results).")
flags.DEFINE_list("cases", None, "Only these cases (default: all of the mode's plans).")
flags.DEFINE_list("methods", None, "Only these methods for the OOM search (default: the mode's).")
flags.DEFINE_float("time_cap", None, "Seconds per trial before it is stopped, on an unloaded machine (scaled "
                   "up by the measured start-up on a busy one); overrides the mode's.")
flags.DEFINE_integer("jobs", None, "Trials of an OOM search run this many at a time (speed trials always "
                     "run one at a time).")
flags.DEFINE_bool("resume", False, "Reuse finished trials from an existing --out file.")
flags.DEFINE_bool("report", True, "Write the report (RESULTS.md and plots) after the run.")
flags.DEFINE_multi_string("note", [], "A note about this run, shown in RESULTS.md (repeatable).")
flags.DEFINE_string("report_dir", None, "Where the report goes (default: next to --out).")

HERE = os.path.dirname(os.path.abspath(__file__))
TRIAL_TARGET = "benchmarks.cases:run_trial"
SPEED_TARGET = "benchmarks.cases:run_speed"
PEER_METHODS = ("sklearn", "faiss")


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget (the allocator's limit) and the tfmem threshold used under it.

    The threshold is well below the budget: a split loop body holds several tensors of
    the split size at once, plus the inputs (which the limit also counts).
    """

    memory_mb: int
    threshold: str


@dataclasses.dataclass(frozen=True)
class CasePlan:
    """How to search one case: where to start, where to stop, how fine to bisect.

    `start` maps a method to its first size (the default is `start["*"]`) so that a
    method expected to run far larger sizes does not spend trials on small ones.
    `speed_sizes` are candidate sizes for the speed comparison; only those every
    compared method can run (below their OOM points) are timed.
    """

    case: str
    start: dict[str, int]
    max_size: int
    quantum: int
    speed_sizes: tuple[int, ...]
    methods: tuple[str, ...] = ("tf", "xla", "chunked", "tfmem")
    peers: tuple[str, ...] = ()
    speed_methods: tuple[str, ...] = ("xla", "tfmem", "chunked", "tf")
    min_size: int | None = None  # the search does not go below this (default: one quantum)
    time_cap_s: float | None = None  # overrides the run's time cap for this case's trials

    def start_for(self, method: str) -> int:
        return self.start.get(method, self.start["*"])


@dataclasses.dataclass(frozen=True)
class Settings:
    """Knobs shared by all searches of a run."""

    time_cap_s: float = 240.0
    growth_factor: float = 2.0
    bisect_steps: int = 2
    search_repeats: int = 1
    speed_repeats: int = 3
    speed_min_seconds: float = 0.0  # and keep timing rounds of warm calls for this long per method
    jobs: int = 1


@dataclasses.dataclass
class OomPoint:
    """The outcome of one OOM-point search.

    Attributes:
        largest_ok: the largest size that ran (None if none did).
        first_failing: the smallest size seen failing above it (None if none did).
        stop: why the search stopped: "oom" (bisected to the OOM point), "time_cap",
            "size_cap", "error", or "none_ok" (even the smallest size tried failed).
        error: the failing trial's message, for "error" / "none_ok".
    """

    case: str
    method: str
    budget_mb: int
    threshold: str
    largest_ok: int | None
    first_failing: int | None
    stop: str
    error: str | None = None

    @property
    def label(self) -> str:
        if self.largest_ok is None:
            return f"< {self.first_failing} ({self.stop_reason_text})"
        if self.stop == "oom":
            return f"{self.largest_ok} (OOM at {self.first_failing})"
        return f"≥ {self.largest_ok} ({self.stop_reason_text})"

    @property
    def stop_reason_text(self) -> str:
        return {"oom": "OOM", "time_cap": "time cap", "size_cap": "size cap", "error": "error",
                "none_ok": "OOM"}.get(self.stop, self.stop)

    @property
    def is_lower_bound(self) -> bool:
        """True when the true OOM point is larger than `largest_ok` by an unknown amount."""
        return self.stop in ("time_cap", "size_cap", "error")

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "label": self.label, "lower_bound": self.is_lower_bound}


# --- plans ---------------------------------------------------------------------------
# Start sizes sit a little below where stock XLA was seen to run out of 1 GiB, so a
# search spends few trials on sizes every method runs; tfmem starts near stock XLA's
# OOM point. Size caps keep a trial under the time cap on 2 cores.

FULL_BUDGETS = (Budget(1024, "32MB"),)
FULL_PLANS = (
    CasePlan("kernel_matmul", {"*": 8000, "tf": 4000, "tfmem": 16000}, max_size=64000, quantum=500,
             speed_sizes=(4000, 8000)),
    CasePlan("kernel_matvec", {"*": 8000, "tf": 4000, "tfmem": 16000}, max_size=64000, quantum=500,
             speed_sizes=(4000, 8000)),
    CasePlan("knn_f32", {"*": 40000, "tf": 20000, "tfmem": 80000}, max_size=240000, quantum=2000,
             speed_sizes=(20000, 40000), peers=PEER_METHODS),
    CasePlan("knn_f64", {"*": 20000, "tf": 10000, "tfmem": 40000}, max_size=120000, quantum=2000,
             speed_sizes=(10000, 20000), peers=PEER_METHODS, time_cap_s=330.0),
    CasePlan("distance_gradient", {"*": 1200, "tf": 800, "tfmem": 3200}, max_size=25600, quantum=100,
             speed_sizes=(1000, 1500), methods=("tf", "xla", "tfmem")),
    CasePlan("sgpr", {"*": 150, "tfmem": 750}, max_size=3000, quantum=25,
             speed_sizes=(150, 200), methods=("tf", "xla", "tfmem"), time_cap_s=330.0),
    CasePlan("sgpr_predict", {"*": 200000, "tfmem": 800000}, max_size=3200000, quantum=25000,
             speed_sizes=(100000, 400000), methods=("tf", "xla", "tfmem")),
)
FULL_SETTINGS = Settings(time_cap_s=240.0, growth_factor=2.0, bisect_steps=2, search_repeats=0,
                         speed_repeats=3, speed_min_seconds=2.0, jobs=2)

# The quick check: a 64 MiB budget that an n=4000 float64 kernel matrix (128 MB) must
# exceed under stock TF and XLA, while tfmem with an 8MB threshold runs it.
QUICK_BUDGETS = (Budget(64, "8MB"),)
QUICK_PLANS = (
    CasePlan("kernel_matmul", {"*": 2000, "tf": 4000}, max_size=4000, quantum=1000,
             speed_sizes=(2000,), methods=("tf", "xla", "tfmem"), speed_methods=("xla", "tfmem"), min_size=4000),
)
# Two rounds of three concurrent searches, then one speed process at n=2000.
QUICK_SETTINGS = Settings(time_cap_s=60.0, growth_factor=2.0, bisect_steps=0, search_repeats=1,
                          speed_repeats=1, jobs=3)


# --- running trials ------------------------------------------------------------------


class TrialLog:
    """All trials of a run, persisted to JSON after each one; reused with `--resume`."""

    def __init__(self, path: str, meta: dict[str, Any], resume: bool = False) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {"meta": meta, "trials": [], "oom_points": [], "speed": [],
                                     "ratios": []}
        self.previous: dict[str, dict[str, Any]] = {}
        if resume and os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            self.previous = {self.key(t): t for t in old.get("trials", [])}
            earlier = old.get("meta", {})
            meta["resumed_from"] = {"started_utc": earlier.get("started_utc"),
                                    "finished_utc": earlier.get("finished_utc"),
                                    "total_s": earlier.get("total_s"),
                                    **({"resumed_from": earlier["resumed_from"]} if "resumed_from" in earlier else {})}

    @staticmethod
    def key(trial: dict[str, Any]) -> str:
        return json.dumps([trial["case"], trial["method"], trial["size"], trial["budget_mb"],
                           trial["threshold"], trial["repeats"], trial.get("timing", "separate"),
                           trial.get("min_seconds", 0.0)])

    def add(self, trial: dict[str, Any]) -> None:
        with self.lock:
            self.data["trials"].append(trial)
            self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=_json_default)
        os.replace(tmp, self.path)


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


class Runner:
    """Runs trials in isolated processes and records each one."""

    def __init__(self, log: TrialLog, settings: Settings, progress: Any | None = None) -> None:
        self.log, self.settings, self.progress = log, settings, progress

    def trial(self, case: str, method: str, size: int, budget: Budget, repeats: int,
              purpose: str, time_cap: float | None = None) -> dict[str, Any]:
        from tfmem import run_isolated

        record: dict[str, Any] = {"case": case, "method": method, "size": int(size),
                                  "budget_mb": budget.memory_mb, "threshold": budget.threshold,
                                  "repeats": repeats}
        time_cap = time_cap or self.settings.time_cap_s
        cached = self.log.previous.get(TrialLog.key(record))
        # A trial stopped by the clock is only worth reusing if the cap has not grown since.
        if cached is not None and (cached["status"] != "timeout" or (cached.get("time_cap_s") or 0) >= time_cap):
            cached = {**cached, "purpose": purpose, "reused": True}
            self.log.add(cached)
            self._tick(cached)
            return cached
        record["time_cap_s"] = time_cap
        start = time.perf_counter()
        result = run_isolated(TRIAL_TARGET, case, method, int(size), threshold=budget.threshold,
                              repeats=repeats, planned=True, memory_limit_mb=budget.memory_mb,
                              timeout=time_cap)
        value = result.value if isinstance(result.value, dict) else {}
        record.update(
            time_limit_s=result.time_limit_seconds, startup_s=result.startup_seconds,
            purpose=purpose, status=result.status, error=_short_error(result.error),
            peak_bytes=result.peak_bytes, max_rss_bytes=result.max_rss_bytes,
            baseline_rss_bytes=result.baseline_rss_bytes, call_s=result.seconds,
            wall_s=time.perf_counter() - start,
            first_call_s=value.get("first_call_s"), step_s=value.get("step_s"),
            steps_timed=value.get("steps_timed"),
            xla_planned_bytes=value.get("xla_planned_bytes"), tfmem_status=value.get("status"),
            splits=value.get("splits"), digest=value.get("digest"))
        if result.status == "ok" and value.get("rss_only"):
            # Peers allocate with numpy, outside TensorFlow's allocator: the limit cannot
            # stop them, so exceeding the budget in resident memory counts as running out.
            above = (result.max_rss_bytes or 0) - (result.baseline_rss_bytes or 0)
            if above > budget.memory_mb * 2 ** 20:
                record.update(status="oom", error=f"resident memory {above / 2**20:.0f} MiB above baseline "
                              f"exceeds the {budget.memory_mb} MiB budget (not enforced for numpy)")
        self.log.add(record)
        self._tick(record)
        return record

    def speed_trials(self, case: str, size: int, methods: Sequence[str], budget: Budget,
                     time_cap: float | None = None) -> list[dict[str, Any]]:
        """Times `methods` at `size` in one isolated process, interleaved (`cases.run_speed`).

        Returns one record per method, like `trial`'s (purpose "speed", timing "interleaved");
        the process's peak memory is shared by all methods, so it is not recorded per method.
        """
        from tfmem import run_isolated

        settings = self.settings
        records = [{"case": case, "method": m, "size": int(size), "budget_mb": budget.memory_mb,
                    "threshold": budget.threshold, "repeats": settings.speed_repeats,
                    "timing": "interleaved", "min_seconds": settings.speed_min_seconds,
                    "methods_together": list(methods)} for m in methods]
        cached = [self.log.previous.get(TrialLog.key(r)) for r in records]
        if all(c is not None and c.get("methods_together") == list(methods) for c in cached):
            reused = [{**c, "reused": True} for c in cached]
            for record in reused:
                self.log.add(record)
                self._tick(record)
            return reused
        time_cap = (time_cap or settings.time_cap_s) * len(methods)  # each method had its own cap
        start = time.perf_counter()
        result = run_isolated(SPEED_TARGET, case, int(size), list(methods), threshold=budget.threshold,
                              repeats=settings.speed_repeats, min_seconds=settings.speed_min_seconds,
                              memory_limit_mb=budget.memory_mb, timeout=time_cap)
        values = result.value if isinstance(result.value, dict) else {}
        for record in records:
            value = values.get(record["method"]) or {"status": result.status, "error": result.error}
            record.update(
                purpose="speed", status=value["status"], error=_short_error(value.get("error")),
                time_cap_s=time_cap, peak_bytes=None, call_s=result.seconds,
                wall_s=time.perf_counter() - start, first_call_s=value.get("first_call_s"),
                step_s=value.get("step_s"), steps_timed=value.get("steps_timed"),
                digest=value.get("digest"))
            self.log.add(record)
            self._tick(record)
        return records

    def _tick(self, record: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(f"{record['case']}/{record['method']}@{record['size']}: "
                                          f"{record['status']}")


def _short_error(error: str | None) -> str | None:
    """The error's first line and the line naming the failed allocation, if any."""
    if not error:
        return None
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    keep = lines[:1] + [line for line in lines[1:] if "allocat" in line.lower()][:1]
    return " | ".join(keep)[:500]


def _round(size: float, quantum: int) -> int:
    return max(quantum, int(round(size / quantum)) * quantum)


def search_oom_point(plan: CasePlan, method: str, budget: Budget, settings: Settings,
                     runner: Runner | None = None) -> OomPoint:
    """Finds the largest size of `plan.case` that `method` runs under `budget`.

    Grows geometrically from the plan's start size; on the first out-of-memory, bisects
    `settings.bisect_steps` times between the last size that ran and that one. If the
    start size already fails, halves until a size runs (down to one quantum).

    Example:
        >>> point = search_oom_point(QUICK_PLANS[0], "xla", Budget(64, "8MB"), QUICK_SETTINGS)
        >>> point.stop, point.largest_ok, point.first_failing
        ('oom', 2000, 4000)
    """
    if runner is None:
        runner = Runner(TrialLog(os.devnull, {}), settings)

    def run(size: int) -> dict[str, Any]:
        return runner.trial(plan.case, method, size, budget, settings.search_repeats, "search", plan.time_cap_s)

    largest_ok: int | None = None
    size = min(plan.start_for(method), plan.max_size)
    while True:
        trial = run(size)
        if trial["status"] != "ok":
            break
        largest_ok = size
        if size >= plan.max_size:
            return OomPoint(plan.case, method, budget.memory_mb, budget.threshold, largest_ok, None, "size_cap")
        size = min(_round(size * settings.growth_factor, plan.quantum), plan.max_size)
    first_failing, failure = size, trial
    # The start size may already be too large: come down until something runs.
    while largest_ok is None and failure["status"] == "oom" and first_failing > (plan.min_size or plan.quantum):
        size = max(_round(first_failing / settings.growth_factor, plan.quantum), plan.min_size or 0)
        if size >= first_failing:
            break
        trial = run(size)
        if trial["status"] == "ok":
            largest_ok = size
        else:
            first_failing, failure = size, trial
    if largest_ok is None:
        stop = "none_ok" if failure["status"] == "oom" else _stop_of(failure["status"])
        return OomPoint(plan.case, method, budget.memory_mb, budget.threshold, None, first_failing, stop,
                        failure.get("error"))
    if failure["status"] != "oom":
        # Stopped by the clock or by a bug, not by memory: a lower bound, never an OOM.
        return OomPoint(plan.case, method, budget.memory_mb, budget.threshold, largest_ok, first_failing,
                        _stop_of(failure["status"]), failure.get("error"))
    for _ in range(settings.bisect_steps):
        middle = _round(math.sqrt(largest_ok * first_failing), plan.quantum)
        if middle <= largest_ok or middle >= first_failing:
            break
        trial = run(middle)
        if trial["status"] == "ok":
            largest_ok = middle
        elif trial["status"] == "oom":
            first_failing = middle
        else:
            # A time cap inside the bracket: larger sizes are not worth trying either.
            first_failing = middle
            break
    return OomPoint(plan.case, method, budget.memory_mb, budget.threshold, largest_ok, first_failing, "oom")


def _stop_of(status: str) -> str:
    return {"timeout": "time_cap", "error": "error", "oom": "oom"}.get(status, status)


def speed_comparison(plan: CasePlan, budget: Budget, points: Sequence[OomPoint], settings: Settings,
                     runner: Runner) -> list[dict[str, Any]]:
    """Times every method (and peer) at the plan's speed sizes that all methods run.

    Returns one entry per size: the warm step time of each method and the ratios
    tfmem/xla, tfmem/chunked, chunked/xla (and peer/xla) where both ran.
    """
    fits = [p.largest_ok or 0 for p in points if p.method in ("xla", "tfmem", "chunked")]
    limit = min(fits) if fits else 0
    sizes = [s for s in plan.speed_sizes if s <= limit]
    if not sizes and limit:
        sizes = [limit]  # the comparison still happens, at the largest size all methods run
    entries = []
    # A hand-chunked version exists where the plan searches one.
    methods = [m for m in plan.speed_methods if m != "chunked" or "chunked" in plan.methods]
    methods += [p for p in plan.peers if _peer_available(p)]
    for size in sizes:
        # A method whose search already ran out of memory at or below this size is not
        # run again: it would only make the allocator stall and retry inside the process.
        known_oom = {p.method for p in points if p.stop in ("oom", "none_ok")
                     and p.first_failing is not None and p.first_failing <= size}
        timed = runner.speed_trials(plan.case, size, [m for m in methods if m not in known_oom],
                                    budget, plan.time_cap_s)
        trials = timed + [{"method": m, "status": "oom", "step_s": None} for m in methods if m in known_oom]
        for peer in plan.peers:  # numpy's memory is resident set, which needs a process of its own
            if peer in methods:
                runner.trial(plan.case, peer, size, budget, 0, "peer_memory", plan.time_cap_s)
        statuses = {t["method"]: t["status"] for t in trials}
        times = {t["method"]: t["step_s"] if t["status"] == "ok" else None for t in trials}
        ratios = {}
        for numerator, denominator in [("tfmem", "xla"), ("tfmem", "chunked"), ("chunked", "xla"),
                                       ("tf", "xla"), *[(p, "xla") for p in plan.peers]]:
            if times.get(numerator) and times.get(denominator):
                ratios[f"{numerator}/{denominator}"] = times[numerator] / times[denominator]
        entries.append({"case": plan.case, "size": size, "budget_mb": budget.memory_mb,
                        "threshold": budget.threshold, "step_s": times, "status": statuses, "ratios": ratios})
    return entries


def _peer_available(peer: str) -> bool:
    module = {"sklearn": "sklearn", "faiss": "faiss"}[peer]
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def oom_ratio(points: Sequence[OomPoint], case_growth: float) -> dict[str, Any] | None:
    """tfmem's OOM point over stock XLA's, in sizes and in units of size**growth."""
    by_method = {p.method: p for p in points}
    tfmem_point, xla_point = by_method.get("tfmem"), by_method.get("xla")
    if not tfmem_point or not xla_point or not tfmem_point.largest_ok or not xla_point.largest_ok:
        return None
    ratio = tfmem_point.largest_ok / xla_point.largest_ok
    return {"case": tfmem_point.case, "budget_mb": tfmem_point.budget_mb, "threshold": tfmem_point.threshold,
            "tfmem": tfmem_point.largest_ok, "xla": xla_point.largest_ok, "size_ratio": ratio,
            "growth": case_growth, "memory_units_ratio": ratio ** case_growth,
            "lower_bound": tfmem_point.is_lower_bound,
            "xla_upper_bound": xla_point.is_lower_bound}


def machine_description() -> dict[str, Any]:
    """Where the numbers come from: CPU, cores, memory (from /proc/meminfo), versions."""
    import tensorflow as tf

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    memory = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"platform": platform.platform(), **_git_state(), "cpu": cpu, "cpu_count": os.cpu_count(), "memory_bytes": memory,
            "python": platform.python_version(), "tensorflow": tf.__version__,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _git_state() -> dict[str, Any]:
    """The commit benchmarked, and whether the work tree differed from it (read-only git)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_head": head or None, "git_dirty": bool(dirty)}


def run(plans: Sequence[CasePlan], budgets: Sequence[Budget], settings: Settings, out: str, *,
        mode: str, methods: Sequence[str] | None = None, resume: bool = False,
        notes: Sequence[str] = ()) -> dict[str, Any]:
    """Runs every plan under every budget; returns (and writes to `out`) the results."""
    from tqdm import tqdm

    from benchmarks.cases import CASES

    meta = {"mode": mode, "machine": machine_description(), "settings": dataclasses.asdict(settings),
            "budgets": [dataclasses.asdict(b) for b in budgets],
            "plans": [dataclasses.asdict(p) for p in plans],
            "growth": {p.case: CASES[p.case].growth for p in plans},
            "descriptions": {p.case: CASES[p.case].description for p in plans},
            "size_names": {p.case: CASES[p.case].size_name for p in plans},
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "notes": list(notes)}
    log = TrialLog(out, meta, resume=resume)
    log.save()
    start = time.perf_counter()
    with tqdm(desc="trials", unit="trial", dynamic_ncols=True) as progress:
        runner = Runner(log, settings, progress)
        for plan in plans:
            for budget in budgets:
                plan_methods = [m for m in plan.methods if methods is None or m in methods]
                with concurrent.futures.ThreadPoolExecutor(max(1, settings.jobs)) as pool:
                    points = list(pool.map(lambda m: search_oom_point(plan, m, budget, settings, runner),
                                           plan_methods))
                with log.lock:
                    log.data["oom_points"].extend(p.to_json() for p in points)
                    ratio = oom_ratio(points, CASES[plan.case].growth)
                    if ratio:
                        log.data["ratios"].append(ratio)
                    log.save()
                for point in points:
                    progress.write(f"{plan.case:18s} {point.method:8s} {budget.memory_mb} MiB: {point.label}")
                entries = speed_comparison(plan, budget, points, settings, runner)
                with log.lock:
                    log.data["speed"].extend(entries)
                    log.save()
                for entry in entries:
                    progress.write(f"{plan.case:18s} speed @ {entry['size']}: " + ", ".join(
                        f"{k}={v:.3f}" for k, v in entry["ratios"].items()))
    log.data["meta"]["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    log.data["meta"]["total_s"] = time.perf_counter() - start
    log.save()
    return log.data


def main(argv: Sequence[str]) -> int:
    del argv
    if FLAGS.quick == FLAGS.full:
        print("give exactly one of --quick or --full", file=sys.stderr)
        return 2
    mode = "quick" if FLAGS.quick else "full"
    plans, budgets, settings = ((QUICK_PLANS, QUICK_BUDGETS, QUICK_SETTINGS) if FLAGS.quick
                                else (FULL_PLANS, FULL_BUDGETS, FULL_SETTINGS))
    if FLAGS.cases:
        unknown = set(FLAGS.cases) - {p.case for p in plans}
        if unknown:
            print(f"no plan for {sorted(unknown)} in --{mode}", file=sys.stderr)
            return 2
        plans = tuple(p for p in plans if p.case in FLAGS.cases)
    if FLAGS.time_cap is not None:
        settings = dataclasses.replace(settings, time_cap_s=FLAGS.time_cap)
        plans = tuple(dataclasses.replace(p, time_cap_s=None) for p in plans)  # the flag wins
    if FLAGS.jobs is not None:
        settings = dataclasses.replace(settings, jobs=FLAGS.jobs)
    out = FLAGS.out or (os.path.join(tempfile.gettempdir(), "tfmem-bench-quick", "results.json") if FLAGS.quick
                        else os.path.join(HERE, "results.json"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    data = run(plans, budgets, settings, out, mode=mode, methods=FLAGS.methods, resume=FLAGS.resume,
               notes=FLAGS.note)
    print(f"wrote {out} ({len(data['trials'])} trials, {data['meta']['total_s']:.0f} s)")
    if FLAGS.report:
        from benchmarks import report

        directory = FLAGS.report_dir or os.path.dirname(os.path.abspath(out))
        written = report.write_report(data, directory)
        print("wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    app.run(main)
