"""The diagonal of an elementwise expression, taken of its operands instead.

    diag_part(A − B)              →   diag_part(A) − diag_part(B)
    diag_part(A + B + C)          →   diag_part(A) + diag_part(B) + diag_part(C)     (AddN)
    diag_part(exp(−½ D))          →   exp(−½ diag_part(D))
    diag_part(a[:, None] + b)     →   a + b                     (a column's diagonal is itself, as is a row's)
    diag_part(X[0])               →   diag_part(X)[0]           (also X[None, ...], tile, expand_dims: leading dimensions)
    diag_part(stack([X, Y]))      →   stack([diag_part(X), diag_part(Y)])     (and concat, along a leading axis)
    diag_part(Xᵀ)                 →   diag_part(X)
    diag_part(set_diag(X, d))     →   d                         (`K + c·I` as AddDiagonal writes it)
    diag_part(Σₖ (x[:, None, :] − y[None, :, :])²)
                                  →   Σₖ (x − y)²               (a pairwise map, reduced over its last axis)

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
    * the matrix is not one of the program's outputs (then it is formed whole anyway). A
      matrix other ops read too is still formed for them, but no longer read whole by its
      diagonal, which takes a few vector ops more: the splitter may then compute it in
      chunks for those readers (`K @ v` beside `diag(K)`, `trace(K)`);
    * its op is elementwise (`_UNARY`, `_BINARY`, `AddN`, a cast, `tf.where` and its comparisons)
      with a real, complex or boolean result, or arranges leading dimensions only (a strided
      slice, a tile, an added axis that leaves the last two dimensions whole: GPflow tiles a
      covariance over its latent GPs; a stack or concat along a leading axis);
    * or it sets the main diagonal: that diagonal is the one set (whatever else reads the
      matrix, and even when it is returned: nothing is computed for it);
    * or it reduces (`_REDUCTIONS`) the last axis of a `[..., n, n, d]` elementwise expression
      read only inside itself (a kernel matrix written with broadcasts, which XLA keeps
      unexpanded for few features): its diagonal is the reduction of the expression over the
      pairs (i, i), computed from each operand's rows (`_pair_diagonal_of`).

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
from rewrites.merge_duplicates import attrs_key
from rewrites.split.diagonals import SET_DIAG_OPS, is_main_diagonal

RULE = "DiagOfElementwise"

# Elementwise ops whose diagonal is the op of their operand's diagonal.
_UNARY = frozenset({"Identity", "Neg", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Abs",
                    "Reciprocal", "Tanh", "Sigmoid", "Sin", "Cos", "Softplus", "Relu", "Sign", "Floor", "Ceil",
                    "Erf", "Erfc", "Inv"})
_BINARY = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "DivNoNan", "Maximum", "Minimum", "Pow",
                     "SquaredDifference", "MulNoNan"})
# Also elementwise, with their own attrs or a third operand (`tf.where`'s, broadcast too),
# the comparisons that make a `tf.where`'s condition, and `AddN` (a list of operands of one
# shape: GPflow's `Sum` kernel, and gradients summed over several readers).
_OTHER_ELEMENTWISE = frozenset({"Cast", "SelectV2", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal",
                                "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "AddN"})
_ELEMENTWISE = _UNARY | _BINARY | _OTHER_ELEMENTWISE
# Reductions whose diagonal, over the last axis of a [..., n, n, d] expression, is the
# reduction of the expression's diagonal pairs.
_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod"})
# How many elementwise ops such an expression may have.
_MAX_PAIRWISE_OPS = 32
# Ops that only arrange leading (batch) dimensions, when they leave the last two whole (a
# transpose may also swap those two: a matrix and its transpose share their diagonal).
_LEADING_SHAPE_OPS = frozenset({"StridedSlice", "Tile", "ExpandDims", "Transpose", "Pack", "ConcatV2"})
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
            _merge_copies_into(graph, node)
            why = _why_not(graph, node)
            if why == _NOT_ELEMENTWISE:
                continue
            if why is not None:
                records.append(RewriteRecord(self.name, RULE, "rejected", (node.name,), why))
                continue
            records.append(_push_down(graph, node))
            graph.prune()  # the replaced diagonal and its matrix: the operands' own readers are now the new ones
            if records[-1].status == "fired":
                # What kept a diagonal back may be gone now (the set_diag of `diag_part(K + c·I)`,
                # pruned once its diagonal was read off it): look at those again, and keep only
                # the reason of the last look in the report.
                again = {r.nodes[0] for r in records if r.status == "rejected" and r.nodes[0] in graph}
                seen -= again
                records = [r for r in records if r.status != "rejected" or r.nodes[0] not in again]
        return PassResult(graph, any(r.status == "fired" for r in records), records)


def _merge_copies_into(graph: Graph, node: node_def_pb2.NodeDef) -> None:
    """Makes the readers of every other diagonal of `node`'s matrix, taken the same way, read
    `node`: diagonals pushed down from several expressions meet at one matrix (a kernel matrix
    in `K ∘ P − 2K`), and it is formed only if something else reads it."""
    def key(other: node_def_pb2.NodeDef) -> tuple[object, ...] | None:
        matrix, *rest = graph.inputs(other.name)
        values = [graph.constant_value(ref) for ref in rest]
        if any(v is None for v in values):
            return None
        return (other.op, matrix, tuple(np.asarray(v).tobytes() for v in values), attrs_key(other))

    mine = key(node)
    if mine is None:
        return
    copies = [other for other in graph.nodes if other.op in DIAG_OPS and other.name != node.name
              and key(other) == mine]
    for other in copies:
        graph.replace_all_uses(TensorRef(other.name), TensorRef(node.name))
    if copies:
        graph.prune()


def _only_updates(graph: Graph, node: node_def_pb2.NodeDef, setting: set[str]) -> bool:
    """Whether the diagonal `node` reads is read only to update it (`set_diag(K, diag_part(K)
    + c)`, directly or through the add): then it stays with K. A diagonal read for more (a
    Jacobi preconditioner's `1 / diag(K + c·I)` outside the loop that reads K) is taken of
    K's operands, so that nothing outside the loop reads K whole."""
    def readers(name: str) -> list[str]:
        return [reader for reader, _ in graph.consumers(name)]

    for reader in readers(node.name):
        if reader in setting:
            continue
        if graph.node(reader).op not in ("Add", "AddV2") or any(r not in setting for r in readers(reader)):
            return False
    return True


def _why_not(graph: Graph, node: node_def_pb2.NodeDef) -> str | None:
    """Why the diagonal `node` is not pushed into its matrix's op (None: it is)."""
    problem = DIAG_OPS[node.op](graph, node)
    if problem is not None:
        return problem
    matrix = graph.inputs(node.name)[0]
    producer = graph.node(matrix.node)
    if producer.op not in _ELEMENTWISE | _LEADING_SHAPE_OPS | _REDUCTIONS | SET_DIAG_OPS:
        return _NOT_ELEMENTWISE
    spec = graph.spec(matrix)
    if not spec.shape.is_fully_defined() or spec.shape.rank < 2 or spec.shape[-1] != spec.shape[-2]:
        return f"{matrix.name} is {spec.shape}, not a square matrix of static shape"
    if producer.op in SET_DIAG_OPS:  # the diagonal it reads is the one just set: free, whatever else reads it
        return None if is_main_diagonal(graph, producer) else f"{producer.name} sets a diagonal off the main one"
    if not (spec.dtype.is_floating or spec.dtype.is_complex or spec.dtype == tf.bool):
        return f"{matrix.name} is {spec.dtype.name}"
    if _returned(graph, matrix):
        return f"{matrix.name} is one of the program's outputs: it is formed whole anyway"
    setting = sorted(reader for reader, _ in graph.consumers(matrix) if graph.node(reader).op in SET_DIAG_OPS)
    if setting and _only_updates(graph, node, set(setting)):
        return (f"{matrix.name} has its diagonal set by {setting[0]} (`K + c·I` in place): the diagonal it reads "
                "stays with it, for the splitter to make both in chunks")
    if producer.op in _REDUCTIONS:
        found = _pairwise_expression(graph, producer)
        return found if isinstance(found, str) else None
    if producer.op == "StridedSlice":
        return _leading_slice_problem(graph, producer)
    if producer.op == "Tile":
        multiples = graph.constant_value(graph.inputs(producer.name)[1])
        if multiples is None or list(np.asarray(multiples)[-2:]) != [1, 1]:
            return f"{producer.name} tiles the matrix dimensions, or by multiples that are not constants"
    if producer.op == "Transpose":
        perm = graph.constant_value(graph.inputs(producer.name)[1])
        rank = spec.shape.rank
        if perm is None or list(np.asarray(perm)[:-2]) != list(range(rank - 2)):
            return f"{producer.name} moves leading dimensions, or by a permutation that is not a constant"
    if producer.op == "ExpandDims":
        axis = graph.constant_value(graph.inputs(producer.name)[1])
        if axis is None or int(np.asarray(axis)) % spec.shape.rank > spec.shape.rank - 3:
            return f"{producer.name} adds a matrix dimension, not a leading one"
    if producer.op in ("Pack", "ConcatV2") and _joined_axis(graph, producer) is None:
        return f"{producer.name} joins its matrices along a matrix dimension, or along an axis that is not a constant"
    return None


def _joined_axis(graph: Graph, node: node_def_pb2.NodeDef) -> int | None:
    """The leading axis a `Pack` (`tf.stack`) or `ConcatV2` (`tf.concat`) joins its matrices
    along, counted from the front of its output; None when it is a matrix dimension or not a
    constant. (GPflow's SeparateIndependent stacks one covariance per latent GP.)"""
    rank = graph.spec(TensorRef(node.name)).shape.rank
    if node.op == "Pack":
        axis: object = node.attr["axis"].i
    else:
        axis = graph.constant_value(graph.inputs(node.name)[-1])
    if axis is None or rank is None:
        return None
    axis = int(np.asarray(axis)) % rank
    return axis if axis <= rank - 3 else None


def _returned(graph: Graph, tensor: TensorRef) -> bool:
    """Whether the program returns `tensor`, itself or through identities, whatever else reads
    it (`Graph.is_returned` asks more: whether only the return, through views, holds it)."""
    return graph.is_output(tensor) or any(graph.node(reader).op == "Identity" and _returned(graph, TensorRef(reader))
                                          for reader, _ in graph.consumers(tensor))


def _push_down(graph: Graph, node: node_def_pb2.NodeDef) -> RewriteRecord:
    """Replaces `node`, the diagonal of an elementwise op's (or a leading slice's) output."""
    matrix = graph.inputs(node.name)[0]
    producer = graph.node(matrix.node)
    n = int(graph.spec(matrix).shape[-1])
    operands = graph.inputs(producer.name)
    if producer.op in _REDUCTIONS:
        ops, leaves = _pairwise_expression(graph, producer)  # type: ignore[misc]  # _why_not found it
        expression = graph.inputs(producer.name)[0]
        reduce: Callable[..., tf.Tensor] = getattr(tf.raw_ops, producer.op)

        def build(*xs: tf.Tensor) -> tf.Tensor:
            values = {leaf: _pair_diagonal_of(x, n) for leaf, x in zip(leaves, xs)}
            for name in ops:  # in the graph's order: operands first
                values[TensorRef(name)] = _apply(graph.node(name), [values[ref] for ref in graph.inputs(name)])
            return reduce(input=values[expression], axis=-1, keep_dims=False)
        inputs = list(leaves)
    elif producer.op == "StridedSlice":
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
    elif producer.op == "Transpose":

        def build(x: tf.Tensor) -> tf.Tensor:
            return tf.linalg.diag_part(x)
        inputs = [operands[0]]
    elif producer.op in ("Pack", "ConcatV2"):
        joined = _joined_axis(graph, producer)
        join = tf.stack if producer.op == "Pack" else tf.concat

        def build(*xs: tf.Tensor) -> tf.Tensor:
            return join([tf.linalg.diag_part(x) for x in xs], axis=joined)
        inputs = list(operands) if producer.op == "Pack" else list(operands[:-1])
    elif producer.op in SET_DIAG_OPS:  # the diagonal of set_diag(X, d) is d

        def build(d: tf.Tensor) -> tf.Tensor:
            return tf.identity(d)
        inputs = [operands[1]]
    elif producer.op == "ExpandDims":
        axis = int(np.asarray(graph.constant_value(operands[1]))) % graph.spec(matrix).shape.rank

        def build(x: tf.Tensor) -> tf.Tensor:
            return tf.expand_dims(tf.linalg.diag_part(x), axis)
        inputs = [operands[0]]
    else:
        inputs = list(operands)

        def build(*xs: tf.Tensor) -> tf.Tensor:
            return _apply(producer, [_diagonal_of(x, n) for x in xs])
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


def _apply(node: node_def_pb2.NodeDef, operands: list[tf.Tensor]) -> tf.Tensor:
    """`node`'s elementwise op on new operands."""
    op: Callable[..., tf.Tensor] = getattr(tf.raw_ops, node.op)
    # The op's own argument names (`x`, `y`; `features` for Relu, `input` for Identity), and a
    # cast's target type (the only attr a build would not infer from the operands).
    args = op_def_registry.get(node.op).input_arg
    attrs = {"DstT": tf.as_dtype(node.attr["DstT"].type)} if node.op == "Cast" else {}
    if len(args) == 1 and args[0].number_attr:  # one list argument (AddN's `inputs`): all operands
        return op(**{args[0].name: operands}, **attrs)
    return op(**{arg.name: x for arg, x in zip(args, operands)}, **attrs)


def _pairwise_expression(graph: Graph, reduction: node_def_pb2.NodeDef) -> tuple[list[str], list[TensorRef]] | str:
    """The elementwise ops (in graph order) and the leaves of the `[..., n, n, d]` expression
    that `reduction` reduces over its last axis, or why it is not one.

    Every op of the expression is elementwise and read only inside it (its root, only by the
    reduction); a leaf is any other tensor, broadcast to the expression.
    """
    expression, axis = graph.inputs(reduction.name)[:2]
    shape = graph.spec(expression).shape
    if shape.rank is None or shape.rank < 3 or not shape.is_fully_defined():
        return f"{expression.name} is {shape}, not a [..., n, n, d] expression of static shape"
    axes = graph.constant_value(axis)
    if axes is None or reduction.attr["keep_dims"].b or \
            [int(a) % shape.rank for a in np.atleast_1d(np.asarray(axes))] != [shape.rank - 1]:
        return f"{reduction.name} does not reduce {expression.name}'s last axis alone, dropping it"

    def elementwise(name: str) -> bool:
        return (graph.node(name).op in _ELEMENTWISE
                and len(graph.output_specs(name)) == 1 and not graph.is_output(TensorRef(name)))

    if not elementwise(expression.node) or {r for r, _ in graph.consumers(expression)} != {reduction.name}:
        return f"{expression.name} is not an elementwise expression read only by {reduction.name}"
    inside, stack = {expression.node}, [expression.node]
    while stack:  # every elementwise op the expression is made of ...
        for ref in graph.inputs(stack.pop()):
            if ref.node not in inside and elementwise(ref.node):
                inside.add(ref.node)
                stack.append(ref.node)
        if len(inside) > _MAX_PAIRWISE_OPS:
            return f"{expression.name}'s expression has more than {_MAX_PAIRWISE_OPS} elementwise ops"
    shared = True
    while shared:  # ... less those read outside it (formed anyway: leaves), until none is
        shared = False
        for name in sorted(inside - {expression.node}):
            if any(reader not in inside for reader, _ in graph.consumers(TensorRef(name))):
                inside.discard(name)
                shared = True
    position = {name: i for i, name in enumerate(graph.topological_order())}
    ops = sorted(inside, key=position.__getitem__)
    leaves = list(dict.fromkeys(ref for name in ops for ref in graph.inputs(name) if ref.node not in inside))
    return ops, leaves


def _pair_diagonal_of(x: tf.Tensor, n: int) -> tf.Tensor:
    """What `x`, broadcast to [..., n, n, d], has at the pairs (i, i), as [..., n, d] or
    broadcastable to it: its matrix dimensions are the third and second from last."""
    shape = x.shape.as_list()
    if len(shape) < 3:
        return x  # [d], or [n | 1, d] read along the columns: the same for every row
    rows, cols = shape[-3:-1]
    if rows == cols == n:  # pairs (i, j) as one axis of n·n: (i, i) is every (n + 1)-th, no copy of x
        return tf.reshape(x, [*shape[:-3], n * n, shape[-1]])[..., ::n + 1, :]
    if cols == 1:
        return x[..., :, 0, :]  # [..., n | 1, 1, d]: one row per i
    return x[..., 0, :, :]  # [..., 1, n, d]: one column per j, read at j = i


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


def _slice_spec(graph: Graph, node: node_def_pb2.NodeDef) -> tuple[list[np.ndarray], dict[str, int]] | None:
    """The strided slice `node`'s begin, end, strides and masks, with an ellipsis spelled out
    as the whole dimensions it stands for (GPflow's `var[None, ...]`); None when they are not
    constants."""
    source, *spec_refs = graph.inputs(node.name)
    values = [graph.constant_value(ref) for ref in spec_refs]
    if any(v is None for v in values):
        return None
    begin, end, strides = (list(np.atleast_1d(np.asarray(v))) for v in values)
    masks = {key: node.attr[key].i for key in ("begin_mask", "end_mask", "shrink_axis_mask", "new_axis_mask")}
    ellipsis = node.attr["ellipsis_mask"].i
    if not ellipsis:
        return [np.asarray(begin), np.asarray(end), np.asarray(strides)], masks
    at = (ellipsis & -ellipsis).bit_length() - 1  # only the first ellipsis counts
    reads = sum(1 for entry in range(len(begin)) if entry != at and not masks["new_axis_mask"] >> entry & 1)
    whole = max(0, graph.spec(source).shape.rank - reads)
    entries: list[tuple[int, int, int, dict[str, int]]] = []  # begin, end, stride, mask bits
    for entry in range(len(begin)):
        if entry == at:  # the dimensions it stands for, read whole: both masks set
            entries += [(0, 0, 1, {"begin_mask": 1, "end_mask": 1})] * whole
        else:
            entries.append((begin[entry], end[entry], strides[entry],
                            {key: masks[key] >> entry & 1 for key in masks}))
    dtype = np.asarray(begin).dtype
    spelled = [np.asarray([e[i] for e in entries], dtype=dtype) for i in range(3)]
    return spelled, {key: sum(bits.get(key, 0) << i for i, (*_, bits) in enumerate(entries)) for key in masks}


def _leading_slice_problem(graph: Graph, node: node_def_pb2.NodeDef) -> str | None:
    """Why the strided slice `node` does not leave its input's last two dimensions whole
    (new axes among the leading ones are fine: `X[None]`, `X[None, ...]`)."""
    spec = _slice_spec(graph, node)
    if spec is None:
        return f"{node.name}'s begin, end and strides are not constants"
    (begin, end, strides), masks = spec
    shape = graph.spec(graph.inputs(node.name)[0]).shape.as_list()
    rank, axis = len(shape), 0  # `axis`: the input dimension the next entry reads
    for entry in range(len(begin)):
        if masks["new_axis_mask"] >> entry & 1:
            if axis > rank - 2:  # after the first matrix dimension
                return f"{node.name} adds an axis among the matrix dimensions"
            continue
        whole = ((masks["begin_mask"] >> entry & 1 or begin[entry] == 0)
                 and (masks["end_mask"] >> entry & 1 or end[entry] >= shape[axis])
                 and strides[entry] == 1 and not masks["shrink_axis_mask"] >> entry & 1)
        if axis >= rank - 2 and not whole:
            return f"{node.name} slices the matrix dimensions, not only leading ones"
        axis += 1
    return None


def _slice_of_diagonal(graph: Graph, node: node_def_pb2.NodeDef) -> tuple[list[np.ndarray], dict[str, int]]:
    """The strided slice `node` (of leading dimensions only) as it applies to its input's
    diagonal: without the entries that read the matrix dimensions (whole, so the diagonal's
    one dimension is read whole too when only one of them is named)."""
    spec = _slice_spec(graph, node)
    assert spec is not None  # _leading_slice_problem found constants
    (begin, end, strides), masks = spec
    read = sum(1 for entry in range(len(begin)) if not masks["new_axis_mask"] >> entry & 1)
    if read == graph.spec(graph.inputs(node.name)[0]).shape.rank:  # the last entry reads the last dimension (whole)
        last = len(begin) - 1
        begin, end, strides = begin[:last], end[:last], strides[:last]
        masks = {key: value & ~(1 << last) for key, value in masks.items()}
    return [begin, end, strides], masks


__all__ = ["DiagOfElementwise"]
