"""Recomputing instead of holding: a cheap whole matrix is made again for its late readers.

A kernel matrix `K = k(Z, Z)` is read early (`K + σ²I` → Cholesky) and again late (its
gradient `Σ dK ⊙ K` for the lengthscales). Held in between, it sits at the program's peak
beside the Cholesky factor and the gradient's work matrices. When K is cheap to make —
elementwise maps, broadcasts, and products with a small inner dimension, from small
inputs (its *cone*) — the late readers get their own copy, made just before them:

    K = k(Z, Z)                          K = k(Z, Z)
    L = chol(K + σ²I)                    L = chol(K + σ²I)
    ... the peak: K, L, dL, ...     →    ... the peak: L, dL, ... (K is gone)
    g = Σ dK ⊙ K                         Z′ = Z − 0·(dK₀ ≠ dK₀);  g = Σ dK ⊙ k(Z′, Z′)

The copy reads its leaves through a subtraction of an exact zero computed from an input
of the first late reader (`dK`; see `order.computed_after`): it cannot be made before that input
exists, and XLA cannot merge it back into the original (its common-subexpression pass
sees other operands). That input must be one the program's inputs decide: XLA folds a
constant (a loss gradient's seed) and the copy with it, so a reader of nothing else waits
for what its result meets downstream instead (`_tie`; GPflow VGP's KL gradient). The
split planner does this (`Planner._recompute_later`) for a tensor held across the static
peak, and keeps it only when the peak falls; the copy's readers may then be split like
any others.

XLA's schedule is not the estimate's, and its peak can be elsewhere. When a plan XLA
compiled does not fit, `recompute_across_xla_peak` does the same for what XLA's own live
set at its peak shows held there (`XlaPlan.peak`), a Cholesky factor included, with the
readers XLA runs after its peak; XLA's next plan decides whether it stays
(`tfmem.stages.compile_within_budget`). XLA holds a buffer for a late reader of any map
it fused from it, too: a Matérn kernel's `1 + √5·r + 5/3·r²` is never written out, and a
gradient that reads it late keeps `r` alive. Such a map is made again for its late
readers (`_fused_from`), and each copy waits for what its first reader reads last in
XLA's order, so that XLA makes it just before its readers rather than just after the
peak (where it would be held until them).

Example (GPflow SGPR loss and gradients; `Exp_1` is the inducing points' kernel matrix):
    >>> cone = cheap_cone(graph, TensorRef("Exp_1"), leaf_limit=2**20)
    >>> cone.leaves                     # Z / lengthscales [M, 3]: all it takes
    >>> estimate = estimate_memory(graph)   # its peak: the gradient's triangular solves
    >>> readers = late_readers(graph, TensorRef("Exp_1"), estimate)   # gradient_tape/mul_5, ...
    >>> recompute_for(graph, cone, readers, estimate)  # the copy's output; they read it now
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import tensorflow as tf

from tfmem.config import format_size
from tfmem.errors import first_line
from tfmem.graph import Graph, GraphError, TensorRef, copy_node, set_node_inputs
from tfmem.memory import MemoryEstimate, graph_node_for, held_at_xla_peak, xla_schedule
from tfmem.passes import RewriteRecord
from tfmem.report import XLA_PEAK_RULE

from rewrites.split.compared import check_one_evaluation
from rewrites.split.cone import Cone, grow_cone
from rewrites.split.op_rules import ELEMENTWISE_OPS, UNARY_OPS
from rewrites.split.order import can_order, computed_after, made_from_inputs
from tfmem.memory import XLA_EXPANDED_OPS

RECOMPUTE_RULE = "RecomputeForLateReaders"
# Ops whose cost is proportional to what they read or write: recomputing them costs about
# as much as reading the tensor back from memory would.
# Not the special functions XLA lowers to loops of many steps per element (igamma).
CHEAP_OPS = (UNARY_OPS | ELEMENTWISE_OPS) - XLA_EXPANDED_OPS | frozenset({
    "ExpandDims", "Squeeze", "Reshape", "BroadcastTo", "Tile", "Fill", "Transpose", "Const",
    "Sum", "Mean", "Max", "Min", "Prod", "MatrixSetDiagV3", "MatrixDiagV3", "MatrixDiagPartV3",
    "MatrixBandPart", "Select", "ZerosLike", "OnesLike",
    # Copies of parts of their input: TFP's `fill_triangular` (GPflow's triangular `q_sqrt`).
    "ConcatV2", "ReverseV2", "StridedSlice", "Slice"})
PRODUCT_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
# How many of the ops a reader's result flows into (the first the schedule runs) are
# searched for a tie when the reader's own inputs are constants.
_TIE_SEARCH = 32
# Factorizations cost about as much as one triangular solve with a square right-hand
# side: made again only where XLA's own plan shows the factor held across its peak
# (`recompute_across_xla_peak`), never on the static estimate's word alone.
FACTORIZATION_OPS = frozenset({"Cholesky"})
# A product is cheap when each output element sums at most this many terms (a kernel
# matrix's squared distances: the inputs' dimension).
MAX_INNER = 128
_MAX_CONE_NODES = 64


def _inner_dimension(graph: Graph, name: str) -> int | None:
    node = graph.node(name)
    shape = graph.spec(graph.inputs(name)[0]).shape
    if shape.rank is None or shape.rank < 2:
        return None
    adjoint = node.attr["transpose_a"].b if node.op == "MatMul" else node.attr["adj_x"].b
    return shape[-2] if adjoint else shape[-1]


def cheap_cone(graph: Graph, tensor: TensorRef, *, leaf_limit: int, factorizations: bool = False,
               in_loop: bool = False, value_sized_leaves: bool = False) -> Cone | str:
    """The cheap ops that make `tensor` from inputs of at most `leaf_limit` bytes (or
    inputs of the program, held anyway); or why there are none.

    Cheap: elementwise maps, broadcasts and reshapes, reductions, diagonal edits, and
    products whose inner dimension is at most `MAX_INNER`; with `factorizations`, a
    Cholesky factor too. Anything else over `leaf_limit` — a product over the data — is
    not recomputed. `in_loop`: for a loop's body, where XLA must know every shape when
    it compiles: nothing sized by a value (GPflow's `eye(num_data)`, num_data a variable),
    unless `value_sized_leaves`: such a tensor is then a leaf, made outside and read whole.
    """
    def refuse(name: str) -> str | None:
        op = graph.node(name).op
        if factorizations and op in FACTORIZATION_OPS:
            return None
        if op in PRODUCT_OPS:
            inner = _inner_dimension(graph, name)
            if inner is None or inner > MAX_INNER:
                return f"{tensor.name} is made by {name} ({op}), a product over {inner or 'unknown'} terms"
            return None
        return None if op in CHEAP_OPS else f"{tensor.name} is made by {name} ({op}), which is not cheap to recompute"

    return grow_cone(graph, tensor, leaf_limit=leaf_limit, refuse=refuse, max_nodes=_MAX_CONE_NODES,
                     resident_leaves=True, sized_by_values=not in_loop, value_sized_leaves=value_sized_leaves)


def late_readers(graph: Graph, tensor: TensorRef, estimate: MemoryEstimate) -> list[tuple[str, int]]:
    """The readers of `tensor` that the estimate's schedule runs after its peak: what
    keeps it alive there. Empty when it is read at the peak itself."""
    position = {name: i for i, name in enumerate(estimate.steps)}
    peak = position.get(estimate.peak_node or "", -1)
    readers = graph.consumers(tensor)
    if any(position.get(reader, -1) == peak for reader, _ in readers):
        return []
    return [(reader, slot) for reader, slot in readers if position.get(reader, -1) > peak]


def readers_after(graph: Graph, tensor: TensorRef, peak_node: str, xla_order: Mapping[str, int]) -> list[tuple[str, int]]:
    """The readers of `tensor` that XLA runs after its peak at `peak_node`; empty when
    `peak_node` itself reads it.

    A reader that depends on the peak runs after it, one the peak depends on before it;
    for the others `xla_order` decides (the program's ops by their first step in XLA's
    schedule; one with no step of its own there, fused into another op, stays before).
    The estimate's schedule is no guide here: a loop's first chunk, peeled, the estimate
    may run early and XLA late.
    """
    readers = _through_identities(graph, tensor)
    if any(reader == peak_node for reader, _ in readers):
        return []
    before, after = graph.ancestors(peak_node), graph.descendants(peak_node)
    peak = xla_order[peak_node]

    def runs_after(reader: str) -> bool:
        if reader in before or reader in after:
            return reader in after
        return reader in xla_order and xla_order[reader] > peak

    return [(reader, slot) for reader, slot in readers if runs_after(reader)]


def fused_positions(graph: Graph, xla_order: Mapping[str, int]) -> dict[str, int]:
    """`xla_order` with a position for the ops XLA fused into others: each runs inside
    the first of its readers that has a step of its own (a reader of a kernel matrix's
    distances, fused into the gradient's product with it, runs where that product runs)."""
    positions = dict(xla_order)
    for name in reversed(graph.topological_order()):
        if name not in positions:
            steps = [positions[reader] for reader in graph.node_consumers(name) if reader in positions]
            if steps:
                positions[name] = min(steps)
    return positions


def _through_identities(graph: Graph, tensor: TensorRef) -> list[tuple[str, int]]:
    """The readers of `tensor`, looking through `Identity` ops (the split stage hands a
    loop its inputs through them; XLA runs none): each reads the same value, and a
    reader past one can be given a copy on its own."""
    readers: list[tuple[str, int]] = []
    for reader, slot in graph.consumers(tensor):
        if graph.node(reader).op == "Identity" and not graph.control_inputs(reader):
            readers.extend(_through_identities(graph, TensorRef(reader)))
        else:
            readers.append((reader, slot))
    return readers


def _tie(graph: Graph, cone: Cone, readers: Sequence[str], position: Mapping[str, int],
         peak_node: str | None = None) -> TensorRef | None:
    """The floating-point input of the first of `readers` made last (other than the tensor
    itself) that the program's inputs decide: the copy waits for it.

    Without one — the reader's other inputs are constants, such as a loss gradient's
    seed, which XLA folds: `computed_after` would order nothing, and XLA would merge the
    copy back into the original — the input made last, after the estimate's peak at
    `peak_node`, of an op the reader's result flows into, where it meets the rest of the
    program (GPflow VGP's KL gradient meets the likelihood's). Never a tensor made from
    what a reader makes: the copy would wait for itself.
    """
    first = min(readers, key=lambda r: position.get(r, -1))
    downstream = graph.descendants(*readers)
    varying = made_from_inputs(graph)

    def usable(ref: TensorRef) -> bool:
        return (ref != cone.tensor and ref.node not in downstream and ref.node not in cone.nodes
                and can_order(graph, ref, varying))

    candidates = [ref for ref in graph.inputs(first) if usable(ref)]
    if not candidates and peak_node in position:
        nearby = sorted(graph.descendants(first), key=lambda name: position.get(name, len(position)))[:_TIE_SEARCH]
        candidates = [ref for name in nearby for ref in graph.inputs(name)
                      if position.get(ref.node, -1) > position[peak_node] and usable(ref)]
    return max(candidates, key=lambda ref: position.get(ref.node, -1), default=None)


def recompute_for(graph: Graph, cone: Cone, readers: Sequence[tuple[str, int]],
                  estimate: MemoryEstimate | None = None, *, tie: TensorRef | None = None,
                  inside_readers: Mapping[TensorRef, Sequence[tuple[str, int]]] | None = None) -> TensorRef:
    """Makes a copy of `cone` for `readers` (see the module docstring), after `tie`, or
    without one after the last made input of the first of them in the estimate's
    schedule; rewires them to it and returns the copy's tensor. Raises GraphError when
    nothing can order the copy."""
    if tie is None:
        if estimate is None:
            raise GraphError("recompute_for needs a tie or an estimate to order the copy")
        position = {name: i for i, name in enumerate(estimate.steps)}
        tie = _tie(graph, cone, [reader for reader, _ in readers], position, estimate.peak_node)
        if tie is None:
            raise GraphError(f"no tensor made from the program's inputs (not from {cone.tensor.name}'s late "
                             "readers) is read beside it, or after the peak where its readers' results go: "
                             "nothing orders a copy")
    if not graph.spec(tie).dtype.is_floating or not graph.spec(tie).shape.num_elements():
        raise GraphError(f"{tie.name} is no floating-point tensor with elements: it cannot order a copy")
    if not any(graph.spec(leaf).dtype.is_floating for leaf in cone.leaves):
        raise GraphError(f"{cone.tensor.name} is made from no floating-point tensor: nothing orders a copy")
    leaves = list(cone.leaves)
    passed = graph.splice(computed_after, [tie, *leaves], scope="tfmem_recompute_after")
    scope = graph.unique_scope("tfmem_recompute")
    renamed = {name: f"{scope}/{name}" for name in cone.nodes}
    leaf_of = dict(zip(leaves, passed))
    for name in cone.nodes:
        inputs = [leaf_of[ref] if ref in leaf_of else TensorRef(renamed[ref.node], ref.index)
                  for ref in graph.inputs(name)]
        copy = set_node_inputs(copy_node(graph.node(name), renamed[name], keep_shapes=True), inputs)
        graph.add_node(copy)
    copied = TensorRef(renamed[cone.tensor.node], cone.tensor.index)
    for reader, slot in readers:
        graph.set_input(reader, slot, copied)
    for inside, its_readers in (inside_readers or {}).items():
        for reader, slot in its_readers:
            graph.set_input(reader, slot, TensorRef(renamed[inside.node], inside.index))
    check_one_evaluation(graph, cone.nodes, {TensorRef(renamed[name], i): (name,) for name in cone.nodes
                                             for i in range(len(graph.output_specs(name)))})
    return copied


def _fused_from(graph: Graph, tensor: TensorRef, own_steps: Mapping[str, int], *, least: int) -> list[TensorRef]:
    """`tensor` and what XLA makes from it inside other ops: the outputs of its readers
    with no step of their own in XLA's schedule, and theirs, and so on. XLA holds a
    buffer for a late reader of any of them: a Matérn kernel's `1 + √5·r + 5/3·r²`,
    never written out, keeps the distances `r` alive for the gradient that reads it."""
    found, frontier = [tensor], [tensor.node]
    seen = {tensor.node}
    while frontier:
        for reader in graph.node_consumers(frontier.pop()):
            if (reader in seen or reader in own_steps or graph.node(reader).op not in CHEAP_OPS
                    or graph.largest_output_bytes(reader) < least):
                continue  # an op of its own (a product's XLA may not name), or a small result held instead
            seen.add(reader)
            frontier.append(reader)
            found.extend(TensorRef(reader, i) for i in range(len(graph.output_specs(reader))))
    return found


def _held_for_late_readers(graph: Graph, tensor: TensorRef, peak_node: str, own_steps: Mapping[str, int],
                           positions: Mapping[str, int], *, least: int) -> list[tuple[TensorRef, list[tuple[str, int]]]]:
    """Each tensor made from `tensor` (itself or fused from it, `_fused_from`) that
    readers after XLA's peak read, with those readers: what they read is made again for
    them, so that nothing after the peak keeps `tensor` alive. `own_steps`: the ops with a
    step of their own in XLA's schedule; `positions`: every op's (`fused_positions`)."""
    fused = _fused_from(graph, tensor, own_steps, least=least)
    inside = {ref.node for ref in fused}
    held = []
    for ref in fused:
        readers = [(reader, slot) for reader, slot in readers_after(graph, ref, peak_node, positions)
                   if reader not in inside]
        if readers:
            held.append((ref, readers))
    return held


def _recompute_held(graph: Graph, tensor: TensorRef, readers: list[tuple[str, int]], leaf_limit: int,
                    xla_peak: MemoryEstimate, peak_node: str, positions: Mapping[str, int],
                    pass_name: str) -> RewriteRecord:
    """Makes `tensor` again from its cheap cone for `readers` (a Cholesky factor may be in
    it), just before the first of them in XLA's order; the readers after XLA's peak of what
    the cone makes on the way read the copy's too. Returns the record: fired or rejected."""
    node = tensor.node
    cone = cheap_cone(graph, tensor, leaf_limit=max(1, leaf_limit), factorizations=True)
    if isinstance(cone, str):
        return RewriteRecord(pass_name, XLA_PEAK_RULE, "rejected", (node,), kind="split", reason=(
            f"held across XLA's peak at {xla_peak.peak_node}, not made again: {cone}"))
    # The copy waits for what its first reader reads last in XLA's order, or else for the
    # op at the peak: made just before its readers, not held from the peak to them.
    tie = _tie(graph, cone, [reader for reader, _ in readers], positions, peak_node) or TensorRef(peak_node)
    # What the cone makes on the way, read after the peak too, is read from the copy, by
    # each reader the tie does not wait for (the copy waits for the tie).
    waited_for = graph.ancestors(tie.node) | {tie.node}
    inside_readers = {}
    for name in cone.nodes:
        for i in range(len(graph.output_specs(name))):
            ref = TensorRef(name, i)
            late = [(reader, slot) for reader, slot in readers_after(graph, ref, peak_node, positions)
                    if reader not in cone.nodes and reader not in waited_for]
            if ref != tensor and late:
                inside_readers[ref] = late
    checkpoint = graph.copy()
    try:
        recompute_for(graph, cone, readers, tie=tie, inside_readers=inside_readers)
    except (GraphError, ValueError, TypeError, KeyError, tf.errors.OpError) as err:
        graph.assign(checkpoint)
        return RewriteRecord(pass_name, XLA_PEAK_RULE, "rejected", (node,), kind="split",
                             reason=f"held across XLA's peak, not made again: {first_line(err)}")
    spec = graph.spec(tensor)
    names = ", ".join(reader for reader, _ in readers)
    return RewriteRecord(
        pass_name, XLA_PEAK_RULE, "fired", (node,), kind="split",
        reason=f"XLA holds it across its peak at {xla_peak.peak_node} ({format_size(xla_peak.peak_bytes)}): made "
               f"again from {', '.join(leaf.name for leaf in cone.leaves) or 'constants'} for {names}",
        details={"tensor": tensor.name, "bytes": graph.nbytes(tensor) or 0,
                 "shape": f"{spec.dtype.name}{spec.shape.as_list()}", "recomputed_for": names,
                 "nodes": len(cone.nodes)})


def recompute_across_xla_peak(graph: Graph, xla_peak: MemoryEstimate, pass_name: str,
                              *, worth: int = 16) -> list[RewriteRecord]:
    """Makes again, for their readers after it, the tensors XLA holds across its peak.

    `xla_peak` is XLA's live set at the peak of this graph's previous compile
    (`XlaPlan.peak`). A tensor of the program in it (at least 1/`worth` of the peak) that
    the op at the peak does not read, and that readers after the peak keep alive, is
    made again from its cone for those readers, as the split planner does for the
    static estimate's peak — here a Cholesky factor may be in the cone: one more
    factorization, where XLA shows the factor's memory at its peak (GPflow's SGPR
    gradient holds the inducing points' factor L across the Cholesky gradient of the
    other factor, in the solve where XLA peaks). The caller compiles the result and keeps
    it only if XLA's plan then fits better. Returns a record per tensor tried.
    """
    peak_node = graph_node_for(graph, xla_peak.peak_node or "")
    own_steps = xla_schedule(graph, xla_peak)
    if peak_node is None or peak_node not in own_steps:
        return [RewriteRecord(pass_name, XLA_PEAK_RULE, "rejected", kind="split", reason=(
            f"XLA's peak, at {xla_peak.peak_node}, is at no op of the program's own graph"))]
    positions = fused_positions(graph, own_steps)
    records: list[RewriteRecord] = []
    for live, tensor in held_at_xla_peak(graph, xla_peak, worth=worth):
        if tensor.node == peak_node:  # made at the peak
            continue
        for held, readers in _held_for_late_readers(graph, tensor, peak_node, own_steps, positions,
                                                    least=live.nbytes // 2):
            records.append(_recompute_held(graph, held, readers, live.nbytes // worth, xla_peak, peak_node,
                                           positions, pass_name))
    graph.prune()
    return records
