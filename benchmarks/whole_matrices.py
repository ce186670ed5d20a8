"""Issue 19: how many whole [M, M] / [n, n] matrices Cholesky-based programs keep alive.

    python -m benchmarks.whole_matrices [--only=sgpr,gpr,speed] [--json=benchmarks/whole_matrices.json]
    python -m benchmarks.whole_matrices --render=benchmarks/whole_matrices.json   # WHOLE_MATRICES.md again

Each trial runs in its own process with TensorFlow's BFC allocator limited to the budget
(`tfmem.run_isolated`); tfmem gets `Config(memory_budget=<the same>)` and nothing else.
For every size it reports ran / out of memory, the allocator's real peak, that peak in
whole matrices (`peak / (M² · 8 bytes)`) and, for tfmem, XLA's plan and the verdict.
`speed` times stock XLA and tfmem in one process at a size both fit: the ratio of their
median step times (later calls; the first call compiles).

    sgpr    GPflow SGPR (SE, D=3) loss+gradients, N=20,000, 512 MiB, M = 1500 … 4000
    gpr     GPflow GPR (SE, D=3) loss+gradients, 512 MiB, n = 3000 … 4500
    speed   SGPR N=20,000 M=1000 and GPR n=2000, stock XLA against tfmem (no limit)
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import documents
from benchmarks.cases import sgpr_loss_and_gradients

LIMIT_MIB = 512
SIZES = {"sgpr": (1500, 2000, 2500, 3000, 3300, 3600, 4000), "gpr": (3000, 3500, 4000, 4300, 4500)}
SGPR_N = 20_000


def gpr_step(n: int) -> tuple[Callable[[], Any], tuple[()]]:
    """GPflow GPR's loss and gradients on synthetic 3-d data (the tape inside)."""
    import gpflow
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, size=(n, 3))
    y = np.sin(x).sum(-1, keepdims=True) + 0.1 * rng.normal(size=(n, 1))
    model = gpflow.models.GPR((x, y), gpflow.kernels.SquaredExponential(lengthscales=[1.0] * 3))

    def step():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)

    return step, ()


def _program(case: str, size: int) -> tuple[Callable[[], Any], tuple[()]]:
    return (sgpr_loss_and_gradients(SGPR_N, size), ()) if case == "sgpr" else gpr_step(size)


def trial(case: str, size: int, method: str, budget: str) -> dict[str, Any]:
    """One call of `case` at `size` with stock XLA or tfmem (budget only); what it reported."""
    import tensorflow as tf

    import tfmem

    fn, args = _program(case, size)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    if method == "xla":
        runner = tf.function(fn, jit_compile=True)
    else:  # the verdict first, so that it is kept when the call then runs out of memory
        runner = tfmem.function(fn, config=tfmem.Config(memory_budget=budget))
        report = runner.report(*args)
        out.update(status=report.status, fits=report.fits, summary=report.summary(),
                   xla_plan=report.xla_bytes_after,
                   static_peak=report.memory_after.peak_bytes if report.memory_after else None)
    try:
        loss, _ = runner(*args)
    except tf.errors.ResourceExhaustedError as err:
        if method == "xla":
            raise
        return {**out, "oom_error": str(err).splitlines()[0][:200]}
    return {**out, "loss": float(loss), "first_call_s": time.perf_counter() - start}


def speed(case: str, size: int, repeats: int = 7) -> dict[str, Any]:
    """Median step time of tfmem (budget only) over stock XLA's, alternating, in one process,
    and the largest relative difference of their loss and gradients."""
    import tensorflow as tf

    import tfmem

    fn, args = _program(case, size)
    runners = {"xla": tf.function(fn, jit_compile=True),
               "tfmem": tfmem.function(fn, config=tfmem.Config(memory_budget=f"{LIMIT_MIB}MiB"))}
    values = {name: run(*args) for name, run in runners.items()}  # compile both first
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            loss, _ = run(*args)
            float(loss)
            times[name].append(time.perf_counter() - start)
    medians = {name: float(np.median(t)) for name, t in times.items()}
    errors = [float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-300))
              for g, w in zip(tf.nest.flatten(values["tfmem"]), tf.nest.flatten(values["xla"]))]
    return {"case": case, "size": size, "median_s": medians, "ratio": medians["tfmem"] / medians["xla"],
            "max_relative_error": max(errors)}


def main(argv: list[str]) -> None:
    del argv
    from absl import flags

    from tfmem import run_isolated

    if flags.FLAGS.render:
        documents.render_again(flags.FLAGS.render, "WHOLE_MATRICES.md", render)
        return
    from tfmem.config import format_size

    only = flags.FLAGS.only or ["sgpr", "gpr", "speed"]
    rows: list[dict[str, Any]] = []
    speeds: list[dict[str, Any]] = []
    for case in [c for c in ("sgpr", "gpr") if c in only]:
        for method in ("xla", "tfmem"):
            for size in SIZES[case]:
                result = run_isolated("benchmarks.whole_matrices:trial", case, size, method, f"{LIMIT_MIB}MiB",
                                      memory_limit_mb=LIMIT_MIB, timeout=flags.FLAGS.timeout)
                value = result.value if result.ok else {}
                whole = size * size * 8
                outcome = "oom" if value.get("oom_error") else result.status
                row = {"case": case, "size": size, "method": method, "outcome": outcome,
                       "real_peak": result.peak_bytes,
                       "peak_in_matrices": None if result.peak_bytes is None else result.peak_bytes / whole,
                       **{k: v for k, v in value.items()}, "error": (result.error or "")[:200]}
                rows.append(row)
                print(f"{case} {method:5s} {size:5d} {row['outcome']:7s} real peak {format_size(row['real_peak'])}"
                      f" = {row['peak_in_matrices'] or 0:.1f} whole matrices  {row.get('summary', row['error'])}",
                      flush=True)
                if outcome != "ok" and method == "xla":
                    break  # stock ran out: larger sizes will too
    if "speed" in only:
        for case, size in (("sgpr", 1000), ("gpr", 2000)):
            result = run_isolated("benchmarks.whole_matrices:speed", case, size, timeout=flags.FLAGS.timeout)
            speeds.append(result.value if result.ok else {"case": case, "size": size, "error": result.error})
            print(speeds[-1], flush=True)
    document = {"commit": os.popen("git rev-parse HEAD").read().strip(), "limit_mib": LIMIT_MIB,
                "rows": rows, "speed": speeds}
    if flags.FLAGS.json:
        documents.write(flags.FLAGS.json, document, "WHOLE_MATRICES.md", render)


def render(document: dict[str, Any]) -> str:
    """WHOLE_MATRICES.md from the JSON `main` writes: one table per case, then the speed rows.

    Example:
        >>> render({"commit": "abc", "limit_mib": 512, "speed": [], "rows": [
        ...     {"case": "gpr", "size": 3000, "method": "xla", "outcome": "ok", "real_peak": 369_000_000,
        ...      "peak_in_matrices": 5.1}]}).splitlines()[8]
        '| 3000 | stock XLA | ok | 351.9 MiB | 5.1 | - | - |'
    """
    from tfmem.config import format_size

    lines = ["# Whole matrices: Cholesky-based programs under a real limit",
             "",
             f"Generated by `python -m benchmarks.whole_matrices` at {document['commit'][:7]}; do not edit by hand. "
             f"Every trial in its own process under a {document['limit_mib']} MiB BFC limit, tfmem with "
             "`memory_budget` only. *Whole matrices*: the real peak in units of one [M, M] (or [n, n]) "
             "float64 matrix.", ""]
    for case in dict.fromkeys(row["case"] for row in document["rows"]):
        title = {"sgpr": f"GPflow SGPR (SE, D=3) loss + gradients, N={SGPR_N:,}, size = M",
                 "gpr": "GPflow GPR (SE, D=3) loss + gradients, size = n"}[case]
        lines += [f"## {title}", "", "| size | method | outcome | real peak | whole matrices | XLA plans | tfmem's verdict |",
                  "|---|---|---|---|---|---|---|"]
        for row in (r for r in document["rows"] if r["case"] == case):
            verdict = {True: "fits", False: "does NOT fit"}.get(row.get("fits"), "-")
            lines.append(f"| {row['size']} | {'stock XLA' if row['method'] == 'xla' else 'tfmem'} | {row['outcome']} | "
                         f"{format_size(row['real_peak']) if row['outcome'] == 'ok' else '-'} | "
                         f"{row['peak_in_matrices']:.1f} | " if row["outcome"] == "ok" else
                         f"| {row['size']} | {'stock XLA' if row['method'] == 'xla' else 'tfmem'} | {row['outcome']} | - | - | ")
            lines[-1] += f"{format_size(row.get('xla_plan')) if row.get('xla_plan') else '-'} | {verdict} |"
        lines.append("")
    if document["speed"]:
        lines += ["## Step time at a size both fit (tfmem / stock XLA, medians of alternating warm calls)", "",
                  "| case | size | tfmem / stock XLA | largest relative difference (loss, gradients) |", "|---|---|---|---|"]
        for row in document["speed"]:
            if "ratio" in row:
                lines.append(f"| {row['case']} | {row['size']} | {row['ratio']:.2f}× | {row['max_relative_error']:.1e} |")
            else:
                lines.append(f"| {row['case']} | {row['size']} | {row.get('error', 'failed')} | - |")
        lines.append("")
    return "\n".join(lines)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_list("only", [], "sgpr, gpr and/or speed (default: all).")
    flags.DEFINE_string("json", None, "Write the results here (and WHOLE_MATRICES.md beside them).")
    flags.DEFINE_string("render", None, "Only write WHOLE_MATRICES.md from this JSON.")
    flags.DEFINE_integer("timeout", 3600, "Seconds per trial.")


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
