"""The two ends of the round trip: ConcreteFunction → GraphDef, and GraphDef → tf.function.

`capture` takes a traced ConcreteFunction apart into what the passes need (a GraphDef
with static shapes, which placeholders are arguments and which are captured tensors or
variables, which tensors are the outputs, which ops must run for their effects).
`import_as_function` puts a (rewritten) GraphDef back together as a `tf.function` that
takes the same arguments as the user's function and returns the same structure.

Example:
    >>> cf = tf.function(lambda x: {"y": 2 * x}).get_concrete_function(tf.ones([3]))
    >>> captured = capture(cf)
    >>> f = import_as_function(captured, captured.to_graph(), jit_compile=True)
    >>> f(tf.ones([3]))["y"].numpy()
    array([2., 2., 2.], dtype=float32)
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.python.framework import function as function_lib

from tfmem.graph import Graph, TensorRef, is_stateful, rename_functions
from tfmem.executor_order import GraphModeFunction, heavy_ops_in_turn
from tfmem.host_folding import leave_large_constants_to_the_executor, leave_large_constants_to_xla

# Stateful ops that only read or check: recomputing them (e.g. in a backward pass) is harmless.
# CheckNumerics and Assert only raise (GPflow's GPR predict_f holds a CheckNumerics): counted as
# effects, they kept such programs from the custom gradient of an outer tape.
_READ_ONLY_STATEFUL_OPS = frozenset({"ReadVariableOp", "VarHandleOp", "VarIsInitializedOp",
                                     "Placeholder", "NoOp", "CheckNumerics", "Assert"})

# Numbers the imports of this process: each import's library functions get names of their own.
_IMPORTS = itertools.count(1)


# Cross-device communication ops: a graph holding them is a multi-device program.
_COLLECTIVE_OP_PREFIXES = ("Collective", "Nccl")


class UnsupportedFunction(ValueError):
    """tfmem cannot rewrite this function; the message says why."""


@dataclasses.dataclass(frozen=True)
class CapturedFunction:
    """A traced function taken apart for rewriting.

    Attributes:
        concrete: the ConcreteFunction it came from (never mutated).
        graph_def: its GraphDef, with `_output_shapes` on every node.
        arg_inputs: tensor names of the argument placeholders, in call order.
        captures: (external tensor, internal tensor name) of each captured input.
        outputs: tensor names of the flat outputs.
        control_outputs: names of ops that must run for their effects (variable writes).
        variables: the variables the function reads or writes.
        has_side_effects: whether running it twice differs from running it once.
    """

    concrete: Any
    graph_def: graph_pb2.GraphDef
    arg_inputs: tuple[str, ...]
    captures: tuple[tuple[Any, str], ...]
    outputs: tuple[str, ...]
    control_outputs: tuple[str, ...]
    variables: tuple[tf.Variable, ...]
    has_side_effects: bool

    def to_graph(self) -> Graph:
        """The Graph view passes work on: outputs protected, placeholders and effects kept."""
        placeholders = {n.name for n in self.graph_def.node if n.op == "Placeholder"}
        return Graph(self.graph_def, outputs=self.outputs,
                     keep=placeholders | set(self.control_outputs))


def capture(concrete: Any) -> CapturedFunction:
    """Takes a ConcreteFunction apart.

    Raises:
        UnsupportedFunction: if an argument's shape is not fully static, or the outputs
            cannot be matched to the graph's tensors.
    """
    graph = concrete.graph
    n_args = len(graph.inputs) - len(graph.captures)
    args = graph.inputs[:n_args]
    for tensor in args:
        if tensor.dtype != tf.resource and not tensor.shape.is_fully_defined():
            raise UnsupportedFunction(
                f"argument {tensor.op.name!r} has dynamic shape {tensor.shape}; "
                "tfmem sizes tensors statically, so every argument needs a fully known shape")
    graph_def = graph.as_graph_def(add_shapes=True)
    _check_one_device(graph_def)
    leaves = [leaf for leaf in tf.nest.flatten(concrete.structured_outputs, expand_composites=True)
              if isinstance(leaf, tf.Tensor)]
    if [t.name for t in leaves] != [t.name for t in concrete.outputs]:
        raise UnsupportedFunction("the function's outputs do not map one-to-one onto graph tensors")
    return CapturedFunction(
        concrete=concrete,
        graph_def=graph_def,
        arg_inputs=tuple(t.name for t in args),
        captures=tuple((external, internal.name) for external, internal in graph.captures),
        outputs=tuple(t.name for t in concrete.outputs),
        control_outputs=tuple(op.name for op in graph.control_outputs),
        variables=tuple(graph.variables),
        has_side_effects=_has_side_effects(graph_def),
    )


def _check_one_device(graph_def: graph_pb2.GraphDef) -> None:
    """Refuses a program that spans devices, as a function calling `strategy.run` does.

    tfmem rewrites and compiles *one device's* program; the imported graph would run on
    one device under XLA. Inside `strategy.run` each replica's trace is such a program.
    """
    devices = sorted({n.device for n in graph_def.node if n.device})
    collectives = sorted({n.op for n in graph_def.node if n.op.startswith(_COLLECTIVE_OP_PREFIXES)})
    if len(devices) > 1 or collectives:
        where = f"places ops on {len(devices)} devices ({', '.join(devices)})" if len(devices) > 1 else \
            f"runs the collective op(s) {', '.join(collectives)}"
        raise UnsupportedFunction(
            f"the function {where}, as a function calling strategy.run does; tfmem rewrites one "
            "device's program: wrap the function passed to strategy.run instead")


def _has_side_effects(graph_def: graph_pb2.GraphDef) -> bool:
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return any(is_stateful(n) and n.op not in _READ_ONLY_STATEFUL_OPS for n in nodes)


def import_as_function(captured: CapturedFunction, graph: Graph, *, jit_compile: bool,
                       input_signature: Any = None, name: str = "tfmem") -> Any:
    """Builds a `tf.function` that runs `graph` in place of `captured`'s function.

    The new function is called with the user's original arguments. Inside its trace,
    its argument placeholders line up one-to-one with the original's (both were traced
    from the same call), so they are mapped onto the imported graph's placeholders;
    captured tensors and variable handles are re-bound the same way.

    Args:
        captured: the original function, taken apart.
        graph: the (rewritten) graph; it keeps the original's placeholder names, and its
            `outputs` are one per original flat output.
        jit_compile: compile with XLA (then large constants are left to XLA to make:
            `leave_large_constants_to_xla`).
    """
    if jit_compile:
        graph, _ = leave_large_constants_to_xla(graph)
    else:  # ordered as planned first: the estimate reads computable nodes as such
        graph, _ = leave_large_constants_to_the_executor(heavy_ops_in_turn(graph))
    outputs = [o.name for o in graph.outputs]
    placeholders = {n.name for n in graph.find("Placeholder")}
    used = {p for p in placeholders if graph.node_consumers(p)} | {o.node for o in graph.outputs}
    # Mapped placeholders must not be imported: XLA has no kernel for Placeholder.
    stripped = graph.to_graph_def(drop=placeholders)
    # The functions the graph calls (loop bodies, branches) run from the eager context, where
    # TensorFlow keeps one definition per name, process-wide: see `_register_library`.
    suffix = f"_tfmem{next(_IMPORTS)}"
    rename_functions(stripped, {f.signature.name: f.signature.name + suffix for f in stripped.library.function})
    library = _register_library(stripped.library)
    control_outputs = [c for c in captured.control_outputs if c not in placeholders]
    structure = captured.concrete.structured_outputs

    def body(*args: Any, **kwargs: Any) -> Any:
        this = tf.compat.v1.get_default_graph()
        # A variable argument is listed by its (eager) handle: its placeholder is its capture's.
        placeholder_of = {id(external): internal for external, internal in this.captures}
        arg_tensors = [placeholder_of.get(id(t), t) for t in this.inputs]
        if len(arg_tensors) != len(captured.arg_inputs):
            raise UnsupportedFunction(
                f"re-tracing gave {len(arg_tensors)} argument tensors, the original had "
                f"{len(captured.arg_inputs)}")
        input_map: dict[str, tf.Tensor] = {}
        for original, tensor in zip(captured.arg_inputs, arg_tensors):
            if TensorRef.parse(original).node in used:
                input_map[original] = tensor
        for external, internal in captured.captures:
            node = TensorRef.parse(internal).node
            if node in used:
                input_map[internal] = tf.identity(external)
        results = tf.graph_util.import_graph_def(
            stripped, input_map=input_map, return_elements=outputs + control_outputs, name=name)
        tensors = results[:len(outputs)]
        if control_outputs:  # effects first, then results, as the original promised
            with tf.control_dependencies(results[len(outputs):]):
                tensors = [tf.identity(t) for t in tensors]
        leaves = iter(tensors)
        flat = [next(leaves) if isinstance(leaf, tf.Tensor) else leaf
                for leaf in tf.nest.flatten(structure, expand_composites=True)]
        return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)

    body.__name__ = name
    # Bound as the original bound its call: by `body`'s own `(*args, **kwargs)` TensorFlow
    # would order the keywords of a call as the call gives them, and `f(x, temp=t, z=z)`
    # for `fn(x, z, temp)` gave `temp` the original's `z` (a wrong result, silently).
    body.__signature__ = traced_signature(captured.concrete.function_type)  # type: ignore[attr-defined]
    body.library = library  # type: ignore[attr-defined]  # registered while the tf.function (holding body) lives
    function = tf.function(body, jit_compile=jit_compile, input_signature=input_signature, autograph=False)
    return function if jit_compile else GraphModeFunction(function)


def traced_signature(function_type: Any) -> inspect.Signature:
    """The Python signature of a traced function: its parameters' names and kinds, in order.

    A parameter traced as a Python value (a literal of `function_type`) takes it as its
    default, as the call may have left it to its default; the others default to None,
    which only keeps Python's rule (no default before none) out of the way: the call was
    traced as the original function, which bound every tensor.

    Example:
        >>> a, b = tf.ones([2]), tf.ones([2])
        >>> c = tf.function(lambda x, s=2.0, y=None: x * s + y).get_concrete_function(a, y=b)
        >>> str(traced_signature(c.function_type))
        '(x=None, s=2.0, y=None)'
    """
    return inspect.Signature([
        inspect.Parameter(p.name, p.kind, default=getattr(p.type_constraint, "value", None))
        for p in function_type.parameters.values()])


def _register_library(library: function_pb2.FunctionDefLibrary) -> list[Any]:
    """Registers `library`'s functions in the eager context; returns the objects that keep them there.

    Importing a GraphDef inside a `tf.function` puts its library in that function's graph
    only: the calls in it (a While's `cond` and `body`) are resolved when it runs, in the
    eager context, by name. Under the traced program's own names that found the context's
    definitions, not the rewritten graph's: the user's trace had registered its loops, a
    pass's scratch graph the loops it built, and a function a pass changed ran unchanged.
    An outer tape differentiating the import registers the graph's own definitions (while_v2's
    gradient reads each loop's), which differ from those (`as_graph_def(add_shapes=True)`
    gave them `_output_shapes`, passes may have edited them): its first call failed with
    "Attempting to add a duplicate function with name: while_cond_…". So each import names
    its functions anew (`import_as_function`) and registers them here, the way TensorFlow's
    gradient does (same definitions, so that registers them again without a conflict).

    TensorFlow removes a function from the context when the object that registered it is
    collected (a count per name): keep the returned list as long as the imported function.
    """
    functions = function_lib.from_library(library)
    with tf.init_scope():  # the context is eager even when the import is built inside a trace
        for function in functions:
            _ = function.definition  # registers it in the eager context
    return functions
