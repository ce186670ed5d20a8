"""Turns the harness's JSON into `RESULTS.md` and plots (peak memory and time vs size).

Everything in `RESULTS.md` comes from the JSON, so rerunning this after a benchmark run
regenerates it exactly; nothing is edited by hand.

Run:
    python -m benchmarks.report                                   # benchmarks/results.json → benchmarks/
    python -m benchmarks.report --results /tmp/q/results.json --out_dir /tmp/q

Example (in code; `python -m benchmarks.report` writes next to the results instead):
    >>> import tempfile
    >>> with open("benchmarks/results.json") as f:
    ...     data = json.load(f)
    >>> with tempfile.TemporaryDirectory() as out:
    ...     [os.path.relpath(p, out) for p in write_report(data, out)]  # doctest: +ELLIPSIS
    ['RESULTS.md', 'plots/kernel_matmul.png', ...]
"""
from __future__ import annotations

import collections
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))
flags.DEFINE_string("results", os.path.join(HERE, "results.json"), "The harness's JSON.")
flags.DEFINE_string("out_dir", None, "Where RESULTS.md and plots/ go (default: next to --results).")

METHOD_ORDER = ("tf", "xla", "chunked", "tfmem", "sklearn", "faiss")
METHOD_NAMES = {"tf": "stock tf.function", "xla": "stock XLA (jit_compile=True)", "chunked": "hand-chunked (XLA)",
                "tfmem": "tfmem", "sklearn": "scikit-learn chunked", "faiss": "faiss-cpu IndexFlatL2"}
# The targets: OOM-point ratio tfmem / stock XLA (in units of the memory growth,
# i.e. n² for the quadratic cases) and step-time ratios where every method fits.
OOM_TARGETS = {"sgpr": 10.0, "kernel_matmul": 20.0, "kernel_matvec": 20.0, "knn_f32": 20.0, "knn_f64": 20.0}
SPEED_TARGETS = {"tfmem/xla": 1.15, "tfmem/chunked": 1.05}
CASE_NOTES = {
    "kernel_matvec": "The design guide expected stock XLA on CPU to fuse kernel × *vector* without "
                     "materialising the n×n matrix; its planned bytes below show whether it did in this run.",
    "knn_f64": "Under XLA on CPU, float64 `top_k` becomes a full sort, so every XLA-compiled method "
               "(stock XLA, hand-chunked, tfmem) is far slower than stock `tf.function`, whose TopKV2 kernel "
               "is not a sort; the time cap, not memory, ends tfmem's search.",
    "sgpr": "N = 100000 training points; the size is M, the number of inducing points. Memory grows "
            "like M·N, so the ratio is reported in M.",
    "sgpr_predict": "M = 100 inducing points; the size is the number of test points (memory grows linearly).",
    "distance_gradient": "A naive [n, n, 64] difference inside a tape, differentiated: the backward pass "
                         "materialises it under stock XLA.",
}


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:,.0f} MiB"


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _ordered(methods: Sequence[str]) -> list[str]:
    return sorted(set(methods), key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else 99, m))


def _largest_ok_trial(data: dict[str, Any], case: str, method: str, budget_mb: int,
                      size: int | None) -> dict[str, Any] | None:
    for trial in data["trials"]:
        if (trial["case"], trial["method"], trial["size"], trial["budget_mb"], trial["status"]) == (
                case, method, size, budget_mb, "ok"):
            return trial
    return None


def summary_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, budget): the OOM-point ratio and speed ratios, with target verdicts."""
    rows = []
    ratios = {(r["case"], r["budget_mb"]): r for r in data.get("ratios", [])}
    points = collections.defaultdict(dict)
    for p in data.get("oom_points", []):
        points[(p["case"], p["budget_mb"])][p["method"]] = p
    speeds = collections.defaultdict(list)
    for s in data.get("speed", []):
        speeds[(s["case"], s["budget_mb"])].append(s)
    for key, by_method in points.items():
        case, budget = key
        ratio = ratios.get(key)
        row: dict[str, Any] = {"case": case, "budget_mb": budget, "xla": by_method.get("xla"),
                               "tfmem": by_method.get("tfmem"), "ratio": ratio}
        # Speed at the largest size where all ran: the most memory-relevant comparison.
        entries = [s for s in speeds.get(key, []) if s["ratios"]]
        row["speed"] = entries[-1] if entries else None
        row["speeds"] = entries
        verdicts = []
        target = OOM_TARGETS.get(case)
        if target is not None:
            if ratio is None:
                verdicts.append(f"OOM ratio ≥ {target:g}×: not measured")
            else:
                value = ratio["memory_units_ratio"]
                met = value >= target
                how = "met" if met else ("not shown (tfmem stopped by a cap, not memory)"
                                         if ratio["lower_bound"] else "missed")
                verdicts.append(f"OOM ratio ≥ {target:g}×: {how}")
        for name, limit in SPEED_TARGETS.items():
            value = row["speed"]["ratios"].get(name) if row["speed"] else None
            if value is not None:
                verdicts.append(f"{name} = {value:.2f} ≤ {limit:g}: {'met' if value <= limit else 'missed'}")
        row["verdicts"] = verdicts
        tfmem_point = by_method.get("tfmem")
        row["tfmem_trial"] = tfmem_point and _largest_ok_trial(data, case, "tfmem", budget,
                                                               tfmem_point["largest_ok"])
        rows.append(row)
    return rows


def _interleaved(data: dict[str, Any]) -> bool:
    return any(t.get("timing") == "interleaved" for t in data["trials"] if t.get("purpose") == "speed")


def _oom_cell(point: dict[str, Any] | None) -> str:
    return "–" if point is None else point["label"]


def render_markdown(data: dict[str, Any], plot_paths: dict[str, str]) -> str:
    """The whole RESULTS.md as a string."""
    meta = data["meta"]
    machine = meta["machine"]
    settings = meta["settings"]
    lines = ["# tfmem benchmark results", "",
             "Generated by `python -m benchmarks.harness --full` and `python -m benchmarks.report` "
             "from `benchmarks/results.json`; do not edit by hand (see `benchmarks/README.md`).", "",
             "## Machine", "",
             f"- CPU: {machine['cpu']}, {machine['cpu_count']} cores (shared with other jobs: timings are noisy)",
             f"- Memory: {_mib(machine.get('memory_bytes'))}",
             f"- Platform: {machine['platform']}, Python {machine['python']}, TensorFlow {machine['tensorflow']}",
             f"- Run: mode `{meta['mode']}`, started {meta.get('started_utc', '?')}, "
             f"finished {meta.get('finished_utc', 'NOT FINISHED (partial results)')}"
             + (f", {meta['total_s'] / 60:.0f} min" if meta.get("total_s") else ""),
             *_resume_lines(meta),
             f"- Code: git {machine.get('git_head', '?')}"
             + (" with uncommitted changes in the work tree" if machine.get("git_dirty") else "")
             + " when this run started (each trial imports the work tree as it is when the trial starts)",
             *[f"- Note: {note}" for note in meta.get("notes", [])],
             f"- Budgets (allocator limit → tfmem threshold): "
             + ", ".join(f"{b['memory_mb']} MiB → {b['threshold']}" for b in meta["budgets"]),
             f"- Search: ×{settings['growth_factor']:g} growth, {settings['bisect_steps']} bisection steps, "
             f"time cap {settings['time_cap_s']:g} s per trial (process start, build, compile, calls); "
             f"speed = median of ≥ {settings['speed_repeats']} warm calls"
             + (f" and ≥ {settings['speed_min_seconds']:g} s of them" if settings.get("speed_min_seconds") else "")
             + (", all methods of a size interleaved in one process" if _interleaved(data) else "")
             + "".join(f"; time cap {p['time_cap_s']:g} s for {p['case']}" for p in meta.get("plans", [])
                       if p.get("time_cap_s")), "",
             "## How to read this", "",
             "- **OOM point**: the largest size that ran under the budget. `N (OOM at M)`: N ran, M ran out "
             "of memory (TensorFlow's BFC allocator under `TF_CPU_BFC_MEM_LIMIT_IN_MB`). "
             "`≥ N (time cap)` / `≥ N (size cap)`: the search was stopped by the clock or by the plan's "
             "largest size, not by memory, so N is a lower bound. `< N (OOM)`: even the smallest size tried "
             "ran out of memory.",
             "- **OOM ratio**: tfmem's OOM point / stock XLA's, in sizes and in units of memory growth "
             "(n² for the quadratic cases, so the ratio of the largest problems' memory footprints). "
             "A `≥` means tfmem's point is a lower bound.",
             "- **Speed ratio**: warm step time of tfmem / stock XLA (and / hand-chunked) at a size every "
             "method runs, in the same run. Below 1 means tfmem is faster.",
             "- **Hand-chunked** (`benchmarks/cases.py`): a Python loop over row blocks inside one "
             "`jit_compile=True` function. XLA's scheduler may keep several blocks alive at once, so it is "
             "a speed reference, not a memory guarantee; where its OOM point equals stock XLA's, that is why.",
             "- Peaks are the BFC allocator's peak bytes (inputs included); *planned* is XLA's buffer "
             "assignment total. Peers (scikit-learn, faiss) allocate with numpy, outside the allocator: their "
             "memory is resident set above the process's baseline, and a run over the budget counts as OOM.",
             ""]
    rows = summary_rows(data)
    lines += ["## Summary", "",
              "Speed verdicts use the largest size where all methods ran (the last one listed). Timings "
              "are medians of warm calls on a shared 2-core machine; the same configuration measured "
              "twice can differ by tens of percent, so ratios near a target are not conclusive.", "",
              "| case | budget | stock XLA OOM point | tfmem OOM point | OOM ratio (size) | OOM ratio (memory units) "
              "| tfmem/xla time | tfmem/chunked time | targets |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio, speed = row["ratio"], row["speed"]
        prefix = "≥ " if ratio and ratio["lower_bound"] else ""
        units = ""
        if ratio:
            units = f"{prefix}{ratio['memory_units_ratio']:.1f}×" + (
                f" (n^{ratio['growth']:g})" if ratio["growth"] != 1 else "")
        def speed_cell(name: str) -> str:
            cells = [f"{_ratio(e['ratios'][name])} @ {e['size']}" for e in row["speeds"] if name in e["ratios"]]
            return ", ".join(cells) or "–"

        lines.append(
            f"| {row['case']} | {row['budget_mb']} MiB | {_oom_cell(row['xla'])} | {_oom_cell(row['tfmem'])} "
            f"| {prefix + format(ratio['size_ratio'], '.1f') + '×' if ratio else '–'} | {units or '–'} "
            f"| {speed_cell('tfmem/xla')} | {speed_cell('tfmem/chunked')} "
            f"| {'; '.join(row['verdicts']) or '–'} |")
    planned_cases = [p["case"] for p in meta.get("plans", [])]
    done = {p["case"] for p in data.get("oom_points", [])}
    missing = [c for c in planned_cases if c not in done]
    if missing:
        lines += ["", f"**Missing cases** (the run ended before their searches finished): "
                  f"{', '.join(missing)}."]
    lines.append("")
    lines += _other_pages()
    lines += _target_discussion(rows)
    for case in dict.fromkeys([*planned_cases, *done]):
        lines += _case_section(data, case, plot_paths.get(case))
    return "\n".join(lines) + "\n"


# Pages other benchmarks render beside this one (each from its own JSON), by issue.
OTHER_PAGES = (
    ("WHOLE_MATRICES.md", "Cholesky-based programs under a real limit: SGPR M and GPR n, whole [M, M] matrices "
                          "(`benchmarks.whole_matrices`)"),
    ("MATRIX_FREE.md", "exact GP solve by conjugate gradients, K recomputed inside the loop "
                       "(`benchmarks.matrix_free`)"),
    ("FIRST_CALL.md", "first call under a budget vs stock XLA (`benchmarks.first_call`)"),
    ("SPLIT_CHECKS.md", "split checks (`benchmarks.split_checks`)"),
    ("DISTRIBUTED_SGPR.md", "data-parallel SGPR on two devices (`benchmarks.distributed_sgpr`)"),
    ("corpus/RESULTS.md", "the budget corpus: verdict against outcome on every program (`benchmarks.corpus.run`)"),
)


def _other_pages() -> list[str]:
    """Links to the other result pages that exist in benchmarks/."""
    pages = [(page, what) for page, what in OTHER_PAGES if os.path.exists(os.path.join(HERE, page))]
    if not pages:
        return []
    return ["## Other result pages", "", *[f"- [{page}]({page}): {what}" for page, what in pages], ""]


def _resume_lines(meta: dict[str, Any]) -> list[str]:
    """One line per earlier run whose trials this one reused (`--resume`), newest first."""
    lines, earlier = [], meta.get("resumed_from")
    while earlier:
        lines.append(f"- Reused trials of an earlier run (`--resume`) started {earlier.get('started_utc')}, "
                     f"{(earlier.get('total_s') or 0) / 60:.0f} min")
        earlier = earlier.get("resumed_from")
    return lines


def _target_discussion(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Targets", ""]
    for row in rows:
        tfmem_trial = row.get("tfmem_trial")
        for verdict in row["verdicts"]:
            if "missed" in verdict or "not shown" in verdict or "not measured" in verdict:
                reason = ""
                if "OOM ratio" in verdict and row["ratio"] and row["ratio"]["lower_bound"]:
                    peak = (f" (BFC peak there {_mib(tfmem_trial.get('peak_bytes'))} of the "
                            f"{row['budget_mb']} MiB budget)") if tfmem_trial else ""
                    reason = (f" tfmem's search ended at {row['tfmem']['label']}{peak}: memory did not stop it, "
                              "so the true ratio is larger; this run could not afford bigger sizes.")
                elif "/" in verdict:
                    reason = (f" Measured at size {row['speed']['size']}; see the case's speed table for the "
                              "other sizes (timings on this shared machine are noisy).")
                lines.append(f"- {row['case']} ({row['budget_mb']} MiB): {verdict}.{reason}")
            else:
                lines.append(f"- {row['case']} ({row['budget_mb']} MiB): {verdict}.")
    return lines + [""]


def _case_section(data: dict[str, Any], case: str, plot: str | None) -> list[str]:
    meta = data["meta"]
    lines = [f"## {case}", "", meta.get("descriptions", {}).get(case, ""), ""]
    if case in CASE_NOTES:
        lines += [CASE_NOTES[case], ""]
    size_name = meta.get("size_names", {}).get(case, "size")
    points = [p for p in data.get("oom_points", []) if p["case"] == case]
    if not points:
        return lines + ["Not run (the run ended before this case).", ""]
    lines += [f"OOM point ({size_name}) per method:", "",
              "| method | budget | OOM point | BFC peak at largest ok | XLA planned at largest ok | "
              "first call at largest ok | note |", "|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p["budget_mb"], _ordered([p["method"]])[0] in METHOD_ORDER
                                            and METHOD_ORDER.index(p["method"]))):
        trial = _largest_ok_trial(data, case, p["method"], p["budget_mb"], p["largest_ok"])
        note = ""
        if p["stop"] in ("error", "none_ok") and p.get("error"):
            note = p["error"].replace("|", "/")[:160]
        if trial and trial.get("tfmem_status"):
            note = f"tfmem {trial['tfmem_status']}, {trial.get('splits')} split(s)"
        lines.append(f"| {METHOD_NAMES.get(p['method'], p['method'])} | {p['budget_mb']} MiB "
                     f"| {p['label']} | {_mib(trial and trial.get('peak_bytes'))} "
                     f"| {_mib(trial and trial.get('xla_planned_bytes'))} "
                     f"| {_seconds(trial and trial.get('first_call_s'))} | {note} |")
    speeds = [s for s in data.get("speed", []) if s["case"] == case]
    if speeds:
        methods = _ordered([m for s in speeds for m in s["step_s"]])
        names = sorted({k for s in speeds for k in s["ratios"]})
        lines += ["", "Warm step time where every method runs:", "",
                  "| size | " + " | ".join(METHOD_NAMES.get(m, m) for m in methods) + " | "
                  + " | ".join(names) + " |",
                  "|---|" + "---|" * (len(methods) + len(names))]
        for s in speeds:
            cells = []
            for m in methods:
                status = s["status"].get(m)
                cells.append(_seconds(s["step_s"].get(m)) if status == "ok" else (status or "–"))
            lines.append(f"| {s['size']} | " + " | ".join(cells) + " | "
                         + " | ".join(_ratio(s["ratios"].get(n)) for n in names) + " |")
        agreement = _agreement(data, case, [s["size"] for s in speeds])
        if agreement:
            lines += ["", "Results agree with stock XLA (largest relative difference of the result digests: "
                      "sums and first entries of every output): " + ", ".join(agreement) + "."]
        peers = [t for t in data["trials"] if t["case"] == case and t.get("purpose") in ("speed", "peer_memory")
                 and t["method"] in ("sklearn", "faiss") and t.get("max_rss_bytes")]
        if peers:
            lines += ["", "Peers' resident memory above baseline: " + ", ".join(
                f"{t['method']} @ {t['size']}: {_mib(t['max_rss_bytes'] - t['baseline_rss_bytes'])}"
                for t in peers) + "."]
    if plot:
        lines += ["", f"![{case}]({plot})"]
    return lines + [""]


def _agreement(data: dict[str, Any], case: str, sizes: Sequence[int]) -> list[str]:
    """Per method and size, the largest relative difference of its digest from stock XLA's."""
    out = []
    for size in sizes:
        trials = {t["method"]: t for t in data["trials"] if t["case"] == case and t["size"] == size
                  and t["status"] == "ok" and t.get("digest")}
        reference = trials.get("xla")
        if not reference:
            continue
        for method in _ordered([m for m in trials if m != "xla"]):
            mine, ref = trials[method]["digest"], reference["digest"]
            if len(mine) != len(ref):
                out.append(f"{method} @ {size}: different output structure")
                continue
            scale = max(1.0, *(abs(r) for r in ref))
            difference = max((abs(a - b) for a, b in zip(mine, ref)), default=0.0) / scale
            out.append(f"{method} @ {size}: {difference:.1e}")
    return out


def write_plots(data: dict[str, Any], directory: str) -> dict[str, str]:
    """One PNG per case: BFC peak vs size with the budget line, and time vs size.

    Peers' memory is their resident set above the process baseline (numpy, not the allocator).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(os.path.join(directory, "plots"), exist_ok=True)
    paths = {}
    by_case = collections.defaultdict(list)
    for trial in data["trials"]:
        by_case[trial["case"]].append(trial)
    budgets = sorted({b["memory_mb"] for b in data["meta"]["budgets"]})
    for case, trials in by_case.items():
        figure, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
        for method in _ordered([t["method"] for t in trials]):
            mine = [t for t in trials if t["method"] == method]
            ok = sorted({t["size"]: t for t in mine if t["status"] == "ok" and t.get("peak_bytes")}.values(),
                        key=lambda t: t["size"])
            peer = method in ("sklearn", "faiss")
            memory = [((t["max_rss_bytes"] - t["baseline_rss_bytes"]) if peer else t["peak_bytes"]) / 2**20
                      for t in ok]
            line, = memory_axis.plot([t["size"] for t in ok], memory, "o-" if not peer else "s--",
                                     label=METHOD_NAMES.get(method, method))
            failed = sorted({t["size"] for t in mine if t["status"] == "oom"})
            if failed:
                memory_axis.plot(failed, [budgets[-1]] * len(failed), "x", color=line.get_color(),
                                 markersize=9, mew=2)
            # First calls (trace, rewrite, compile, run) exist at every size that ran; warm
            # steps only at the speed sizes, so they are drawn as separate stars.
            first = sorted({t["size"]: t for t in mine if t["status"] == "ok" and t.get("first_call_s")}.values(),
                           key=lambda t: t["size"])
            time_axis.plot([t["size"] for t in first], [t["first_call_s"] for t in first],
                           "o-" if not peer else "s--", color=line.get_color(), alpha=0.8,
                           label=METHOD_NAMES.get(method, method))
            warm = sorted({t["size"]: t for t in mine if t["status"] == "ok" and t.get("step_s")}.values(),
                          key=lambda t: t["size"])
            time_axis.plot([t["size"] for t in warm], [t["step_s"] for t in warm], "*", color=line.get_color(),
                           markersize=12)
        for budget in budgets:
            memory_axis.axhline(budget, color="k", ls=":", lw=1)
            memory_axis.text(0.01, budget, f"budget {budget} MiB", va="bottom", fontsize=8,
                             transform=memory_axis.get_yaxis_transform())
        size_name = data["meta"].get("size_names", {}).get(case, "size")
        for axis in (memory_axis, time_axis):
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            # Label the 2× and 5× minor ticks too: a range within one decade would otherwise show none.
            axis.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
                lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
            axis.set_xlabel(size_name)
            axis.grid(True, which="both", alpha=0.3)
        memory_axis.set_ylabel("peak memory (MiB; × = out of memory)")
        memory_axis.set_title(f"{case}: peak memory")
        time_axis.set_ylabel("seconds (line: first call incl. compile; ★: warm step)")
        time_axis.set_title(f"{case}: time")
        memory_axis.legend(fontsize=8)
        figure.tight_layout()
        path = os.path.join(directory, "plots", f"{case}.png")
        figure.savefig(path, dpi=90)
        plt.close(figure)
        paths[case] = os.path.relpath(path, directory)
    return paths


def write_report(data: dict[str, Any], directory: str) -> list[str]:
    """Writes `RESULTS.md` and `plots/*.png` under `directory`; returns the paths written.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as out:
        ...     write_report(json.load(open("benchmarks/results.json")), out)[0] == os.path.join(out, "RESULTS.md")
        True
    """
    os.makedirs(directory, exist_ok=True)
    plots = write_plots(data, directory)
    path = os.path.join(directory, "RESULTS.md")
    with open(path, "w") as f:
        f.write(render_markdown(data, plots))
    return [path, *(os.path.join(directory, p) for p in plots.values())]


def main(argv: Sequence[str]) -> int:
    del argv
    with open(FLAGS.results) as f:
        data = json.load(f)
    written = write_report(data, FLAGS.out_dir or os.path.dirname(os.path.abspath(FLAGS.results)))
    print("wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
