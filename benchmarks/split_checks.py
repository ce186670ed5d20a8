"""The splitting pass's acceptance checks, each trial in its own memory-limited process.

    python -m benchmarks.split_checks [--only=kernel,kernel_grad,knn,sgpr,sgpr_equal] [--json=out.json]

For each check, stock `tf.function` and `tf.function(jit_compile=True)` run under a
real limit (TensorFlow's BFC allocator), then tfmem under the same limit; tfmem's
result is compared with a reference computed by stock XLA *without* a limit in its own
process (float64 relative error, or identical indices for kNN).

    kernel       exp(-½ sqdist(X, X)) @ V, X: 20000×3, V: 20000×16, float64, 512 MiB, threshold 64MB
    kernel_grad  the same, with an outer tape taking d/dX of Σ(K V)² (equality at n=5000)
    knn          20000×8 queries, 200000×8 data, k=10, float32, 512 MiB, threshold 64MB
    sgpr         GPflow SGPR loss+gradients, N=100000, 1 GiB: stock XLA at M=300, tfmem at M=2800
    sgpr_equal   SGPR at N=100000, M=200 (fits both): tfmem vs stock XLA, relative error
"""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
from absl import app, flags

from tfmem import run_isolated
from tfmem.config import format_size

FLAGS = flags.FLAGS
flags.DEFINE_list("only", [], "Checks to run (default: all).")
flags.DEFINE_string("json", None, "Write the results here.")
flags.DEFINE_integer("timeout", 1800, "Seconds per trial.")

# name → case, size (tfmem; stock_size for stock if different), limit MiB (None: no limit),
# tfmem threshold, run_trial options, and whether to check tfmem against an unlimited stock run.
CHECKS: dict[str, dict[str, Any]] = {
    "kernel": dict(case="kernel_matmul", size=20000, limit=512, threshold="64MB", options={}),
    # Stock's own backward holds three [n, n, 3] tensors (27 GiB at n=20000): no reference
    # fits this machine, so equality is checked at n=5000 (kernel_grad_equal).
    "kernel_grad": dict(case="kernel_matmul", size=20000, limit=512, threshold="64MB",
                        options={"outer_gradient": True}, reference=False),
    "kernel_grad_equal": dict(case="kernel_matmul", size=5000, limit=None, threshold="64MB",
                              options={"outer_gradient": True}),
    "knn": dict(case="knn_f32", size=200000, limit=512, threshold="64MB", options={}),
    "sgpr": dict(case="sgpr", size=2800, stock_size=300, limit=1024, threshold="32MB", options={},
                 reference=False),
    "sgpr_equal": dict(case="sgpr", size=200, limit=None, threshold="32MB", options={}),
}


def _trial(case: str, method: str, size: int, limit: int | None, threshold: str | None,
           options: dict[str, Any], keep_value: bool) -> Any:
    return run_isolated("benchmarks.cases:run_trial", case, method, size, threshold=threshold,
                        repeats=1, planned=False, keep_value=keep_value, memory_limit_mb=limit,
                        timeout=FLAGS.timeout, **options)


def _compare(got: Any, want: Any) -> str:
    import tensorflow as tf

    got_leaves, want_leaves = tf.nest.flatten(got), tf.nest.flatten(want)
    if all(np.asarray(w).dtype.kind in "iu" for w in want_leaves):
        same = all(np.array_equal(g, w) for g, w in zip(got_leaves, want_leaves))
        return "identical" if same else "DIFFERENT"
    error = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)))
                      / max(float(np.max(np.abs(np.asarray(w, np.float64)))), 1e-300))
                for g, w in zip(got_leaves, want_leaves))
    return f"rel err {error:.1e}"


def main(argv: list[str]) -> None:
    del argv
    rows = []
    for name, check in CHECKS.items():
        if FLAGS.only and name not in FLAGS.only:
            continue
        row: dict[str, Any] = {"check": name, "limit_mib": check["limit"]}
        stock_size = check.get("stock_size", check["size"])
        for method in ("tf", "xla"):
            if check["limit"] is None and method == "tf":
                continue
            start = time.perf_counter()
            result = _trial(check["case"], method, stock_size, check["limit"], None, check["options"],
                            keep_value=check["limit"] is None)
            row[method] = {"size": stock_size, "status": result.status, "peak": result.peak_bytes,
                           "seconds": time.perf_counter() - start, "error": (result.error or "")[:160]}
            if check["limit"] is None:
                reference = result.value["value"] if result.ok else None
                row["xla"]["step_s"] = result.value and result.value["first_call_s"]
        start = time.perf_counter()
        result = _trial(check["case"], "tfmem", check["size"], check["limit"], check["threshold"],
                        check["options"], keep_value=True)
        row["tfmem"] = {"size": check["size"], "status": result.status, "peak": result.peak_bytes,
                        "seconds": time.perf_counter() - start, "error": (result.error or "")[:160]}
        if result.ok:
            row["tfmem"]["first_call_s"] = result.value["first_call_s"]
            if check["limit"] is not None and check.get("reference", True):
                ref = _trial(check["case"], "xla", check["size"], None, None, check["options"], keep_value=True)
                reference = ref.value["value"] if ref.ok else None
                if not ref.ok:
                    row["equal"] = f"no reference: stock XLA without a limit gave {ref.status}"
            if check.get("reference", True) and reference is not None:
                row["equal"] = _compare(result.value["value"], reference)
        rows.append(row)
        print(_line(row), flush=True)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=2, default=str)


def _line(row: dict[str, Any]) -> str:
    parts = [f"{row['check']:12s} limit={row['limit_mib']} MiB"]
    for method in ("tf", "xla", "tfmem"):
        if method in row:
            r = row[method]
            parts.append(f"{method}@{r['size']}: {r['status']} (peak {format_size(r['peak'])}, "
                         f"{r['seconds']:.0f} s)")
    if "equal" in row:
        parts.append(row["equal"])
    return " | ".join(parts)


if __name__ == "__main__":
    app.run(main)
