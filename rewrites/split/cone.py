"""Cones: the ops that make a tensor from small inputs, to be made again elsewhere.

Two rewrites recompute a big tensor rather than hold it: `sink` inside the loop that
reads it, `recompute` for its readers after the peak. Both grow the tensor's *cone*
backwards from it: through every input over `leaf_limit` bytes (and small constants,
which are copied with it), stopping at inputs of at most `leaf_limit` bytes, its
*leaves*. Each says which ops it refuses (`refuse`).

Example:
    >>> cone = grow_cone(graph, TensorRef("Exp"), leaf_limit=2**20, refuse=lambda name: None)
    >>> cone.leaves, cone.nodes   # x [n, 3]; the squared distances, the scaling, Exp
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tfmem.graph import Graph, TensorRef
from tfmem.memory import RESIDENT_OPS

from rewrites.split.loops import is_small_constant

# Tensors held to the end anyway: the program's inputs, and reads of its variables (under
# XLA a read is the variable's own buffer, a parameter of the computation).
_HELD_ANYWAY = RESIDENT_OPS | {"ReadVariableOp"}


@dataclasses.dataclass(frozen=True)
class Cone:
    """How to make `tensor` again: `nodes` (topological order) from `leaves`."""

    tensor: TensorRef
    nodes: tuple[str, ...]
    leaves: tuple[TensorRef, ...]


def grow_cone(graph: Graph, tensor: TensorRef, *, leaf_limit: int, refuse: Callable[[str], str | None],
              max_nodes: int = 128, resident_leaves: bool = False, sized_by_values: bool = False,
              value_sized_leaves: bool = False) -> Cone | str:
    """The cone of `tensor` (see the module docstring), or why there is none.

    `refuse(node)`: why that node may not be made again (None: it may). Nodes with
    side effects or control inputs never may. `resident_leaves`: inputs of the program
    and reads of its variables (held to the end anyway) are leaves whatever their size.
    `sized_by_values`: a tensor whose shape a value decides is made again too (never in a
    loop's body: XLA must know every shape there when it compiles the loop).
    `value_sized_leaves`: such a tensor is a leaf instead, made where it is and read whole
    (a loop's body may read it: XLA knows its shape when it compiles the program).
    """
    nodes: set[str] = set()
    leaves: list[TensorRef] = []
    stack = [tensor.node]
    while stack:
        name = stack.pop()
        if name in nodes:
            continue
        reason = refuse(name)
        if reason is not None:
            return reason
        if graph.is_stateful(name):
            return f"{tensor.name} is made by {name} ({graph.node(name).op}), which has side effects"
        if graph.control_inputs(name):
            return f"{tensor.name} is made by {name}, which has control inputs"
        nodes.add(name)
        if len(nodes) > max_nodes:
            return f"{tensor.name} takes more than {max_nodes} ops to recompute"
        for ref in graph.inputs(name):
            nbytes = graph.nbytes(ref)
            if nbytes is None and value_sized_leaves and graph.inputs(ref.node):
                if ref not in leaves:
                    leaves.append(ref)
                continue
            if nbytes is None:
                if not sized_by_values or graph.node(ref.node).op in _HELD_ANYWAY or not graph.inputs(ref.node):
                    return f"{tensor.name} is made from {ref.name}, whose shape is not static"
                # Sized by a value (GPflow's `eye(num_data)`, num_data a variable): no leaf
                # of unknown size, so it is made again too, from what sizes it.
                stack.append(ref.node)
                continue
            if is_small_constant(graph, ref):
                stack.append(ref.node)  # copied with the cone
            elif nbytes <= leaf_limit or (resident_leaves and graph.node(ref.node).op in _HELD_ANYWAY):
                if ref not in leaves:
                    leaves.append(ref)
            else:
                stack.append(ref.node)
    order = [name for name in graph.topological_order() if name in nodes]
    return Cone(tensor, tuple(order), tuple(leaves))
