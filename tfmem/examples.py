"""Small example programs with the memory problems tfmem targets, and their inputs.

Used by the README and `tfmem explain tfmem.examples:kernel_matmul`. Each function
`f` has a factory `f_inputs()` returning its example arguments.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf


def kernel_matmul(x: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
    """exp(-½‖xᵢ − xⱼ‖²) @ v: the [n, n] kernel matrix exists only to be multiplied away."""
    sqdist = tf.reduce_sum(tf.square(x[:, None, :] - x[None, :, :]), axis=-1)  # [n, n]
    return tf.exp(-0.5 * sqdist) @ v  # [n, k]


def kernel_matmul_inputs(n: int = 2000, d: int = 3, k: int = 16) -> tuple[tf.Tensor, tf.Tensor]:
    rng = np.random.default_rng(0)
    return tf.constant(rng.normal(size=(n, d))), tf.constant(rng.normal(size=(n, k)))


def distance_with_gradient(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Σ of naive pairwise squared distances and its gradient w.r.t. x (a tape inside)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        total = tf.reduce_sum(tf.reduce_sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1))
    return total, tape.gradient(total, x)


def distance_with_gradient_inputs(n: int = 1000, d: int = 64) -> tuple[tf.Tensor, tf.Tensor]:
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(n, d)), tf.float32),
            tf.constant(rng.normal(size=(n, d)), tf.float32))


def allocate(megabytes: int) -> float:
    """Fills a float32 tensor of `megabytes` MiB and sums it: a known-size allocation."""
    ones = tf.ones([megabytes * 2**20 // 4], tf.float32)
    return float(tf.reduce_sum(tf.exp(ones * 0.0)))
