"""tfmem computes what stock XLA computes on GP programs nobody here wrote for it.

The programs (`tests/unseen_programs.py`) come from a fuzzing round, written the way a GP
researcher writes them. Each runs at its small size under a budget of a quarter of what
stock XLA plans for it, which forces splits, recomputation and the XLA-checked rewrites,
and its every output must equal stock XLA's within the program's rtol (of its largest
entry: an output that is zero in exact arithmetic compares rounding noise otherwise).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tests.unseen_programs import PROGRAMS

# The programs this suite runs: each takes under 7 s here. The others (TFP's
# MultivariateNormalTriL, the LinearOperators, eigh, lstsq, the float32 adjoint solve, the
# odd diagonals, the upper-triangular solves) equal stock XLA too, but take 8–30 s each under
# so tight a budget, mostly in the splitter's search (64 loops tried for `tfp_mvn_tril`) and
# XLA's compiles: run them with `TFMEM_ALL_UNSEEN=1`.
SUITE = ("batched_chol_logdet", "chol_sample_grad", "gp_nll_chol_solve", "hutchinson", "inverse_trace_grad",
         "jacobi_f32", "k_reused", "laplace_newton", "pcg_grad", "power_iter_grad", "qr_kernel")
CHOSEN = sorted(PROGRAMS) if os.environ.get("TFMEM_ALL_UNSEEN") else SUITE


@pytest.mark.parametrize("name", CHOSEN)
def test_tfmem_under_a_tight_budget_equals_stock_xla(name: str) -> None:
    build, small, _, _, rtol = PROGRAMS[name]
    fn, args = build(small)
    stock = tf.function(fn, jit_compile=True)
    planned = tfmem.xla_planned_bytes(stock, *args)
    assert planned, "stock XLA planned nothing"
    wrapped = tfmem.function(fn, config=tfmem.Config(memory_budget=planned // 4))
    got = tf.nest.flatten(wrapped(*args))
    want = tf.nest.flatten(stock(*args))
    assert len(got) == len(want)
    largest = max(float(np.max(np.abs(w.numpy()))) for w in want)
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = g.numpy(), w.numpy()
        assert g.shape == w.shape, (i, g.shape, w.shape)
        # Relative to the output's own scale, and never below rounding of the largest output.
        scale = max(float(np.max(np.abs(w))), np.finfo(w.dtype).eps * largest * 1e3)
        error = float(np.max(np.abs(g - w))) / scale if w.size else 0.0
        assert error <= rtol, f"{name} output {i}: relative error {error:.3g} over {rtol:g}"
