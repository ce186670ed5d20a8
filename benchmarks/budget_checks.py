"""Issue 10's acceptance checks: `memory_budget` alone, under a real allocator limit equal to it.

    python -m benchmarks.budget_checks [--only=sgpr,sgpr_stock,...] [--json=out.json]

Each trial runs in its own process with TensorFlow's BFC allocator limited to the budget
(`tfmem.run_isolated`); tfmem gets `Config(memory_budget=<the same>)` and nothing else
(or, for `*_zero_config`, no config at all: the budget comes from the allocator's limit).
Equality checks run tfmem and stock `tf.function(jit_compile=True)` without a limit in one
process and report the largest relative error.

    sgpr               GPflow SGPR (SE, D=3) loss+gradients, N=100,000, M=2800, 1 GiB
    sgpr_stock         the same with stock XLA at M=300 (expected: out of memory)
    sgpr_equal         M=200, tfmem vs stock XLA
    sgpr_zero_config   M=2800 with no tfmem config at all, under the same 1 GiB limit
    sgpr_threshold     M=2800 with tensor_size_threshold=100MB only: the device's 1 GiB still bounds it
    sgpr_threshold_matern32  the same with a Matern32 kernel
    sgpr_threshold_off M=2800, tensor_size_threshold=100MB and memory_budget: off (the paper's
                       per-tensor semantics: expected out of memory, as every threshold was before)
    kernel             exp(-½(‖x‖²+‖x‖²ᵀ−2·X·Xᵀ)) @ V, n=20,000, float64, 512 MiB (GPflow's form, K(X, X))
    kernel_stock       the same, stock XLA
    attention          softmax(Q·Kᵀ/√d)·V, s=16,384, d=64, float32, gradients w.r.t. Q, K, V, 1 GiB
    attention_stock    the same, stock XLA
    attention_equal    s=2048 under a 12 MiB budget (so that it splits), tfmem vs stock XLA
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("only", [], "Checks to run (default: all).")
flags.DEFINE_string("json", None, "Write the results here.")
flags.DEFINE_integer("timeout", 3600, "Seconds per trial.")


# --- the programs ---------------------------------------------------------------------------


def sgpr_step(n: int, m: int, kernel: str = "SquaredExponential") -> Any:
    """GPflow SGPR's loss and gradients on synthetic 3-d data (the tape inside)."""
    import gpflow
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, size=(n, 3))
    y = np.sin(x).sum(-1, keepdims=True) + 0.1 * rng.normal(size=(n, 1))
    model = gpflow.models.SGPR((x, y), getattr(gpflow.kernels, kernel)(lengthscales=[1.0] * 3),
                               inducing_variable=x[rng.choice(n, m, replace=False)].copy())

    def step():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)

    return step, ()


def kernel(n: int) -> Any:
    """K(X, X) @ V in GPflow's expanded squared-distance form."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(n, 3)))
    v = tf.constant(rng.normal(size=(n, 16)))

    def fn(x, v):
        sq = tf.reduce_sum(tf.square(x), -1)
        dist = sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)
        return tf.exp(-0.5 * dist) @ v

    return fn, (x, v)


def attention(s: int, d: int = 64) -> Any:
    """Softmax attention and its gradients w.r.t. Q, K and V."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    q, k, v = (tf.constant(rng.normal(size=(s, d)), tf.float32) for _ in range(3))

    def fn(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            weights = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / np.sqrt(d), axis=-1)
            out = weights @ v
            loss = tf.reduce_sum(out ** 2)
        return (loss, *tape.gradient(loss, [q, k, v]))

    return fn, (q, k, v)


PROGRAMS = {"sgpr": sgpr_step, "kernel": kernel, "attention": attention}


def run(program: str, size: Any, method: str, budget: str | dict[str, Any] | None) -> dict[str, Any]:
    """Builds `program` at `size` and calls it once with `method`; returns the result and report.

    `budget`: tfmem's `memory_budget`, or a whole config mapping (None: no config at all).
    """
    import tensorflow as tf

    import tfmem

    fn, args = PROGRAMS[program](*(size if isinstance(size, (tuple, list)) else [size]))
    if method == "xla":
        runner = tf.function(fn, jit_compile=True)
    elif method == "tfmem":
        config = {"memory_budget": budget} if isinstance(budget, str) else budget
        runner = tfmem.function(fn, config=None if config is None else tfmem.Config.from_mapping(config))
    else:
        raise ValueError(method)
    start = time.perf_counter()
    value = runner(*args)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"value": tf.nest.map_structure(np.asarray, value), "first_call_s": seconds}
    if method == "tfmem":
        report = runner.report(*args)
        out.update(status=report.status, summary=report.summary(), static_peak=report.memory_after.peak_bytes
                   if report.memory_after else None, pipeline_s=report.pipeline_seconds,
                   budget=str(report.budget))
    return out


def stock_planned_bytes(program: str, size: Any) -> int:
    """XLA's planned bytes for stock `jit_compile=True` of `program` at `size` (compiled, not run)."""
    import tensorflow as tf

    import tfmem

    fn, args = PROGRAMS[program](*(size if isinstance(size, (tuple, list)) else [size]))
    return tfmem.xla_planned_bytes(tf.function(fn, jit_compile=True), *args)


def equal(program: str, size: Any, budget: str) -> dict[str, Any]:
    """tfmem (budget only) against stock XLA, in one process without a limit."""
    import tensorflow as tf

    got, want = run(program, size, "tfmem", budget), run(program, size, "xla", None)
    errors = [float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-300))
              for g, w in zip(tf.nest.flatten(got["value"]), tf.nest.flatten(want["value"]))]
    return {"max_relative_error": max(errors), "summary": got.get("summary")}


# name → (function, args, allocator limit in MiB or None)
CHECKS: dict[str, tuple[str, tuple[Any, ...], int | None]] = {
    "sgpr": ("run", ("sgpr", (100_000, 2800), "tfmem", "1GiB"), 1024),
    "sgpr_stock": ("run", ("sgpr", (100_000, 300), "xla", None), 1024),
    "sgpr_equal": ("equal", ("sgpr", (100_000, 200), "1GiB"), None),
    "sgpr_zero_config": ("run", ("sgpr", (100_000, 2800), "tfmem", None), 1024),
    "sgpr_threshold": ("run", ("sgpr", (100_000, 2800), "tfmem", {"tensor_size_threshold": "100MB"}), 1024),
    "sgpr_threshold_matern32": ("run", ("sgpr", (100_000, 2800, "Matern32"), "tfmem",
                                        {"tensor_size_threshold": "100MB"}), 1024),
    "sgpr_threshold_off": ("run", ("sgpr", (100_000, 2800), "tfmem",
                                   {"tensor_size_threshold": "100MB", "memory_budget": "off"}), 1024),
    "kernel": ("run", ("kernel", 20_000, "tfmem", "512MiB"), 512),
    "kernel_stock": ("run", ("kernel", 20_000, "xla", None), 512),
    "attention": ("run", ("attention", 16_384, "tfmem", "1GiB"), 1024),
    "attention_stock": ("run", ("attention", 16_384, "xla", None), 1024),
    "attention_equal": ("equal", ("attention", 2048, "12MiB"), None),  # small: it must split
}


def main(argv: list[str]) -> None:
    del argv
    from tfmem import run_isolated
    from tfmem.config import format_size

    rows = []
    for name in FLAGS.only or list(CHECKS):
        function, args, limit = CHECKS[name]
        result = run_isolated(f"benchmarks.budget_checks:{function}", *args, memory_limit_mb=limit,
                              timeout=FLAGS.timeout)
        value = result.value if result.ok else {}
        row = {"check": name, "status": result.status, "limit_mib": limit, "peak": result.peak_bytes,
               "seconds": result.seconds, "error": (result.error or "")[:300],
               **{k: v for k, v in value.items() if k != "value"}}
        rows.append(row)
        print(f"{name:18s} {row['status']:8s} limit {limit or '-'} MiB  real peak {format_size(row['peak'])}  "
              + "  ".join(f"{k}={v}" for k, v in row.items() if k in ("max_relative_error", "summary", "pipeline_s"))
              + (f"  {row['error']}" if row["error"] else ""), flush=True)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"commit": os.popen("git rev-parse HEAD").read().strip(), "rows": rows}, f, indent=2,
                      default=str)


if __name__ == "__main__":
    app.run(main)
