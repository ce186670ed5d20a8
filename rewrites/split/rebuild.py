"""Rebuilding a user's `While` loop with a changed body: the step both loop rewrites share.

A rewrite of a user's loop (`sink`: recompute an invariant inside; `accumulators`:
collect a gradient's outer products instead of summing them whole) edits the loop's
body as a Graph of its own, drops some loop variables, and carries new ones (`Extras`).
`rebuild_while` builds the new loop with `tf.while_loop` from that body and the old
condition, splices it into the graph in place of the old one, and hands back the new
outputs; the caller rewires the readers.

Example (a loop that drops slot 3 and carries a leaf `x` unchanged in its place):
    >>> extras = Extras(inputs=[x_ref], feed=lambda values: {TensorRef("body_x"): values[0]})
    >>> kept_refs, _ = rebuild_while(graph, "while", body, cond, kept=[0, 1, 2], extras=extras)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfmem.graph import Graph, TensorRef

from rewrites.split.fragment import fragment

Tensors = list[tf.Tensor]


def _unchanged(values: Tensors, _outputs: Tensors) -> Tensors:
    return list(values)


def _no_results(_values: Tensors, _inputs: Tensors) -> Tensors:
    return []


@dataclasses.dataclass
class Extras:
    """The loop variables a rebuilt loop carries after the kept ones.

    Attributes:
        inputs: graph tensors the extras start from (handed to `start`).
        start: their first values, from `inputs` (by default `inputs` themselves).
        feed: the body's arguments they feed, from their current values.
        step: their next values, from their current values and the body's outputs after
            the kept slots' (by default unchanged).
        finish: results computed after the loop from their final values and `inputs`
            (returned by `rebuild_while` after the kept outputs).
    """

    inputs: Sequence[TensorRef] = ()
    start: Callable[[Tensors], Tensors] = list
    feed: Callable[[Tensors], dict[TensorRef, tf.Tensor]] = lambda values: {}
    step: Callable[[Tensors, Tensors], Tensors] = _unchanged
    finish: Callable[[Tensors, Tensors], Tensors] = _no_results


def rebuild_while(graph: Graph, loop: str, body: Graph, cond: Graph, kept: Sequence[int], *,
                  extras: Extras, scope: str) -> tuple[list[TensorRef], list[TensorRef]]:
    """Splices a new loop for `loop` into `graph`: refs to its kept outputs and to the
    extras' `finish` results.

    `body` and `cond` are the loop's functions as Graphs (`tfmem.memory.function_graph`),
    their arguments named as in the functions' signatures; `body.outputs` are the kept
    slots' results, then what `extras.step` reads. The old loop stays in the graph until
    its readers are rewired.
    """
    node = graph.node(loop)
    loop_inputs = graph.inputs(loop)
    body_args = [arg.name for arg in graph.function(node.attr["body"].func.name).signature.input_arg]
    cond_args = [arg.name for arg in graph.function(node.attr["cond"].func.name).signature.input_arg]
    declared = list(node.attr["output_shapes"].list.shape)
    kept_shapes = [tf.TensorShape(declared[slot]) for slot in kept] if len(declared) == len(loop_inputs) else None
    carried = len(kept)

    def build(*tensors: tf.Tensor) -> Tensors:
        # The functions the body calls (its split loops' bodies) must be in the graph the
        # loop is built in: the body's nodes are imported without a library.
        tf.graph_util.import_graph_def(graph_pb2.GraphDef(library=body.library), name="")
        start = extras.start(list(tensors[carried:]))

        def cond_fn(*values: tf.Tensor) -> tf.Tensor:
            fed = {TensorRef(cond_args[slot]): values[j] for j, slot in enumerate(kept)}
            return _run(cond, fed, cond.outputs, "cond")[0]

        def body_fn(*values: tf.Tensor) -> Tensors:
            fed = {TensorRef(body_args[slot]): values[j] for j, slot in enumerate(kept)}
            fed.update(extras.feed(list(values[carried:])))
            outputs = _run(body, fed, body.outputs, "body")
            if kept_shapes is not None:
                for output, shape in zip(outputs, kept_shapes):
                    # The loop declared these shapes; a gradient body's TensorList reads lose them.
                    output.set_shape(output.shape.merge_with(shape))
            return outputs[:carried] + extras.step(list(values[carried:]), outputs[carried:])

        invariants = None if kept_shapes is None else kept_shapes + [t.shape for t in start]
        # One trip at a time, whatever the user's loop allowed: its body now makes in chunks
        # what it read whole, and trips run side by side (TensorFlow's executor, jit_compile
        # off) would each hold their chunks at once. XLA runs trips one by one anyway.
        results = tf.while_loop(cond_fn, body_fn, list(tensors[:carried]) + start,
                                shape_invariants=invariants, parallel_iterations=1)
        results = list(results)
        return results[:carried] + extras.finish(results[carried:], list(tensors[carried:]))

    new_refs = graph.splice(build, [loop_inputs[slot] for slot in kept] + list(extras.inputs), scope=scope)
    return new_refs[:carried], new_refs[carried:]


def _run(function: Graph, fed: dict[TensorRef, tf.Tensor], returns: Sequence[TensorRef], name: str) -> Tensors:
    """Imports a function's nodes into the current graph with its arguments `fed`, and
    returns `returns` (an argument returned as it came is handed straight back)."""
    arguments = {n.name for n in function.find("Placeholder")}
    nodes = [n for n in function.topological_order() if n not in arguments]
    computed = [ref for ref in returns if ref.node not in arguments]
    results = iter(fragment(function, nodes).import_into(fed, computed, name=name) if computed else [])
    return [tf.identity(fed[ref]) if ref.node in arguments else next(results) for ref in returns]
