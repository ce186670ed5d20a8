"""Issue 20: an exact GP solve by conjugate gradients with K [n, n] formed outside the loop.

    python -m benchmarks.matrix_free [--sizes=12000,50000,100000] [--json=benchmarks/matrix_free.json]
    python -m benchmarks.matrix_free --only=gradients --json=benchmarks/matrix_free.json   # one part again
    python -m benchmarks.matrix_free --render=benchmarks/matrix_free.json   # MATRIX_FREE.md again

The program is what a user writes (`cg_solve`): the SE kernel matrix of n points in d=8
(f64) formed once, then `CG_STEPS` conjugate-gradient steps in a `tf.while_loop` whose
body computes `K @ p + σ² p`. Stock TensorFlow holds K whole (n=11,600 is 1 GiB). tfmem,
given `Config(memory_budget="1GiB")` and nothing else, recomputes K's chunks inside the
loop body (`rewrites.split.sink`).

    outcome   each size in its own process under a real 1 GiB BFC limit, stock XLA and tfmem:
              ran / out of memory, real peak, XLA's plan and tfmem's verdict, seconds per step;
              tfmem's solution against the hand-chunked reference at the same n (another process)
    accuracy  at n=`ACCURACY_N`: tfmem's solution against a chunked NumPy CG (relative max error)
    speed     at n=`SPEED_N`: seconds per CG step of tfmem against the hand-chunked TensorFlow
              loop a user would otherwise write (`chunked_reference`, XLA), warm calls, one process
    gradients `cg_loss_and_grads` (the solve differentiated with respect to x) at
              `GRADIENT_SIZES` under the same limit, stock XLA and tfmem, tfmem's gradient
              against stock's where both ran
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import documents

LIMIT_MIB = 1024
D = 8
CG_STEPS = 25
LENGTHSCALE = 1.0
NOISE = 0.5
SIZES = (8000, 11000, 12000, 20000, 50000, 100000)
GRADIENT_SIZES = (4000, 6000, 7000, 20000, 50000)
ACCURACY_N = 12000
SPEED_N = 20000
REFERENCE_CHUNK = 1000


def data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n standard-normal points in d=8 and a right-hand side, the same for every method."""
    rng = np.random.default_rng(n)
    return rng.normal(size=(n, D)), rng.normal(size=(n, 1))


def _se_kernel(x: Any, z: Any) -> Any:
    import tensorflow as tf

    xs, zs = x / LENGTHSCALE, z / LENGTHSCALE
    sq = tf.reduce_sum(xs * xs, 1)[:, None] + tf.reduce_sum(zs * zs, 1)[None, :] - 2.0 * tf.matmul(xs, zs, transpose_b=True)
    return tf.exp(-0.5 * tf.maximum(sq, 0.0))


def _cg(matvec: Callable[[Any], Any], y: Any, bounded: bool = False) -> Any:
    """`CG_STEPS` steps of conjugate gradients on (K + σ²I) α = y, in a `tf.while_loop`
    (`bounded`: with `maximum_iterations`, which XLA needs to differentiate the loop)."""
    import tensorflow as tf

    def body(i, sol, r, p, rr):
        ap = matvec(p) + NOISE * p
        alpha = rr / tf.reduce_sum(p * ap)
        sol, r = sol + alpha * p, r - alpha * ap
        rr_new = tf.reduce_sum(r * r)
        return i + 1, sol, r, r + (rr_new / rr) * p, rr_new

    _, sol, *_ = tf.while_loop(lambda i, *_: i < CG_STEPS, body,
                               (tf.constant(0), tf.zeros_like(y), y, y, tf.reduce_sum(y * y)),
                               maximum_iterations=CG_STEPS if bounded else None)
    return sol


def cg_solve(x: Any, y: Any) -> Any:
    """The user's program: K formed once, outside the loop that reads it."""
    k = _se_kernel(x, x)  # [n, n]
    return _cg(lambda p: k @ p, y)


def cg_loss_and_grads(x: Any, y: Any) -> Any:
    """The solve differentiated: ‖α‖² and its gradient with respect to the points x,
    through the loop (TensorFlow's while-loop gradient: a second loop reading K, which
    sums dK = Σ g pᵀ over the steps)."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch(x)
        k = _se_kernel(x, x)
        sol = _cg(lambda p: k @ p, y, bounded=True)
        loss = tf.reduce_sum(sol * sol)
    return loss, tape.gradient(loss, x)


def chunked_reference(x: Any, y: Any) -> Any:
    """What a user writes by hand instead: K's rows recomputed in blocks inside each step.

    The blocks run in a `tf.while_loop`: written as a Python loop of static slices, each
    block is invariant in the CG loop, and XLA's loop-invariant code motion hoists all of
    them out of it, holding K whole again (measured: 25 steps at n=8,000 then take less
    time than one matrix-vector product).
    """
    import tensorflow as tf

    n = x.shape[0]
    blocks = -(-n // REFERENCE_CHUNK)
    padded = tf.pad(x, [[0, blocks * REFERENCE_CHUNK - n], [0, 0]])

    def matvec(p):
        def block(i, rows):
            xb = tf.slice(padded, [i * REFERENCE_CHUNK, 0], [REFERENCE_CHUNK, D])
            return i + 1, rows.write(i, _se_kernel(xb, x) @ p)

        rows = tf.TensorArray(x.dtype, size=blocks, element_shape=[REFERENCE_CHUNK, 1])
        _, rows = tf.while_loop(lambda i, _: i < blocks, block, (tf.constant(0), rows))
        return tf.reshape(rows.stack(), [-1, 1])[:n]

    return _cg(matvec, y)


def numpy_cg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The same CG in NumPy, K's rows in blocks (the accuracy reference)."""
    xs = x / LENGTHSCALE
    sq = (xs * xs).sum(1)

    def matvec(p: np.ndarray) -> np.ndarray:
        out = np.empty_like(p)
        for s in range(0, len(x), REFERENCE_CHUNK):
            d = sq[s:s + REFERENCE_CHUNK, None] + sq[None, :] - 2.0 * xs[s:s + REFERENCE_CHUNK] @ xs.T
            out[s:s + REFERENCE_CHUNK] = np.exp(-0.5 * np.maximum(d, 0.0)) @ p
        return out

    sol, r, p = np.zeros_like(y), y.copy(), y.copy()
    rr = float((y * y).sum())
    for _ in range(CG_STEPS):
        ap = matvec(p) + NOISE * p
        alpha = rr / float((p * ap).sum())
        sol, r = sol + alpha * p, r - alpha * ap
        rr_new = float((r * r).sum())
        p, rr = r + (rr_new / rr) * p, rr_new
    return sol


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def trial(n: int, method: str, save: str | None = None, gradients: bool = False) -> dict[str, Any]:
    """One call at size n: stock XLA, tfmem (budget only) or the hand-chunked reference;
    of the solve, or (`gradients`) of `cg_loss_and_grads` (then `save` keeps the gradient)."""
    import tensorflow as tf

    import tfmem

    x, y = (tf.constant(a) for a in data(n))
    out: dict[str, Any] = {}
    program = cg_loss_and_grads if gradients else cg_solve
    if method == "xla":
        runner = tf.function(program, jit_compile=True)
    elif method == "reference":
        runner = tf.function(chunked_reference, jit_compile=True)
    else:  # the verdict first, so that it is kept when the call then runs out of memory
        runner = tfmem.function(program, config=tfmem.Config(memory_budget=f"{LIMIT_MIB}MiB"))
        report = runner.report(x, y)
        out.update(fits=report.fits, summary=report.summary(), xla_plan=report.xla_bytes_after,
                   static_peak=report.memory_after.peak_bytes if report.memory_after else None,
                   sunk=[r.details.get("tensor") for r in report.records
                         if r.rule == "RecomputeLoopInvariant" and r.status == "fired"])
    start = time.perf_counter()
    try:
        result = runner(x, y)
        sol = (result[1] if gradients else result).numpy()
    except tf.errors.ResourceExhaustedError as err:
        return {**out, "oom_error": str(err).splitlines()[0][:200]}
    out["first_call_s"] = time.perf_counter() - start
    if save:
        np.save(save, sol)
    return {**out, "solution_max_abs": float(np.max(np.abs(sol)))}


def accuracy(n: int = ACCURACY_N) -> dict[str, Any]:
    """tfmem (budget only) against the chunked NumPy CG, and stock XLA against it too."""
    import tensorflow as tf

    import tfmem

    x, y = data(n)
    want = numpy_cg(x, y)
    tx, ty = tf.constant(x), tf.constant(y)
    got = tfmem.function(cg_solve, config=tfmem.Config(memory_budget=f"{LIMIT_MIB // 4}MiB"))(tx, ty).numpy()
    stock = tf.function(cg_solve, jit_compile=True)(tx, ty).numpy()
    return {"n": n, "tfmem_vs_numpy": _relative(got, want), "stock_vs_numpy": _relative(stock, want)}


def speed(n: int = SPEED_N, repeats: int = 3) -> dict[str, Any]:
    """Seconds per CG step, tfmem (budget only) and the hand-chunked reference, warm, alternating."""
    import tensorflow as tf

    import tfmem

    x, y = (tf.constant(a) for a in data(n))
    runners = {"reference": tf.function(chunked_reference, jit_compile=True),
               "tfmem": tfmem.function(cg_solve, config=tfmem.Config(memory_budget=f"{LIMIT_MIB}MiB"))}
    values = {name: run(x, y).numpy() for name, run in runners.items()}  # compile both first
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run(x, y).numpy()
            times[name].append((time.perf_counter() - start) / CG_STEPS)
    per_step = {name: float(np.median(t)) for name, t in times.items()}
    return {"n": n, "seconds_per_step": per_step, "ratio": per_step["tfmem"] / per_step["reference"],
            "tfmem_vs_reference": _relative(values["tfmem"], values["reference"])}


def main(argv: list[str]) -> None:
    del argv
    from absl import flags

    from tfmem import run_isolated
    from tfmem.config import format_size

    if flags.FLAGS.render:
        documents.render_again(flags.FLAGS.render, "MATRIX_FREE.md", render)
        return
    only = flags.FLAGS.only or ["outcome", "accuracy", "speed", "gradients"]
    sizes = [int(s) for s in flags.FLAGS.sizes] if flags.FLAGS.sizes else None
    rows: list[dict[str, Any]] = []
    commit = os.popen("git rev-parse HEAD").read().strip()
    document: dict[str, Any] = {"commit": commit, "limit_mib": LIMIT_MIB, "d": D, "steps": CG_STEPS, "rows": rows}
    if flags.FLAGS.json and os.path.exists(flags.FLAGS.json) and "outcome" not in only:
        with open(flags.FLAGS.json) as f:  # a part run again: the other parts stay as measured
            document = json.load(f)
    scratch = flags.FLAGS.scratch
    os.makedirs(scratch, exist_ok=True)
    if "gradients" in only:
        document["gradients"] = {"commit": commit, "rows": _gradient_rows(sizes or list(GRADIENT_SIZES), scratch)}
    if "outcome" in only:
        sizes = sizes or list(SIZES)
        for method in ("xla", "tfmem"):
            for n in sizes:
                save = os.path.join(scratch, f"{method}_{n}.npy")
                row = _limited_trial(n, method, save, gradients=False)
                outcome = row["outcome"]
                if outcome == "ok" and method == "tfmem":  # the hand-chunked reference, no limit
                    ref = os.path.join(scratch, f"reference_{n}.npy")
                    reference = run_isolated("benchmarks.matrix_free:trial", n, "reference", ref,
                                             timeout=flags.FLAGS.timeout)
                    if reference.ok:
                        row["vs_reference"] = _relative(np.load(save), np.load(ref))
                rows.append(row)
                print(f"{method:5s} {n:6d} {outcome:7s} real peak {format_size(row['real_peak'])} "
                      f"{row.get('summary', row['error'])} vs reference {row.get('vs_reference')}", flush=True)
                if outcome != "ok":
                    break  # larger sizes run out too
    if "accuracy" in only:
        result = run_isolated("benchmarks.matrix_free:accuracy", timeout=flags.FLAGS.timeout)
        document["accuracy"] = result.value if result.ok else {"error": result.error}
        print(document["accuracy"], flush=True)
    if "speed" in only:
        result = run_isolated("benchmarks.matrix_free:speed", timeout=flags.FLAGS.timeout)
        document["speed"] = result.value if result.ok else {"error": result.error}
        print(document["speed"], flush=True)
    if flags.FLAGS.json:
        documents.write(flags.FLAGS.json, document, "MATRIX_FREE.md", render)


def _limited_trial(n: int, method: str, save: str, *, gradients: bool) -> dict[str, Any]:
    """`trial` in its own process under the real limit, as a table row (outcome: ok, oom, …)."""
    from absl import flags

    from tfmem import run_isolated

    result = run_isolated("benchmarks.matrix_free:trial", n, method, save, gradients,
                          memory_limit_mb=LIMIT_MIB, timeout=flags.FLAGS.timeout)
    value = result.value if result.ok else {}
    outcome = "oom" if value.get("oom_error") else result.status
    return {"n": n, "method": method, "outcome": outcome, "real_peak": result.peak_bytes, **value,
            "error": (result.error or "")[:200]}


def _gradient_rows(sizes: list[int], scratch: str) -> list[dict[str, Any]]:
    """`cg_loss_and_grads` at each size under the real limit, stock XLA then tfmem; tfmem's
    gradient against stock XLA's where both ran."""
    from tfmem.config import format_size

    rows: list[dict[str, Any]] = []
    for method in ("xla", "tfmem"):
        for n in sizes:
            save = os.path.join(scratch, f"grad_{method}_{n}.npy")
            row = _limited_trial(n, method, save, gradients=True)
            outcome = row["outcome"]
            stock = os.path.join(scratch, f"grad_xla_{n}.npy")
            if outcome == "ok" and method == "tfmem" and any(
                    r["n"] == n and r["method"] == "xla" and r["outcome"] == "ok" for r in rows):
                row["vs_stock"] = _relative(np.load(save), np.load(stock))
            rows.append(row)
            print(f"gradients {method:5s} {n:6d} {outcome:7s} real peak {format_size(row['real_peak'])} "
                  f"{row.get('summary', row['error'])} vs stock {row.get('vs_stock')}", flush=True)
            if outcome != "ok":
                break  # larger sizes run out too
    return rows


def render(document: dict[str, Any]) -> str:
    """MATRIX_FREE.md from the JSON `main` writes.

    Example:
        >>> render({"commit": "abc", "limit_mib": 1024, "d": 8, "steps": 25, "rows": [
        ...     {"n": 8000, "method": "xla", "outcome": "ok", "real_peak": 600 * 2**20, "first_call_s": 5.0}]}
        ...     ).splitlines()[6]
        '| 8000 | stock XLA | ok | 600.0 MiB | - | - | 0.20 | - |'
    """
    from tfmem.config import format_size

    lines = ["# Matrix-free loops: exact GP solve by conjugate gradients",
             "",
             (f"Generated by `python -m benchmarks.matrix_free` at {document['commit'][:7]}; do not edit by hand. "
             f"SE kernel, d={document['d']}, float64, {document['steps']} CG steps, K formed outside the loop; each "
             f"size in its own process under a {document['limit_mib']} MiB BFC limit, tfmem with `memory_budget` only."),
             "",
             "| n | method | outcome | real peak | XLA plans | tfmem's verdict | s per step (first call) | vs hand-chunked |",
             "|---|---|---|---|---|---|---|---|"]
    for row in document["rows"]:
        ok = row["outcome"] == "ok"
        verdict = {True: "fits", False: "does NOT fit"}.get(row.get("fits"), "-")
        per_step = f"{row['first_call_s'] / document['steps']:.2f}" if ok and row.get("first_call_s") else "-"
        versus = f"{row['vs_reference']:.1e}" if row.get("vs_reference") is not None else "-"
        lines.append(f"| {row['n']} | {'stock XLA' if row['method'] == 'xla' else 'tfmem'} | {row['outcome']} | "
                     f"{format_size(row['real_peak']) if ok else '-'} | "
                     f"{format_size(row['xla_plan']) if row.get('xla_plan') else '-'} | {verdict} | {per_step} | {versus} |")
    lines.append("")
    if "accuracy" in document:
        acc = document["accuracy"]
        lines += ["## Accuracy against a chunked NumPy CG", ""]
        lines.append(f"n={acc['n']}: tfmem {acc['tfmem_vs_numpy']:.1e}, stock XLA {acc['stock_vs_numpy']:.1e} "
                     "(max |x − x_numpy| / max |x_numpy|)." if "n" in acc else f"failed: {acc.get('error')}")
        lines.append("")
    if "speed" in document:
        sp = document["speed"]
        lines += ["## Speed against the hand-chunked TensorFlow loop (XLA), warm calls, one process", ""]
        lines.append(f"n={sp['n']}: tfmem {sp['seconds_per_step']['tfmem']:.3f} s per step, hand-chunked "
                     f"{sp['seconds_per_step']['reference']:.3f} s: **{sp['ratio']:.2f}×** (solutions differ by "
                     f"{sp['tfmem_vs_reference']:.1e})." if "n" in sp else f"failed: {sp.get('error')}")
        lines.append("")
    if "gradients" in document:
        grads = document["gradients"]
        lines += ["## Gradients through the loop",
                  "",
                  (f"`cg_loss_and_grads` (‖α‖² and its gradient with respect to x, through the loop: TensorFlow's "
                   f"gradient loop reads K too and sums dK = Σ g pᵀ), measured at {grads['commit'][:7]}, the same "
                   "limit and sizes in their own processes; tfmem collects the sum's outer products and recomputes "
                   "K in both loops."),
                  "",
                  "| n | method | outcome | real peak | XLA plans | tfmem's verdict | s (first call) | vs stock XLA |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in grads["rows"]:
            ok = row["outcome"] == "ok"
            verdict = {True: "fits", False: "does NOT fit"}.get(row.get("fits"), "-")
            versus = f"{row['vs_stock']:.1e}" if row.get("vs_stock") is not None else "-"
            seconds = f"{row['first_call_s']:.1f}" if ok and row.get("first_call_s") else "-"
            lines.append(f"| {row['n']} | {'stock XLA' if row['method'] == 'xla' else 'tfmem'} | {row['outcome']} | "
                         f"{format_size(row['real_peak']) if ok else '-'} | "
                         f"{format_size(row['xla_plan']) if row.get('xla_plan') else '-'} | {verdict} | {seconds} | "
                         f"{versus} |")
        lines.append("")
    return "\n".join(lines)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_list("only", [], "outcome, accuracy, speed and/or gradients (default: all; a part run alone "
                      "keeps the others from --json).")
    flags.DEFINE_list("sizes", [], f"Sizes n (default: {SIZES} for the outcome, {GRADIENT_SIZES} for gradients).")
    flags.DEFINE_string("json", None, "Write the results here (and MATRIX_FREE.md beside them).")
    flags.DEFINE_string("render", None, "Only write MATRIX_FREE.md from this JSON.")
    flags.DEFINE_string("scratch", "/tmp/tfmem_matrix_free", "Where solutions are saved to compare them.")
    flags.DEFINE_integer("timeout", 7200, "Seconds per trial.")


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
