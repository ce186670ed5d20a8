"""Running a program without XLA as the static estimate counts it.

XLA runs a program one op at a time, in one order, and the static estimate
(`tfmem.memory`) counts that. TensorFlow's executor, which runs a program compiled
without XLA (`jit_compile: false`, or a rewrite XLA cannot compile), starts every op whose
inputs are ready: independent loops and large ops then run side by side. The import
(`tfmem.capture.import_as_function`) chains them in the estimate's order instead.
"""
from __future__ import annotations

from tfmem.graph import Graph, TensorRef
from tfmem.host_folding import LARGE_TENSOR_BYTES
from tfmem.memory import RESIDENT_OPS, WHILE_LOOP_OPS, estimate_memory


def heavy_ops_in_turn(graph: Graph) -> Graph:
    """A copy of `graph` whose loops, and ops that make large tensors, wait on each other
    in the order of the static estimate's schedule (`graph` itself where there are fewer
    than two).

    Side by side, two split loops each hold their chunks, and a loop holds its own beside
    the last chunk another computes after its trips, where the estimate counts one at a
    time (the [4000, 4000] kernels of two inputs, split in two loops under a 40 MiB limit,
    ran out of memory together in two runs of four). A control edge from each such op to
    the next keeps the estimate's order; an op that needs another's result is after it in
    that order already. Large: at least a 64th of the estimated peak, and at least
    `LARGE_TENSOR_BYTES`.

    Example:
        >>> import tensorflow as tf
        >>> from tfmem.capture import capture
        >>> def two_loops(x, y):
        ...     a = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0), (0, x))[1]
        ...     b = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v + 1.0), (0, y))[1]
        ...     return a + b
        >>> cf = tf.function(two_loops, autograph=False).get_concrete_function(tf.ones([3]), tf.ones([3]))
        >>> ordered = heavy_ops_in_turn(capture(cf).to_graph())
        >>> sorted((node.name, ordered.control_inputs(node.name)) for node in ordered.find(WHILE_LOOP_OPS))
        [('while', []), ('while_1', ['while'])]
    """
    estimate = estimate_memory(graph)  # its `steps` are in the order its schedule runs them
    large = max(LARGE_TENSOR_BYTES, estimate.peak_bytes // 64)
    heavy = {node.name for node in graph.nodes if node.op in WHILE_LOOP_OPS or node.op not in RESIDENT_OPS and any(
        (graph.nbytes(TensorRef(node.name, index)) or 0) >= large for index in range(len(graph.output_specs(node.name))))}
    if len(heavy) < 2:
        return graph
    ordered = graph.copy()
    in_order = [name for name in estimate.steps if name in heavy]
    for before, after in zip(in_order, in_order[1:]):
        ordered.add_control_input(after, before)
    return ordered
