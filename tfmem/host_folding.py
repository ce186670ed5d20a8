"""Large constants are XLA's to make, not TensorFlow's host's.

Before XLA compiles a function, TensorFlow folds the function's constant subgraphs on the
host (`ConstantFold`, in tf2xla's graph optimization): every node whose data inputs are all
constants is run with TensorFlow's CPU kernels, for results up to 10 MiB, and XLA gets the
result as a literal. For the masks the rewrites build from iotas (`iota_r == iota_c`, the
diagonal of a self-distance matrix) and for a program's own `eye` or `fill`, that defeats
the point: XLA would have fused the compare into its reader and stored nothing, and instead
its executable carries the [n, n] literal, and its plan counts it. Under a limited CPU
allocator (`TF_CPU_BFC_MEM_LIMIT_IN_MB`) it is also slow: the fold allocates from that
allocator, and an allocation that fails waits 10 s for memory before the fold gives up,
at every compile. (A Matérn GP gradient at n = 2,200 under 32 MiB: 33 failed folds of nine
masks of 4.6 MiB each; `report()` took 297 s, stock XLA's first call 17 s.)

So the graph XLA gets reads, at each large computable node (over `LARGE_TENSOR_BYTES`), its
small computable operands through one `XlaOptimizationBarrier`: an XLA-only op TensorFlow
has no CPU kernel for, so nothing after it is folded on the host; XLA keeps the small
operand as it is (an [n, 1] iota: n numbers) and fuses the rest into its readers.

Only operands XLA reads as data get one: a shape, an axis, a limit must stay a compile-time
constant, so a node is shielded only through the operands `_DATA_OPERANDS` names for its
op, and one with none stays as TensorFlow would fold it (a `range` of over 2**18 numbers).

Without XLA, TensorFlow folds computable nodes on the host when it first runs a function,
and tfmem's cleanup makes more of them computable: there each large one waits for the run
instead (`leave_large_constants_to_the_executor`).

Example:
    >>> cf = tf.function(lambda x: tf.where(tf.eye(2000) > 0, 0.0, x)).get_concrete_function(
    ...     tf.TensorSpec([2000, 2000]))
    >>> graph = Graph(cf.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in cf.outputs])
    >>> shielded, names = leave_large_constants_to_xla(graph)
    >>> names   # the compare (through its 0) and the eye (through its diagonal of ones)
    ['Greater', 'eye/diag']
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfmem.graph import ORDERED_OPS, Graph, TensorRef

# Above this, a computed constant is never built on the host: not by Grappler, not by
# TensorFlow's folding before XLA, not by tfmem.
LARGE_TENSOR_BYTES = 1 << 20

BARRIER_OP = "XlaOptimizationBarrier"

# Shape queries TensorFlow folds when the shape is static (whatever computes the input).
_SHAPE_QUERIES = frozenset({"Shape", "ShapeN", "Size", "Rank"})

# Elementwise ops: every operand is data (XLA needs none of them at compile time).
_ELEMENTWISE = frozenset("""Abs Add AddV2 Cast Ceil Cos Div DivNoNan Equal Exp Floor FloorDiv FloorMod
    Greater GreaterEqual Identity IsFinite Less LessEqual Log LogicalAnd LogicalNot LogicalOr
    Maximum Minimum Mul MulNoNan Neg NotEqual Pow RealDiv Reciprocal Rsqrt Select SelectV2 Sign Sin
    Sqrt Square SquaredDifference Sub Tanh""".split())
# Other ops that make a large tensor from small ones: the positions of their data operands
# (the rest are dims, multiples, diagonal offsets: compile-time constants for XLA). Ops
# whose output is as large as their input (a reshape, a transpose) need no entry: a large
# input is shielded where it is made.
_DATA_OPERANDS: dict[str, tuple[int, ...]] = {
    "Fill": (1,), "BroadcastTo": (0,), "Tile": (0,), "MatrixDiag": (0,), "MatrixDiagV3": (0,),
    "MatrixSetDiagV3": (0, 1), "MatMul": (0, 1), "BatchMatMulV2": (0, 1), "BatchMatMulV3": (0, 1),
}


def _data_operands(op: str, count: int) -> tuple[int, ...]:
    return tuple(range(count)) if op in _ELEMENTWISE else _DATA_OPERANDS.get(op, ())


def computable_nodes(graph: Graph) -> frozenset[str]:
    """The nodes whose value depends on no input, variable or effect: what TensorFlow
    would fold (a `Const`; a shape query of a static shape; a stateless op whose data
    inputs are all computable). Computed once per version of `graph` (`Graph.derived`):
    the memory estimate reads it at every schedule."""
    return graph.derived(_computable_nodes)


def _computable_nodes(graph: Graph) -> frozenset[str]:
    computable: set[str] = set()
    for name in graph.topological_order():
        node = graph.node(name)
        inputs = graph.inputs(name)
        if node.op == "Const":
            computable.add(name)
        elif node.op in _SHAPE_QUERIES and all(graph.spec(r).shape.is_fully_defined() for r in inputs):
            computable.add(name)
        elif (inputs and node.op not in ORDERED_OPS and graph.function(node.op) is None
              and not graph.is_stateful(name) and all(r.node in computable for r in inputs)
              and all(spec.dtype != tf.variant for spec in graph.output_specs(name))):
            computable.add(name)
    return frozenset(computable)


def _large(graph: Graph, name: str) -> bool:
    """Whether an output of node `name` is over `LARGE_TENSOR_BYTES`."""
    return graph.largest_output_bytes(name) > LARGE_TENSOR_BYTES


def leave_large_constants_to_xla(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` in which TensorFlow's pre-XLA folding builds no large tensor,
    and the names of the nodes it shields (none: `graph` itself comes back).

    Each large computable node (not a `Const`: that is a literal already) reads its small
    computable data operands through an `XlaOptimizationBarrier`, one per operand tensor.
    The copy runs under XLA only (the barrier has no CPU kernel).
    """
    computable = computable_nodes(graph)
    shielded: list[str] = []
    targets: list[tuple[str, int, TensorRef]] = []
    for name in sorted(computable):
        node = graph.node(name)
        if node.op == "Const" or not _large(graph, name):
            continue
        inputs = graph.inputs(name)
        operands = [(position, inputs[position]) for position in _data_operands(node.op, len(inputs))
                    if position < len(inputs) and (graph.nbytes(inputs[position]) or 0) <= LARGE_TENSOR_BYTES]
        if operands:
            shielded.append(name)
            targets.extend((name, position, ref) for position, ref in operands)
    if not targets:
        return graph, []
    copy = graph.copy()
    _read_through(copy, targets, _barrier, "tfmem_xla_constant")
    return copy, shielded


def leave_large_constants_to_the_executor(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` in which TensorFlow builds no large tensor when it instantiates the
    function, for a program run without XLA; and the names of the nodes that changed (none:
    `graph` itself comes back).

    TensorFlow folds a function's computable nodes on the host when it first runs it
    (`ConstantFold`, in the function runtime), and parses its `Const`s then. tfmem's
    cleanup makes more nodes computable (a `Shape` of a [3000, 3000] matrix becomes a
    `Const`, and a seeded dropout mask of that shape with it): under a limited allocator the
    fold's copy of a 34 MiB mask crashed the process (SIGSEGV in `tensor::DeepCopy`), where
    the program as written ran out of memory cleanly; and a splat `zeros` of 68.7 MiB failed
    to parse ("Cannot parse tensor from proto"). So each large computable node that reads
    no other large computable node (the rest read it, and wait for the run) reads its small
    operands through `_executor_barrier`, and a large splat `Const` becomes a `Fill` whose
    shape does: they are made when the program runs, where the plan counts them.

    Example:
        >>> cf = tf.function(lambda x: x + tf.random.stateless_uniform([2000, 2000], seed=[1, 2])
        ...                  ).get_concrete_function(tf.TensorSpec([2000, 2000]))
        >>> graph = Graph(cf.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in cf.outputs])
        >>> _, names = leave_large_constants_to_the_executor(graph)
        >>> names
        ['stateless_random_uniform/StatelessRandomUniformV2']
    """
    computable = computable_nodes(graph)
    roots = [name for name in sorted(computable) if graph.node(name).op != "Const" and _large(graph, name)
             and not any(r.node in computable and _large(graph, r.node) for r in graph.inputs(name))]
    targets = [(name, position, ref) for name in roots for position, ref in enumerate(graph.inputs(name))
               if (graph.nbytes(ref) or 0) <= LARGE_TENSOR_BYTES]
    splats = {node.name: value for node in graph.find("Const")
              if _large(graph, node.name) and (value := _splat(node)) is not None}
    if not targets and not splats:
        return graph, []
    copy = graph.copy()
    _read_through(copy, targets, _executor_barrier, "tfmem_executor_constant")
    for name, value in splats.items():
        shape = graph.spec(TensorRef(name)).shape.as_list()
        (filled,) = copy.splice(lambda: tf.fill(_executor_barrier(tf.constant(shape, tf.int64)), value), [],
                                scope="tfmem_executor_constant")
        copy.replace_all_uses(TensorRef(name), filled)
        if not copy.node_consumers(name) and not copy.is_output(TensorRef(name)):
            copy.remove(name)  # a function parses every Const it holds, read or not
    return copy, sorted({name for name, _, _ in targets} | set(splats))


def _read_through(graph: Graph, targets: list[tuple[str, int, TensorRef]], barrier: Callable[[tf.Tensor], tf.Tensor],
                  scope: str) -> None:
    """Makes each (node, input position, operand) of `targets` read its operand through
    `barrier`, one barrier per operand tensor, in place."""
    barriers: dict[TensorRef, TensorRef] = {}
    for name, position, ref in targets:
        if ref not in barriers:
            (barriers[ref],) = graph.splice(barrier, [ref], scope=scope)
        graph.set_input(name, position, barriers[ref])


def _splat(node: Any) -> Any:
    """The one value of a `Const` node stored as a splat (one value for many elements), as a
    NumPy scalar; None for any other constant."""
    proto = node.attr["value"].tensor
    if proto.tensor_content or proto.dtype in (tf.string.as_datatype_enum, tf.resource.as_datatype_enum,
                                               tf.variant.as_datatype_enum):
        return None
    scalar = type(proto)()
    scalar.CopyFrom(proto)
    scalar.ClearField("tensor_shape")
    try:
        value = tf.make_ndarray(scalar)
    except (TypeError, ValueError):
        return None
    return value if value.size == 1 else None


def _executor_barrier(tensor: tf.Tensor) -> tf.Tensor:
    """`tensor`, unchanged, through an op TensorFlow's folding cannot see through: a select
    on whether the (stateful, so never folded) clock reads at least zero, which it always does."""
    return tf.where(tf.raw_ops.Timestamp() >= 0.0, tensor, tensor)


def _barrier(tensor: tf.Tensor) -> tf.Tensor:
    from tensorflow.compiler.tf2xla.python import xla  # XLA's op wrappers, loaded when needed

    (out,) = xla.optimization_barrier(tensor)
    return out


__all__ = ["BARRIER_OP", "LARGE_TENSOR_BYTES", "computable_nodes", "leave_large_constants_to_the_executor",
           "leave_large_constants_to_xla"]
