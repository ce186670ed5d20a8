"""Speed and XLA-planned memory of rewritten programs against stock TensorFlow.

For each case, runs the same function three ways in one process, warm (compiled and
run once before timing), and reports the median of `--repeats` calls:

* tfmem: `tfmem.function` with the cleanup and reorder stages,
* stock XLA: `tf.function(jit_compile=True)` (the baseline the speed ratio is against),
* stock graph: plain `tf.function`.

Memory columns are XLA's planned bytes for one call ("Total bytes used" of its buffer
assignment) for stock XLA and for tfmem, and tfmem's static estimate before and after.

Cases:
    chain_ab_v:   (A @ B) @ v with A [n, k], B [k, n], v [n, 1]   → A @ (B @ v)
    diag_product: diag_part(Knm @ Qinv @ Kmn), Knm [N, M] float64   → Σ_j ((Knm @ Qinv) ∘ Knm)
    chain_ab_v_grad, diag_product_grad: the same with a tape gradient inside the function
                  (the backward's [n, n] / [N, N] tensors go too; N = --diag_grad_n)
    sqdist:       the naive squared distance with its tape gradient, from
                  `benchmarks/sqdist_memory.py` (skipped if that module is absent)

Adding a case: append to `CASES` a `Case(name, description, build)` whose `build()`
returns `(fn, args)` (raise `CaseUnavailable` to skip it), and name the pipeline
stages it needs in `stages`.

Example:
    python benchmarks/rewrite_speed.py --repeats=5 --cases=chain_ab_v,diag_product
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from absl import app, flags

import tfmem
from tfmem.config import format_size

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 5, "Timed calls per variant (after one warm-up call).")
flags.DEFINE_list("cases", [], "Cases to run (default: all).")
flags.DEFINE_integer("chain_n", 3000, "Rows of A and length of v in the chain case.")
flags.DEFINE_integer("chain_k", 500, "Inner dimension of the chain case.")
flags.DEFINE_integer("diag_n", 20000, "N of the diag_part case.")
flags.DEFINE_integer("diag_m", 200, "M of the diag_part case.")
flags.DEFINE_integer("diag_grad_n", 5000, "N of the diag_part case with gradient (stock holds "
                     "several [N, N] tensors).")
flags.DEFINE_integer("sqdist_n", 2000, "Points in x and in y for the squared-distance case.")
flags.DEFINE_integer("sqdist_d", 16, "Feature dimension of the squared-distance case.")
flags.DEFINE_bool("graph_baseline", True, "Also time plain tf.function (no XLA).")
flags.DEFINE_integer("seed", 0, "Seed of the random inputs.")

Build = Callable[[], tuple[Callable[..., Any], Sequence[tf.Tensor]]]


class CaseUnavailable(RuntimeError):
    """A case cannot run here (e.g. the module defining it is absent)."""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    description: str
    build: Build
    stages: tuple[str, ...] = ("cleanup", "reorder")


def chain_ab_v() -> tuple[Callable[..., Any], list[tf.Tensor]]:
    n, k = FLAGS.chain_n, FLAGS.chain_k
    rng = np.random.default_rng(FLAGS.seed)
    a = tf.constant(rng.normal(size=(n, k)))  # [n, k]
    b = tf.constant(rng.normal(size=(k, n)))  # [k, n]
    v = tf.constant(rng.normal(size=(n, 1)))  # [n, 1]

    def chain(a: tf.Tensor, b: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
        return (a @ b) @ v  # [n, n] intermediate

    return chain, [a, b, v]


def diag_product() -> tuple[Callable[..., Any], list[tf.Tensor]]:
    n, m = FLAGS.diag_n, FLAGS.diag_m
    rng = np.random.default_rng(FLAGS.seed)
    knm = tf.constant(rng.normal(size=(n, m)))  # [N, M]
    root = rng.normal(size=(m, m))
    qinv = tf.constant(root @ root.T / m + np.eye(m))  # [M, M], SPD like a GP's Qinv

    def predictive_variance(knm: tf.Tensor, qinv: tf.Tensor) -> tf.Tensor:
        return tf.linalg.diag_part(knm @ qinv @ tf.transpose(knm))  # [N]

    return predictive_variance, [knm, qinv]


def with_gradient(build: Build) -> Build:
    """The case's function with the gradient of a sum of its result, by a tape inside."""
    def build_with_gradient() -> tuple[Callable[..., Any], Sequence[tf.Tensor]]:
        fn, args = build()

        def value_and_gradients(*inputs: tf.Tensor) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                loss = tf.reduce_sum(tf.sin(fn(*inputs)))
            return loss, tape.gradient(loss, inputs)

        return value_and_gradients, args
    return build_with_gradient


def diag_product_grad() -> tuple[Callable[..., Any], Sequence[tf.Tensor]]:
    saved = FLAGS.diag_n
    FLAGS.diag_n = FLAGS.diag_grad_n
    try:
        return with_gradient(diag_product)()
    finally:
        FLAGS.diag_n = saved


def sqdist() -> tuple[Callable[..., Any], list[tf.Tensor]]:
    module = None
    for name in ("benchmarks.sqdist_memory", "sqdist_memory"):  # as a module, or as a script
        try:
            module = importlib.import_module(name)
            break
        except ImportError:
            continue
    if module is None or not hasattr(module, "naive_loss_and_gradients"):
        raise CaseUnavailable("benchmarks/sqdist_memory.py with naive_loss_and_gradients is absent")
    n, d = FLAGS.sqdist_n, FLAGS.sqdist_d
    x = tf.random.stateless_normal([n, d], seed=[1, 2], dtype=tf.float32)  # [n, d]
    y = tf.random.stateless_normal([n, d], seed=[3, 4], dtype=tf.float32)  # [n, d]
    return module.naive_loss_and_gradients, [x, y]


CASES: list[Case] = [
    Case("chain_ab_v", "(A@B)@v, A [n,k], B [k,n], v [n,1] f64", chain_ab_v),
    Case("diag_product", "diag_part(Knm@Qinv@Kmn), Knm [N,M] f64", diag_product),
    Case("chain_ab_v_grad", "Σ sin((A@B)@v) and its gradient wrt A, B, v", with_gradient(chain_ab_v)),
    Case("diag_product_grad", "Σ sin(diag_part(Knm@Qinv@Kmn)) and its gradient, N=--diag_grad_n",
         diag_product_grad),
    Case("sqdist", "naive Σ_d (x[:,None]-y[None])² + tape gradient, x, y [n,d] f32", sqdist,
         ("cleanup", "match_and_replace", "reorder")),
]


def _median_seconds(fn: Callable[..., Any], args: Sequence[tf.Tensor], repeats: int) -> float:
    tf.nest.map_structure(lambda t: t.numpy(), fn(*args))  # warm: trace, compile, run once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn(*args))  # .numpy() waits for the result
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(case: Case, repeats: int) -> dict[str, Any]:
    fn, args = case.build()
    rewritten = tfmem.function(fn, config={"passes": list(case.stages), "strict": True})
    stock_xla = tf.function(fn, jit_compile=True)
    report = rewritten.explain(*args)  # also fills XLA's planned bytes of both
    row: dict[str, Any] = {
        "case": case.name, "what": case.description,
        "fired": ", ".join(sorted({r.rule for r in report.fired})) or "-",
        "est_before": report.memory_before.peak_bytes, "est_after": report.memory_after.peak_bytes,
        "xla_bytes_stock": report.xla_bytes_before, "xla_bytes_tfmem": report.xla_bytes_after,
    }
    row["tfmem_s"] = _median_seconds(rewritten, args, repeats)
    row["xla_s"] = _median_seconds(stock_xla, args, repeats)
    row["graph_s"] = _median_seconds(tf.function(fn), args, repeats) if FLAGS.graph_baseline else None
    errors = [np.max(np.abs(g.numpy() - w.numpy())) / max(np.max(np.abs(w.numpy())), 1e-300)
              for g, w in zip(tf.nest.flatten(rewritten(*args)), tf.nest.flatten(stock_xla(*args)))]
    row["max_rel_err"] = float(max(errors))
    return row


def _format_table(rows: list[dict[str, Any]]) -> str:
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f}"

    header = ["case", "tfmem ms", "stock XLA ms", "stock graph ms", "speedup vs XLA",
              "XLA bytes stock", "XLA bytes tfmem", "estimate before", "estimate after",
              "max rel err", "fired"]
    lines = [[r["case"], ms(r["tfmem_s"]), ms(r["xla_s"]), ms(r["graph_s"]),
              f"{r['xla_s'] / r['tfmem_s']:.1f}x", format_size(r["xla_bytes_stock"]),
              format_size(r["xla_bytes_tfmem"]), format_size(r["est_before"]),
              format_size(r["est_after"]), f"{r['max_rel_err']:.1e}", r["fired"]] for r in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines)]
    text = [" | ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in [header, *lines]]
    text.insert(1, "-+-".join("-" * w for w in widths))
    text += ["", *(f"{r['case']}: {r['what']}" for r in rows)]
    return "\n".join(text)


def main(argv: Sequence[str]) -> None:
    del argv
    for name in ("tfmem", "rewrites"):  # absl would print every rewrite at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    cases = CASES
    if FLAGS.cases:
        unknown = set(FLAGS.cases) - {c.name for c in cases}
        if unknown:
            raise app.UsageError(f"unknown cases {sorted(unknown)}; known: {[c.name for c in cases]}")
        cases = [c for c in cases if c.name in FLAGS.cases]
    print(f"TF {tf.__version__}, {os.cpu_count()} CPUs, median of {FLAGS.repeats} warm calls; "
          f"chain n={FLAGS.chain_n} k={FLAGS.chain_k}; diag N={FLAGS.diag_n} M={FLAGS.diag_m} "
          f"(with gradient N={FLAGS.diag_grad_n}); sqdist n={FLAGS.sqdist_n} d={FLAGS.sqdist_d}")
    rows = []
    for case in cases:
        try:
            rows.append(run_case(case, FLAGS.repeats))
        except CaseUnavailable as err:
            print(f"  skipped {case.name}: {err}", flush=True)
            continue
        print(f"  done: {case.name}", flush=True)
    print(_format_table(rows))


if __name__ == "__main__":
    app.run(main)
