"""Sinking: a big loop invariant is recomputed inside the loop that reads it, in chunks.

    K = k(X, X)                      while ...:
    while ...:                 →         p' = k(X, X) @ p      (the body split: K's rows
        p' = K @ p                                               in chunks, never whole)

TensorFlow hands a tensor captured by a `tf.while_loop` body to the loop as a loop
variable the body returns unchanged: a *loop invariant*, held whole for the whole loop
(`K` above, `[n, n]`, in conjugate gradients or power iteration). When it is made from
small inputs by ops without side effects (its *cone*: `x` → squared distances → exp),
`sink_invariant` clones the cone into the body, hands the loop the cone's small inputs
instead of K, and plans the new body like any program (`plan_body`: the split planner),
so that each iteration recomputes K chunk by chunk. That trades flops (one K per
iteration) for memory; the split planner (`Planner`) does it only for a tensor at the
budget's peak, and keeps it only when the program's peak falls.

Readers of K outside the loop keep the original (which the planner may then split on its
own). Not sunk, with the reason: a loop whose condition reads the invariant, a body with
control outputs (side effects), resource loop variables, and a cone with control edges,
stateful ops, function calls, or large inputs of its own.

Example (conjugate gradients: `add_diagonal/set_diag` is K + σ²I, read by loop `while`):
    >>> [(loop, slot)] = invariant_slots(graph, TensorRef("add_diagonal/set_diag"))
    >>> found = loop_invariant(graph, TensorRef("add_diagonal/set_diag"), loop, slot, leaf_limit=2**20)
    >>> found.leaves  # the loop takes x [n, 3] (and the diagonal's [n]) instead of K [n, n]
    >>> records = sink_invariant(graph, found, plan_body=lambda body: [])  # K whole in each trip
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tfmem.graph import Graph, GraphError, TensorRef, copy_node, set_node_inputs
from tfmem.memory import WHILE_LOOP_OPS, loop_function_graph, while_passthrough
from tfmem.passes import RewriteRecord

from rewrites.split.compared import check_one_evaluation
from rewrites.split.cone import grow_cone
from rewrites.split.rebuild import Extras, rebuild_while

# Ops a cone may not contain: they call functions (whose bodies are not cloned here) or
# read state the loop may change.
_OPAQUE_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
                         "PartitionedCall", "StatefulPartitionedCall", "Placeholder",
                         "ReadVariableOp", "VarHandleOp"})
_MAX_CONE_NODES = 128


@dataclasses.dataclass(frozen=True)
class LoopInvariant:
    """A tensor one loop reads as an invariant, and how to recompute it.

    Attributes:
        tensor: the invariant, outside the loop.
        loop: the `While` node reading it.
        slot: its loop-variable position.
        cone: the nodes that compute it from `leaves`, in topological order.
        leaves: the small tensors the cone reads from outside (the loop takes these instead).
    """

    tensor: TensorRef
    loop: str
    slot: int
    cone: tuple[str, ...]
    leaves: tuple[TensorRef, ...]


def invariant_slots(graph: Graph, tensor: TensorRef) -> list[tuple[str, int]]:
    """The loops that read `tensor` as an invariant: `(While node, loop-variable slot)`."""
    found = []
    for consumer, position in graph.consumers(tensor):
        if graph.node(consumer).op in WHILE_LOOP_OPS and while_passthrough(graph, consumer).get(position) == position:
            found.append((consumer, position))
    return found


def read_through_loops(graph: Graph, tensor: TensorRef) -> None:
    """Rewires readers of a loop's unchanged output of `tensor` to `tensor` itself: the
    same value (TensorFlow's gradient of a loop reads a captured K from the forward
    loop's output), so every loop that reads K is found by `invariant_slots`."""
    handed = [(loop, slot) for loop, slot in invariant_slots(graph, tensor)]
    while handed:
        loop, slot = handed.pop()
        output = TensorRef(loop, slot)
        if graph.consumers(output):
            graph.replace_all_uses(output, tensor)
            handed = [(loop, slot) for loop, slot in invariant_slots(graph, tensor)]


def loop_invariant(graph: Graph, tensor: TensorRef, loop: str, slot: int, *,
                   leaf_limit: int) -> LoopInvariant | str:
    """`tensor`, read by `loop` at `slot`, as a LoopInvariant; or why it cannot be sunk.

    Its cone grows backwards from `tensor` through every input over `leaf_limit` bytes;
    inputs at most that size are its leaves (small constants are cloned instead).
    """
    node = graph.node(loop)
    cond_name, body_name = node.attr["cond"].func.name, node.attr["body"].func.name
    for name in (cond_name, body_name):
        function = graph.function(name)
        if function is None:
            return f"loop {loop}: its function {name!r} is not in the graph's library"
        if function.control_ret:
            return f"loop {loop}: {name} has side effects (control outputs)"
    for ref in graph.inputs(loop):
        if graph.spec(ref).dtype == tf.resource:
            return f"loop {loop}: it carries a resource ({ref.name})"
    cond = loop_function_graph(graph, loop, "cond")
    cond_arg = TensorRef(graph.function(cond_name).signature.input_arg[slot].name)
    if cond.consumers(cond_arg) or cond.is_output(cond_arg):
        return f"loop {loop}: its condition reads {tensor.name}"

    def refuse(name: str) -> str | None:
        if graph.node(name).op in _OPAQUE_OPS or graph.is_stateful(name):
            return f"{tensor.name} is made from {name} ({graph.node(name).op}), which cannot be recomputed in the loop"
        return None

    cone = grow_cone(graph, tensor, leaf_limit=leaf_limit, refuse=refuse, max_nodes=_MAX_CONE_NODES)
    if isinstance(cone, str):
        return cone
    return LoopInvariant(tensor, loop, slot, cone.nodes, cone.leaves)


def sink_invariant(graph: Graph, invariant: LoopInvariant,
                   plan_body: Callable[[Graph], Sequence[RewriteRecord]]) -> list[RewriteRecord]:
    """Rebuilds `invariant.loop` to recompute the invariant in its body (see the module
    docstring); `plan_body` plans the new body in place (splits it) and returns its records.

    The loop's other outputs keep their meaning; readers of its invariant output read
    the original tensor. Raises GraphError when the loop cannot be rebuilt.
    """
    node = graph.node(invariant.loop)
    loop_inputs = graph.inputs(invariant.loop)
    body_name = node.attr["body"].func.name
    body = loop_function_graph(graph, invariant.loop, "body")
    cond = loop_function_graph(graph, invariant.loop, "cond")
    body_args = [arg.name for arg in graph.function(body_name).signature.input_arg]
    kept = [slot for slot in range(len(loop_inputs)) if slot != invariant.slot]

    # The body: the cone cloned in, reading new arguments for its leaves, in place of K's.
    scope = body.unique_scope("tfmem_sunk")
    leaf_args = []
    for i, leaf in enumerate(invariant.leaves):
        spec = graph.spec(leaf)
        placeholder = node_def_pb2.NodeDef(name=f"{scope}/input_{i}", op="Placeholder")
        placeholder.attr["dtype"].type = spec.dtype.as_datatype_enum
        placeholder.attr["shape"].shape.CopyFrom(spec.shape.as_proto())
        placeholder.attr["_output_shapes"].list.shape.add().CopyFrom(spec.shape.as_proto())
        leaf_args.append(body.add_node(placeholder))
    clone = {name: f"{scope}/{name}" for name in invariant.cone}
    leaf_of = {leaf: TensorRef(arg) for leaf, arg in zip(invariant.leaves, leaf_args)}
    for name in invariant.cone:
        inputs = [leaf_of[ref] if ref in leaf_of else TensorRef(clone[ref.node], ref.index)
                  for ref in graph.inputs(name)]
        copy = set_node_inputs(copy_node(graph.node(name), clone[name]), inputs)
        if "_output_shapes" in graph.node(name).attr:  # the same shapes as outside (sizes the body's plan)
            copy.attr["_output_shapes"].CopyFrom(graph.node(name).attr["_output_shapes"])
        body.add_node(copy)
    outputs = list(body.outputs)
    body.outputs = [outputs[slot] for slot in kept]
    body.replace_all_uses(TensorRef(body_args[invariant.slot]), TensorRef(clone[invariant.tensor.node],
                                                                           invariant.tensor.index))
    body.remove(body_args[invariant.slot])  # not an argument any more
    body.prune()
    records = list(plan_body(body))

    leaf_refs = [TensorRef(arg) for arg in leaf_args]
    extras = Extras(inputs=invariant.leaves, feed=lambda values: dict(zip(leaf_refs, values)))
    new_refs, _ = rebuild_while(graph, invariant.loop, body, cond, kept, extras=extras, scope="tfmem_sunk")
    for slot, new in zip(kept, new_refs):
        graph.replace_all_uses(TensorRef(invariant.loop, slot), new)
    graph.replace_all_uses(TensorRef(invariant.loop, invariant.slot), loop_inputs[invariant.slot])
    graph.prune()
    # What the rebuilt loop returns is made from its own evaluation of the cone.
    check_one_evaluation(graph, invariant.cone, {ref: invariant.cone for ref in new_refs})
    if invariant.loop in graph:
        raise GraphError(f"loop {invariant.loop} is still read after it was rebuilt")
    return records

