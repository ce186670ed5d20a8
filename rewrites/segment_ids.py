"""Cleanup: a segment reduction reads its ids in the shape they were made.

    UnsortedSegmentSum(Reshape(x, [a·b, d]), Reshape(ids, [a·b]), n) → UnsortedSegmentSum(x, ids, n)

TensorFlow's gradient of `tf.gather(params, ids)` with `ids` of shape `[a, b]` (k nearest
neighbours, tokens of a batch of sequences) flattens both the incoming gradient and the
ids before summing rows into segments. The segment ops take ids of any rank that prefix
the data's shape, so the flattening changes no value; without it, the split engine can
cut the sum along `a` or `b` in chunks (each chunk's segments summed into the result),
where a reshape that merges axes cannot be cut.

Conditions: both operands of an `UnsortedSegment{Sum,Max,Min,Prod}` are `Reshape`s; the
ids' source has a static shape whose size is the flat ids' length, and the data's source
is that shape followed by the data's other axes.

Example:
    >>> UnflattenSegmentIds().run(graph, context).records[0].nodes
    ('UnsortedSegmentSum',)
"""
from __future__ import annotations

import numpy as np

from tfmem.context import PassContext
from tfmem.graph import Graph
from tfmem.passes import GraphPass, PassResult, RewriteRecord

SEGMENT_OPS = frozenset({"UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin", "UnsortedSegmentProd"})


class UnflattenSegmentIds(GraphPass):
    """Makes segment reductions read their data and ids before a flattening reshape."""

    name = "unflatten_segment_ids"
    stage = "cleanup"
    reads = frozenset()  # no config key: the graph alone decides

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        records = []
        for node in list(graph.nodes):
            if node.op not in SEGMENT_OPS:
                continue
            data, ids = graph.inputs(node.name)[:2]
            if graph.node(data.node).op != "Reshape" or graph.node(ids.node).op != "Reshape":
                continue
            x, raw_ids = graph.inputs(data.node)[0], graph.inputs(ids.node)[0]
            x_shape, id_shape = graph.spec(x).shape, graph.spec(raw_ids).shape
            flat_shape = graph.spec(data).shape
            if not (x_shape.is_fully_defined() and id_shape.is_fully_defined() and flat_shape.is_fully_defined()):
                continue
            k = id_shape.rank
            if (k < 2 or x_shape[:k] != id_shape or flat_shape.rank < 1
                    or flat_shape[0] != int(np.prod(id_shape.as_list())) or x_shape[k:] != flat_shape[1:]):
                continue
            graph.set_input(node.name, 0, x)
            graph.set_input(node.name, 1, raw_ids)
            records.append(RewriteRecord(self.name, "UnflattenSegmentIds", "fired", (node.name,), kind="cleanup",
                                         details={"ids": str(id_shape)}))
        return PassResult(graph, bool(records), records)
