"""The first call under a budget, against stock `tf.function(jit_compile=True)`'s.

A user's first call of a tfmem function traces it, rewrites it, may ask XLA for its plan
(a full compilation), then compiles and runs it; stock traces, compiles and runs. This
runs every corpus program (`benchmarks/corpus/programs.py`) at its `small` size, each in
its own process, under a budget that forces splits (half of tfmem's static estimate of the
unchanged program, the corpus's "tight" budget), and reports per program:

- the first call of each, and its ratio (tfmem / stock), with tfmem's time by stage
  (`Report.first_call_seconds`: trace, rewrite, XLA check, compile and run);
- the steady-state step of each (median of warm calls) and its ratio;
- with `--plan_cache`: the same trial in a second process that finds the first one's
  plan in `Config.plan_cache` (no rewrite, no XLA check), with XLA's own persistent
  cache (`TF_XLA_FLAGS=--tf_xla_persistent_cache_directory`) in both processes; its
  tfmem first call is compared with the first process's stock first call (the second's
  stock is cached too). tfmem's program does compile again there: XLA's cache knows it
  by its function's name, which carries TensorFlow's process-wide trace counter, and the
  process that rewrote traced more than the one that loads the plan (a third process
  would find the second's).

Each process warms TensorFlow and XLA up first (one small jit-compiled call), so neither
side pays the process's one-off start-up. Ratios are taken within one process.

Run:
    python -m benchmarks.first_call                      # all programs → benchmarks/first_call.json, FIRST_CALL.md
    python -m benchmarks.first_call --only=sgpr_se_grad,knn_cosine --out=/tmp/fc
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags: defined when run as a script only, since other benchmark
    modules imported beside this one (in the tests) define flags of the same names."""
    flags.DEFINE_list("only", [], "Programs to run (default: every corpus program).")
    flags.DEFINE_string("out", HERE, "Directory for first_call.json and FIRST_CALL.md.")
    flags.DEFINE_bool("plan_cache", True, "Also time a second process that reuses the first one's plan.")
    flags.DEFINE_integer("steps", 5, "Warm calls timed for the steady-state step (the median is kept).")

_TIMEOUT = 900.0


def trial(name: str, steps: int = 5, plan_cache: str | None = None) -> dict[str, Any]:
    """One program in this process: stock's first call and steps, then tfmem's.

    `plan_cache`: a directory for `Config.plan_cache` (None: no plan cache).
    """
    import tensorflow as tf

    import tfmem
    from benchmarks.corpus.programs import PROGRAMS
    from benchmarks.corpus.trial import call

    warm = tf.function(lambda x: tf.reduce_sum(x @ tf.transpose(x)), jit_compile=True)
    warm(tf.ones([8, 8]))  # TensorFlow's and XLA's one-off start-up, outside both timings
    program = PROGRAMS[name]
    fn, args = program.build(program.small)
    record: dict[str, Any] = {"program": name, "size": program.small}
    stock_fn = tf.function(fn, jit_compile=True)
    record["stock"] = _timed(lambda: call(program, stock_fn, args), steps)
    unchanged = tfmem.function(fn, config=tfmem.Config()).trace(*args).memory.peak_bytes
    budget = unchanged // 2
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=budget, plan_cache=plan_cache))
    record["tfmem"] = _timed(lambda: call(program, wrapped, args), steps)
    report = wrapped.report(*args)
    record.update(budget_bytes=budget, unchanged_estimate_bytes=unchanged, status=report.status,
                  fits=report.fits, summary=report.summary(), stages=report.first_call_seconds,
                  xla_checked=report.xla_bytes_after is not None, splits=len(report.splits),
                  plan_from_cache=report.plan_from_cache)
    return record


def _timed(first_and_steps: Any, steps: int) -> dict[str, Any]:
    """The first call's seconds, then the median of `steps` warm calls."""
    start = time.perf_counter()
    first_and_steps()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        first_and_steps()
        times.append(time.perf_counter() - start)
    return {"first_seconds": first, "step_seconds": statistics.median(times)}


def _isolated(name: str, steps: int, env: dict[str, str], **kwargs: Any) -> dict[str, Any]:
    import tfmem

    result = tfmem.run_isolated("benchmarks.first_call:trial", name, steps, timeout=_TIMEOUT, env=env, **kwargs)
    if result.status != "ok":
        return {"program": name, "status": result.status, "error": str(result.error)[:500]}
    return result.value


def run_program(name: str, steps: int, plan_cache: bool) -> dict[str, Any]:
    """The program's trial in a fresh process; with `plan_cache`, again in a second one."""
    with tempfile.TemporaryDirectory(prefix="tfmem-first-call-") as tmp:
        env = {"TF_XLA_FLAGS": f"--tf_xla_persistent_cache_directory={os.path.join(tmp, 'xla')}"} if plan_cache else {}
        plans = os.path.join(tmp, "plans") if plan_cache else None
        record = _isolated(name, steps, env, plan_cache=plans)
        if plan_cache and "tfmem" in record:
            # The same script again: TensorFlow numbers some node names by a process-wide
            # counter, so the second process must trace what the first did, in order.
            record["second_process"] = _isolated(name, steps, env, plan_cache=plans)
    return record


def ratios(record: dict[str, Any]) -> dict[str, float]:
    """tfmem / stock for the first call, the steady step and (if run) a second process's first call."""
    if "tfmem" not in record or "stock" not in record:
        return {}
    stock, mine = record["stock"], record["tfmem"]
    out = {"first": mine["first_seconds"] / stock["first_seconds"],
           "step": mine["step_seconds"] / stock["step_seconds"]}
    second = record.get("second_process", {}).get("tfmem")
    if second:
        out["second_process_first"] = second["first_seconds"] / stock["first_seconds"]
    return out


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def markdown(data: dict[str, Any]) -> str:
    """FIRST_CALL.md from the JSON (nothing in it is written by hand)."""
    records = data["programs"]
    lines = ["# First call under a budget, vs stock XLA", "",
             f"Generated by `python -m benchmarks.first_call` on {data['date']} at commit `{data['commit']}`; "
             f"{data['machine']}. Every program of `benchmarks/corpus` at its `small` size, each in a fresh "
             "process (TensorFlow and XLA warmed up first), budget = half of tfmem's static estimate of the "
             "unchanged program (it forces splits). *first* = first call (trace, rewrite, XLA check, compile, "
             "run) / stock's first call (trace, compile, run); *step* = median warm step / stock's; *2nd process* "
             "= tfmem's first call in a second process with the first one's plan cache and XLA's persistent "
             "cache / stock's first call; stages in seconds.", ""]
    table = [r for r in records if ratios(r)]
    summary = {key: [ratios(r)[key] for r in table if key in ratios(r)] for key in
               ("first", "step", "second_process_first")}
    lines += ["| ratio | programs | median | 90th percentile | max |", "|---|---|---|---|---|"]
    for key, values in summary.items():
        if values:
            lines.append(f"| {key.replace('_', ' ')} | {len(values)} | {statistics.median(values):.2f} | "
                         f"{_quantile(values, 0.9):.2f} | {max(values):.2f} |")
    checked = sum(1 for r in table if r.get("xla_checked"))
    lines += ["", f"XLA's plan was asked for (one extra compilation) in {checked} of {len(table)} programs.", "",
              "| program | budget | first | step | 2nd process | stock first s | tfmem first s | trace | rewrite | "
              "XLA check | compile + run | splits | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if not ratios(r):
            lines.append(f"| {r['program']} | | | | | | | | | | | | {r.get('status')}: {r.get('error', '')[:120]} |")
            continue
        q, s = ratios(r), r.get("stages", {})
        second = f"{q['second_process_first']:.2f}" if "second_process_first" in q else "-"
        verdict = "fits" if r.get("fits") else "does NOT fit" if r.get("fits") is False else str(r.get("status"))
        lines.append(
            f"| {r['program']} | {r['budget_bytes'] / 2**20:.1f} MiB | {q['first']:.2f} | {q['step']:.2f} | "
            f"{second} | {r['stock']['first_seconds']:.2f} | {r['tfmem']['first_seconds']:.2f} | "
            f"{s.get('trace', 0):.2f} | {s.get('rewrite', 0):.2f} | {s.get('xla check', 0):.2f} | "
            f"{s.get('compile and run', 0):.2f} | {r.get('splits')} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> None:
    del argv
    from benchmarks.corpus.programs import PROGRAMS

    names = FLAGS.only or list(PROGRAMS)
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        raise app.UsageError(f"--only: unknown programs {unknown}; known: {sorted(PROGRAMS)}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=HERE).stdout.strip()
    data: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit + ("+ (uncommitted changes)" if dirty else ""),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "argv": sys.argv[1:], "programs": []}
    os.makedirs(FLAGS.out, exist_ok=True)
    for name in names:
        record = run_program(name, FLAGS.steps, FLAGS.plan_cache)
        data["programs"].append(record)
        print(name, {k: round(v, 2) for k, v in ratios(record).items()} or record.get("status"), flush=True)
        with open(os.path.join(FLAGS.out, "first_call.json"), "w") as f:
            json.dump(data, f, indent=1)
        with open(os.path.join(FLAGS.out, "FIRST_CALL.md"), "w") as f:
            f.write(markdown(data))


if __name__ == "__main__":
    define_flags()
    app.run(main)
