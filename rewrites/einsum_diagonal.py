"""A one-operand einsum that is a diagonal or a trace, as `diag_part` / `trace`.

    einsum("ii->i", k)            →   diag_part(k)
    einsum("bii->bi", k)          →   diag_part(k)          (leading batch letters, or "...")
    einsum("ii->", k)             →   trace(k)

Spelled with einsum, the diagonal of a kernel matrix is an op the diagonal rules
(`DiagOfElementwise`, `ContractDiagOfProduct`, which run next) do not know, and the
whole [n, n] matrix is formed for it; spelled as `diag_part` it is not (n = 2000: an
`einsum("ii->i")` of an elementwise kernel planned 62.0 MiB, `diag_part` 1.9 MiB). A
diagonal is the same values either way; a trace sums them, as `tf.linalg.trace` does.

Conditions (rejections carry these reasons):
    * one operand, an explicit output;
    * the operand's last two letters are one letter repeated, its others (the batch
      letters, or a leading "...") are all different and stay in order in the output;
    * the output is the batch letters and the repeated letter (a diagonal), or the batch
      letters alone (a trace).

Example:
    >>> f = tfmem.TfmemFunction(lambda k: tf.einsum("ii->i", k), passes=[EinsumAsDiagonal()])
    >>> tfmem.Graph(f.report(k).rewritten_graph_def).op_counts().get("Einsum", 0)
    0
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Literal

import tensorflow as tf

from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Emitted, RegionRule

Reading = Literal["diag_part", "trace"]


def diagonal_of(equation: str) -> Reading | str:
    """What a one-operand einsum equation reads of its operand's last two dimensions, or why
    it is neither a diagonal nor a trace.

    Example:
        >>> diagonal_of("bii->bi"), diagonal_of("...ii->..."), diagonal_of("iij->ij")
        ('diag_part', 'trace', "the last two letters of 'iij' are not one letter repeated")
    """
    equation = equation.replace(" ", "")
    if "->" not in equation or "," in equation.split("->")[0]:
        return f"equation {equation!r} has more than one operand or no explicit output"
    letters, output = equation.split("->")
    if letters.startswith("...") and output.startswith("..."):
        letters, output = letters[3:], output[3:]
    if "." in letters + output:
        return f"equation {equation!r} has an ellipsis that is not leading in both operand and output"
    if len(letters) < 2 or letters[-1] != letters[-2]:
        return f"the last two letters of {letters!r} are not one letter repeated"
    batch, repeated = letters[:-2], letters[-1]
    if len(set(batch)) != len(batch) or repeated in batch:
        return f"the batch letters of {letters!r} repeat"
    if output == batch + repeated:
        return "diag_part"
    if output == batch:
        return "trace"
    return f"output {output!r} is not {batch + repeated!r} (a diagonal) or {batch!r} (a trace)"


@dataclasses.dataclass
class EinsumDiagonal:
    node: str

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.node,)


class EinsumAsDiagonal(RegionRule[EinsumDiagonal]):
    """Writes a one-operand einsum that is a diagonal or a trace as one.

    Example:
        >>> f = tfmem.TfmemFunction(lambda k: tf.einsum("ii->", k), passes=[EinsumAsDiagonal()])
        >>> [r.details["reading"] for r in f.report(k).fired]
        ['trace']
    """

    name = "einsum_as_diagonal"
    rule = "EinsumAsDiagonal"
    stage = "match_and_replace"
    reads = frozenset()  # no config key: the graph alone decides

    def find(self, graph: Graph) -> Iterator[EinsumDiagonal]:
        for node in list(graph.find("Einsum")):
            if node.name in graph and len(graph.inputs(node.name)) == 1:
                yield EinsumDiagonal(node.name)

    def check(self, graph: Graph, region: EinsumDiagonal, config: Config) -> str | None:
        reading = diagonal_of(graph.node(region.node).attr["equation"].s.decode())
        if reading not in ("diag_part", "trace"):
            return reading
        shape = graph.spec(graph.inputs(region.node)[0]).shape
        if shape.rank is None or shape.rank < 2:
            return f"the operand is {shape}, not a matrix of static rank"
        return None

    def emit(self, graph: Graph, region: EinsumDiagonal) -> Emitted | str:
        equation = graph.node(region.node).attr["equation"].s.decode()
        reading = diagonal_of(equation)
        read = tf.linalg.diag_part if reading == "diag_part" else tf.linalg.trace
        (result,) = graph.splice(read, graph.inputs(region.node), scope=self.name)
        if graph.spec(result).shape != graph.spec(TensorRef(region.node)).shape:
            graph.prune()
            return f"the {reading} has shape {graph.spec(result).shape}, not the einsum's"
        graph.replace_all_uses(TensorRef(region.node), result)
        return Emitted({"equation": equation, "reading": reading})


__all__ = ["EinsumAsDiagonal", "EinsumDiagonal", "diagonal_of"]
