"""Pass-pipeline overhead on GPflow's SGPR loss-and-gradient graph, with no rewrites enabled.

Measures, in one process and against fresh functions each repeat:
- the pipeline's own time (capture, memory estimates, passes, building the import);
- first-call time of `tf.function(jit_compile=True)` (trace + XLA compile + run), and
  of `tfmem.function` on the same step (trace + pipeline + import + compile + run).

The overhead is their difference; targets: < 0.5 s and < 10% of stock's first call.

    python -m benchmarks.pipeline_overhead [--n=2000 --m=100 --repeats=3 --passes=]
"""
from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from absl import app, flags

import tfmem
from benchmarks.cases import sgpr_loss_and_gradients

FLAGS = flags.FLAGS
flags.DEFINE_integer("n", 2000, "Training points.")
flags.DEFINE_integer("m", 100, "Inducing points.")
flags.DEFINE_integer("repeats", 3, "Fresh functions to time (the median is reported).")
flags.DEFINE_list("passes", [], "Pipeline stages to enable (default none: pure overhead).")
flags.DEFINE_string("json", None, "Write the measurements here.")


def main(argv: list[str]) -> None:
    del argv
    config = tfmem.Config(passes=FLAGS.passes)
    rows = []
    for _ in range(FLAGS.repeats):
        stock = tf.function(sgpr_loss_and_gradients(FLAGS.n, FLAGS.m), jit_compile=True)
        start = time.perf_counter()
        stock_loss = stock()[0]
        stock_first = time.perf_counter() - start

        wrapped = tfmem.function(sgpr_loss_and_gradients(FLAGS.n, FLAGS.m), config=config)
        start = time.perf_counter()
        tfmem_loss = wrapped()[0]
        tfmem_first = time.perf_counter() - start
        report = wrapped.report()
        np.testing.assert_allclose(tfmem_loss.numpy(), stock_loss.numpy(), rtol=1e-8)
        rows.append({"nodes": report.nodes_before, "pipeline_s": report.pipeline_seconds,
                     "stock_first_call_s": stock_first, "tfmem_first_call_s": tfmem_first,
                     "overhead_s": tfmem_first - stock_first})
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    print(f"SGPR loss+gradients, N={FLAGS.n}, M={FLAGS.m}, passes={FLAGS.passes or 'none'}: "
          f"{int(median['nodes'])} nodes; median of {FLAGS.repeats} fresh functions")
    print(f"  pipeline (capture, estimates, passes, import build): {median['pipeline_s']:.3f} s")
    print(f"  first call, tf.function(jit_compile=True):          {median['stock_first_call_s']:.3f} s")
    print(f"  first call, tfmem.function:                        {median['tfmem_first_call_s']:.3f} s")
    print(f"  overhead: {median['overhead_s']:.3f} s = "
          f"{100 * median['overhead_s'] / median['stock_first_call_s']:.1f}% of stock's first call "
          f"(pipeline alone: {100 * median['pipeline_s'] / median['stock_first_call_s']:.1f}%)")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"runs": rows, "median": median}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
