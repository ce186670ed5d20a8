"""Compose two stacked band parts into one.

    MatrixBandPart(MatrixBandPart(x, a, b), c, d)
        →  the inner band part itself                    when the band (c, d) keeps all of (a, b)
        →  MatrixBandPart(x, min(a, c), min(b, d))        otherwise            (a negative band: all of it)

A band part keeps entry (i, j) when `i - j ≤ lower` and `j - i ≤ upper`; two of them in a
row keep what both keep, the band of the smaller bounds. The stack comes from triangular
parameters masked again: TFP's `fill_triangular` (GPflow's `FillTriangular` transform of
`q_sqrt`) ends in `band_part(·, -1, 0)`, and GPflow's VGP and `gauss_kl` apply
`band_part(q_sqrt, -1, 0)` to it; a band part's gradient is the same band part of the
gradient, so the backward has the same stack. Without XLA each band part is a whole
copy of the matrix. XLA fuses a band part into its readers, so under `jit_compile` this
only simplifies the graph (GPflow's VGP at N=2,000: XLA plans the same with it).

Conditions: the four bands are constants (else no match). When the outer band keeps all
of the inner one the outer is dropped whoever else reads the inner; otherwise the inner
must be read only by the outer (else it is materialised anyway: rejected, with the reader).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfmem.graph import Graph
from tfmem.pattern import Match, OpBuilder, PatternNode, RewriteRule


def band_part_pair(op: OpBuilder, x: PatternNode) -> PatternNode:
    inner = op.MatrixBandPart(x, op.const(name="inner_lower"), op.const(name="inner_upper")).named("inner")
    return op.MatrixBandPart(inner, op.const(name="outer_lower"), op.const(name="outer_upper"))


def _band(value: np.ndarray) -> float:
    """A band bound as a number: a negative bound keeps every diagonal on its side."""
    return float("inf") if int(value) < 0 else float(int(value))


def _keeps_inner(match_values: dict[str, np.ndarray]) -> bool:
    """Whether the outer band keeps every entry the inner band keeps."""
    return (_band(match_values["outer_lower"]) >= _band(match_values["inner_lower"])
            and _band(match_values["outer_upper"]) >= _band(match_values["inner_upper"]))


def composed_band_part(x: tf.Tensor, inner: tf.Tensor, inner_lower: np.ndarray, inner_upper: np.ndarray,
                       outer_lower: np.ndarray, outer_upper: np.ndarray) -> tf.Tensor:
    bands = {"inner_lower": inner_lower, "inner_upper": inner_upper,
             "outer_lower": outer_lower, "outer_upper": outer_upper}
    if _keeps_inner(bands):
        return tf.identity(inner)  # a node of its own: the pair's result may be a graph output
    lower = min(_band(inner_lower), _band(outer_lower))
    upper = min(_band(inner_upper), _band(outer_upper))
    as_bound = lambda band: -1 if band == float("inf") else int(band)  # noqa: E731
    return tf.linalg.band_part(x, tf.constant(as_bound(lower), inner_lower.dtype),
                               tf.constant(as_bound(upper), inner_upper.dtype))


class ComposeBandParts(RewriteRule):
    """`band_part(band_part(x, a, b), c, d)` → one band part (or the inner one alone).

    Example:
        >>> f = tfmem.TfmemFunction(lambda x: tf.linalg.band_part(tf.linalg.band_part(x, -1, 0), -1, 0),
        ...                         passes=[ComposeBandParts()])
        >>> [str(r) for r in f.report(x).records]
        ['[ComposeBandParts] ComposeBandParts fired at MatrixBandPart_1']
    """

    reads = frozenset()  # no config key: the graph alone decides

    def __init__(self) -> None:
        super().__init__("ComposeBandParts", band_part_pair, replacement=composed_band_part)

    def self_contained(self, graph: Graph, match: Match) -> str | None:
        # An outer band part that keeps all of the inner one is dropped, not rebuilt: the
        # inner's other readers cost nothing more.
        bands = {name: graph.constant_value(match[name]) for name in match.value_captures}
        return None if _keeps_inner(bands) else super().self_contained(graph, match)


__all__ = ["ComposeBandParts"]
