"""Diagonal reads and writes of a big matrix as elementwise selects, which split by rows.

    set_diag(X, diag_part(X) + d)  →  X + where(I, d[..., None, :], 0)     I = (iota_r == iota_c)
    set_diag(X, v)                 →  where(I, v[..., None, :], X)
    diag_part(X)                   →  reduce_sum(where(I, X, 0), axis=-1)

`set_diag` and `diag_part` (what `AddDiagonal` makes of `K + σ²I`) have no split rule:
a row chunk's diagonal sits at a column that moves with the chunk. Written with the
identity mask they are elementwise ops and a row reduction, which the split stage passes
through, so a kernel matrix with jitter can be computed chunk by chunk (inside a loop that
recomputes it, `rewrites.split.sink`). The values are the same bits: a select picks, the
sum adds one diagonal entry to zeros. XLA lowers both ops to these same selects, so a
program compiled with XLA does the same work; only the main diagonal (k = 0) of square
matrices is lowered.

Example:
    >>> lowered = lower_diagonals(graph, limit=2**20)  # every set_diag / diag_part of a matrix over 1 MiB
    >>> [old.name for old in lowered]
    ['add_diagonal/diag_part:0', 'add_diagonal/set_diag:0']
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from rewrites.split.op_rules import ELEMENTWISE_OPS, REDUCTION_OPS, UNARY_OPS
from tfmem.graph import Graph, TensorRef
from tfmem.memory import LOWERED_SCOPE_SUFFIX

# Every version of the two ops; the first takes no offset `k` (it is the main diagonal).
SET_DIAG_OPS = frozenset({"MatrixSetDiag", "MatrixSetDiagV2", "MatrixSetDiagV3"})
DIAG_PART_OPS = frozenset({"MatrixDiagPart", "MatrixDiagPartV2", "MatrixDiagPartV3"})
# `tf.linalg.diag(v)`: a matrix made from its diagonal.
MATRIX_DIAG_OPS = frozenset({"MatrixDiag", "MatrixDiagV2", "MatrixDiagV3"})


def lower_diagonals(graph: Graph, limit: int, names: set[str] | None = None) -> dict[TensorRef, TensorRef]:
    """Lowers every main-diagonal `set_diag` / `diag_part` of a square matrix over `limit`
    bytes (among `names`, if given) to selects; returns each lowered output → its new tensor."""
    lowered: dict[TensorRef, TensorRef] = {}
    # Updates first: `set_diag(X, diag_part(X) + d)` is lowered whole, before its diag_part.
    for node in sorted(graph.nodes, key=lambda n: n.op not in SET_DIAG_OPS):
        if node.name not in graph:
            continue  # pruned: the diag_part of an update lowered whole
        if node.op not in SET_DIAG_OPS | DIAG_PART_OPS or (names is not None and node.name not in names):
            continue
        inputs = graph.inputs(node.name)
        matrix = inputs[0]
        shape = graph.spec(matrix).shape
        if (not shape.is_fully_defined() or shape.rank < 2 or shape[-1] != shape[-2]
                or not is_main_diagonal(graph, node) or (graph.nbytes(matrix) or 0) <= limit):
            continue
        n = int(shape[-1])

        def mask(n: int = n) -> tf.Tensor:
            return diagonal_mask(n)

        added = _added_to_diagonal(graph, matrix, inputs[1]) if node.op in SET_DIAG_OPS else None
        if added is not None:  # set_diag(X, diag_part(X) + d): X + d·I, without X's diagonal read apart
            [new] = graph.splice(lambda x, d: x + tf.where(mask(), _as_row(d), tf.zeros([], x.dtype)),
                                 [matrix, added], scope=f"{node.name}{LOWERED_SCOPE_SUFFIX}")
        elif node.op in SET_DIAG_OPS:
            [new] = graph.splice(lambda x, v: tf.where(mask(), tf.expand_dims(v, -2), x),
                                 [matrix, inputs[1]], scope=f"{node.name}{LOWERED_SCOPE_SUFFIX}")
        else:
            [new] = graph.splice(lambda x: tf.reduce_sum(tf.where(mask(), x, tf.zeros([], x.dtype)), axis=-1),
                                 [matrix], scope=f"{node.name}{LOWERED_SCOPE_SUFFIX}")
        graph.replace_all_uses(TensorRef(node.name), new)
        lowered[TensorRef(node.name)] = new
        graph.prune()
    return lowered


def overwritten_diagonals(graph: Graph, limit: int) -> set[str]:
    """The `set_diag(X, v)` nodes over `limit` bytes whose `v` is not `diag_part(X) + d`:
    a diagonal written over, as a leave-one-out statistic or a contrastive loss masks its
    self-pairs (`set_diag(S, -inf)` before a row's logsumexp). Lowered to a select, the
    whole expression splits by rows (`Planner.split_all`)."""
    names = set()
    for node in graph.nodes:
        if node.op in SET_DIAG_OPS and (graph.nbytes(TensorRef(node.name)) or 0) > limit:
            matrix, values = graph.inputs(node.name)[:2]
            if _added_to_diagonal(graph, matrix, values) is None:
                names.add(node.name)
    return names


def lower_matrix_diags(graph: Graph, limit: int) -> dict[TensorRef, TensorRef]:
    """Lowers every square `diag(v)` over `limit` bytes (main diagonal, its padding a scalar)
    to `where(I, v[..., None, :], padding)`, which splits by rows as `K + diag(noise)` needs;
    returns each lowered output → its new tensor."""
    lowered: dict[TensorRef, TensorRef] = {}
    for node in graph.nodes:
        if node.op not in MATRIX_DIAG_OPS or (graph.nbytes(TensorRef(node.name)) or 0) <= limit:
            continue
        shape = graph.spec(TensorRef(node.name)).shape
        inputs = graph.inputs(node.name)
        if not shape.is_fully_defined() or shape.rank < 2 or shape[-1] != shape[-2] \
                or graph.spec(inputs[0]).shape[-1:] != shape[-1:] or not is_main_diagonal(graph, node):
            continue
        # MatrixDiag pads with zeros; V2/V3 read (diagonal, k, num_rows, num_cols, padding_value).
        operands = [inputs[0]] if node.op == "MatrixDiag" else [inputs[0], inputs[4]]

        def made(v: tf.Tensor, pad: tf.Tensor | None = None, n: int = int(shape[-1])) -> tf.Tensor:
            return tf.where(diagonal_mask(n), tf.expand_dims(v, -2), tf.zeros([], v.dtype) if pad is None else pad)

        [new] = graph.splice(made, operands, scope=f"{node.name}{LOWERED_SCOPE_SUFFIX}")
        graph.replace_all_uses(TensorRef(node.name), new)
        lowered[TensorRef(node.name)] = new
    if lowered:
        graph.prune()
    return lowered


# Readers through which a row chunk of a band flows on (the band's own rows): a causal
# mask's scores go to elementwise ops, a softmax, a reduction or a product.
_ROW_LOCAL_READERS = UNARY_OPS | ELEMENTWISE_OPS | REDUCTION_OPS | frozenset({
    "Softmax", "LogSoftmax", "Select", "MatMul", "BatchMatMulV2", "BatchMatMulV3"})


def lower_band_parts(graph: Graph, limit: int) -> dict[TensorRef, TensorRef]:
    """Lowers every `band_part(X, lower, upper)` of a matrix over `limit` bytes, its limits
    constants and its readers row-local (`_ROW_LOCAL_READERS`), to `where(B, X, 0)` with B
    the band as iota compares (a causal mask, `band_part(S, -1, 0)`): a row chunk's band
    moves with it, so only the select splits by rows; returns each lowered output → its new
    tensor."""
    lowered: dict[TensorRef, TensorRef] = {}
    for node in graph.nodes:
        if node.op != "MatrixBandPart" or (graph.nbytes(TensorRef(node.name)) or 0) <= limit:
            continue
        if any(graph.node(reader).op not in _ROW_LOCAL_READERS for reader, _ in graph.consumers(node.name)):
            continue  # a solve or a factorization reads the band whole: nothing to split it for
        new = band_part_as_select(graph, node.name, scope=f"{node.name}{LOWERED_SCOPE_SUFFIX}")
        if new is not None:
            lowered[TensorRef(node.name)] = new
    if lowered:
        graph.prune()
    return lowered


def band_part_as_select(graph: Graph, band: str, *, scope: str, offset: TensorRef | None = None) -> TensorRef | None:
    """Replaces the `MatrixBandPart` node `band` by `band_as_select` of its matrix (its readers
    read the select; the caller prunes); returns the select, or None when the band's limits
    are not constants or its shape is not static (the band is left as it is). `offset`: an
    int32 scalar zero the select's row iota adds (`bands_offset_by`)."""
    matrix, lower_ref, upper_ref = graph.inputs(band)
    shape = graph.spec(matrix).shape
    lower, upper = graph.constant_value(lower_ref), graph.constant_value(upper_ref)
    if lower is None or upper is None or not shape.is_fully_defined() or shape.rank < 2:
        return None
    select = functools.partial(band_as_select, rows=int(shape[-2]), cols=int(shape[-1]),
                               lower=int(lower), upper=int(upper))
    if offset is None:
        [new] = graph.splice(select, [matrix], scope=scope)
    else:
        [new] = graph.splice(lambda x, zero: select(x, offset=zero), [matrix, offset], scope=scope)
    graph.replace_all_uses(TensorRef(band), new)
    return new


def bands_offset_by(graph: Graph, nodes: Sequence[str], *,
                    scope: str) -> tuple[list[str], TensorRef | None, dict[TensorRef, TensorRef]]:
    """`nodes` with each `MatrixBandPart` among them lowered to `band_as_select`, its row
    iota offset by a new int32 zero (a `Const` outside `nodes`); returns the nodes after
    (in topological order, the selects' ops included), that zero (None: no band), and each
    lowered band's output → its select.

    For a loop of one trip (`order.once_in_a_loop`) that reads the zero through its trip
    counter. XLA lowers a band part to a select by a mask made of iotas; with constant
    limits, the mask (or the `iota_r - iota_c` it compares) is made of constants alone,
    and XLA hoists it out of the loop and holds it whole until the loop runs (GPflow VGP's
    `q_sqrt` gradient fold, N=2,000: a bool [2000, 2000] across XLA's peak, an int32 one
    when the limits alone vary). Offset by a value of the loop, the mask is made in the
    loop, fused into its select, and never stored.
    """
    bands = [name for name in nodes if graph.node(name).op == "MatrixBandPart"]
    if not bands:
        return list(nodes), None, {}
    before = {node.name for node in graph.nodes}
    [zero] = graph.splice(lambda: tf.zeros([], tf.int32), [], scope=f"{scope}_zero")
    lowered: dict[TensorRef, TensorRef] = {}
    for band in bands:
        select = band_part_as_select(graph, band, scope=f"{band}{LOWERED_SCOPE_SUFFIX}", offset=zero)
        if select is not None:
            lowered[TensorRef(band)] = select
    if not lowered:
        graph.remove(zero.node)
        return list(nodes), None, {}
    keep = (set(nodes) - {ref.node for ref in lowered}) | ({node.name for node in graph.nodes} - before - {zero.node})
    for ref in lowered:
        if not graph.node_consumers(ref.node) and not graph.is_output(ref):
            graph.remove(ref.node)
    return [node.name for node in graph.nodes if node.name in keep], zero, lowered


def band_as_select(x: tf.Tensor, rows: int, cols: int, lower: int, upper: int,
                   offset: tf.Tensor | None = None) -> tf.Tensor:
    """`band_part(x, lower, upper)` as `where(B, x, 0)`, B the band as compares of the row and
    column iotas (`[rows, 1]` against `[1, cols]`): made of only the compares its limits ask
    for, so XLA fuses them into the select's reader and never stores B. `offset`: an int32
    zero added to the row iota (a value of a loop, so that XLA does not hoist B out of it).

    Example:
        >>> band_as_select(tf.ones([3, 3]), 3, 3, -1, 0).numpy()   # band_part(x, -1, 0)
        array([[1., 0., 0.],
               [1., 1., 0.],
               [1., 1., 1.]], dtype=float32)
    """
    row = tf.range(rows) if offset is None else tf.range(rows) + offset
    below = tf.expand_dims(row, 1) - tf.expand_dims(tf.range(cols), 0)  # i - j
    # A whole `ones` [rows, cols] beside the compares (for a limit of -1) would be a constant
    # of the matrix's size, sliced into a loop instead of made in it.
    keeps = ([below <= lower] if lower >= 0 else []) + ([-below <= upper] if upper >= 0 else [])
    if not keeps:
        return tf.identity(x)  # band_part(x, -1, -1) keeps everything
    keep = keeps[0] if len(keeps) == 1 else tf.logical_and(*keeps)
    return tf.where(keep, x, tf.zeros([], x.dtype))


def diagonal_mask(n: int) -> tf.Tensor:
    """The identity as a boolean mask, `iota_r == iota_c` [n, n] (it broadcasts over batches).

    Selects by it are elementwise, so the split stage cuts them by rows; XLA fuses the iota
    compare into its reader, so the mask itself is never stored.
    """
    iota = tf.range(n)
    return tf.equal(tf.expand_dims(iota, 1), tf.expand_dims(iota, 0))


def _added_to_diagonal(graph: Graph, matrix: TensorRef, diagonal: TensorRef) -> TensorRef | None:
    """`d` when `diagonal` is `diag_part(matrix) + d` (what `AddDiagonal` writes), else None."""
    node = graph.node(diagonal.node)
    if node.op not in ("Add", "AddV2"):
        return None
    for position, ref in enumerate(graph.inputs(node.name)):
        reader = graph.node(ref.node)
        if reader.op in DIAG_PART_OPS and graph.inputs(ref.node)[0] == matrix and is_main_diagonal(graph, reader):
            return graph.inputs(node.name)[1 - position]
    return None


def is_main_diagonal(graph: Graph, node: node_def_pb2.NodeDef) -> bool:
    """Whether a `set_diag` / `diag_part` node reads or writes the main diagonal: its offset
    `k` is the constant 0, or it is a first version, which has no offset."""
    if node.op in ("MatrixSetDiag", "MatrixDiagPart", "MatrixDiag"):
        return True
    inputs = graph.inputs(node.name)
    value = graph.constant_value(inputs[2] if node.op in SET_DIAG_OPS else inputs[1])
    return value is not None and not np.any(np.asarray(value) != 0)


def _as_row(d: tf.Tensor) -> tf.Tensor:
    """`d` (per diagonal entry, or a scalar) broadcast along a matrix's rows."""
    return tf.expand_dims(d, -2) if d.shape.rank else d
