"""Helpers for testing rewrites: seeded inputs and dtype-aware closeness.

Example:
    >>> from tfmem.testing import assert_close, random_inputs
    >>> a, b = random_inputs(np.random.default_rng(0), [[4, 3], [3, 2]], tf.float64)
    >>> assert_close(tfmem.function(tf.matmul)(a, b), a @ b, tf.float64)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf


def random_inputs(rng: np.random.Generator, shapes: Sequence[Sequence[int]], dtype: tf.DType) -> list[tf.Tensor]:
    """One standard-normal tensor per shape."""
    return [tf.constant(rng.normal(size=s), dtype) for s in shapes]


def assert_close(got: Any, want: Any, dtype: tf.DType) -> None:
    """Equal structures of tensors, within 1e-4 (float32) or 1e-10 (float64) relative.

    A rewrite reorders float arithmetic, so results agree up to rounding; the absolute
    tolerance scales with the largest value, so entries near zero do not dominate.
    """
    rtol = 1e-4 if dtype == tf.float32 else 1e-10
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * max(1.0, np.abs(w).max()))
