"""Cleanup: every large tensor of one repeated value becomes a `Fill`.

    ZerosLike(x) → Fill(shape(x), 0)        OnesLike(x) → Fill(shape(x), 1)
    BroadcastTo(c, shape) → Fill(shape, c)  (c a scalar constant)
    Const splat [M, N] → Fill([M, N], c)    (a TensorProto holding one value for many)

Gradients are full of these (`zeros_like` of an [M, N] activation, `ones_like` of a
loss). As a `Fill` with constant dims such a tensor is free to slice (the split stage
computes each chunk's part where it is read) and does not keep `x` alive just for its
shape. Left alone, Grappler's constant folding turns it into a `Const` — building the
whole tensor on the host first (GPflow's Matern32 SGPR gradient: a 572 MiB
`zeros_like`; 19 GB of host memory at M=10,000, N=289,916) — and XLA then embeds it.
The cleanup stage also hides large `Fill`s from Grappler (`grappler_cleanup`).

Conditions: static shape; output over `LARGE_TENSOR_BYTES` (smaller splats are cheap
either way, and Grappler folding them helps the patterns downstream); for a `Const`,
a TensorProto that stores one value (never expanded to find out).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2

from tfmem.context import PassContext
from tfmem.graph import Graph, TensorRef
from tfmem.host_folding import LARGE_TENSOR_BYTES
from tfmem.passes import GraphPass, PassResult, RewriteRecord


_VALUE_FIELDS = ("float_val", "double_val", "int_val", "int64_val", "bool_val")


def proto_splat_value(proto: tensor_pb2.TensorProto) -> Any:
    """The one value a TensorProto repeats, or None; reads the proto, never expands it."""
    if proto.tensor_content:
        return None
    for field in _VALUE_FIELDS:
        values = getattr(proto, field)
        if len(values) == 1:
            return values[0]
    return None


def splat_value(graph: Graph, tensor: TensorRef) -> Any:
    """The value every element of `tensor` has, if the graph says so statically; else None.

    Example:
        >>> splat_value(graph, TensorRef("zeros_like"))
        0
    """
    node = graph.node(tensor.node)
    inputs = graph.inputs(tensor.node)
    if node.op == "ZerosLike":
        return 0
    if node.op == "OnesLike":
        return 1
    if node.op == "Const":
        return proto_splat_value(node.attr["value"].tensor)
    if node.op in ("Fill", "BroadcastTo"):
        value = inputs[1] if node.op == "Fill" else inputs[0]
        constant = graph.constant_value(value) if graph.node(value.node).op == "Const" else None
        if constant is not None and np.size(constant) == 1:
            return np.ravel(constant)[0]
    return None


class CanonicalizeSplats(GraphPass):
    """Rewrites large splat tensors as `Fill(dims, value)`; see the module docstring."""

    name = "canonicalize_splats"
    stage = "cleanup"
    reads = frozenset()  # no config key: the graph alone decides

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        records = []
        for node in list(graph.nodes):
            if node.op == "Fill" or node.name not in graph:
                continue
            ref = TensorRef(node.name)
            if len(graph.output_specs(node.name)) != 1 or (graph.nbytes(ref) or 0) <= LARGE_TENSOR_BYTES:
                continue
            value = splat_value(graph, ref)
            if value is None or graph.is_output(ref) or node.name in graph.keep \
                    or graph.control_dependants(node.name):
                continue
            spec = graph.spec(ref)
            (fill,) = graph.splice(lambda: tf.fill(spec.shape.as_list(), tf.constant(value, spec.dtype)), [],
                                   scope="tfmem_splat")
            graph.replace_all_uses(ref, fill)
            records.append(RewriteRecord(self.name, "CanonicalizeSplats", "fired", (node.name,), kind="cleanup",
                                         details={"op": node.op, "bytes": graph.nbytes(fill)}))
        if records:
            graph.prune()
        return PassResult(graph, bool(records), records)


__all__ = ["CanonicalizeSplats", "proto_splat_value", "splat_value"]
