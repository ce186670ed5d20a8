"""Self-containment: is a rewrite's region read from outside it?

A rewrite removes the tensors inside its region and keeps only their replacement. If
anything outside the region still reads one of them — a node, a control edge, the
function's outputs, a node that must be kept — that tensor stays alive anyway, and the
rewrite saves no memory (or, for a control edge, would lose an ordering). Every rule
asks this the same way: `outside_readers` lists the offending readers, and
`self_containment_reason` words the first of them as a rejection reason.

One exception is allowed where a rule can honour it: a `Const` that waits on an inner
node by a control edge only (TF's gradients put such edges in) reads no data; the rule
may drop that edge (`OutsideReader.waiting_constant`) instead of rejecting.

Example:
    >>> import tensorflow as tf
    >>> from tfmem.capture import capture
    >>> def f(x):
    ...     s = tf.square(x)
    ...     return tf.reduce_sum(s) + tf.reduce_sum(tf.exp(s))
    >>> graph = capture(tf.function(f).get_concrete_function(tf.TensorSpec([3]))).to_graph()
    >>> readers = outside_readers(graph, [TensorRef("Square")], {"Sum"})
    >>> [(str(r.tensor), r.reader) for r in readers]
    [('Square:0', 'Exp')]
    >>> self_containment_reason(graph, readers)
    'not self-contained: Square:0 is also read by Exp'
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

from tfmem.graph import Graph, TensorRef

GRAPH_OUTPUT = "<graph output>"
KEPT = "<kept>"


class OutsideReader(NamedTuple):
    """Something outside a region that needs one of its tensors.

    Attributes:
        tensor: the inner tensor (the first output of its node that is needed).
        reader: the reading node's name, or `GRAPH_OUTPUT` / `KEPT`.
        control_only: the reader waits on the tensor's node by a control edge, reading no data.
        waiting_constant: the reader is a `Const` waiting by a control edge only; a rule
            may detach it instead of rejecting.
    """

    tensor: TensorRef
    reader: str
    control_only: bool = False
    waiting_constant: bool = False


def outside_readers(graph: Graph, inner_tensors: Iterable[TensorRef],
                    inside_nodes: Collection[str]) -> list[OutsideReader]:
    """Who outside `inside_nodes` needs the nodes of `inner_tensors`, in a stable order.

    A tensor's node stays alive if any of its outputs is a graph output, if it must be
    kept, or if any node not in `inside_nodes` reads any of its outputs or waits on it
    by a control edge: each such case is one `OutsideReader` (one per reading node).

    Example:
        >>> import tensorflow as tf
        >>> from tfmem.capture import capture
        >>> def f(a, b):
        ...     ab = a @ b
        ...     return tf.linalg.diag_part(ab), tf.reduce_max(ab)
        >>> spec = tf.TensorSpec([3, 3])
        >>> graph = capture(tf.function(f).get_concrete_function(spec, spec)).to_graph()
        >>> outside_readers(graph, [TensorRef("matmul")], {"diag_part"})
        [OutsideReader(tensor=TensorRef(node='matmul', index=0), reader='Max', ...)]
    """
    found: list[OutsideReader] = []
    for tensor in inner_tensors:
        name = tensor.node
        for output in graph.outputs:
            if output.node == name:
                found.append(OutsideReader(output, GRAPH_OUTPUT))
        if name in graph.keep:
            found.append(OutsideReader(tensor, KEPT))
        data_readers = {consumer for index in range(len(graph.output_specs(name)))
                        for consumer, _ in graph.consumers(TensorRef(name, index))}
        for consumer in graph.node_consumers(name):
            if consumer in inside_nodes:
                continue
            control_only = consumer not in data_readers
            found.append(OutsideReader(tensor, consumer, control_only,
                                       control_only and graph.node(consumer).op == "Const"))
    return found


def describe_reader(graph: Graph, reader: OutsideReader) -> str:
    """`"Max"`, `"truediv_3 (RealDiv)"`, `"NoOp (control edge)"` or `GRAPH_OUTPUT` / `KEPT`."""
    if reader.reader in (GRAPH_OUTPUT, KEPT):
        return reader.reader
    if reader.control_only:
        return f"{reader.reader} (control edge)"
    op = graph.node(reader.reader).op
    return reader.reader if op == reader.reader else f"{reader.reader} ({op})"


def self_containment_reason(graph: Graph, readers: Sequence[OutsideReader], *,
                            subject: str = "not self-contained: {tensor}", consequence: str = "",
                            allow_waiting_constants: bool = False) -> str | None:
    """Why a region whose `readers` (from `outside_readers`) are these is not self-contained.

    Args:
        graph: the graph.
        readers: the region's outside readers.
        subject: how to name the offending tensor; `{tensor}` and `{node}` are filled in.
        consequence: appended after a colon (e.g. "it is materialised anyway").
        allow_waiting_constants: `Const`s waiting by a control edge do not count (the
            rule detaches them).

    Returns:
        None when nothing counts; otherwise about the first offending tensor: that it is
        a graph output, that it must be kept, or which nodes (up to three) also read it.

    Example:
        >>> import tensorflow as tf
        >>> from tfmem.capture import capture
        >>> def f(a, b):
        ...     ab = a @ b
        ...     return tf.linalg.diag_part(ab), tf.reduce_max(ab)
        >>> spec = tf.TensorSpec([3, 3])
        >>> graph = capture(tf.function(f).get_concrete_function(spec, spec)).to_graph()
        >>> readers = outside_readers(graph, [TensorRef("matmul")], {"diag_part"})
        >>> self_containment_reason(graph, readers, subject="product {node}",
        ...                         consequence="it is materialised anyway")
        'product matmul is also read by Max: it is materialised anyway'
    """
    counted = [r for r in readers if not (allow_waiting_constants and r.waiting_constant)]
    if not counted:
        return None
    first = counted[0]
    name = subject.format(tensor=first.tensor, node=first.tensor.node)
    if first.reader == GRAPH_OUTPUT:
        text = f"{name} is a graph output"
    elif first.reader == KEPT:
        text = f"{name} must be kept"
    else:
        others = [describe_reader(graph, r) for r in counted
                  if r.tensor.node == first.tensor.node and r.reader not in (GRAPH_OUTPUT, KEPT)]
        text = f"{name} is also read by {', '.join(others[:3])}"
    return f"{text}: {consequence}" if consequence else text


def outside_uses(graph: Graph, inner: Sequence[TensorRef], inside: Collection[str]) -> str | None:
    """`self_containment_reason` of `outside_readers`, worded the default way.

    Example:
        >>> import tensorflow as tf
        >>> from tfmem.capture import capture
        >>> from tfmem.pattern.matcher import Pattern
        >>> def f(x):
        ...     s = tf.square(x)
        ...     return tf.reduce_sum(s) + tf.reduce_sum(tf.exp(s))
        >>> graph = capture(tf.function(f).get_concrete_function(tf.TensorSpec([3]))).to_graph()
        >>> match = Pattern(lambda op, x: op.Sum(op.Square(x), op.any())).match(graph, "Sum")
        >>> match.nodes
        ('Sum', 'Square')
        >>> outside_uses(graph, match.inner, set(match.nodes))
        'not self-contained: Square:0 is also read by Exp'
    """
    return self_containment_reason(graph, outside_readers(graph, inner, inside))


def sole_reader(graph: Graph, tensor: TensorRef) -> str | None:
    """The node that alone reads `tensor`, once, when nothing else needs its node; else None.

    Example:
        >>> import tensorflow as tf
        >>> from tfmem.capture import capture
        >>> spec = tf.TensorSpec([3, 3])
        >>> cf = tf.function(lambda a, b, v: (a @ b) @ v).get_concrete_function(spec, spec, spec)
        >>> graph = capture(cf).to_graph()
        >>> sole_reader(graph, TensorRef("matmul"))   # a @ b is read only by (a @ b) @ v
        'matmul_1'
    """
    uses = graph.consumers(tensor)
    if len(uses) != 1:
        return None
    reader = uses[0][0]
    return None if outside_readers(graph, [tensor], {reader}) else reader


__all__ = ["GRAPH_OUTPUT", "KEPT", "OutsideReader", "describe_reader", "outside_readers", "outside_uses",
           "self_containment_reason", "sole_reader"]
