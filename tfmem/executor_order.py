"""Running a program without XLA as the static estimate counts it.

XLA runs a program one op at a time, in one order, and the static estimate
(`tfmem.memory`) counts that. TensorFlow's executor, which runs a program compiled
without XLA (`jit_compile: false`, or a rewrite XLA cannot compile), starts every op whose
inputs are ready: independent loops and large ops then run side by side. The import
(`tfmem.capture.import_as_function`) chains them in the estimate's order instead, in the
program and in every function it calls (loop bodies, branches), and the program is called
with Grappler's arithmetic rewrites off (`GraphModeFunction`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from tfmem.graph import Graph, GraphError
from tfmem.host_folding import LARGE_TENSOR_BYTES
from tfmem.memory import RESIDENT_OPS, WHILE_LOOP_OPS, estimate_memory, function_calls

logger = logging.getLogger(__name__)

# Functions nest this deep at most before the ordering stops looking further in (a loop
# in a loop's gradient in a branch is four).
_MAX_DEPTH = 8


def heavy_ops_in_turn(graph: Graph) -> Graph:
    """A copy of `graph` whose loops, and ops that make large tensors, wait on each other
    in the order of the static estimate's schedule, in the graph itself and in each library
    function it calls (`graph` itself where nothing needs ordering).

    Side by side, two split loops each hold their chunks, and a loop holds its own beside
    the last chunk another computes after its trips, where the estimate counts one at a
    time (the [4000, 4000] kernels of two inputs, split in two loops under a 40 MiB limit,
    ran out of memory together in two runs of four). Inside a loop's body it is the same: a
    conjugate-gradient loop's gradient whose body splits `K @ p` ran its split loop beside
    that loop's last chunk and peaked at 77 MiB where the estimate said 37. A control edge
    from each such op to the next keeps the estimate's order; an op that needs another's
    result is after it in that order already. Large: at least a 64th of the program's
    estimated peak, and at least `LARGE_TENSOR_BYTES`.

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
    estimate = estimate_memory(graph)
    large = max(LARGE_TENSOR_BYTES, estimate.peak_bytes // 64)
    top = _chain(graph, list(estimate.steps), large)  # `steps` are in the order the schedule runs them
    in_functions: dict[str, list[tuple[str, str]]] = {}
    _order_called(graph, large, in_functions, depth=0)
    if not top and not any(in_functions.values()):
        return graph
    ordered = graph.copy()
    for after, before in top:
        ordered.add_control_input(after, before)
    for function, edges in in_functions.items():
        for after, before in edges:
            try:
                ordered.add_control_input_in_function(function, after, before)
            except GraphError as err:  # a name the body's graph gave a node of its own
                logger.debug("cannot order %s after %s in %s: %s", after, before, function, err)
    return ordered


def _chain(graph: Graph, schedule: list[str], large: int) -> list[tuple[str, str]]:
    """The control edges (after, before) that run `graph`'s loops and large ops one after
    another in `schedule`'s order."""
    heavy = [name for name in schedule if _is_heavy(graph, name, large)]
    return list(zip(heavy[1:], heavy))


def _is_heavy(graph: Graph, name: str, large: int) -> bool:
    node = graph.node(name)
    if node.op in WHILE_LOOP_OPS:
        return True
    return node.op not in RESIDENT_OPS and graph.largest_output_bytes(name) >= large


def _order_called(graph: Graph, large: int, edges: dict[str, list[tuple[str, str]]], depth: int) -> None:
    """Fills `edges` with the control edges of each function `graph` calls, directly or not,
    by name: ordered as the estimate schedules the function for its first call's shapes."""
    if depth >= _MAX_DEPTH:
        return
    for node in graph.nodes:
        for call in function_calls(graph, node.name):
            if call.function in edges:
                continue
            edges[call.function] = []  # also guards against recursion
            try:
                body = call.graph(graph)
                edges[call.function] = _chain(body, list(estimate_memory(body).steps), large)
            except Exception as err:  # noqa: BLE001 - ordering is a help, never a reason to fail
                logger.debug("cannot order the ops of %s: %s", call.function, err)
                continue
            _order_called(body, large, edges, depth + 1)


class GraphModeFunction:
    """A `tf.function` run without XLA, called with Grappler's arithmetic optimizer off.

    TensorFlow optimizes a function with Grappler when it is first called. Its arithmetic
    optimizer then runs a program other than the one the estimate counted: it regroups
    sums (`AddOpsRewrite`, whose node ran out of memory in one such run: regrouped, a row
    plus a column of a chunk's squared distances is a whole temporary). A conjugate-gradient
    gradient whose split loops the estimate put at 13.2 MiB peaked at 21–23 MiB with it, and
    at 13.4 MiB without. tfmem's cleanup ran Grappler's arithmetic rewrites on the program
    before the estimate already (`rewrites.grappler_cleanup`). The setting is the calling
    thread's own and holds only for these calls; everything else the function is, it
    forwards.

    Example:
        >>> import tensorflow as tf
        >>> double = GraphModeFunction(tf.function(lambda x: 2.0 * x))
        >>> float(double(tf.constant(1.5)))
        3.0
        >>> double.python_function(1.0)
        2.0
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _arithmetic_rewrites_off():
            return self._function(*args, **kwargs)

    def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        with _arithmetic_rewrites_off():
            return self._function.get_concrete_function(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._function, name)


@contextlib.contextmanager
def _arithmetic_rewrites_off() -> Iterator[None]:
    """Function calls made on this thread inside run with Grappler's arithmetic optimizer
    off, the rest of the config as it was (eager calls read it at the call, calls traced
    into a graph when they are traced)."""
    ctx = context.context()
    previous = ctx.function_call_options
    config = config_pb2.ConfigProto()
    if previous.config_proto_serialized:
        config.ParseFromString(previous.config_proto_serialized)
    config.graph_options.rewrite_options.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    ctx.function_call_options = context.FunctionCallOptions(executor_type=previous.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = previous
