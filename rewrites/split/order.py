"""Order without control edges: a value XLA must compute after another.

XLA schedules by data alone: TensorFlow's control edges do not reach it, and its CPU
pipeline removes `XlaOptimizationBarrier`s before common-subexpression elimination. A
data dependency that changes no bit is what orders a copy after the peak it must not
precede (`rewrites.split.recompute`) and each row block of a product after the previous
block's update (`rewrites.split.loops`), and a reduction before what XLA ran it beside
(`rewrites.split.earlier`). The tie must be a value XLA cannot know before the program
runs (`can_order`): a constant it folds, and the order with it. The same unknown value
counts the trips of a loop XLA can neither remove nor fuse through (`once_in_a_loop`):
what must be written out before a reader that would otherwise fuse it (`held`,
`whole_input`). `tied_leaves` finds the leaves passed through ties again, for a rule that
must move a wait (`at_xla_peak`).

Example:
    >>> x, y = tf.constant([1.0, -0.0]), tf.constant([3.0])
    >>> [after] = computed_after(y, x)
    >>> after.numpy().tolist() == x.numpy().tolist()
    True
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from collections.abc import Callable, Collection, Sequence

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


def once_in_a_loop(tie: tf.Tensor, specs: Sequence[tf.TensorSpec],
                   compute: Callable[[Callable[[tf.Tensor], tf.Tensor]], Sequence[tf.Tensor]]) -> list[tf.Tensor]:
    """`compute`'s results, made in a `tf.while_loop` of one trip whose count XLA cannot
    know before the program runs: one trip, or two when `tie`'s first element (a float)
    is NaN; the body computes the same each trip. XLA neither removes such a loop nor
    fuses through it, so what `compute` makes is written out in it, and what it reads
    there dies there.

    `compute(through)` builds the results (of `specs`' dtypes and shapes); `through(t)` is
    `t` read through the trip counter, the same bits (a float `t - 0·[i < -2]`, an integer
    `t + [i < -2]`: the trips count from -1 or 0, which XLA cannot know), so that XLA
    cannot hoist what is made from it out of the loop. Pass the body's float inputs
    through it, and the offset of its band masks (`diagonals.bands_offset_by`).

    Example:
        >>> x = tf.constant([[1.0, 2.0]])
        >>> [y] = once_in_a_loop(x, [tf.TensorSpec([2], tf.float32)], lambda through: [tf.reduce_sum(through(x), 0)])
        >>> y.numpy().tolist()
        [1.0, 2.0]
    """
    first = tf.reshape(tie, [-1])[0]
    unknown = tf.math.not_equal(first, first)
    start = -tf.cast(unknown, tf.int32)
    # Made from `unknown`, so XLA makes them just before the loop, not at the start.
    first_values = [tf.fill(spec.shape, tf.cast(unknown, spec.dtype) * tf.zeros([], spec.dtype))
                    if spec.dtype.is_floating else tf.zeros(spec.shape, spec.dtype) for spec in specs]

    def body(i: tf.Tensor, *_: tf.Tensor) -> list[tf.Tensor]:
        def through(t: tf.Tensor) -> tf.Tensor:
            if t.dtype.is_integer:  # XLA folds an integer 0·x: add the (false) test itself
                return t + tf.cast(i < -2, t.dtype)
            return t - tf.cast(i < -2, t.dtype) * tf.zeros([], t.dtype)

        results = compute(through)
        return [i + 1, *(tf.reshape(r, spec.shape) for r, spec in zip(results, specs))]

    _, *results = tf.while_loop(lambda i, *_: i < 1, body, [start, *first_values])
    return results


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


@dataclasses.dataclass(frozen=True)
class TiedLeaf:
    """A leaf `computed_after` passed through a tie: `node` makes `leaf`'s bits after `tie`.

    Attributes:
        node: the `Sub` that passes the leaf (what the copy reads).
        leaf: the tensor passed.
        tie: the tensor it waits for.
        first: the `Reshape` to one axis whose first element is tested, when the tie is
            read that way (None: the tie is the scalar tested, such as a loop's result).
    """

    node: str
    leaf: TensorRef
    tie: TensorRef
    first: str | None


def tied_leaves(graph: Graph) -> list[TiedLeaf]:
    """Every leaf of the graph passed through a tie by `computed_after`, found by its shape
    (`leaf - cast(first ≠ first)·0`, `first` the tie's first element), in graph order.

    Example:
        >>> with tf.Graph().as_default() as g:
        ...     x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        ...     y = tf.compat.v1.placeholder(tf.float32, [2, 2], name="y")
        ...     z = tf.identity(computed_after(y, x)[0], name="z")
        >>> graph = Graph(g.as_graph_def(add_shapes=True), outputs=["z"])
        >>> [(t.leaf.node, t.tie.node) for t in tied_leaves(graph)]
        [('x', 'y')]
    """
    found = []
    for node in graph.nodes:
        if node.op != "Sub":
            continue
        leaf, zero = graph.inputs(node.name)
        scaled = graph.node(zero.node)
        if scaled.op != "Mul":
            continue
        factors = graph.inputs(scaled.name)
        cast = next((graph.node(ref.node) for ref in factors if graph.node(ref.node).op == "Cast"), None)
        # Only a zero times the test passes the leaf's bits: anything else is the program's own.
        if cast is None or not any((value := graph.constant_value(ref)) is not None and not np.any(value)
                                   for ref in factors):
            continue
        unknown = graph.node(graph.inputs(cast.name)[0].node)
        tested = {ref for ref in graph.inputs(unknown.name)}
        if unknown.op != "NotEqual" or len(tested) != 1:
            continue
        [tie] = tested
        first = graph.node(tie.node)
        flat = graph.node(graph.inputs(first.name)[0].node) if first.op == "StridedSlice" else None
        if flat is not None and flat.op == "Reshape":
            found.append(TiedLeaf(node.name, leaf, graph.inputs(flat.name)[0], flat.name))
        else:
            found.append(TiedLeaf(node.name, leaf, tie, None))
    return found

