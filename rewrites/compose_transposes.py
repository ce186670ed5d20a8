"""Compose two consecutive transposes into one.

    Transpose(Transpose(x, p), q)   →   Transpose(x, p[q])        (x itself when p[q] = identity)

(`perm[i]` names the input axis that becomes output axis i, so the outer transpose's
axis i is the inner's axis q[i], which is x's axis p[q[i]].) Stacked transposes come
from user code and from gradients (a transpose's backward is a transpose); Grappler's
arithmetic pass removes only a pair that cancels out. Without XLA every `Transpose` is
a copy, so the pair holds one copy of x more than needed; XLA merges the pair itself,
so under `jit_compile` this only simplifies the graph and its memory estimate.

Conditions: both permutations are constants (else no match); the inner transpose is
read only by the outer one (else it is materialised anyway: rejected, with the reader).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfmem.pattern import OpBuilder, PatternNode, RewriteRule


def transpose_pair(op: OpBuilder, x: PatternNode) -> PatternNode:
    return op.Transpose(op.Transpose(x, op.const(name="inner")), op.const(name="outer"))


def composed_transpose(x: tf.Tensor, inner: np.ndarray, outer: np.ndarray) -> tf.Tensor:
    perm = inner[outer]
    if np.array_equal(perm, np.arange(perm.size)):
        return tf.identity(x)  # a node of its own: the pair's result may be a graph output
    return tf.transpose(x, perm)


class ComposeTransposes(RewriteRule):
    """`Transpose(Transpose(x, p), q) → Transpose(x, p[q])`.

    Example:
        >>> f = tfmem.TfmemFunction(lambda x: tf.transpose(tf.transpose(x, [1, 0, 2]), [0, 2, 1]),
        ...                         passes=[ComposeTransposes()])
        >>> [str(r) for r in f.report(x).records]
        ['[ComposeTransposes] ComposeTransposes fired at transpose_1']
    """

    reads = frozenset()  # no config key: the graph alone decides

    def __init__(self) -> None:
        super().__init__("ComposeTransposes", transpose_pair, replacement=composed_transpose)


__all__ = ["ComposeTransposes"]
