"""Order without control edges: a value XLA must compute after another.

XLA schedules by data alone: TensorFlow's control edges do not reach it, and its CPU
pipeline removes `XlaOptimizationBarrier`s before common-subexpression elimination. A
data dependency that changes no bit is what orders a copy after the peak it must not
precede (`rewrites.split.recompute`) and each row block of a product after the previous
block's update (`rewrites.split.loops`), and a reduction before what XLA ran it beside
(`rewrites.split.earlier`). The tie must be a value XLA cannot know before the program
runs (`can_order`): a constant it folds, and the order with it.

Example:
    >>> x, y = tf.constant([1.0, -0.0]), tf.constant([3.0])
    >>> [after] = computed_after(y, x)
    >>> after.numpy().tolist() == x.numpy().tolist()
    True
"""
from __future__ import annotations

import tensorflow as tf

from collections.abc import Collection

from tfmem.graph import Graph, TensorRef
from tfmem.memory import ARG_OPS, RESIDENT_OPS


def computed_after(tie: tf.Tensor, *leaves: tf.Tensor) -> list[tf.Tensor]:
    """`leaves`, bit for bit, as values computed from `tie`.

    `leaf - zero`, where `zero` is `0.0 × (tie₀ ≠ tie₀)`: 0 × 0 or 0 × 1, so +0.0
    whatever `tie₀` holds (NaN included), and `x - (+0.0)` is `x` for every float (−0.0
    too). XLA cannot fold it (the comparison is false only for numbers it does not know),
    so what reads the result can neither run before `tie` nor be merged with what reads
    the leaf itself. Non-float leaves pass unchanged.
    """
    first = tf.reshape(tie, [-1])[0]
    unknown = tf.math.not_equal(first, first)
    passed = []
    for leaf in leaves:
        if leaf.dtype.is_floating:
            passed.append(leaf - tf.cast(unknown, leaf.dtype) * tf.constant(0.0, leaf.dtype))
        else:
            passed.append(leaf)
    return passed


def made_from_inputs(graph: Graph) -> set[str]:
    """The nodes made from what the program is given (or from a stateful op): the rest are
    constants to XLA."""
    return graph.descendants(*(node.name for node in graph.nodes
                               if node.op in ARG_OPS or graph.is_stateful(node.name)))


def can_order(graph: Graph, ref: TensorRef, varying: set[str]) -> bool:
    """Whether `ref` is a floating-point tensor with elements, made by an op (not held)
    from something the program is given (`varying`, from `made_from_inputs`): one XLA
    cannot compute before it runs, so a tie for `computed_after`."""
    spec = graph.spec(ref)
    return (spec.dtype.is_floating and (spec.shape.num_elements() or 0) > 0
            and graph.node(ref.node).op not in RESIDENT_OPS and ref.node in varying)


def input_to_tie(graph: Graph, name: str, prefer_made_by: Collection[str] = ()) -> int | None:
    """The floating-point input of `name` to read through a tie (`computed_after`): one
    an op in `prefer_made_by` makes, if any, then the smallest (the exact zero is then
    subtracted from the fewest elements); None when `name` reads no float.

    `rewrites.split.held` prefers cheap producers: XLA fuses the zero into a cheap op
    rather than copying a whole matrix to subtract it.
    """
    slots = [(graph.node(ref.node).op not in prefer_made_by, graph.nbytes(ref) or 0, slot)
             for slot, ref in enumerate(graph.inputs(name)) if graph.spec(ref).dtype.is_floating]
    return min(slots)[2] if slots else None
