"""When does XLA fuse a naive forward squared distance? The data behind a rule's cut-off.

`ExpandSquaredDistance` keeps `exp(-½ Σ_d (x[:, None] − y[None])²)` naive under
`jit_compile` when no gradient reads the difference and d ≤ `KEEP_NAIVE_UP_TO_D`.
This script measures why: for each d it jit-compiles the naive and the expanded
(‖x‖² + ‖y‖² − 2·x·yᵀ) kernel matrix, reads XLA's planned bytes for both, and times
them interleaved in this process. Where the naive form's planned bytes equal the
expansion's, XLA fused the [n, m, d] difference away; the time ratio then says which
form is faster.

Run:
    python benchmarks/sqdist_fusion.py                         # n = 3000, d = 1…64, float64
    python benchmarks/sqdist_fusion.py --n 8000 --d 2,3,4,6,40
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.cases import kernel_matrix as naive  # noqa: E402
from rewrites.squared_distance import KEEP_NAIVE_UP_TO_D  # noqa: E402
from tfmem.config import format_size  # noqa: E402
from tfmem.memory import xla_planned_bytes  # noqa: E402


def expanded(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    d2 = (tf.reduce_sum(x * x, -1)[:, None] + tf.reduce_sum(y * y, -1)[None]
          - 2.0 * tf.matmul(x, y, transpose_b=True))
    return tf.exp(-0.5 * tf.maximum(d2, 0.0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="rows of x and of y")
    parser.add_argument("--d", default="1,2,3,4,6,8,16,32,64", help="feature counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="timed calls of each form")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"n = m = {args.n}, float64; the rule keeps the naive form for d ≤ {KEEP_NAIVE_UP_TO_D}")
    print(f"{'d':>4}  {'expanded/naive time':>20}  {'naive planned':>14}  {'expanded planned':>16}")
    for d in (int(v) for v in args.d.split(",")):
        x, y = (tf.constant(rng.normal(size=(args.n, d))) for _ in range(2))
        forms = {"naive": tf.function(naive, jit_compile=True),
                 "expanded": tf.function(expanded, jit_compile=True)}
        planned = {name: xla_planned_bytes(f, x, y) for name, f in forms.items()}
        times: dict[str, list[float]] = {name: [] for name in forms}
        for f in forms.values():
            f(x, y).numpy()  # compile
        for _ in range(args.rounds):  # interleaved, so both see the same machine load
            for name, f in forms.items():
                start = time.perf_counter()
                f(x, y).numpy()
                times[name].append(time.perf_counter() - start)
        ratio = statistics.median(times["expanded"]) / statistics.median(times["naive"])
        print(f"{d:>4}  {ratio:>20.2f}  {format_size(planned['naive']):>14}  "
              f"{format_size(planned['expanded']):>16}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
