"""Runs the corpus for real and writes the budget fidelity table.

For each program, in fresh processes under a BFC limit equal to its budget:
  (a) stock `tf.function(jit_compile=True)` at `big` (expected: out of memory);
  (b) tfmem with `Config(memory_budget=<budget>)` only, at `big`: status, real BFC peak,
      the Report's static estimate (`memory_after.peak_bytes`) and whether it claims to fit;
  (c) tfmem vs stock at `small`: max relative error of values and gradients, under the
      program's budget and under a tight budget that forces splits.
Writes `RESULTS.md` and `results.json` (with the git commit and whether the tree was clean)
next to this file, or into `--out`.

Run:
    python -m benchmarks.corpus.run                         # the full corpus (≈ 30–40 min on 2 cores)
    python -m benchmarks.corpus.run --ci                    # only the programs the CI test runs
    python -m benchmarks.corpus.run --only kxx_expanded_matmul,knn_cosine --out /tmp/corpus
    python -m benchmarks.corpus.run --modes budget,expert   # + the expert-threshold diagnostic
    python -m benchmarks.corpus.run --modes graph           # without XLA (`jit_compile: false`)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from tfmem.config import format_size
from tfmem.isolation import IsolatedResult, run_isolated

from benchmarks.corpus.programs import CI_PROGRAMS, PROGRAMS, Program

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TFMEM_TARGET = "benchmarks.corpus.trial:tfmem_trial"
STOCK_TARGET = "benchmarks.corpus.trial:stock_trial"


def git_state() -> dict[str, Any]:
    """The commit the sources are at, and whether the working tree had changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=True).stdout

    try:
        return {"commit": git("rev-parse", "HEAD").strip(), "clean": not git("status", "--porcelain").strip()}
    except (OSError, subprocess.CalledProcessError) as err:
        return {"commit": None, "clean": None, "error": str(err)}


def isolated(target: str, program: Program, *args: Any, timeout: float) -> dict[str, Any]:
    """One isolated trial; a process that died or timed out becomes a record with that status."""
    start = time.perf_counter()
    result: IsolatedResult = run_isolated(target, program.name, *args, memory_limit_mb=program.budget_mb,
                                          timeout=timeout)
    wall = time.perf_counter() - start
    if result.ok:
        return {**result.value, "process_status": "ok", "wall_seconds": wall}
    return {"process_status": result.status, "error": _name_signal(result.error or ""), "wall_seconds": wall}


def _name_signal(error: str) -> str:
    """"process died (exit -11): <last stderr line>" → "process died: SIGSEGV (exit -11)".

    The child's last stderr line is TensorFlow's start-up noise when it crashed in C++;
    the signal is what tells a crash from an error.
    """
    match = re.match(r"process died \(exit (-\d+)\)", error)
    if not match:
        return error
    try:
        name = signal.Signals(-int(match.group(1))).name
    except ValueError:
        return error
    return f"process died: {name} (exit {match.group(1)})"


def tfmem_record(program: Program, mode: str, *, timeout: float) -> dict[str, Any]:
    """All steps of a tfmem trial in one process; if it dies, each group in its own.

    A crash (a signal, or an allocator failure that kills the process) would otherwise
    lose every step of the process; run apart, the crashing group is named and the other
    keeps its result.
    """
    record = isolated(TFMEM_TARGET, program, mode, timeout=timeout)
    if record["process_status"] in ("ok", "timeout"):
        return record
    merged: dict[str, Any] = {"process_status": "ok", "wall_seconds": record["wall_seconds"],
                              "first_process": {"status": record["process_status"], "error": record["error"]}}
    for steps in (("big",), ("stock_planned", "equality")):
        part = isolated(TFMEM_TARGET, program, mode, steps, timeout=timeout)
        merged["wall_seconds"] += part["wall_seconds"]
        for step in steps:
            merged[step] = tfmem_step(part, step)
    return merged


Task = tuple[str, str, str]  # (program, "tfmem" or "stock", mode)


def start_trials(tasks: Sequence[Task], *, timeout: float, jobs: int = 1,
                 pool: concurrent.futures.Executor | None = None) -> list[concurrent.futures.Future[dict[str, Any]]]:
    """Starts every task's isolated process(es), in order; one future per task.

    They run in `pool` (the test suite's, shared with its other background work) or,
    without one, `jobs` at a time. Each process still has its own allocator limit;
    running two at a time only shares the machine's cores (2 on CI), as the benchmark
    harness's OOM searches do.
    """
    def run(name: str, kind: str, mode: str) -> dict[str, Any]:
        if kind == "stock":
            return isolated(STOCK_TARGET, PROGRAMS[name], timeout=timeout)
        return tfmem_record(PROGRAMS[name], mode, timeout=timeout)

    own = pool is None
    executor = pool if pool is not None else concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
    futures = [executor.submit(run, *task) for task in tasks]
    if own:
        executor.shutdown(wait=False)
    return futures


def tfmem_step(record: dict[str, Any], step: str) -> dict[str, Any]:
    """One step of a tfmem trial; a dead or timed-out process stands for every step."""
    if record.get("process_status") != "ok":
        return {"status": record.get("process_status"), "error": record.get("error")}
    return record.get(step) or {"status": "error", "error": f"step {step} missing"}


_VOLATILE = [(re.compile(r"\[Op:[^\]]*\]"), "[Op:…]"), (re.compile(r"\d+(\.\d+)?"), "N"),
             (re.compile(r"'[^']*'"), "'…'")]


def failure_reason(step: dict[str, Any], *, compared: bool = False, blank: bool = True) -> str | None:
    """Why a tfmem step failed, None if it passed.

    With `blank`, sizes and names in the message are blanked so that alike failures group.
    """
    status = step.get("status")
    if status == "ok":
        if step.get("report_status") == "fallback":
            status, text = "fallback", step.get("report_reason", "")
        elif compared and not step.get("equal"):
            return "wrong answer"
        else:
            return None
    else:
        text = (step.get("error") or "").splitlines()[0] if step.get("error") else ""
    for pattern, replacement in _VOLATILE if blank else ():
        text = pattern.sub(replacement, text)
    if status == "oom" and step.get("claims_fit"):
        status = "oom although the report claims it fits"
    return f"{status}: {text[:160]}" if text else str(status)


def _entry(program: Program) -> dict[str, Any]:
    return {"program": program.name, "family": program.family, "description": program.description,
            "budget_bytes": program.budget_bytes, "small": program.small, "big": program.big,
            "rtol": program.rtol, "outer_tape": program.outer_tape, "ci": program.name in CI_PROGRAMS, "tfmem": {}}


# --- the report --------------------------------------------------------------------------


def _mib(nbytes: int | None) -> str:
    return format_size(nbytes) if nbytes else "-"


def _err(step: dict[str, Any]) -> str:
    if step.get("status") != "ok" or "max_rel_err" not in step:
        return step.get("status") or "-"
    mark = "" if step.get("equal") else " ✗"
    extra = f", idx {step['index_mismatch']:.1e}" if step.get("index_mismatch") else ""
    return f"{step['max_rel_err']:.1e}{extra}{mark}"


def _row(entry: dict[str, Any], mode: str) -> str:
    trial = entry["tfmem"][mode]
    big, planned = tfmem_step(trial, "big"), tfmem_step(trial, "stock_planned")
    equality = tfmem_step(trial, "equality")
    small, tight = equality.get("budget", equality), equality.get("tight", equality)
    stock = entry.get("stock_big", {})
    stock_text = "-" if not stock else (f"{stock.get('status') or stock.get('process_status')}"
                                        + (f" {_mib(stock.get('peak_bytes'))}" if stock.get("status") == "ok" else ""))
    claims = {True: "yes", False: "no"}.get(big.get("claims_fit"), "-") if "claims_fit" in big else "-"
    ran = big.get("status") == "ok" and big.get("estimate_bytes")
    ratio = f"{big['peak_bytes'] / big['estimate_bytes']:.2f}" if ran and big.get("peak_bytes") else "-"
    fidelity = " **VIOLATION**" if big.get("claims_fit") and big.get("status") == "oom" else ""
    splits = f" ({tight.get('splits')} splits)" if "splits" in tight else ""
    replayed = ""
    if mode == "graph":  # the allocator's peak, replayed over the estimate (`Report.allocator_replay`)
        peak = big.get("replayed_peak_bytes")
        over = f" ({big['peak_bytes'] / peak:.2f})" if ran and peak and big.get("peak_bytes") else ""
        replayed = f" {_mib(peak)}{over} |"
    return (f"| {entry['program']} | {_mib(entry['budget_bytes'])} | {_mib(planned.get('planned_bytes'))} | "
            f"{stock_text} | {big.get('status', '-')}{fidelity} | {_mib(big.get('estimate_bytes'))} | {claims} | "
            f"{_mib(big.get('peak_bytes')) if big.get('status') == 'ok' else '-'} | {ratio} |{replayed} {_err(small)} | "
            f"{_err(tight)}{splits} |")


def _failures(entries: Sequence[dict[str, Any]], mode: str) -> list[str]:
    """One line per failure reason: the programs, and at which steps (big, small, tight)."""
    groups: dict[str, dict[str, list[str]]] = {}
    for entry in entries:
        trial = entry["tfmem"][mode]
        equality = tfmem_step(trial, "equality")
        checks = [("big", tfmem_step(trial, "big"), False), ("small", equality.get("budget", equality), True),
                  ("tight", equality.get("tight", equality), True)]
        for where, step, compared in checks:
            reason = failure_reason(step, compared=compared)
            if reason:
                groups.setdefault(reason, {}).setdefault(entry["program"], []).append(where)
    lines = []
    for reason, programs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        listed = ", ".join(f"{name} ({', '.join(where)})" for name, where in programs.items())
        lines.append(f"- **{reason}** — {len(programs)} programs: {listed}")
    return lines or ["- none"]


def verdict_table(entries: Sequence[dict[str, Any]], mode: str) -> list[str]:
    """The report's verdict against what happened at `big` under the real limit, per program
    and counted: a false "fits" ran out of memory, a false "does NOT fit" ran; the margin
    is the limit less the real peak (the allocator's, inputs included)."""
    counts = {"fits, ran": 0, "fits, out of memory (false fits)": 0, "does NOT fit, out of memory": 0,
              "does NOT fit, ran (false does NOT fit)": 0, "no verdict": 0}
    rows = []
    for entry in entries:
        big = tfmem_step(entry["tfmem"][mode], "big")
        claims, status = big.get("claims_fit"), big.get("status")
        if claims is None or status not in ("ok", "oom"):
            counts["no verdict"] += 1
            continue
        key = {(True, "ok"): "fits, ran", (True, "oom"): "fits, out of memory (false fits)",
               (False, "oom"): "does NOT fit, out of memory",
               (False, "ok"): "does NOT fit, ran (false does NOT fit)"}[(claims, status)]
        counts[key] += 1
        margin = "-"
        if status == "ok" and big.get("peak_bytes"):
            left = entry["budget_bytes"] - big["peak_bytes"]
            margin = f"{_mib(left) if left > 0 else '0'} ({left / entry['budget_bytes']:.0%})"
        decided = ("XLA's plan" if big.get("xla_bytes") else
                   "estimate, allocator replay" if big.get("replayed_peak_bytes") is not None else "estimate")
        rows.append(f"| {entry['program']} | {'fits' if claims else 'does NOT fit'} | {decided} | "
                    f"{'ran' if status == 'ok' else 'out of memory'} | {margin} |")
    judged = sum(v for k, v in counts.items() if k != "no verdict")
    lines = [f"- {name}: {n}" + (f" ({n / judged:.0%})" if judged and "false" in name else "")
             for name, n in counts.items()]
    return lines + ["", "| program | verdict | decided by | at `big` under the limit | margin left |",
                    "|---|---|---|---|---|"] + rows


def write_report(data: dict[str, Any], path: str) -> None:
    entries = data["programs"]
    lines = [
        "# Corpus: `memory_budget` as the one knob",
        "",
        f"Generated by `python -m benchmarks.corpus.run {' '.join(data['argv'])}` on {data['date']} "
        f"at commit `{data['git']['commit']}` ({'clean tree' if data['git']['clean'] else 'UNCOMMITTED CHANGES'}); "
        f"{data['machine']}.",
        "",
        "Every trial runs in a fresh process under a BFC limit equal to the program's budget. Columns: "
        "*stock planned* = XLA's buffer assignment for stock `jit_compile=True` at `big` (compiled, not run; "
        "forward only for outer-tape programs); *stock real* = stock run at `big`; *tfmem* = "
        "`tfmem.function(fn, config=Config(memory_budget=budget))` at `big`; *estimate* = the Report's "
        "`memory_after.peak_bytes` (for outer-tape programs the forward function's: `report()` does not "
        "cover the backward one); *fits?* = whether that claims to fit; *real peak* = the BFC peak of the "
        "tfmem call (inputs and model data included), and its ratio to the estimate; *replayed peak* (without "
        "XLA) = the peak of TensorFlow's allocator replayed over the estimate's allocations under the budget "
        "(`Report.allocator_replay`, the verdict's second half there); *rel err* = max |tfmem − stock| / max |stock| at `small` "
        "over values and gradients, under the budget (*small*) and under a tight budget (*tight*: half the "
        "unchanged program's static estimate, to force splits); ✗ = over the program's tolerance. "
        "VIOLATION = the report claimed to fit and the run ran out of memory.",
    ]
    for mode in data["modes"]:
        title = {"budget": "budget only",
                 "expert": "expert override (diagnostic: `tensor_size_threshold = budget / 16` as well)",
                 "graph": "without XLA (`jit_compile: false` as well: TensorFlow's executor runs the plan)"}[mode]
        replayed = " replayed peak (real / replayed) |" if mode == "graph" else ""
        lines += ["", f"## tfmem {title}", "",
                  "| program | budget | stock planned | stock real | tfmem | estimate | fits? | real peak | "
                  f"real / estimate |{replayed} rel err (budget) | rel err (tight) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * bool(replayed)]
        lines += [_row(entry, mode) for entry in entries]
        lines += ["", f"### Verdict against outcome ({mode})", ""] + verdict_table(entries, mode)
        lines += ["", f"### Failures by reason ({mode})", ""] + _failures(entries, mode)
    lines += ["", "## Programs", "", "| program | family | what | small | big | rtol |", "|---|---|---|---|---|---|"]
    lines += [f"| {e['program']} | {e['family']} | {e['description']} | {e['small']} | {e['big']} | {e['rtol']:g} |"
              for e in entries]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated program names")
    parser.add_argument("--ci", action="store_true", help="only the programs of the CI corpus test")
    parser.add_argument("--modes", default="budget", help="budget, expert (a diagnostic) and/or graph (without XLA), comma-separated")
    parser.add_argument("--no-stock", action="store_true", help="skip the real stock run at the big size")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds per isolated process before it is stopped and reported as a timeout")
    parser.add_argument("--jobs", type=int, default=1, help="isolated processes at a time")
    parser.add_argument("--out", default=HERE, help="directory for RESULTS.md and results.json")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CI_PROGRAMS if args.ci else PROGRAMS)
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        parser.error(f"unknown program(s) {', '.join(unknown)}; known: {', '.join(PROGRAMS)}")
    modes = [m for m in args.modes.split(",") if m]
    os.makedirs(args.out, exist_ok=True)
    data: dict[str, Any] = {
        "argv": list(argv if argv is not None else sys.argv[1:]), "git": git_state(), "modes": modes,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "programs": [_entry(PROGRAMS[name]) for name in names],
    }
    json_path, md_path = os.path.join(args.out, "results.json"), os.path.join(args.out, "RESULTS.md")
    entries = {entry["program"]: entry for entry in data["programs"]}
    tasks: list[Task] = [(name, "tfmem", mode) for mode in modes for name in names]
    if not args.no_stock:
        tasks += [(name, "stock", "") for name in names]
    start = time.perf_counter()
    for (name, kind, mode), future in zip(tasks, start_trials(tasks, timeout=args.timeout, jobs=args.jobs)):
        record = future.result()
        if kind == "stock":
            entries[name]["stock_big"] = record
        else:
            entries[name]["tfmem"][mode] = record
        label = f"{kind} {mode}".strip()
        data["seconds"] = time.perf_counter() - start
        with open(json_path, "w") as f:  # after every trial: a killed run keeps what it finished
            json.dump(data, f, indent=1, default=str)
        status = record.get("status") or tfmem_step(record, "big").get("status")
        print(f"{label} {name}: {status} ({record['wall_seconds']:.0f} s; {data['seconds']:.0f} s in all)",
              flush=True)
    write_report(data, md_path)
    print(f"wrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
