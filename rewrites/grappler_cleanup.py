"""Cleanup: canonicalise the graph with TensorFlow's Grappler, then fold no-op shape ops.

    Reshape(Const, Const) → Const;  Shape(x) → Const (static x);  Pow(x, 2) → Square(x)
    Identity(x) → x;  NoOp / control chains → pruned;  Sub(Const 2, Const 1) → Const 1
    Reshape|ExpandDims|Squeeze|BroadcastTo|EnsureShape(x, ...) → x   when the shape is unchanged
    Cast(x, T) → x                                                    when x is already T

Grappler (constfold, arithmetic, dependency, pruning; one meta-optimizer round) runs on
a MetaGraphDef built around the GraphDef, with the function's outputs, placeholders
and kept nodes (variable writes) named as fetches so it preserves them. Its output has
no `_output_shapes`, so static shapes are recomputed (`grappler_shapes.infer_shapes`, seeded with
the shapes the original graph had for the nodes Grappler left in place — a variable
read's shape is only known from there). Grappler leaves reshapes whose shape tensor is
computed but statically known, and casts to the same type; the no-op folds above
(pattern rules) catch them. Patterns downstream then see e.g. `Square(Sub(...))`
however the user spelled it.

Conditions: if Grappler raises, drops a placeholder, an output or a kept node, changes
an output's type, or its graph cannot be re-typed, the graph stays unchanged (no folds
either) and the pass records "rejected" with the reason. The function library is
carried over from the input as it was, with the functions Grappler specialised added.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import function_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2

from tfmem.context import PassContext
from tfmem.errors import first_line
from tfmem.graph import Graph, GraphError, TensorRef
from tfmem.host_folding import LARGE_TENSOR_BYTES
from tfmem.passes import GraphPass, PassResult, RewriteRecord
from tfmem.pattern import Match, OpBuilder, Pattern, PatternNode, RewriteRule, RuleSet

from rewrites.grappler_shapes import constant_like, infer_shapes, placeholder_like, placeholder_node

logger = logging.getLogger(__name__)

GRAPPLER_OPTIMIZERS: tuple[str, ...] = ("constfold", "arithmetic", "dependency", "pruning")


def run_grappler(graph: Graph, optimizers: Sequence[str] = GRAPPLER_OPTIMIZERS) -> Graph:
    """The graph after one round of the given Grappler optimizers, with static shapes.

    Example:
        >>> cleaned = run_grappler(graph)
        >>> cleaned.outputs == graph.outputs and not cleaned.lint()
        True

    Raises:
        GraphError: if Grappler fails, or its result lost something the function needs.
    """
    from tensorflow.python.grappler import tf_optimizer

    protected = sorted({o.node for o in graph.outputs} | (graph.keep & {n.name for n in graph.nodes})
                       | {n.name for n in graph.find("Placeholder")})
    shielded = _shield_large_constants(graph)
    meta_graph = meta_graph_pb2.MetaGraphDef()
    meta_graph.graph_def.CopyFrom(shielded.graph.to_graph_def())
    # Grappler treats the train_op collection as fetches: those nodes survive with their names.
    meta_graph.collection_def["train_op"].node_list.value.extend(protected)
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers.extend(optimizers)
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    rewrite.min_graph_nodes = -1  # small graphs too: the tests and small functions need it
    try:
        optimized = tf_optimizer.OptimizeGraph(config, meta_graph)
    except Exception as err:  # Grappler's errors come as several types; all mean "keep the original"
        raise GraphError(f"Grappler failed: {type(err).__name__}: {first_line(err)}") from err
    names = {n.name: n for n in optimized.node}
    for name in protected:
        if name not in names:
            raise GraphError(f"Grappler dropped {name!r}, which the function needs")
        if graph.node(name).op == "Placeholder" and names[name].op != "Placeholder":
            raise GraphError(f"Grappler turned placeholder {name!r} into a {names[name].op}")
    # Nodes Grappler kept under their name compute the same tensors: their old shapes
    # are valid hints where inference alone cannot know (e.g. reads of a variable).
    for node in optimized.node:
        if node.name in graph and graph.node(node.name).op == node.op \
                and "_output_shapes" in graph.node(node.name).attr:
            node.attr["_output_shapes"].CopyFrom(graph.node(node.name).attr["_output_shapes"])
    # Grappler may drop functions it thinks unused, and adds the ones it specialises (the
    # branches of a `tf.cond`'s gradient, "…_tfg_region_specialized_…"), which its nodes call.
    specialised = function_pb2.FunctionDefLibrary()
    specialised.CopyFrom(optimized.library)
    optimized.library.CopyFrom(graph.library)
    optimized.versions.CopyFrom(graph.versions)
    cleaned = Graph(optimized, outputs=graph.outputs, keep=graph.keep)
    cleaned.merge_library(specialised)
    shielded.restore(cleaned)
    infer_shapes(cleaned)
    problems = cleaned.lint()
    if problems:
        raise GraphError(f"Grappler's graph is not usable: {problems[0]}")
    for output in graph.outputs:
        if cleaned.spec(output).dtype != graph.spec(output).dtype or not \
                cleaned.spec(output).shape.is_compatible_with(graph.spec(output).shape):
            raise GraphError(f"Grappler changed output {output} from {graph.spec(output)} to "
                             f"{cleaned.spec(output)}")
    return cleaned


# --- large constants Grappler must not compute --------------------------------------------


@dataclasses.dataclass
class _Shielded:
    """A copy of a graph prepared so that Grappler never builds a large tensor on the host.

    Grappler evaluates every node whose inputs are constants, whatever its size, and
    keeps the result if it is a splat (an [M, M] `eye`, an [M, N] `Fill`); and it feeds
    every placeholder a made-up tensor of the placeholder's shape. Both cost time and
    host memory that grow with the tensors tfmem exists to avoid. So, in the copy:

    - shape queries of statically shaped tensors are constants already (what Grappler
      would have folded them into, without its needing the shapes below);
    - large computable nodes are placeholders (opaque: Grappler cannot fold them), those
      made from a `zeros_like` of an input too (its value is its shape's), and so are small
      ones that Grappler could fold together into a large one (`_may_fold_into_large`);
    - large placeholders, and those stand-ins, have unknown dimensions (tiny feeds);
    - floating-point constants added to computed values are stand-ins too, one per read
      (`_shield_additive_constants`): Grappler would reassociate around them.

    `restore` puts the hidden nodes (and whatever of their constant inputs Grappler
    dropped) and the original placeholders back.
    """

    graph: Graph
    originals: Graph
    hidden: tuple[str, ...] = ()
    relaxed: tuple[str, ...] = ()
    # Constants made opaque at one read each: the value each stand-in stands for.
    operands: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def restore(self, cleaned: Graph) -> None:
        for name, value in self.operands.items():
            if name in cleaned:  # the stand-in becomes the constant it stood for, folded
                cleaned.replace_node(constant_like(cleaned, name, value))
        missing: list[str] = []
        for name in self.hidden + self.relaxed:
            if name in cleaned:  # still read: the stand-in becomes the node again
                cleaned.replace_node(self.originals.node(name))
                missing.extend(self.originals.producers(name))
        while missing:
            name = missing.pop()
            if name not in cleaned:
                cleaned.add_node(self.originals.node(name))
                missing.extend(self.originals.producers(name))


# Sums and differences, whose constant operands Grappler's constant folding moves elsewhere.
_ADDITIVE_OPS = frozenset({"Add", "AddV2", "Sub", "BiasAdd"})

_SHAPE_QUERIES = {"Shape": lambda shape: shape, "Size": lambda shape: int(np.prod(shape)),
                  "Rank": lambda shape: len(shape)}
# Ops whose value is their input's static shape's alone: Grappler folds them whatever the input.
_SHAPE_ONLY_OPS = frozenset({"ZerosLike", "OnesLike"})
# Binary elementwise ops whose constant operands Grappler's push-down gathers and folds together.
_ELEMENTWISE_BINARY = _ADDITIVE_OPS | {"Mul", "RealDiv", "Div", "MulNoNan", "DivNoNan", "Maximum", "Minimum",
                                       "SquaredDifference"}


def _shield_large_constants(graph: Graph) -> _Shielded:
    shielded = graph.copy()
    for node in list(shielded.find(list(_SHAPE_QUERIES))):
        shape = shielded.spec(shielded.inputs(node.name)[0]).shape
        if shape.is_fully_defined():
            dtype = node.attr["out_type"].type if "out_type" in node.attr else tf.int32.as_datatype_enum
            value = np.asarray(_SHAPE_QUERIES[node.op](shape.as_list()), tf.as_dtype(dtype).as_numpy_dtype)
            shielded.replace_node(constant_like(shielded, node.name, value))
    computable: set[str] = set()  # nodes whose value depends on no input, variable or effect
    hidden: list[str] = []
    relaxed: list[str] = []
    for node in shielded.nodes:
        large = len(shielded.output_specs(node.name)) == 1 \
            and (shielded.nbytes(TensorRef(node.name)) or 0) > LARGE_TENSOR_BYTES
        if node.op == "Placeholder":
            relaxed += [node.name] if large else []
            continue
        producers = shielded.producers(node.name)
        shape_only = (node.op in _SHAPE_ONLY_OPS
                      and shielded.spec(shielded.inputs(node.name)[0]).shape.is_fully_defined())
        if node.op == "Const" or shape_only or (producers and not shielded.is_stateful(node.name)
                                                and all(p in computable for p in producers)):
            computable.add(node.name)
            hidden += [node.name] if large and node.op != "Const" else []
    hidden += [name for name in sorted(computable - set(hidden)) if _may_fold_into_large(shielded, name, computable)]
    for name in hidden + relaxed:
        shielded.replace_node(placeholder_like(shielded, name, unknown_dims=True))
    operands = _shield_additive_constants(shielded, computable)
    return _Shielded(shielded, graph, tuple(hidden), tuple(relaxed), operands)


def _may_fold_into_large(graph: Graph, name: str, computable: set[str]) -> bool:
    """Whether Grappler may fold computable node `name` with another constant into a large one.

    Its constant push-down gathers the constant factors of a chain of elementwise ops:
    `(sW ∘ K) ∘ sWᵀ` → `(sW ∘ sWᵀ) ∘ K`, and evaluates `sW ∘ sWᵀ`, an [n, n] outer product of
    two [n] vectors, on the host (a Laplace GP classifier's Newton step from f = 0: 17 MiB
    the allocator then keeps as a region). So a computable tensor with more than one element,
    read by an elementwise op that makes a large value from what is not computable, is hidden.
    """
    spec = graph.spec(TensorRef(name))
    if not (spec.dtype.is_floating or spec.dtype.is_complex) or (spec.shape.num_elements() or 0) <= 1:
        return False
    return any(graph.node(reader).op in _ELEMENTWISE_BINARY and reader not in computable
               and (graph.nbytes(TensorRef(reader)) or 0) > LARGE_TENSOR_BYTES
               for reader, _ in graph.consumers(TensorRef(name)))


def _constant_value(graph: Graph, ref: TensorRef) -> np.ndarray | None:
    """The value of a `Const`, also through casts and identities (GPflow's `to_default_float`), or None.

    Only these: a constant computed otherwise (a `Fill` of zeros, a sum of constants) is left to
    Grappler, which folds what it feeds.
    """
    dtype = graph.spec(ref).dtype
    while graph.node(ref.node).op in ("Cast", "Identity") and ref.index == 0:
        ref = graph.inputs(ref.node)[0]
    value = graph.constant_value(ref)
    return None if value is None else np.asarray(value).astype(dtype.as_numpy_dtype)


def _shield_additive_constants(shielded: Graph, computable: set[str]) -> dict[str, np.ndarray]:
    """Makes each floating-point constant that a sum or difference adds to a computed value
    opaque to Grappler, at that read only; returns the constants to put back, by stand-in.

    Grappler's constant folding reassociates around such a constant ("push-down": `(x - y)
    + c` → `x + (c - y)`), which real arithmetic allows and IEEE arithmetic does not: a
    `‖xᵢ − xⱼ + 1e-9‖` guard inside a distance lost its 1e-9 in float32, and its gradient was
    NaN where stock XLA, which keeps the program's order, has none. A constant is a `Const`,
    also through a cast (`tf.cast` of a float64 constant, as GPflow's `to_default_float`
    makes), which comes back folded, as Grappler would have left it (the rewrites read it as a
    constant, and a new constant: XLA plans more for GPflow's VGP when the program's own
    constants are read there, 114.4 MiB against 105.3 at N=1,500). Each read gets its own
    stand-in, so the same constant still folds where it is read otherwise (the exponent
    `2 - 1` of a `Pow` gradient). Products are left alone: a constant factor may be folded
    into a neighbouring one (`(x·c)/c` → `x`), as stock TensorFlow does with a constant the
    function makes itself; only an overflow or underflow the written order would hit differs.
    """
    operands: dict[str, np.ndarray] = {}
    for node in list(shielded.nodes):
        if node.op not in _ADDITIVE_OPS or node.name in computable:
            continue
        for position, ref in enumerate(shielded.inputs(node.name)):
            spec = shielded.spec(ref)
            if not (spec.dtype.is_floating or spec.dtype.is_complex):
                continue
            value = _constant_value(shielded, ref)
            if value is None:
                continue
            stand_in = shielded.unique_name(f"{ref.node}/tfmem_additive_operand")
            shielded.add_node(placeholder_node(stand_in, tf.TensorSpec(spec.shape, spec.dtype)))
            shielded.set_input(node.name, position, TensorRef(stand_in))
            operands[stand_in] = value
    return operands


# --- no-op folds Grappler leaves behind -------------------------------------------------


def no_op_shape_change(op: OpBuilder, x: PatternNode) -> PatternNode:
    """A shape op that may leave its input's shape as it was."""
    return op.any_of((op.Reshape | op.ExpandDims | op.BroadcastTo)(x, op.any()),
                     (op.Squeeze | op.EnsureShape)(x))


def no_op_cast(op: OpBuilder, x: PatternNode) -> PatternNode:
    """A cast that may be to the type its input already has."""
    return op.Cast(x)


def _unchanged(graph: Graph, match: Match) -> str | None:
    """Why the root is not a no-op of `x`: its static shape or dtype differs, or it is an output.

    (An output must stay a node of its own: if it became a placeholder, the import,
    which drops placeholders, could not return it.)
    """
    before, after = graph.spec(match["x"]), graph.spec(match.root)
    if not before.shape.is_fully_defined():
        return f"{match['x']} has a dynamic shape {before.shape}"
    if before.shape != after.shape or before.dtype != after.dtype:
        return f"it changes {before.dtype.name}{before.shape} to {after.dtype.name}{after.shape}"
    if graph.is_output(match.root):
        return f"{match.root} is a graph output"
    return None


class FoldNoOp(RewriteRule):
    """Forwards `x` past a shape op or cast that leaves it unchanged (no new ops)."""

    def __init__(self, name: str, pattern_fn: Callable[..., PatternNode]) -> None:
        super().__init__(name, Pattern(pattern_fn, require=_unchanged))

    def apply(self, graph: Graph, match: Match) -> dict[TensorRef, TensorRef]:
        return {match.root: match["x"]}  # readers of the no-op read its input; pruning removes it


def no_op_folds() -> list[RewriteRule]:
    """The fold rules; an op that does change the shape or dtype is not a match (logged why)."""
    return [FoldNoOp("FoldNoOpReshape", no_op_shape_change), FoldNoOp("FoldNoOpCast", no_op_cast)]


class GrapplerCleanup(GraphPass):
    """Runs Grappler once, then folds no-op reshapes and casts. See the module docstring."""

    name = "grappler_cleanup"
    stage = "cleanup"
    reads = frozenset()  # no config key: the graph alone decides

    def __init__(self, optimizers: Sequence[str] = GRAPPLER_OPTIMIZERS) -> None:
        self.optimizers = tuple(optimizers)
        self._done: set[int] = set()

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        records: list[RewriteRecord] = []
        before = len(graph)
        modified = False
        # Grappler is a fixed point after one round on its own output: run it once per graph.
        fingerprint = hash(graph.to_graph_def().SerializeToString(deterministic=True))
        if fingerprint not in self._done:
            try:
                cleaned = run_grappler(graph, self.optimizers)
            except GraphError as err:  # all or nothing: the graph goes on exactly as it came
                logger.info("grappler cleanup skipped: %s", err)
                return PassResult(graph, False, [RewriteRecord(self.name, "Grappler", "rejected",
                                                               reason=str(err), kind="cleanup")])
            else:
                modified = _differs(graph, cleaned)
                if modified:
                    records.append(RewriteRecord(self.name, "Grappler", "fired",
                                                 details={"nodes_before": before,
                                                          "nodes_after": len(cleaned)},
                                                 kind="cleanup"))
                graph = cleaned
        folds = RuleSet(no_op_folds(), name=self.name).run(graph, context)
        records.extend(r for r in folds.records if r.status == "fired")
        graph = folds.graph
        self._done.add(hash(graph.to_graph_def().SerializeToString(deterministic=True)))
        return PassResult(graph, modified or folds.modified, records)


def _differs(a: Graph, b: Graph) -> bool:
    if a.outputs != b.outputs or len(a) != len(b):
        return True
    return any(n.name not in b or b.node(n.name).op != n.op or list(b.node(n.name).input) != list(n.input)
               for n in a.nodes)


__all__ = ["GRAPPLER_OPTIMIZERS", "FoldNoOp", "GrapplerCleanup", "no_op_folds", "run_grappler"]
