"""Split rules: how the dimensions of an op's inputs and outputs correspond.

Each supported op is described by its *dimension classes*, as in einsum notation:
a class lists the `(operand, axis)` pairs that must be split together, where an
operand is one input *position* of the node or one of its outputs. For
`MatMul(a[m,k], b[k,n]) → out[m,n]` the classes are `m: {a.0, out.0}`,
`n: {b.1, out.1}` and `k: {a.1, b.0}`. A class that contains an output *maps* the split
through the op; a class without one *reduces* the split dimension, and names the
`combine` that merges per-chunk results (sum, max, top-k merge, ...). Positions, not
tensors, because one tensor may play two roles: in `X @ Xᵀ` split by rows, input 0 is
sliced and input 1 is read whole.

A few ops carry the full size of a dimension in a constant input (the target shape of a
`Reshape`, the `size` of a `Slice`); `chunk_patches` says how to rewrite those constants
for a chunk.

Ops without a rule end a region: the tensor that reaches them is computed in full.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from tensorflow.core.framework import node_def_pb2

from tfmem.graph import Graph, TensorRef

@dataclasses.dataclass(frozen=True, order=True)
class Operand:
    """Input `position` of node `node`, which reads tensor `ref`."""

    node: str
    position: int
    ref: TensorRef = dataclasses.field(compare=False)


Member = tuple["Operand | TensorRef", int]  # an input position or an output, and one of its axes


@dataclasses.dataclass(frozen=True)
class DimClass:
    """Axes that are split together; `combine` names the merge of a reduced class."""

    members: tuple[Member, ...]
    combine: str | None = None

    def tensors(self) -> list[tuple[TensorRef, int]]:
        """The members as `(tensor, axis)`: an input position stands for the tensor it reads."""
        return [(m.ref if isinstance(m, Operand) else m, axis) for m, axis in self.members]

    def operands(self) -> dict[int, int]:
        """Input position → its split axis, for the input positions in this class."""
        return {m.position: axis for m, axis in self.members if isinstance(m, Operand)}


class NoRule(Exception):
    """The op has no split rule (or not for these attributes); the message says why."""


_UNARY = frozenset("""Abs Acos Asin Atan Cast Ceil Cos Cosh Digamma Erf Erfc Exp Expm1 Floor Identity
    Inv IsFinite IsInf IsNan Lgamma Log Log1p LogicalNot Neg OnesLike PreventGradient Reciprocal Relu
    Relu6 Rint Round Rsqrt Sigmoid Sign Sin Sinh Snapshot Softplus Softsign Sqrt Square StopGradient
    Tan Tanh ZerosLike CheckNumerics EnsureShape Elu Selu Asinh Acosh Atanh Erfinv Ndtri BesselI0e
    BesselI1e LeakyRelu""".split())
_ELEMENTWISE = frozenset("""Add AddV2 Sub Mul RealDiv Div DivNoNan Maximum Minimum Pow SquaredDifference
    Greater GreaterEqual Less LessEqual Equal NotEqual LogicalAnd LogicalOr SelectV2 AddN TanhGrad
    SigmoidGrad SqrtGrad RsqrtGrad ReciprocalGrad Atan2 FloorDiv FloorMod Xdivy Xlogy MulNoNan
    TruncateDiv ReluGrad SoftplusGrad BiasAdd Xlog1py Igamma Igammac IgammaGradA EluGrad SeluGrad
    Relu6Grad SoftsignGrad LeakyReluGrad""".split())
# Public names for other passes that ask "is this op elementwise?" (the recompute cone).
UNARY_OPS, ELEMENTWISE_OPS = _UNARY, _ELEMENTWISE
_REDUCTIONS = {"Sum": "sum", "Mean": "mean", "Max": "max", "Min": "min", "Prod": "prod",
               "All": "all", "Any": "any"}
REDUCTION_OPS = frozenset(_REDUCTIONS)


def _operands(graph: Graph, node: node_def_pb2.NodeDef) -> list[Operand]:
    return [Operand(node.name, i, ref) for i, ref in enumerate(graph.inputs(node.name))]


def _ref(tensor: Operand | TensorRef) -> TensorRef:
    return tensor.ref if isinstance(tensor, Operand) else tensor


def _shape(graph: Graph, tensor: Operand | TensorRef) -> list[int]:
    shape = graph.spec(_ref(tensor)).shape
    if not shape.is_fully_defined():
        raise NoRule(f"{_ref(tensor)} has no static shape")
    return shape.as_list()


def _const(graph: Graph, tensor: Operand | TensorRef, what: str) -> np.ndarray:
    value = graph.constant_value(_ref(tensor))
    if value is None:
        raise NoRule(f"its {what} ({_ref(tensor)}) is not a constant")
    return value


def _elementwise(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """Broadcasting: output axis j lines up with each input's axis j - (rank_out - rank_in)."""
    out = TensorRef(node.name)
    out_shape = _shape(graph, out)
    inputs = _operands(graph, node)
    classes = []
    for j, size in enumerate(out_shape):
        members: list[Member] = [(out, j)]
        for ref in inputs:
            shape = _shape(graph, ref)
            axis = j - (len(out_shape) - len(shape))
            if axis >= 0 and shape[axis] == size:  # a size-1 (broadcast) input is invariant
                members.append((ref, axis))
        classes.append(DimClass(tuple(members)))
    return classes


def _unary(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x = _operands(graph, node)[0]
    return [DimClass(((x, j), (TensorRef(node.name), j))) for j in range(len(_shape(graph, x)))]


def _select(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """TF1's `Select(cond, t, e)` (Pow's gradient uses it): `t`, `e` and the output share one
    shape; `cond` has that shape too, or is a scalar (read whole), or is a vector that picks
    whole rows (its axis lines up with axis 0, not with the last as broadcasting would)."""
    cond, t, e = _operands(graph, node)
    out = TensorRef(node.name)
    rank, cond_rank = len(_shape(graph, out)), len(_shape(graph, cond))
    classes = []
    for j in range(rank):
        members: list[Member] = [(out, j), (t, j), (e, j)]
        if cond_rank == rank or (cond_rank == 1 and j == 0):
            members.append((cond, j))
        classes.append(DimClass(tuple(members)))
    return classes


def _reduction(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x, axes_ref = _operands(graph, node)
    rank = len(_shape(graph, x))
    axes = {int(a) % rank for a in np.ravel(_const(graph, axes_ref, "axis"))}
    keep = node.attr["keep_dims"].b
    out = TensorRef(node.name)
    classes, out_axis = [], 0
    for j in range(rank):
        if j in axes:
            classes.append(DimClass(((x, j),), combine=_REDUCTIONS[node.op]))
            out_axis += keep
        else:
            classes.append(DimClass(((x, j), (out, out_axis))))
            out_axis += 1
    return classes


def _arg_reduction(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x, axis_ref = _operands(graph, node)
    rank = len(_shape(graph, x))
    axis = int(_const(graph, axis_ref, "axis")) % rank
    out = TensorRef(node.name)
    combine = "argmax" if node.op == "ArgMax" else "argmin"
    return [DimClass(((x, j),), combine) if j == axis else DimClass(((x, j), (out, j - (j > axis))))
            for j in range(rank)]


def _top_k(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x = _operands(graph, node)[0]
    rank = len(_shape(graph, x))
    values, indices = TensorRef(node.name, 0), TensorRef(node.name, 1)
    return [DimClass(((x, j), (values, j), (indices, j))) for j in range(rank - 1)] + [
        DimClass(((x, rank - 1),), combine="topk")]


def _matmul(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    a, b = _operands(graph, node)
    out = TensorRef(node.name)
    if node.op == "MatMul":
        ta, tb = node.attr["transpose_a"].b, node.attr["transpose_b"].b
    else:
        ta, tb = node.attr["adj_x"].b, node.attr["adj_y"].b
    a_shape, b_shape, out_shape = _shape(graph, a), _shape(graph, b), _shape(graph, out)
    ra, rb, ro = len(a_shape), len(b_shape), len(out_shape)
    classes = []
    for j in range(ro - 2):  # broadcast batch dimensions
        members: list[Member] = [(out, j)]
        for ref, shape in ((a, a_shape), (b, b_shape)):
            axis = j - (ro - len(shape))
            if axis >= 0 and shape[axis] == out_shape[j]:
                members.append((ref, axis))
        classes.append(DimClass(tuple(members)))
    a_rows, a_inner = (ra - 1, ra - 2) if ta else (ra - 2, ra - 1)
    b_inner, b_cols = (rb - 1, rb - 2) if tb else (rb - 2, rb - 1)
    classes.append(DimClass(((a, a_rows), (out, ro - 2))))
    classes.append(DimClass(((b, b_cols), (out, ro - 1))))
    classes.append(DimClass(((a, a_inner), (b, b_inner)), combine="sum"))
    return classes


def _triangular_solve(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    matrix, rhs = _operands(graph, node)
    out = TensorRef(node.name)
    rank = len(_shape(graph, rhs))
    if len(_shape(graph, matrix)) != 2:
        raise NoRule("batched triangular systems are not split")
    # Each right-hand-side column is solved on its own: only the last axis splits.
    return [DimClass(((rhs, rank - 1), (out, rank - 1)))]


def _transpose(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x, perm_ref = _operands(graph, node)
    perm = [int(p) for p in _const(graph, perm_ref, "permutation")]
    out = TensorRef(node.name)
    return [DimClass(((x, p), (out, j))) for j, p in enumerate(perm)]


def _expand_dims(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x, axis_ref = _operands(graph, node)
    rank = len(_shape(graph, x))
    new = int(_const(graph, axis_ref, "axis")) % (rank + 1)
    out = TensorRef(node.name)
    return [DimClass(((x, j), (out, j + (j >= new)))) for j in range(rank)]


def _squeeze(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x = _operands(graph, node)[0]
    shape = _shape(graph, x)
    dims = {d % len(shape) for d in node.attr["squeeze_dims"].list.i} or {
        j for j, s in enumerate(shape) if s == 1}
    out, classes, out_axis = TensorRef(node.name), [], 0
    for j in range(len(shape)):
        if j not in dims:
            classes.append(DimClass(((x, j), (out, out_axis))))
            out_axis += 1
    return classes


def _reshape_axes(in_shape: list[int], out_shape: list[int]) -> list[tuple[int, int]]:
    """Input/output axes a reshape keeps intact: same size, same number of elements before."""
    pairs = []
    for i, size in enumerate(in_shape):
        before = int(np.prod(in_shape[:i]))
        for j, out_size in enumerate(out_shape):
            if out_size == size and int(np.prod(out_shape[:j])) == before and size > 1:
                pairs.append((i, j))
                break
    return pairs


def _reshape(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x, shape_ref = _operands(graph, node)
    _const(graph, shape_ref, "target shape")
    out = TensorRef(node.name)
    return [DimClass(((x, i), (out, j))) for i, j in _reshape_axes(_shape(graph, x), _shape(graph, out))]


def _tile(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """Untiled axes map through; an axis tiled from size 1 is a broadcast, which splits like
    a `Fill` (its multiple is patched per chunk). (The gradient of a sum tiles like that.)"""
    x, multiples_ref = _operands(graph, node)
    multiples = _const(graph, multiples_ref, "multiples")
    out, shape = TensorRef(node.name), _shape(graph, x)
    classes = []
    for j, m in enumerate(multiples):
        if int(m) == 1:
            classes.append(DimClass(((x, j), (out, j))))
        elif shape[j] == 1:
            classes.append(DimClass(((out, j),)))
    return classes


def _broadcast_to(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x, shape_ref = _operands(graph, node)
    _const(graph, shape_ref, "target shape")
    out = TensorRef(node.name)
    in_shape, out_shape = _shape(graph, x), _shape(graph, out)
    classes = []
    for j, size in enumerate(out_shape):
        axis = j - (len(out_shape) - len(in_shape))
        members = [(out, j)] + ([(x, axis)] if axis >= 0 and in_shape[axis] == size else [])
        classes.append(DimClass(tuple(members)))
    return classes


def _fill(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """A splat reads nothing along its axes: any of them splits (its dims constant is patched)."""
    dims_ref = graph.inputs(node.name)[0]
    _const(graph, dims_ref, "dims")
    out = TensorRef(node.name)
    return [DimClass(((out, j),)) for j in range(len(_shape(graph, out)))]


def _slice(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x, begin_ref, size_ref = _operands(graph, node)
    begin, size = _const(graph, begin_ref, "begin"), _const(graph, size_ref, "size")
    shape, out = _shape(graph, x), TensorRef(node.name)
    return [DimClass(((x, j), (out, j))) for j in range(len(shape))
            if int(begin[j]) == 0 and int(size[j]) in (-1, shape[j])]


def _strided_slice_specs(graph: Graph, node: node_def_pb2.NodeDef) -> list[tuple[int | None, int | None, bool]]:
    """Per slice spec: (input axis, output axis, takes that axis whole), ellipsis expanded.

    A new axis has no input axis; a shrunk axis has no output axis.
    """
    if node.op == "StridedSliceGrad":  # (shape of the sliced tensor, begin, end, strides, dy)
        shape_ref, begin_ref, end_ref, strides_ref, _ = graph.inputs(node.name)
        shape = [int(size) for size in _const(graph, shape_ref, "shape")]
    else:
        x, begin_ref, end_ref, strides_ref = graph.inputs(node.name)
        shape = _shape(graph, x)
    begin, end = _const(graph, begin_ref, "begin"), _const(graph, end_ref, "end")
    strides = _const(graph, strides_ref, "strides")
    masks = {k: node.attr[k].i for k in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                         "shrink_axis_mask")}
    consuming = sum(1 for spec in range(len(begin))
                    if not (masks["new_axis_mask"] | masks["ellipsis_mask"]) & (1 << spec))
    specs: list[tuple[int | None, int | None, bool]] = []
    in_axis = out_axis = 0
    for spec in range(len(begin)):
        bit = 1 << spec
        if masks["ellipsis_mask"] & bit:
            for _ in range(len(shape) - consuming):
                specs.append((in_axis, out_axis, True))
                in_axis, out_axis = in_axis + 1, out_axis + 1
        elif masks["new_axis_mask"] & bit:
            specs.append((None, out_axis, False))
            out_axis += 1
        elif masks["shrink_axis_mask"] & bit:
            specs.append((in_axis, None, False))
            in_axis += 1
        else:
            whole = (int(strides[spec]) == 1 and bool(masks["begin_mask"] & bit or int(begin[spec]) == 0)
                     and bool(masks["end_mask"] & bit or int(end[spec]) >= shape[in_axis]))
            specs.append((in_axis, out_axis, whole))
            in_axis, out_axis = in_axis + 1, out_axis + 1
    for rest in range(in_axis, len(shape)):  # axes past the spec are taken whole
        specs.append((rest, out_axis + rest - in_axis, True))
    return specs


def _strided_slice(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """Slices such as `x[:, None, :]` or `x[..., None]`: axes taken whole map through."""
    x, out = _operands(graph, node)[0], TensorRef(node.name)
    return [DimClass(((x, i), (out, o))) for i, o, whole in _strided_slice_specs(graph, node)
            if whole and i is not None and o is not None]


def _strided_slice_grad(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """The gradient of a slice pads `dy` back to the sliced tensor's shape: the axes the
    slice took whole map through (its `shape` and `end` constants are patched per chunk)."""
    dy, out = _operands(graph, node)[4], TensorRef(node.name)
    return [DimClass(((dy, o), (out, i))) for i, o, whole in _strided_slice_specs(graph, node)
            if whole and i is not None and o is not None]


def _reverse(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """`ReverseV2` splits on the axes it does not reverse."""
    x, axes_ref = _operands(graph, node)
    rank = len(_shape(graph, x))
    reversed_axes = {int(a) % rank for a in np.atleast_1d(_const(graph, axes_ref, "axis"))}
    out = TensorRef(node.name)
    return [DimClass(((x, j), (out, j))) for j in range(rank) if j not in reversed_axes]


def _pad(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """`Pad`, `PadV2`, `MirrorPad` (and `MirrorPadGrad`, which folds the padding back) split on
    the axes they do not pad; a `PadV2`'s fill value is read whole."""
    x, paddings_ref = _operands(graph, node)[:2]
    paddings = np.asarray(_const(graph, paddings_ref, "paddings")).reshape(-1, 2)
    out = TensorRef(node.name)
    return [DimClass(((x, j), (out, j))) for j in range(len(_shape(graph, x))) if not paddings[j].any()]


def _pack(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """`Pack` (`tf.stack`): the inputs' axis j is the output's j, or j + 1 past the new axis."""
    values, out = _operands(graph, node), TensorRef(node.name)
    rank = len(_shape(graph, values[0]))
    axis = node.attr["axis"].i % (rank + 1)
    return [DimClass(tuple([(v, j) for v in values] + [(out, j if j < axis else j + 1)])) for j in range(rank)]


def _unpack(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """`Unpack` (`tf.unstack`): the input's axis j is each output's j, or j - 1 past the
    unstacked axis."""
    x = _operands(graph, node)[0]
    rank = len(_shape(graph, x))
    axis = node.attr["axis"].i % rank
    outputs = [TensorRef(node.name, i) for i in range(node.attr["num"].i)]
    return [DimClass(((x, j), *((out, j if j < axis else j - 1) for out in outputs)))
            for j in range(rank) if j != axis]


def _batch_matrix_op(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """An op on each matrix of a batch (`MatrixBandPart`) maps the batch axes through; its
    other inputs (the band's limits) are read whole."""
    x, out = _operands(graph, node)[0], TensorRef(node.name)
    return [DimClass(((x, j), (out, j))) for j in range(len(_shape(graph, x)) - 2)]


def _gather(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """`GatherV2(params, indices, axis, batch_dims=b)`: the output is
    `params[:axis] + indices[b:] + params[axis + 1:]`. The first `b` (batch) axes of all
    three split together; params' other axes and the indices' other axes map to the
    output's; the gathered axis is read whole."""
    params, indices, axis_ref = _operands(graph, node)
    rank, index_rank = len(_shape(graph, params)), len(_shape(graph, indices))
    batch = node.attr["batch_dims"].i
    batch += index_rank if batch < 0 else 0  # counted from the indices' last axis, as TensorFlow does
    axis = int(_const(graph, axis_ref, "axis")) % rank
    if axis < batch:
        raise NoRule(f"gather along axis {axis}, inside its {batch} batch axes")
    out = TensorRef(node.name)
    classes = [DimClass(((params, j), (indices, j), (out, j))) for j in range(batch)]
    classes += [DimClass(((params, j), (out, j))) for j in range(batch, axis)]
    classes += [DimClass(((indices, k), (out, axis + k - batch))) for k in range(batch, index_rank)]
    classes += [DimClass(((params, j), (out, j + index_rank - batch - 1))) for j in range(axis + 1, rank)]
    return classes


_SEGMENT_REDUCTIONS = {"UnsortedSegmentSum": "sum", "UnsortedSegmentMax": "max", "UnsortedSegmentMin": "min",
                       "UnsortedSegmentProd": "prod"}


def _unsorted_segment(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """`UnsortedSegmentSum(data, segment_ids, num_segments)` (a gather's gradient): the axes
    of `data` the ids index are reduced, each chunk's segments merged by the op's own
    reduction (a segment no chunk row falls in holds the merge's identity); data's other
    axes map to the output's after its first."""
    data, ids, _ = _operands(graph, node)
    k, rank = len(_shape(graph, ids)), len(_shape(graph, data))
    out = TensorRef(node.name)
    combine = _SEGMENT_REDUCTIONS[node.op]
    return ([DimClass(((data, i), (ids, i)), combine=combine) for i in range(k)]
            + [DimClass(((data, j), (out, j - k + 1))) for j in range(k, rank)])


def _concat(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    *values, axis_ref = _operands(graph, node)
    out = TensorRef(node.name)
    rank = len(_shape(graph, out))
    axis = int(_const(graph, axis_ref, "axis")) % rank
    return [DimClass(tuple([(v, j) for v in values] + [(out, j)])) for j in range(rank) if j != axis]


def _row_wise(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """Softmax-like ops normalise along the last axis, which they need whole; every other
    axis maps through (all inputs and outputs share the input's shape)."""
    operands = _operands(graph, node)
    outputs = [TensorRef(node.name, i) for i in range(len(graph.output_specs(node.name)))]
    rank = len(_shape(graph, operands[0]))
    classes = []
    for j in range(rank - 1):
        members: list[Member] = [(x, j) for x in operands if len(_shape(graph, x)) == rank]
        members += [(out, j) for out in outputs if len(_shape(graph, out)) > j]
        classes.append(DimClass(tuple(members)))
    return classes


def _cumulative(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """Running sums (`Cumsum`, `Cumprod`, `CumulativeLogsumexp`, exclusive or reversed) need
    their own axis whole; every other axis maps through. Their gradients are running sums
    too, so a loss over one splits forward and backward."""
    x, axis_ref = _operands(graph, node)
    rank = len(_shape(graph, x))
    axis = int(_const(graph, axis_ref, "axis")) % rank
    out = TensorRef(node.name)
    return [DimClass(((x, j), (out, j))) for j in range(rank) if j != axis]


def _l2_loss(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    x = _operands(graph, node)[0]
    return [DimClass(((x, j),), combine="sum") for j in range(len(_shape(graph, x)))]


def _einsum(graph: Graph, node: node_def_pb2.NodeDef) -> list[DimClass]:
    """Einsum: a class per index letter; a letter missing from the output is summed over."""
    equation = node.attr["equation"].s.decode().replace(" ", "")
    operands = _operands(graph, node)
    out = TensorRef(node.name)
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if not arrow or len(terms) != len(operands):
        raise NoRule(f"einsum equation {equation!r} has no explicit output")
    shapes = [_shape(graph, x) for x in operands]
    out_shape = _shape(graph, out)
    # "..." stands for the leading axes each term lacks; number them from the right so
    # that they broadcast like elementwise ops.
    ellipsis_rank = max((len(shape) - len(term.replace("...", "")) for term, shape in zip(terms, shapes)),
                        default=0)

    def letters(term: str, rank: int) -> list[str]:
        if "..." not in term:
            return list(term)
        before, after = term.split("...")
        dots = rank - len(before) - len(after)
        return list(before) + [f"...{ellipsis_rank - dots + k}" for k in range(dots)] + list(after)

    in_letters = [letters(t, len(s)) for t, s in zip(terms, shapes)]
    out_letters = letters(rhs, len(out_shape))
    if any(len(ls) != len(set(ls)) for ls in in_letters + [out_letters]):
        raise NoRule(f"einsum equation {equation!r} repeats an index within a term (a diagonal)")
    classes = []
    for letter in dict.fromkeys(ls for term in in_letters + [out_letters] for ls in term):
        members: list[Member] = []
        sizes = set()
        for x, term, shape in zip(operands, in_letters, shapes):
            if letter in term and shape[term.index(letter)] != 1:  # size 1: broadcast, invariant
                members.append((x, term.index(letter)))
                sizes.add(shape[term.index(letter)])
        if letter in out_letters:
            members.append((out, out_letters.index(letter)))
        if len(sizes) > 1:
            raise NoRule(f"einsum index {letter!r} has sizes {sorted(sizes)}")
        classes.append(DimClass(tuple(members), combine=None if letter in out_letters else "sum"))
    return classes


_RULES: dict[str, Callable[[Graph, node_def_pb2.NodeDef], list[DimClass]]] = {
    **{op: _unary for op in _UNARY},
    **{op: _elementwise for op in _ELEMENTWISE}, "Select": _select,
    **{op: _reduction for op in _REDUCTIONS},
    "ArgMax": _arg_reduction, "ArgMin": _arg_reduction, "TopKV2": _top_k,
    "MatMul": _matmul, "BatchMatMulV2": _matmul, "BatchMatMulV3": _matmul,
    "MatrixTriangularSolve": _triangular_solve, "Transpose": _transpose,
    "ExpandDims": _expand_dims, "Squeeze": _squeeze, "Reshape": _reshape, "Tile": _tile,
    "BroadcastTo": _broadcast_to, "Slice": _slice, "StridedSlice": _strided_slice,
    "ConcatV2": _concat, "Fill": _fill, "Einsum": _einsum, "L2Loss": _l2_loss,
    **dict.fromkeys(["Cumsum", "Cumprod", "CumulativeLogsumexp"], _cumulative),
    "StridedSliceGrad": _strided_slice_grad, "ReverseV2": _reverse,
    **dict.fromkeys(["Pad", "PadV2", "MirrorPad", "MirrorPadGrad"], _pad),
    "Pack": _pack, "Unpack": _unpack, "MatrixBandPart": _batch_matrix_op, "GatherV2": _gather,
    **dict.fromkeys(_SEGMENT_REDUCTIONS, _unsorted_segment),
    **dict.fromkeys(["Softmax", "LogSoftmax", "SoftmaxCrossEntropyWithLogits"], _row_wise),
}
SUPPORTED_OPS = frozenset(_RULES)


def dim_classes(graph: Graph, name: str) -> list[DimClass]:
    """The dimension classes of node `name`.

    Raises:
        NoRule: the op is not supported, or not with these attributes or inputs.
    """
    node = graph.node(name)
    rule = _RULES.get(node.op)
    if rule is None:
        raise NoRule(f"no split rule for op {node.op}")
    return rule(graph, node)


def class_of(classes: list[DimClass], tensor: TensorRef, axis: int) -> DimClass | None:
    """The first class holding `(tensor, axis)` as an output or through an input position,
    or None if that axis cannot be split through the op."""
    for dim_class in classes:
        if (tensor, axis) in dim_class.tensors():
            return dim_class
    return None


def chunk_patches(graph: Graph, name: str, out_axis: int | None, chunk: int,
                  in_axes: dict[int, int]) -> dict[int, np.ndarray]:
    """Constant inputs of node `name` that encode a split dimension's full size, for a chunk.

    Args:
        out_axis: the split axis of the node's output (None if it is not split).
        chunk: the chunk length.
        in_axes: split axis of each split data input, by input position.

    Returns:
        input position → the constant's value for a chunk of length `chunk`.
    """
    node = graph.node(name)
    inputs = graph.inputs(name)
    if node.op == "Tile" and out_axis is not None and 0 not in in_axes:
        multiples = np.array(_const(graph, inputs[1], "multiples"))
        multiples[out_axis] = chunk
        return {1: multiples}
    if node.op in ("Reshape", "BroadcastTo", "Fill") and out_axis is not None:
        position = 0 if node.op == "Fill" else 1
        shape = np.array(_const(graph, inputs[position], "target shape"))
        if shape[out_axis] != -1:
            shape[out_axis] = chunk
        return {position: shape}
    if node.op == "Slice" and 0 in in_axes:
        size = np.array(_const(graph, inputs[2], "size"))
        if size[in_axes[0]] != -1:
            size[in_axes[0]] = chunk
        return {2: size}
    if node.op == "StridedSlice" and 0 in in_axes:
        return _strided_slice_patch(graph, node, in_axes[0], chunk)
    if node.op == "StridedSliceGrad" and out_axis is not None:
        shape = np.array(_const(graph, inputs[0], "shape"))
        shape[out_axis] = chunk
        return {0: shape, **_strided_slice_patch(graph, node, out_axis, chunk)}
    if node.op == "TopKV2" and in_axes.get(0) == len(_shape(graph, inputs[0])) - 1:
        k = int(_const(graph, inputs[1], "k"))
        return {1: np.array(min(k, chunk), dtype=np.int32)} if chunk < k else {}  # a short last chunk
    return {}


def _strided_slice_patch(graph: Graph, node: node_def_pb2.NodeDef, in_axis: int,
                         chunk: int) -> dict[int, np.ndarray]:
    """An explicit `end` on the split axis becomes the chunk length (begin is 0, stride 1)."""
    if node.attr["ellipsis_mask"].i:
        return {}  # ellipsis axes are always whole: nothing explicit to patch
    end = np.array(_const(graph, graph.inputs(node.name)[2], "end"))
    for spec, (axis, _, whole) in enumerate(_strided_slice_specs(graph, node)[:len(end)]):
        if axis == in_axis and whole and not node.attr["end_mask"].i & (1 << spec):
            end[spec] = chunk
            return {2: end}
    return {}
