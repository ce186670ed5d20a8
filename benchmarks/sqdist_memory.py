"""XLA's planned bytes for a naive squared distance with its gradient, stock vs tfmem.

The function computes Σ_d (x[:, None] − y[None])² the naive way and differentiates a
loss of it with a tape *inside* the function, so the backward [n, m, d] tensors are in
the same graph. Stock `tf.function(jit_compile=True)` materialises the [n, m, d]
difference in the backward pass; tfmem's ExpandSquaredDistance removes every such
tensor. Both are only compiled (XLA's buffer assignment is read), never run, so this
needs no memory beyond the compiler's.

Run:
    python benchmarks/sqdist_memory.py                       # n = m = 4000, d = 64, float32
    python benchmarks/sqdist_memory.py --n 1000 --d 16       # quicker
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

import tfmem  # noqa: E402
from tfmem.config import format_size  # noqa: E402


def naive_loss_and_gradients(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    with tf.GradientTape() as tape:
        tape.watch([x, y])
        d2 = tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1)  # [n, m]
        loss = tf.reduce_sum(tf.exp(-0.5 * d2))
    gx, gy = tape.gradient(loss, [x, y])
    return loss, gx, gy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--m", type=int, default=None, help="defaults to n")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--min-ratio", type=float, default=10.0)
    args = parser.parse_args()
    n, m, d = args.n, args.m or args.n, args.d
    x = tf.random.stateless_normal([n, d], seed=[1, 2], dtype=tf.float32)
    y = tf.random.stateless_normal([m, d], seed=[3, 4], dtype=tf.float32)

    start = time.perf_counter()
    wrapped = tfmem.function(naive_loss_and_gradients, config={"strict": True})
    report = wrapped.explain(x, y)  # compiles stock jit_compile=True and tfmem, runs neither
    seconds = time.perf_counter() - start
    before, after = report.xla_bytes_before, report.xla_bytes_after
    print(f"naive squared distance + tape gradient, n={n} m={m} d={d} float32")
    print(f"[n, m, d] tensor: {format_size(n * m * d * 4)}")
    print("rules:", "; ".join(str(r) for r in report.records if r.status in ("fired", "rejected")))
    print(f"XLA planned bytes, stock tf.function(jit_compile=True): {before} ({format_size(before or 0)})")
    print(f"XLA planned bytes, tfmem.function:                      {after} ({format_size(after or 0)})")
    if not before or not after:
        print("XLA planned bytes unavailable")
        return 1
    ratio = before / after
    print(f"ratio: {ratio:.1f}x (explain took {seconds:.1f} s)")
    return 0 if ratio >= args.min_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
