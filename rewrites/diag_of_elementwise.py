"""The diagonal of an elementwise expression, taken of its operands instead.

    diag_part(A − B)              →   diag_part(A) − diag_part(B)
    diag_part(exp(−½ D))          →   exp(−½ diag_part(D))
    diag_part(a[:, None] + b)     →   a + b                     (a column's diagonal is itself, as is a row's)
    diag_part(X[0])               →   diag_part(X)[0]           (also tile, expand_dims: leading dimensions)

An elementwise op on `[..., n, n]` matrices computes each entry from the same entry of
its operands, so its diagonal needs only theirs. Pushed down to the leaves, the diagonal
meets what other rules take without forming a matrix: `diag_part(AᵀA)` becomes a column
sum of squares (`ContractDiagOfProduct`, which runs next), and a broadcast column or row
is a vector already. GPflow's `predict_f(Xs, full_cov=True)` followed by `diag_part(cov[0])`
computes `Kss − AᵀA` with two `[n, n]` matrices; here it needs none. Each step is exact:
the same operations on the same values.

Operands broadcast as the op broadcasts them, by their last two dimensions: `[..., n, n]`
gives its diagonal, `[..., n, 1]` its column, `[..., 1, n]` its row, and `[..., 1, 1]`, a
vector `[n]` (a row) or a scalar stay as they are.

Conditions (rejections carry these reasons):
    * the diagonal is the main one (`k = 0`) of a square matrix with static shapes;
    * the matrix is read only by the diagonal (otherwise it is formed anyway);
    * its op is elementwise (`_UNARY`, `_BINARY`, a cast, `tf.where` and its comparisons)
      with a real, complex or boolean result, or arranges leading dimensions only (a strided
      slice, a tile, an added axis that leaves the last two dimensions whole: GPflow tiles a
      covariance over its latent GPs).

Example:
    >>> f = tfmem.TfmemFunction(lambda k, a: tf.linalg.diag_part(k - tf.matmul(a, a, transpose_a=True)),
    ...                         passes=[DiagOfElementwise(), ContractDiagOfProduct()])
    >>> [r.rule for r in f.report(k, a).records if r.status == "fired"]
    ['DiagOfElementwise', 'ContractDiagOfProduct']
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2
from tensorflow.python.framework import op_def_registry

from tfmem.context import PassContext
from tfmem.graph import Graph, TensorRef
from tfmem.passes import GraphPass, PassResult, RewriteRecord

from rewrites.diag_of_product import DIAG_OPS

RULE = "DiagOfElementwise"

# Elementwise ops whose diagonal is the op of their operand's diagonal.
_UNARY = frozenset({"Identity", "Neg", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Abs",
                    "Reciprocal", "Tanh", "Sigmoid", "Sin", "Cos", "Softplus", "Relu", "Sign", "Floor", "Ceil",
                    "Erf", "Erfc", "Inv"})
_BINARY = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "DivNoNan", "Maximum", "Minimum", "Pow",
                     "SquaredDifference", "MulNoNan"})
# Also elementwise, with their own attrs or a third operand (`tf.where`'s, broadcast too),
# and the comparisons that make a `tf.where`'s condition.
_OTHER_ELEMENTWISE = frozenset({"Cast", "SelectV2", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal",
                                "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot"})
# Ops that only arrange leading (batch) dimensions, when they leave the last two whole.
_LEADING_SHAPE_OPS = frozenset({"StridedSlice", "Tile", "ExpandDims"})
# Why a diagonal is not this rule's to record (a product's is ContractDiagOfProduct's, say).
_NOT_ELEMENTWISE = "not of an elementwise op's output"
# How many diagonals one run pushes down, at most (each step adds a few small ops).
_MAX_STEPS = 256


class DiagOfElementwise(GraphPass):
    """Takes `diag_part` of an elementwise expression's operands, never forming the matrix.

    Example:
        >>> f = tfmem.TfmemFunction(lambda x, y: tf.linalg.diag_part(tf.exp(x - y)),
        ...                         passes=[DiagOfElementwise()])
        >>> f.report(x, y).records[0].status
        'fired'
    """

    name = "diag_of_elementwise"
    stage = "reorder"
    reads = frozenset()

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        records: list[RewriteRecord] = []
        seen: set[str] = set()  # each diagonal is looked at once: pushed down, refused, or not this rule's
        while sum(r.status == "fired" for r in records) < _MAX_STEPS:
            node = next((n for n in graph.nodes if n.op in DIAG_OPS and n.name not in seen), None)
            if node is None:
                break
            seen.add(node.name)
            why = _why_not(graph, node)
            if why == _NOT_ELEMENTWISE:
                continue
            if why is not None:
                records.append(RewriteRecord(self.name, RULE, "rejected", (node.name,), why))
                continue
            records.append(_push_down(graph, node))
            graph.prune()  # the replaced diagonal and its matrix: the operands' own readers are now the new ones
        return PassResult(graph, any(r.status == "fired" for r in records), records)


def _why_not(graph: Graph, node: node_def_pb2.NodeDef) -> str | None:
    """Why the diagonal `node` is not pushed into its matrix's op (None: it is)."""
    problem = DIAG_OPS[node.op](graph, node)
    if problem is not None:
        return problem
    matrix = graph.inputs(node.name)[0]
    producer = graph.node(matrix.node)
    if producer.op not in _UNARY | _BINARY | _OTHER_ELEMENTWISE | _LEADING_SHAPE_OPS:
        return _NOT_ELEMENTWISE
    spec = graph.spec(matrix)
    if not spec.shape.is_fully_defined() or spec.shape.rank < 2 or spec.shape[-1] != spec.shape[-2]:
        return f"{matrix.name} is {spec.shape}, not a square matrix of static shape"
    if not (spec.dtype.is_floating or spec.dtype.is_complex or spec.dtype == tf.bool):
        return f"{matrix.name} is {spec.dtype.name}"
    readers = {reader for reader, _ in graph.consumers(matrix)}
    if readers != {node.name} or graph.is_output(matrix):
        others = sorted(readers - {node.name}) or ["the program's outputs"]
        return f"{matrix.name} is also read by {others[0]}: it is formed anyway"
    if producer.op == "StridedSlice":
        return _leading_slice_problem(graph, producer)
    if producer.op == "Tile":
        multiples = graph.constant_value(graph.inputs(producer.name)[1])
        if multiples is None or list(np.asarray(multiples)[-2:]) != [1, 1]:
            return f"{producer.name} tiles the matrix dimensions, or by multiples that are not constants"
    if producer.op == "ExpandDims":
        axis = graph.constant_value(graph.inputs(producer.name)[1])
        if axis is None or int(np.asarray(axis)) % spec.shape.rank > spec.shape.rank - 3:
            return f"{producer.name} adds a matrix dimension, not a leading one"
    return None


def _push_down(graph: Graph, node: node_def_pb2.NodeDef) -> RewriteRecord:
    """Replaces `node`, the diagonal of an elementwise op's (or a leading slice's) output."""
    matrix = graph.inputs(node.name)[0]
    producer = graph.node(matrix.node)
    n = int(graph.spec(matrix).shape[-1])
    operands = graph.inputs(producer.name)
    if producer.op == "StridedSlice":
        (begin, end, strides), masks = _slice_of_diagonal(graph, producer)

        def build(x: tf.Tensor) -> tf.Tensor:
            return tf.raw_ops.StridedSlice(input=tf.linalg.diag_part(x), begin=begin, end=end, strides=strides,
                                           **masks)
        inputs = [operands[0]]
    elif producer.op == "Tile":
        multiples = np.asarray(graph.constant_value(operands[1]))[:-1]

        def build(x: tf.Tensor) -> tf.Tensor:
            return tf.tile(tf.linalg.diag_part(x), multiples)
        inputs = [operands[0]]
    elif producer.op == "ExpandDims":
        axis = int(np.asarray(graph.constant_value(operands[1]))) % graph.spec(matrix).shape.rank

        def build(x: tf.Tensor) -> tf.Tensor:
            return tf.expand_dims(tf.linalg.diag_part(x), axis)
        inputs = [operands[0]]
    else:
        op: Callable[..., tf.Tensor] = getattr(tf.raw_ops, producer.op)
        # The op's own argument names (`x`, `y`; `features` for Relu, `input` for Identity).
        names = [arg.name for arg in op_def_registry.get(producer.op).input_arg]
        inputs = list(operands)

        # A cast's target type (its only attr a build would not infer from the operands).
        attrs = {"DstT": tf.as_dtype(producer.attr["DstT"].type)} if producer.op == "Cast" else {}

        def build(*xs: tf.Tensor) -> tf.Tensor:
            return op(**{name: _diagonal_of(x, n) for name, x in zip(names, xs)}, **attrs)
    [new] = graph.splice(build, inputs, scope="diag_of_operands")
    got, want = graph.spec(new).shape, graph.spec(TensorRef(node.name)).shape
    if got != want:
        graph.prune()  # the new ops have no reader yet: gone again
        return RewriteRecord("diag_of_elementwise", RULE, "rejected", (node.name,),
                             f"the operands' diagonals give {got}, not {want}")
    graph.replace_all_uses(TensorRef(node.name), new)
    return RewriteRecord("diag_of_elementwise", RULE, "fired", (node.name,),
                         f"diag_part of {producer.op} {matrix.name} taken of its operands",
                         details={"matrix": matrix.name, "op": producer.op,
                                  "matrix_bytes": graph.nbytes(matrix) or 0})


def _diagonal_of(x: tf.Tensor, n: int) -> tf.Tensor:
    """What `x`, broadcast to [..., n, n], has on the diagonal, as [..., n] or broadcastable to it."""
    shape = x.shape.as_list()
    if len(shape) < 2:
        return x  # a scalar, or a vector broadcast as a row: its diagonal is itself
    rows, cols = shape[-2:]
    if rows == cols == n:
        return tf.linalg.diag_part(x)
    if cols == 1:
        return x[..., 0]  # a column [..., n, 1] (or [..., 1, 1]): its entries, one per row
    return x[..., 0, :]  # a row [..., 1, n]


def _leading_slice_problem(graph: Graph, node: node_def_pb2.NodeDef) -> str | None:
    """Why the strided slice `node` does not leave its input's last two dimensions whole
    (new axes among the leading ones are fine: `X[None]`)."""
    source, *spec_refs = graph.inputs(node.name)
    values = [graph.constant_value(ref) for ref in spec_refs]
    if any(v is None for v in values):
        return f"{node.name}'s begin, end and strides are not constants"
    if node.attr["ellipsis_mask"].i:
        return f"{node.name} uses an ellipsis"
    begin, end, strides = (np.atleast_1d(np.asarray(v)) for v in values)
    shape = graph.spec(source).shape.as_list()
    rank, axis = len(shape), 0  # `axis`: the input dimension the next entry reads
    for entry in range(len(begin)):
        if node.attr["new_axis_mask"].i >> entry & 1:
            if axis > rank - 2:  # after the first matrix dimension
                return f"{node.name} adds an axis among the matrix dimensions"
            continue
        whole = ((node.attr["begin_mask"].i >> entry & 1 or begin[entry] == 0)
                 and (node.attr["end_mask"].i >> entry & 1 or end[entry] >= shape[axis])
                 and strides[entry] == 1 and not node.attr["shrink_axis_mask"].i >> entry & 1)
        if axis >= rank - 2 and not whole:
            return f"{node.name} slices the matrix dimensions, not only leading ones"
        axis += 1
    return None


def _slice_of_diagonal(graph: Graph, node: node_def_pb2.NodeDef) -> tuple[list[np.ndarray], dict[str, int]]:
    """The strided slice `node` (of leading dimensions only) as it applies to its input's
    diagonal: without the entry that reads the last dimension, if it has one."""
    source, *spec_refs = graph.inputs(node.name)
    begin, end, strides = (np.atleast_1d(np.asarray(graph.constant_value(ref))) for ref in spec_refs)
    masks = {key: node.attr[key].i for key in ("begin_mask", "end_mask", "shrink_axis_mask", "new_axis_mask")}
    read = sum(1 for entry in range(len(begin)) if not masks["new_axis_mask"] >> entry & 1)
    if read == graph.spec(source).shape.rank:  # the last entry reads the last dimension (whole)
        last = len(begin) - 1
        begin, end, strides = begin[:last], end[:last], strides[:last]
        masks = {key: value & ~(1 << last) for key, value in masks.items()}
    return [begin, end, strides], masks


__all__ = ["DiagOfElementwise"]
