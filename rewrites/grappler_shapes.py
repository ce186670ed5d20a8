"""Shapes and stand-ins for the graph Grappler hands back (`rewrites.grappler_cleanup`).

Grappler drops the `_output_shapes` attrs every pass sizes tensors by, and it feeds
placeholders with made-up values of their shape when it folds constants. These helpers
restore the shapes (`infer_shapes`) and build the stand-ins the cleanup shields large
tensors with (`placeholder_like`, `constant_like`).

Example:
    >>> infer_shapes(cleaned)   # after Grappler: every node gets its `_output_shapes` back
    57
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tfmem.graph import (ALWAYS_KEEP_OPS, Graph, GraphError, const_node, copy_node, is_stateful,
                         keep_functions_alive, output_dtypes, set_node_inputs)


def placeholder_like(graph: Graph, name: str, *, unknown_dims: bool = False) -> node_def_pb2.NodeDef:
    """A `Placeholder` NodeDef with the name, dtype and shape of node `name`'s one output.

    With `unknown_dims`, every dimension is left unknown (the rank stays): a tool that
    feeds placeholders with made-up values of their shape (Grappler does) then feeds
    a tiny tensor instead of a large one.
    """
    (spec,) = graph.output_specs(name)
    shape = tf.TensorShape([None] * spec.shape.rank) if unknown_dims else spec.shape
    return placeholder_node(name, tf.TensorSpec(shape, spec.dtype))


def placeholder_node(name: str, spec: tf.TensorSpec) -> node_def_pb2.NodeDef:
    """A `Placeholder` NodeDef named `name` of `spec`'s dtype and shape (also as `_output_shapes`)."""
    node = node_def_pb2.NodeDef(name=name, op="Placeholder")
    node.attr["dtype"].type = spec.dtype.as_datatype_enum
    node.attr["shape"].shape.CopyFrom(spec.shape.as_proto())
    node.attr["_output_shapes"].list.shape.add().CopyFrom(spec.shape.as_proto())
    return node


def constant_like(graph: Graph, name: str, value: Any) -> node_def_pb2.NodeDef:
    """A `Const` NodeDef holding `value` to stand in for node `name` (its control inputs kept)."""
    const = set_node_inputs(const_node(name, value), [], control=graph.control_inputs(name))
    const.attr["_output_shapes"].list.shape.add().CopyFrom(tf.TensorShape(np.shape(value)).as_proto())
    return const


def infer_shapes(graph: Graph) -> int:
    """Recomputes every node's `_output_shapes` by importing the graph into a scratch graph.

    For graphs from tools that drop the attr (e.g. Grappler). A node's existing
    `_output_shapes` is a hint: it is merged with (refines) what TF infers, and a
    stateful op with one fully known hinted output (e.g. a `ReadVariableOp`, whose
    shape TF cannot infer without the variable) stands in as a placeholder of that
    shape, so its readers get static shapes too. Returns the number of nodes whose
    shapes changed.

    Raises:
        GraphError: if TensorFlow cannot import the graph.
    """
    graph_def = graph.to_graph_def()
    hints: dict[str, list[tf.TensorShape]] = {}
    for node in graph_def.node:
        if "_output_shapes" in node.attr:
            hints[node.name] = [tf.TensorShape(s) for s in node.attr["_output_shapes"].list.shape]
            del node.attr["_output_shapes"]  # the importer must infer, not trust
        hint = hints.get(node.name)
        if node.op == "Placeholder" and "shape" not in node.attr and hint:
            node.attr["shape"].shape.CopyFrom(hint[0].as_proto())
        elif (is_stateful(node) and hint and len(hint) == 1 and hint[0].is_fully_defined()
              and node.op not in ALWAYS_KEEP_OPS):
            dtype = output_dtypes(node, graph.library)
            if len(dtype) == 1 and dtype[0] not in (tf.resource, tf.variant):
                stand_in = node_def_pb2.NodeDef(name=node.name, op="Placeholder")
                stand_in.attr["dtype"].type = dtype[0].as_datatype_enum
                stand_in.attr["shape"].shape.CopyFrom(hint[0].as_proto())
                node.CopyFrom(stand_in)
    try:
        with tf.Graph().as_default() as scratch:
            tf.graph_util.import_graph_def(graph_def, name="")
            keep_functions_alive(scratch)
    except (ValueError, tf.errors.OpError) as err:
        raise GraphError(f"cannot infer shapes: {err}") from err
    changed = 0
    for op in scratch.get_operations():
        if op.name not in graph:
            continue
        hint = hints.get(op.name, [])
        shapes = []
        for i, tensor in enumerate(op.outputs):
            shape = tensor.shape
            if i < len(hint) and shape.is_compatible_with(hint[i]):
                shape = shape.merge_with(hint[i])
            shapes.append(shape.as_proto())
        node = graph.node(op.name)
        old = list(node.attr["_output_shapes"].list.shape) if "_output_shapes" in node.attr else None
        if old != shapes:
            node = copy_node(node, node.name, keep_shapes=True)
            attr = node.attr["_output_shapes"]
            attr.ClearField("list")
            attr.list.shape.extend(shapes)
            graph.replace_node(node)
            changed += 1
    return changed
