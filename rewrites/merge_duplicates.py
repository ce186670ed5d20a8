"""Cleanup: nodes that compute the same thing from the same inputs are one node.

    a = f(x); b = f(x)   →   a = f(x); b's readers read a
    a = ReadVariableOp(v); b = ReadVariableOp(v)   →   the same, in a function that writes no variable

GPflow reads a parameter, and applies its transform, at every access: GPflow's VGP
reads `q_sqrt` (`FillTriangular`, `[N, N]`) once in its KL term and once in its
likelihood term, so the function forms two triangular fills of the same variable, each
from its own read and its own copies of the constants. A read is stateful, so Grappler
merges neither the reads nor anything built on them. Here a read is an ordinary value
when nothing in the function can write a variable, and nodes are merged producers
first: equal constants, then equal reads, then equal ops on merged inputs. XLA merges
some such pairs itself, not all: for VGP's loss and gradients (N=2,000) it plans
278.7 MiB with the fills merged here, 309.2 MiB without, with a Matern52 kernel (the
same with a Linear kernel, where XLA had merged them).

A merged tensor lives from its first reader to its last, where each copy lived only
around its own readers: the static estimate of VGPOpperArchambeau's gradient (N=400)
rises from 19.8 to 21.0 MiB with the merges, while XLA, which merges most such pairs
itself, plans 14.7 MiB either way. So the pass is `xla_checked`: under a budget it runs
once a plan without it does not fit, and stays where XLA then plans less
(`tfmem.stages._with_xla_checked_passes`); where it merged nothing of 1 MiB or more, its
record is "info", not "fired", and no compile is spent on it.

Conditions: a node merges with an earlier one of the same op, device, attrs (those
TensorFlow names with `_` aside), data inputs and control inputs. Never merged: stateful ops (but
variable reads in a function where every reader of a variable handle is a read: an
assignment, a call or a loop handed a handle could change a variable between two reads),
calls and control flow (`ORDERED_OPS`, library functions, ops whose attrs name functions),
placeholders. A merged node the function must keep (a read among its control outputs)
stays, read by nothing.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tfmem.config import format_size
from tfmem.context import PassContext
from tfmem.graph import ALWAYS_KEEP_OPS, ORDERED_OPS, Graph, TensorRef, is_stateful
from tfmem.passes import GraphPass, PassResult, RewriteRecord

from tfmem.host_folding import LARGE_TENSOR_BYTES

RULE = "MergeDuplicates"


class MergeDuplicates(GraphPass):
    """Common subexpression elimination, variable reads included where nothing writes one.

    Example:
        >>> v = tf.Variable(tf.ones([3]))
        >>> traced = tfmem.TfmemFunction(lambda: tf.reduce_sum(v * 2.0) + tf.reduce_sum(v * 2.0)).trace()
        >>> [str(r) for r in traced.rewrite(tfmem.Config(), passes=[MergeDuplicates()]).records]
        ['[merge_duplicates] MergeDuplicates info: nothing of 1.0 MiB or more merged=5 reads=1']
    """

    name = "merge_duplicates"
    stage = "cleanup"
    reads = frozenset()  # no config key: the graph alone decides
    # Merging holds a tensor across the readers between its copies' (see the module docstring).
    xla_checked = True

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        writer = _variable_writer(graph)
        records = [] if writer is None or not _read_twice(graph) else [RewriteRecord(
            self.name, RULE, "rejected", (writer,), kind="cleanup",
            reason=f"variable reads not merged: {writer} ({graph.node(writer).op}) is handed a variable "
                   "and may change one between two reads")]
        reads_are_values = writer is None
        first: dict[tuple, str] = {}
        merged = reads = largest = 0
        for name in graph.topological_order():
            node = graph.node(name)
            key = _key(graph, node, reads_are_values)
            if key is None:
                continue
            original = first.setdefault(key, name)
            if original == name:
                continue
            uses = sum(graph.replace_all_uses(TensorRef(name, i), TensorRef(original, i))
                       for i in range(len(graph.output_specs(name))))
            if uses:
                merged += 1
                reads += node.op == "ReadVariableOp"
                largest = max(largest, *(graph.nbytes(TensorRef(original, i)) or 0
                                         for i in range(len(graph.output_specs(original)))), 0)
        if not merged:
            return PassResult(graph, False, records)
        graph.prune()
        # Merged constants and small tensors change nothing XLA's plan would show: said as
        # "info", so that a budget does not pay a compile to try them (`xla_checked`).
        status = "fired" if largest >= LARGE_TENSOR_BYTES else "info"
        return PassResult(graph, True, [*records, RewriteRecord(
            self.name, RULE, status, kind="cleanup", details={"merged": merged, "reads": reads},
            reason="" if status == "fired" else f"nothing of {format_size(LARGE_TENSOR_BYTES)} or more")])


def _key(graph: Graph, node: node_def_pb2.NodeDef, reads_are_values: bool) -> tuple | None:
    """What makes `node`'s value: equal keys, equal values; None for a node never merged."""
    if (node.op in ALWAYS_KEEP_OPS or node.op in ORDERED_OPS or graph.function(node.op) is not None
            or any(value.HasField("func") or len(value.list.func) for value in node.attr.values())):
        return None
    if is_stateful(node) and not (node.op == "ReadVariableOp" and reads_are_values):
        return None
    return (node.op, node.device, attrs_key(node), tuple(graph.inputs(node.name)),
            tuple(sorted(graph.control_inputs(node.name))))


def attrs_key(node: node_def_pb2.NodeDef) -> tuple[tuple[str, bytes], ...]:
    """`node`'s attrs as a comparable value, those TensorFlow names with `_` aside."""
    return tuple(sorted((key, value.SerializeToString(deterministic=True))
                        for key, value in node.attr.items() if not key.startswith("_")))


def _read_twice(graph: Graph) -> bool:
    """Whether some variable handle is read more than once."""
    handles = [graph.inputs(node.name)[0] for node in graph.find("ReadVariableOp")]
    return len(handles) > len(set(handles))


def _variable_writer(graph: Graph) -> str | None:
    """A node other than a read that is handed a variable handle, if any (a handle passed
    through an `Identity` counts: what reads the identity is not followed)."""
    handles = {graph.inputs(node.name)[0] for node in graph.find("ReadVariableOp")}
    handles |= {TensorRef(node.name) for node in graph.find("VarHandleOp")}
    handles |= {TensorRef(node.name) for node in graph.find("Placeholder")
                if node.attr["dtype"].type == tf.resource.as_datatype_enum}
    for handle in sorted(handles, key=str):
        for reader, _ in graph.consumers(handle):
            if graph.node(reader).op != "ReadVariableOp":
                return reader
    return None


__all__ = ["MergeDuplicates"]
