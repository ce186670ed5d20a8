"""Issue 19: how many whole [M, M] / [n, n] matrices Cholesky-based programs keep alive.

    python -m benchmarks.whole_matrices [--only=sgpr,gpr,sgpr_100k,gpr_matern,solve_wide,speed] [--json=benchmarks/whole_matrices.json]
    python -m benchmarks.whole_matrices --render=benchmarks/whole_matrices.json   # WHOLE_MATRICES.md again

Each trial runs in its own process with TensorFlow's BFC allocator limited to the case's
limit (`tfmem.run_isolated`); tfmem gets `Config(memory_budget=<the same>)` and nothing
else. For every size it reports ran / out of memory, the allocator's real peak, that peak
in whole matrices (`peak / bytes of the case's unit matrix`) and, for tfmem, XLA's plan
and the verdict. Stock XLA is tried from the smallest size up to its first failure.
`speed` times stock XLA and tfmem in one process at a size both fit: the ratio of their
median step times (later calls; the first call compiles).

    sgpr        GPflow SGPR (SE, D=3) loss+gradients, N=20,000, 512 MiB, M = 1500 … 4000
    sgpr_100k   the same with N=100,000, 1 GiB, M = 2000 … 5000
    gpr         GPflow GPR (SE, D=3) loss+gradients, 512 MiB, n = 3000 … 5600
    gpr_matern  GPflow GPR (Matérn-5/2, D=3) log marginal likelihood, 512 MiB, n = 3500 … 5600
    solve_wide  L⁻¹ K(Z, X) with L [1000, 1000], K(Z, X) [1000, n] f64, 512 MiB, n = 20,000 … 40,000
    speed       SGPR N=20,000 M=1000, GPR n=2000 and 4300 (in-place solves), stock XLA against tfmem (no limit)

With `--only` and `--json`, the rows of the cases not run are kept from the file (each
row names the commit it was measured at).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import documents
from benchmarks.cases import sgpr_loss_and_gradients

Program = tuple[Callable[..., Any], tuple[Any, ...]]


def gpr_step(n: int) -> Program:
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


def gpr_matern_objective(n: int) -> Program:
    """GPflow GPR's log marginal likelihood with a Matérn-5/2 kernel on synthetic 3-d data:
    no gradient (an objective evaluated for model selection), so XLA's peak is the Cholesky,
    which stock XLA computes from the kernel's `XXᵀ`, `r` and `e^{-√5·r}` held whole."""
    import gpflow

    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, size=(n, 3))
    y = np.sin(x).sum(-1, keepdims=True) + 0.1 * rng.normal(size=(n, 1))
    model = gpflow.models.GPR((x, y), gpflow.kernels.Matern52(lengthscales=[1.0] * 3))
    return model.log_marginal_likelihood, ()


def solve_wide(n: int, m: int = 1000) -> Program:
    """The paper's projection onto inducing points: column sums of (L⁻¹ K(Z, X))², with
    L = chol(K(Z, Z) + 10⁻⁶ I) [m, m] and a wide right-hand side K(Z, X) [m, n], f64."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    z = tf.constant(rng.uniform(-3, 3, size=(m, 3)))
    x = tf.constant(rng.uniform(-3, 3, size=(n, 3)))

    def project(z, x):
        sz = tf.reduce_sum(z ** 2, 1)
        kzz = tf.exp(-0.5 * (sz[:, None] + sz[None, :] - 2.0 * z @ tf.transpose(z)))
        kzx = tf.exp(-0.5 * (sz[:, None] + tf.reduce_sum(x ** 2, 1)[None, :] - 2.0 * z @ tf.transpose(x)))
        chol = tf.linalg.cholesky(kzz + 1e-6 * tf.eye(m, dtype=tf.float64))
        return tf.reduce_sum(tf.linalg.triangular_solve(chol, kzx, lower=True) ** 2, axis=0)

    return project, (z, x)


@dataclasses.dataclass(frozen=True)
class Case:
    """One program family of the benchmark: its sizes, its real limit and its unit matrix."""

    name: str
    title: str
    limit_mib: int
    sizes: tuple[int, ...]
    build: Callable[[int], Program]
    unit: str  # the matrix the real peak is counted in
    unit_bytes: Callable[[int], int]


CASES: dict[str, Case] = {c.name: c for c in [
    Case("sgpr", "GPflow SGPR (SE, D=3) loss + gradients, N=20,000, size = M", 512,
         (1500, 2000, 2500, 3000, 3300, 3600, 3800, 4000), lambda m: (sgpr_loss_and_gradients(20_000, m), ()),
         "[M, M]", lambda m: m * m * 8),
    Case("sgpr_100k", "GPflow SGPR (SE, D=3) loss + gradients, N=100,000, size = M", 1024,
         (2000, 4000, 4500, 4800, 5000), lambda m: (sgpr_loss_and_gradients(100_000, m), ()),
         "[M, M]", lambda m: m * m * 8),
    Case("gpr", "GPflow GPR (SE, D=3) loss + gradients, size = n", 512, (3000, 3500, 4000, 4300, 4500, 4700, 5000, 5300, 5600), gpr_step,
         "[n, n]", lambda n: n * n * 8),
    Case("gpr_matern", "GPflow GPR (Matérn-5/2, D=3) log marginal likelihood, no gradient, size = n", 512,
         (3500, 4000, 4500, 5000, 5300, 5600), gpr_matern_objective, "[n, n]", lambda n: n * n * 8),
    Case("solve_wide", "Triangular solve with a wide right-hand side: Σ (L⁻¹ K(Z, X))² over rows, "
         "L [1000, 1000], K(Z, X) [1000, n], size = n", 512, (20_000, 30_000, 40_000), solve_wide,
         "[1000, n]", lambda n: 1000 * n * 8),
]}
SPEED_SIZES = (("sgpr", 1000), ("gpr", 2000), ("gpr", 4300))


def trial(case: str, size: int, method: str, budget: str) -> dict[str, Any]:
    """One call of `case` at `size` with stock XLA or tfmem (budget only); what it reported."""
    import tensorflow as tf

    import tfmem

    fn, args = CASES[case].build(size)
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
        value = runner(*args)
    except tf.errors.ResourceExhaustedError as err:
        if method == "xla":
            raise
        return {**out, "oom_error": str(err).splitlines()[0][:200]}
    first = tf.nest.flatten(value)[0]
    return {**out, "value": float(tf.reduce_sum(first)), "first_call_s": time.perf_counter() - start}


def speed(case: str, size: int, repeats: int = 7) -> dict[str, Any]:
    """Median step time of tfmem (budget only) over stock XLA's, alternating, in one process,
    and the largest relative difference of their loss and gradients."""
    import tensorflow as tf

    import tfmem

    fn, args = CASES[case].build(size)
    runners = {"xla": tf.function(fn, jit_compile=True),
               "tfmem": tfmem.function(fn, config=tfmem.Config(memory_budget=f"{CASES[case].limit_mib}MiB"))}
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


def run_case(case: Case, commit: str, timeout: float) -> list[dict[str, Any]]:
    """Every size of `case` with stock XLA (up to its first failure), then with tfmem."""
    from tfmem import run_isolated
    from tfmem.config import format_size

    rows = []
    for method in ("xla", "tfmem"):
        for size in case.sizes:
            result = run_isolated("benchmarks.whole_matrices:trial", case.name, size, method,
                                  f"{case.limit_mib}MiB", memory_limit_mb=case.limit_mib, timeout=timeout)
            value = result.value if result.ok else {}
            outcome = "oom" if value.get("oom_error") else result.status
            row = {"case": case.name, "size": size, "method": method, "outcome": outcome, "commit": commit,
                   "limit_mib": case.limit_mib, "real_peak": result.peak_bytes,
                   "peak_in_matrices": None if result.peak_bytes is None else result.peak_bytes / case.unit_bytes(size),
                   **value, "error": (result.error or "")[:200]}
            rows.append(row)
            print(f"{case.name} {method:5s} {size:6d} {outcome:7s} real peak {format_size(row['real_peak'])}"
                  f" = {row['peak_in_matrices'] or 0:.1f} {case.unit}  {row.get('summary', row['error'])}", flush=True)
            if outcome != "ok" and method == "xla":
                break  # stock ran out: larger sizes will too
    return rows


def main(argv: list[str]) -> None:
    del argv
    from absl import flags

    from tfmem import run_isolated

    if flags.FLAGS.render:
        documents.render_again(flags.FLAGS.render, "WHOLE_MATRICES.md", render)
        return
    only = flags.FLAGS.only or [*CASES, "speed"]
    unknown = sorted(set(only) - {*CASES, "speed"})
    if unknown:
        raise SystemExit(f"--only: unknown case(s) {unknown}; the cases are {[*CASES, 'speed']}")
    commit = os.popen("git rev-parse HEAD").read().strip()
    kept: dict[str, Any] = {"rows": [], "speed": []}
    if flags.FLAGS.json and os.path.exists(flags.FLAGS.json):
        with open(flags.FLAGS.json) as f:
            kept = json.load(f)
    rows = [row for row in kept["rows"] if row["case"] not in only]
    for name in (c for c in CASES if c in only):
        rows += run_case(CASES[name], commit, flags.FLAGS.timeout)
    speeds = [] if "speed" in only else kept["speed"]
    if "speed" in only:
        for case, size in SPEED_SIZES:
            result = run_isolated("benchmarks.whole_matrices:speed", case, size, timeout=flags.FLAGS.timeout)
            speeds.append({**(result.value if result.ok else {"case": case, "size": size, "error": result.error}),
                           "commit": commit})
            print(speeds[-1], flush=True)
    rows.sort(key=lambda row: [*CASES].index(row["case"]))
    document = {"commit": commit, "rows": rows, "speed": speeds}
    if flags.FLAGS.json:
        documents.write(flags.FLAGS.json, document, "WHOLE_MATRICES.md", render)


def render(document: dict[str, Any]) -> str:
    """WHOLE_MATRICES.md from the JSON `main` writes: one table per case, then the speed rows.

    Example:
        >>> render({"commit": "abcdef0", "speed": [], "rows": [
        ...     {"case": "gpr", "size": 3000, "method": "xla", "outcome": "ok", "real_peak": 369_000_000,
        ...      "peak_in_matrices": 5.1, "limit_mib": 512, "commit": "abcdef0"}]}).splitlines()[10]
        '| 3000 | stock XLA | ok | 351.9 MiB | 5.1 | - | - |'
    """
    from tfmem.config import format_size

    lines = ["# Whole matrices: Cholesky-based programs under a real limit",
             "",
             "Generated by `python -m benchmarks.whole_matrices`; do not edit by hand. Every trial in its own "
             "process under a real BFC limit, tfmem with `memory_budget` (the same limit) only. *Whole matrices*: "
             "the real peak in units of the case's unit matrix (float64).", ""]
    for name in dict.fromkeys(row["case"] for row in document["rows"]):
        case = CASES[name]
        rows = [r for r in document["rows"] if r["case"] == name]
        commits = ", ".join(sorted({r.get("commit", document["commit"])[:7] for r in rows}))
        lines += [f"## {case.title}", "",
                  f"Limit {rows[0].get('limit_mib', case.limit_mib)} MiB; whole matrices in units of {case.unit}; "
                  f"measured at {commits}.", "",
                  "| size | method | outcome | real peak | whole matrices | XLA plans | tfmem's verdict |",
                  "|---|---|---|---|---|---|---|"]
        for row in rows:
            method = "stock XLA" if row["method"] == "xla" else "tfmem"
            ran = row["outcome"] == "ok"
            verdict = {True: "fits", False: "does NOT fit"}.get(row.get("fits"), "-")
            matrices = f"{row['peak_in_matrices']:.1f}" if ran else "-"
            lines.append(f"| {row['size']} | {method} | {row['outcome']} | "
                         f"{format_size(row['real_peak']) if ran else '-'} | {matrices} | "
                         f"{format_size(row.get('xla_plan')) if row.get('xla_plan') else '-'} | {verdict} |")
        lines.append("")
    lines += _gpu_projection(document["rows"])
    if document["speed"]:
        lines += ["## Step time (tfmem / stock XLA, medians of alternating warm calls; no memory limit, tfmem "
                  "planned for the case's budget, so at GPR n=4300 with its solves in place)", "",
                  "| case | size | tfmem / stock XLA | largest relative difference (loss, gradients) |", "|---|---|---|---|"]
        for row in document["speed"]:
            if "ratio" in row:
                lines.append(f"| {row['case']} | {row['size']} | {row['ratio']:.2f}× | {row['max_relative_error']:.1e} |")
            else:
                lines.append(f"| {row['case']} | {row['size']} | {row.get('error', 'failed')} | - |")
        lines.append("")
    return "\n".join(lines)


# The GPU of the paper's and the issue's SGPR runs: a 32 GB pool (an H100's share there).
GPU_POOL_BYTES = 32 * 10**9


def _gpu_projection(rows: list[dict[str, Any]]) -> list[str]:
    """A projection, not a measurement: SGPR's largest M in a 32 GB GPU pool, if the peak
    there held as many whole [M, M] matrices as at the largest M that ran here.

    Example:
        >>> line = _gpu_projection([{"case": "sgpr", "size": 3600, "method": "tfmem", "outcome": "ok",
        ...                          "peak_in_matrices": 5.1}])[2]
        >>> line[line.index("the largest M"):line.index(" (√")]
        'the largest M would be about 28,000'
    """
    ran = [r for r in rows if r["case"] == "sgpr" and r["method"] == "tfmem" and r["outcome"] == "ok"
           and r.get("peak_in_matrices")]
    if not ran:
        return []
    largest = max(ran, key=lambda r: r["size"])
    matrices = largest["peak_in_matrices"]
    m = (GPU_POOL_BYTES / (8 * matrices)) ** 0.5
    return ["## Projection to a GPU (not measured)", "",
            f"At M={largest['size']} the real peak held {matrices:.1f} whole [M, M] matrices (float64). If a 32 GB "
            f"GPU pool held as many at its peak, the largest M would be about {round(m, -3):,.0f} "
            f"(√(32 GB / (8 B × {matrices:.1f}))). This machine has no GPU: the [M, N] chunks at N=290,000 and "
            "XLA's GPU schedule are not in it.", ""]


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_list("only", [], "Cases to run: sgpr, sgpr_100k, gpr, solve_wide, speed (default: all).")
    flags.DEFINE_string("json", None, "Write the results here (and WHOLE_MATRICES.md beside them).")
    flags.DEFINE_string("render", None, "Only write WHOLE_MATRICES.md from this JSON.")
    flags.DEFINE_integer("timeout", 3600, "Seconds per trial.")


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
