"""`Graph`: a mutable, indexed view over a TensorFlow GraphDef.

Passes read and edit graphs only through this view. It is the one place that parses
the GraphDef's input strings (`"node"`, `"node:1"`, `"^control"`), so passes speak in
`TensorRef`s and node names. It copies the GraphDef it is given (the caller's proto is
never mutated) and carries the function `library` and `versions` along.

Static types come from TensorFlow itself: dtypes from each op's registered OpDef and
shapes from the `_output_shapes` attribute that `as_graph_def(add_shapes=True)` writes.
New nodes get their shapes from `splice`, which builds them with real TF ops.

Example:
    >>> import tensorflow as tf
    >>> @tf.function
    ... def f(x):
    ...     return tf.reduce_sum(tf.exp(x))
    >>> cf = f.get_concrete_function(tf.TensorSpec([4, 3], tf.float32))
    >>> g = Graph(cf.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in cf.outputs])
    >>> [n.op for n in g.nodes if n.op == "Exp"], g.spec(TensorRef("Exp")).shape
    (['Exp'], TensorShape([4, 3]))
    >>> (log,) = g.splice(lambda e: tf.math.log(e), [TensorRef("Exp")])
    >>> g.node(log.node).op
    'Log'
"""
from __future__ import annotations

import dataclasses
import hashlib
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2, node_def_pb2
from tensorflow.python.framework import op_def_registry

# Ops whose output is a view of (or the same buffer as) their first input: they extend
# the input's lifetime but allocate nothing of their own.
ALIASING_OPS = frozenset({"Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze",
                          "StopGradient", "Snapshot", "PreventGradient", "EnsureShape",
                          "CheckNumerics"})
# Ops that hold state or talk to the outside world: never removed, never duplicated.
ALWAYS_KEEP_OPS = frozenset({"Placeholder", "NoOp"})
# Ops whose order is part of their meaning although TensorFlow registers them as stateless:
# v1 control flow (frames) and the function calls that may hide effects.
ORDERED_OPS = frozenset("Switch Merge Enter Exit NextIteration LoopCond RefEnter RefExit RefSwitch RefMerge "
                        "PartitionedCall StatefulPartitionedCall While StatelessWhile If StatelessIf Case "
                        "StatelessCase".split())


# TensorFlow unregisters a library function from the eager context, by name, when a
# Python object that registered it is garbage-collected — also when that object lives
# in a throw-away graph and a compiled function has registered the same name since
# (its next call then fails with "Function ... is not defined"). Scratch graphs that
# hold functions park them here, so that never happens.
_SCRATCH_FUNCTIONS: list[Any] = []


def keep_functions_alive(scratch: tf.Graph) -> None:
    """Keeps the functions a scratch graph holds alive for the rest of the process."""
    _SCRATCH_FUNCTIONS.extend(scratch._functions.values())  # noqa: SLF001 - no public accessor


_STALE_ATTRS = ("_output_shapes", "_class")


def copy_node(original: node_def_pb2.NodeDef, name: str, *, keep_shapes: bool = False) -> node_def_pb2.NodeDef:
    """A copy named `name`, without the attrs that tie it to its graph (stale shapes,
    colocation with nodes another graph does not have) unless `keep_shapes`."""
    node = node_def_pb2.NodeDef()
    node.CopyFrom(original)
    node.name = name
    for attr in () if keep_shapes else _STALE_ATTRS:
        if attr in node.attr:
            del node.attr[attr]
    return node


def _colocated_within(node: node_def_pb2.NodeDef, names: set[str]) -> node_def_pb2.NodeDef:
    """`node`, or a copy of it colocated (`_class: loc:@X`) only with nodes of `names`: a pass
    that removed a node (a no-op Reshape, say) leaves its readers' colocation naming it, and
    the importer refuses a colocation with an unknown node (`tape.jacobian`'s pfor loop at n=512)."""
    if "_class" not in node.attr:  # (reading a missing map key would add it)
        return node
    entries = node.attr["_class"].list.s
    kept = [e for e in entries if not (e.startswith(b"loc:@") and e[5:].decode() not in names)]
    if len(kept) == len(entries):
        return node
    copy = copy_node(node, node.name, keep_shapes=True)
    del copy.attr["_class"].list.s[:]
    copy.attr["_class"].list.s.extend(kept)
    if not kept:
        del copy.attr["_class"]
    return copy


def const_node(name: str, value: Any) -> node_def_pb2.NodeDef:
    value = np.asarray(value)
    node = node_def_pb2.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return node


class GraphError(ValueError):
    """A graph is malformed, or an edit would make it so."""


@dataclasses.dataclass(frozen=True, order=True)
class TensorRef:
    """One output of one node: `TensorRef("MatMul", 0)` is the tensor `"MatMul:0"`."""

    node: str
    index: int = 0

    @classmethod
    def parse(cls, name: str | TensorRef) -> TensorRef:
        """`"a/b:1"` → `TensorRef("a/b", 1)`; a bare node name means output 0."""
        if isinstance(name, TensorRef):
            return name
        if name.startswith("^"):
            raise GraphError(f"{name!r} is a control input, not a tensor")
        node, sep, index = name.rpartition(":")
        if sep and index.isdigit():
            return cls(node, int(index))
        return cls(name, 0)

    @property
    def name(self) -> str:
        return f"{self.node}:{self.index}"

    def __str__(self) -> str:
        return self.name

    def as_input(self) -> str:
        """The NodeDef input-string form: `"node"` for output 0, `"node:i"` otherwise."""
        return self.node if self.index == 0 else self.name


def set_node_inputs(node: node_def_pb2.NodeDef, inputs: Iterable[TensorRef],
                    control: Iterable[str] = ()) -> node_def_pb2.NodeDef:
    """Makes a NodeDef outside any Graph (one being built to import elsewhere) read
    `inputs` and wait on the nodes `control`; returns it. The one writer of input strings
    for code outside this module."""
    del node.input[:]
    node.input.extend(ref.as_input() for ref in inputs)
    node.input.extend(f"^{name}" for name in control)
    return node


def function_tensor_node(text: str) -> str:
    """The node a FunctionDef tensor string names: `"node:output_arg:index"` → `"node"`;
    a function argument's name is itself."""
    return text.split(":")[0]


def node_inputs(node: node_def_pb2.NodeDef) -> list[TensorRef]:
    """The data inputs of a NodeDef outside any Graph (a copy kept to restore later), in
    order: what it read when it was copied, to compare with what its namesake reads now."""
    return _split_inputs(node)[0]


def rename_functions(graph_def: graph_pb2.GraphDef, names: Mapping[str, str]) -> None:
    """Renames library functions of `graph_def` in place, with every reference to them.

    A function is named by its signature, by the op of a node that calls it directly, by
    `func` attrs (a While's `cond` and `body`, a call's `f`, nested in other attrs' lists
    and in function-valued attrs' own attrs) in the graph and inside functions, and by the
    library's gradient entries. Edit only a GraphDef of your own (`to_graph_def`'s).

    Example:
        >>> graph_def = graph.to_graph_def()
        >>> rename_functions(graph_def, {"while_body_6": "while_body_6_x", "while_cond_5": "while_cond_5_x"})
    """
    def rename_node(node: node_def_pb2.NodeDef) -> None:
        node.op = names.get(node.op, node.op)
        for function in _function_attrs(node.attr.values()):
            function.name = names.get(function.name, function.name)

    for node in graph_def.node:
        rename_node(node)
    for function in graph_def.library.function:
        function.signature.name = names.get(function.signature.name, function.signature.name)
        for node in function.node_def:
            rename_node(node)
        for named in _function_attrs(function.attr.values()):
            named.name = names.get(named.name, named.name)
    for gradient in graph_def.library.gradient:
        gradient.function_name = names.get(gradient.function_name, gradient.function_name)
        gradient.gradient_func = names.get(gradient.gradient_func, gradient.gradient_func)


def called_functions(node: node_def_pb2.NodeDef) -> list[str]:
    """The functions `node` names in its `func` attrs (a While's `cond` and `body`, an If's
    branches, a call's `f`, also nested in lists and in function-valued attrs' own attrs)."""
    return [function.name for function in _function_attrs(node.attr.values())]


def _function_attrs(values: Iterable[attr_value_pb2.AttrValue]) -> Iterator[attr_value_pb2.NameAttrList]:
    """Every function-valued attr among `values`, also in lists and nested in their own attrs
    (the protos themselves: `rename_functions` renames them in place)."""
    for value in values:
        kind = value.WhichOneof("value")
        for function in [value.func] if kind == "func" else list(value.list.func) if kind == "list" else []:
            yield function
            yield from _function_attrs(function.attr.values())


def _split_inputs(node: node_def_pb2.NodeDef) -> tuple[list[TensorRef], list[str]]:
    data: list[TensorRef] = []
    control: list[str] = []
    for text in node.input:
        if text.startswith("^"):
            control.append(text[1:])
        else:
            data.append(TensorRef.parse(text))
    return data, control


def _resolve_type(node: node_def_pb2.NodeDef, attr_name: str, op_def: Any) -> Any:
    if attr_name in node.attr:
        return node.attr[attr_name]
    for attr in op_def.attr:  # fall back to the OpDef's default
        if attr.name == attr_name and attr.HasField("default_value"):
            return attr.default_value
    raise GraphError(f"node {node.name!r} ({node.op}) has no attr {attr_name!r}")


def output_dtypes(node: node_def_pb2.NodeDef,
                  library: function_pb2.FunctionDefLibrary | None = None) -> list[tf.DType]:
    """The dtypes of a node's outputs, read from its registered OpDef (or library function)."""
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        for function in (library.function if library is not None else ()):
            if function.signature.name == node.op:
                op_def = function.signature
                break
        else:
            raise GraphError(f"node {node.name!r}: op {node.op!r} is not registered")
    dtypes: list[tf.DType] = []
    for arg in op_def.output_arg:
        if arg.type_list_attr:
            dtypes.extend(tf.as_dtype(t) for t in _resolve_type(node, arg.type_list_attr, op_def).list.type)
            continue
        dtype = tf.as_dtype(arg.type if arg.type else _resolve_type(node, arg.type_attr, op_def).type)
        count = _resolve_type(node, arg.number_attr, op_def).i if arg.number_attr else 1
        dtypes.extend([dtype] * count)
    return dtypes


def is_stateful(node: node_def_pb2.NodeDef) -> bool:
    """Whether the op is registered as stateful (variables, random, I/O...)."""
    op_def = op_def_registry.get(node.op)
    return bool(op_def is not None and op_def.is_stateful)


class Graph:
    """A mutable view over a copy of a GraphDef, indexed for rewriting.

    Args:
        graph_def: the graph; copied, never mutated.
        outputs: tensors the graph must keep producing (the function's results). A
            rewrite that replaces one of them updates this list.
        keep: node names that must survive pruning even if nothing reads them
            (control outputs such as variable writes, the function's placeholders).
    """

    def __init__(self, graph_def: graph_pb2.GraphDef, *,
                 outputs: Iterable[str | TensorRef] = (), keep: Iterable[str] = ()) -> None:
        self._nodes: dict[str, node_def_pb2.NodeDef] = {}
        for node in graph_def.node:
            if node.name in self._nodes:
                raise GraphError(f"duplicate node name {node.name!r}")
            self._nodes[node.name] = node_def_pb2.NodeDef.FromString(node.SerializeToString())
        self.library = function_pb2.FunctionDefLibrary()
        self.library.CopyFrom(graph_def.library)
        self.versions = graph_def.versions.__class__()
        self.versions.CopyFrom(graph_def.versions)
        self.outputs: list[TensorRef] = [TensorRef.parse(o) for o in outputs]
        self.keep: set[str] = set(keep)
        # Caches, dropped by `_changed`: whole-graph ones always, per-node ones for the nodes named.
        self._consumer_index: dict[str, list[tuple[str, int]]] | None = None
        self._topological: list[str] | None = None
        self._derived: dict[Callable[[Graph], Any], Any] = {}
        self._parsed: dict[str, tuple[list[TensorRef], list[str], list[str]]] = {}
        self._specs: dict[str, list[tf.TensorSpec]] = {}
        self._name_counter = 0

    # --- reading ------------------------------------------------------------------

    def copy(self) -> Graph:
        """An independent copy (what is cached about the nodes is shared: it is never edited
        in place, only dropped)."""
        copy = Graph.__new__(Graph)
        copy._nodes = {name: copy_node(node, name, keep_shapes=True) for name, node in self._nodes.items()}
        copy.library = function_pb2.FunctionDefLibrary()
        copy.library.CopyFrom(self.library)
        copy.versions = self.versions.__class__()
        copy.versions.CopyFrom(self.versions)
        copy.outputs, copy.keep = list(self.outputs), set(self.keep)
        copy._consumer_index, copy._topological = self._consumer_index, self._topological
        copy._derived = dict(self._derived)
        copy._parsed, copy._specs = dict(self._parsed), dict(self._specs)
        copy._name_counter = self._name_counter
        return copy

    def assign(self, other: Graph) -> None:
        """Makes this graph a copy of `other` (to roll an edit back to a saved copy)."""
        copy = other.copy()
        self._nodes, self.library, self.versions = copy._nodes, copy.library, copy.versions
        self.outputs, self.keep = copy.outputs, copy.keep
        self._consumer_index, self._topological = copy._consumer_index, copy._topological
        self._derived = copy._derived
        self._parsed, self._specs, self._name_counter = copy._parsed, copy._specs, copy._name_counter

    def fingerprint(self) -> str:
        """A digest of all a pass reads of this graph: its nodes in order, its function
        library, versions, outputs and kept names, and the counter fresh names come from.
        Graphs with one fingerprint are rewritten alike (passes are deterministic).

        >>> import tensorflow as tf
        >>> g = Graph(tf.function(lambda x: x * 2.0).get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def())
        >>> g.fingerprint() == g.copy().fingerprint(), g.fingerprint() == Graph(g.to_graph_def(), keep=["x"]).fingerprint()
        (True, False)
        """
        digest = hashlib.sha256()
        for node in self._nodes.values():
            serialized = node.SerializeToString(deterministic=True)
            digest.update(len(serialized).to_bytes(8, "little"))
            digest.update(serialized)
        digest.update(self.library.SerializeToString(deterministic=True))
        digest.update(self.versions.SerializeToString(deterministic=True))
        digest.update(repr(([ref.name for ref in self.outputs], sorted(self.keep), self._name_counter)).encode())
        return digest.hexdigest()

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: str) -> bool:
        return name in self._nodes

    def node(self, name: str) -> node_def_pb2.NodeDef:
        try:
            return self._nodes[name]
        except KeyError:
            raise GraphError(f"no node named {name!r}") from None

    @property
    def nodes(self) -> list[node_def_pb2.NodeDef]:
        """All nodes, in a topological order (producers before consumers)."""
        return [self._nodes[name] for name in self.topological_order()]

    def inputs(self, name: str) -> list[TensorRef]:
        """The data inputs of a node, in order."""
        return list(self._parse(name)[0])

    def control_inputs(self, name: str) -> list[str]:
        return list(self._parse(name)[1])

    def _parse(self, name: str) -> tuple[list[TensorRef], list[str], list[str]]:
        """(data inputs, control inputs, producers once each) of node `name`, parsed once."""
        parsed = self._parsed.get(name)
        if parsed is None:
            data, control = _split_inputs(self.node(name))
            parsed = (data, control, list(dict.fromkeys([r.node for r in data] + control)))
            self._parsed[name] = parsed
        return parsed

    def control_dependants(self, name: str) -> list[str]:
        """Nodes that wait on `name` by a control edge (a rewrite removing it would drop them)."""
        return [c for c in self.node_consumers(name) if name in self.control_inputs(c)]

    def consumers(self, tensor: TensorRef | str) -> list[tuple[str, int]]:
        """`(node name, input position)` of every data use of `tensor`."""
        tensor = TensorRef.parse(tensor)
        return [(n, i) for n, i in self._consumers().get(tensor.node, ()) if i >= 0
                and self.inputs(n)[i] == tensor]

    def node_consumers(self, name: str) -> list[str]:
        """Names of all nodes that read any output of `name` or depend on it by control."""
        seen: dict[str, None] = {}
        for consumer, _ in self._consumers().get(name, ()):
            seen[consumer] = None
        return list(seen)

    def is_output(self, tensor: TensorRef) -> bool:
        return tensor in self.outputs

    def aliases_input(self, name: str) -> bool:
        """Whether node `name` only reinterprets its first input's buffer: an op of
        `ALIASING_OPS`, or a `Transpose` that moves only axes of length 1 (a reshape, which
        XLA makes a bitcast).

        Example:
            >>> graph.aliases_input("transpose")   # [10, 300, 1, 3000] → [1, 10, 300, 3000]
            True
        """
        node = self.node(name)
        if node.op in ALIASING_OPS:
            return True
        if node.op != "Transpose":
            return False
        shape = self.spec(self.inputs(name)[0]).shape
        perm = self.constant_value(self.inputs(name)[1])
        if perm is None or shape.rank is None:
            return False
        moved = [axis for axis in (int(p) for p in np.asarray(perm).reshape(-1)) if shape[axis] != 1]
        return moved == sorted(moved)  # the axes longer than 1 keep their order

    def is_returned(self, tensor: TensorRef) -> bool:
        """Whether the graph returns `tensor`'s buffer: as an output, or only through ops
        that reinterpret it (`aliases_input`: an `Identity`, a `Reshape`, ...). Such a
        tensor is held whole at the end whatever computes it.

        Example:
            >>> graph.is_returned(TensorRef("cov"))    # returned as cov[None]
            True
        """
        seen: set[TensorRef] = set()
        pending = [tensor]
        while pending:
            ref = pending.pop()
            if ref in seen:
                continue
            seen.add(ref)
            if self.is_output(ref):
                continue
            readers = self.consumers(ref)
            if not readers or not all(self.aliases_input(name) for name, _ in readers):
                return False
            # IdentityN hands input i through as output i; the other views have one output.
            pending.extend(TensorRef(name, position if self.node(name).op == "IdentityN" else 0)
                           for name, position in readers)
        return True

    def output_specs(self, name: str) -> list[tf.TensorSpec]:
        """The static dtype and shape of each output of a node."""
        if name not in self._specs:
            self._specs[name] = self._output_specs(name)
        return self._specs[name]

    def _output_specs(self, name: str) -> list[tf.TensorSpec]:
        node = self.node(name)
        dtypes = output_dtypes(node, self.library)
        shapes = list(node.attr["_output_shapes"].list.shape) if "_output_shapes" in node.attr else []
        if len(shapes) != len(dtypes):
            shapes = [None] * len(dtypes)  # unknown: lint reports it
        return [tf.TensorSpec(tf.TensorShape(s) if s is not None else tf.TensorShape(None), d)
                for s, d in zip(shapes, dtypes)]

    def spec(self, tensor: TensorRef | str) -> tf.TensorSpec:
        tensor = TensorRef.parse(tensor)
        specs = self.output_specs(tensor.node)
        if tensor.index >= len(specs):
            raise GraphError(f"{tensor} does not exist: {tensor.node!r} has {len(specs)} outputs")
        return specs[tensor.index]

    def nbytes(self, tensor: TensorRef | str) -> int | None:
        """Bytes of a tensor, or None if its shape is not fully static (or its dtype has no size)."""
        spec = self.spec(tensor)
        if not spec.shape.is_fully_defined() or spec.dtype in (tf.resource, tf.variant, tf.string):
            return None
        return spec.shape.num_elements() * spec.dtype.size

    def largest_output_bytes(self, name: str) -> int:
        """The bytes of node `name`'s largest output of static size (0 if none has one)."""
        return max((self.nbytes(TensorRef(name, index)) or 0 for index in range(len(self.output_specs(name)))),
                   default=0)

    def function(self, name: str) -> function_pb2.FunctionDef | None:
        """The library function called `name`, if the graph carries one."""
        for function in self.library.function:
            if function.signature.name == name:
                return function
        return None

    def is_stateful(self, name: str) -> bool:
        return is_stateful(self.node(name))

    # --- order --------------------------------------------------------------------

    def topological_order(self, priority: Callable[[str], Any] | None = None, *,
                          reprioritize: Callable[[str], Iterable[str]] | None = None) -> list[str]:
        """Node names, producers first.

        Args:
            priority: a list scheduler's key: among the nodes whose producers have all run,
                the one with the smallest `priority(node)` runs next (ties: graph order).
                None: ties keep the order nodes were added in (cached).
            reprioritize: called with each node as it is scheduled; returns the nodes
                whose priority that changed (e.g. the memory estimate's "frees most
                first": running a node can make its producers' last reader free them).

        Raises:
            GraphError: if the graph has a cycle or an input names a missing node.
        """
        if priority is not None:
            return self._schedule(priority, reprioritize)
        if self._topological is None:
            self._topological = self._sort()
        return list(self._topological)

    def derived(self, compute: Callable[[Graph], Any]) -> Any:
        """`compute(self)`, computed once for this version of the graph: any edit drops it.

        For whole-graph facts read on hot paths (the memory estimate runs after every
        candidate edit, and reads the same facts each time). The result is shared:
        `compute` should return something immutable (a frozenset, a tuple).

        Example:
            >>> graph = Graph(tf.function(lambda: tf.constant(1.0) + 1).get_concrete_function().graph.as_graph_def())
            >>> graph.derived(len) is graph.derived(len), graph.derived(len)
            (True, 4)
        """
        if compute not in self._derived:
            self._derived[compute] = compute(self)
        return self._derived[compute]

    def producers(self, name: str) -> list[str]:
        """Nodes `name` reads data from or waits on by control edge, each once, in input order."""
        return self._parse(name)[2]

    def ancestors(self, *names: str) -> set[str]:
        """`names` and every node one of them depends on, through data and control edges."""
        return self._reachable(names, self.producers)

    def descendants(self, *names: str) -> set[str]:
        """`names` and every node that depends on one of them, through data and control edges."""
        return self._reachable(names, self.node_consumers)

    @staticmethod
    def _reachable(names: Iterable[str], step: Callable[[str], Iterable[str]]) -> set[str]:
        seen: set[str] = set()
        stack = list(names)
        while stack:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(step(current))
        return seen

    def _schedule(self, priority: Callable[[str], Any],
                  reprioritize: Callable[[str], Iterable[str]] | None) -> list[str]:
        base = self.topological_order()
        position = {name: i for i, name in enumerate(base)}
        waiting = {name: len(self.producers(name)) for name in base}
        current: dict[str, Any] = {}  # the key each waiting-to-run node is queued under
        heap: list[tuple[Any, int, str]] = []

        def push(name: str) -> None:
            current[name] = priority(name)
            heapq.heappush(heap, (current[name], position[name], name))

        for name in base:
            if waiting[name] == 0:
                push(name)
        order: list[str] = []
        while heap:
            key, _, name = heapq.heappop(heap)
            if name not in current or current[name] != key:
                continue  # scheduled already, or queued again under a new key
            del current[name]
            order.append(name)
            for changed in (reprioritize(name) if reprioritize else ()):
                if changed in current:
                    push(changed)
            for consumer in self.node_consumers(name):
                waiting[consumer] -= 1
                if waiting[consumer] == 0:
                    push(consumer)
        return order

    def _sort(self) -> list[str]:
        position = {name: i for i, name in enumerate(self._nodes)}
        pending: dict[str, int] = {}
        for name in self._nodes:
            producers = set(self.producers(name))
            missing = producers - position.keys()
            if missing:
                raise GraphError(f"node {name!r} reads missing node(s) {sorted(missing)}")
            pending[name] = len(producers)
        ready = [(position[n], n) for n, count in pending.items() if count == 0]
        heapq.heapify(ready)
        order: list[str] = []
        consumers = self._consumers()
        while ready:
            _, name = heapq.heappop(ready)
            order.append(name)
            for consumer in dict.fromkeys(c for c, _ in consumers.get(name, ())):
                pending[consumer] -= 1
                if pending[consumer] == 0:
                    heapq.heappush(ready, (position[consumer], consumer))
        if len(order) != len(self._nodes):
            stuck = sorted(set(self._nodes) - set(order))[:5]
            raise GraphError(f"graph has a cycle through {stuck}")
        return order

    def _consumers(self) -> dict[str, list[tuple[str, int]]]:
        # producer node → [(consumer node, data input position or -1 for control)]
        if self._consumer_index is None:
            index: dict[str, list[tuple[str, int]]] = {}
            for name in self._nodes:
                data, control, _ = self._parse(name)
                for position, ref in enumerate(data):
                    index.setdefault(ref.node, []).append((name, position))
                readers = {ref.node for ref in data}
                for producer in dict.fromkeys(control):
                    if producer not in readers:  # a control edge beside a data edge adds nothing
                        index.setdefault(producer, []).append((name, -1))
            self._consumer_index = index
        return self._consumer_index

    # --- editing ------------------------------------------------------------------

    def _changed(self, *names: str) -> None:
        """Drops the caches an edit invalidates: the whole-graph ones, and what is cached
        about the nodes `names` (edited, added or gone); with no names, about every node."""
        self._consumer_index = None
        self._topological = None
        self._derived = {}
        if not names:
            self._parsed, self._specs = {}, {}
        for name in names:
            self._parsed.pop(name, None)
            self._specs.pop(name, None)

    def unique_name(self, base: str) -> str:
        """A node name not yet in the graph, derived from `base`."""
        if base not in self._nodes:
            return base
        while True:
            self._name_counter += 1
            candidate = f"{base}_{self._name_counter}"
            if candidate not in self._nodes:
                return candidate

    def add_node(self, node: node_def_pb2.NodeDef) -> str:
        """Adds a NodeDef (copied; renamed if its name is taken). Returns its name."""
        copy = node_def_pb2.NodeDef()
        copy.CopyFrom(node)
        copy.name = self.unique_name(node.name)
        self._nodes[copy.name] = copy
        self._changed(copy.name)
        return copy.name

    def replace_node(self, node: node_def_pb2.NodeDef) -> None:
        """Puts `node` (copied) in place of the node of the same name; readers stay wired to it."""
        self.node(node.name)  # must exist
        self._nodes[node.name] = copy_node(node, node.name, keep_shapes=True)
        self._changed(node.name)

    def set_input(self, name: str, position: int, tensor: TensorRef) -> None:
        """Points data input `position` of node `name` at `tensor`."""
        node = self.node(name)
        data_positions = [i for i, text in enumerate(node.input) if not text.startswith("^")]
        node.input[data_positions[position]] = tensor.as_input()
        self._changed(name)

    def add_control_input(self, name: str, producer: str) -> bool:
        """Makes node `name` wait on node `producer` (`^producer`). Returns whether the
        edge is new."""
        node = self.node(name)
        self.node(producer)  # raises for a node not in the graph
        if f"^{producer}" in node.input:
            return False
        node.input.append(f"^{producer}")
        self._changed(name)
        return True

    def add_control_input_in_function(self, function: str, name: str, producer: str) -> bool:
        """Makes node `name` of library function `function` wait on its node `producer`.
        Returns whether the edge is new.

        Raises:
            GraphError: if the library has no such function, or it no such node.
        """
        fdef = self.function(function)
        nodes = {node.name: node for node in fdef.node_def} if fdef is not None else {}
        if name not in nodes or producer not in nodes:
            raise GraphError(f"no node {name!r} and {producer!r} in library function {function!r}")
        if f"^{producer}" in nodes[name].input:
            return False
        nodes[name].input.append(f"^{producer}")
        return True

    def remove_control_input(self, name: str, producer: str) -> bool:
        """Drops the control edge `^producer` from node `name`. Returns whether it was there."""
        node = self.node(name)
        kept = [text for text in node.input if text != f"^{producer}"]
        if len(kept) == len(node.input):
            return False
        del node.input[:]
        node.input.extend(kept)
        self._changed(name)
        return True

    def replace_all_uses(self, old: TensorRef | str, new: TensorRef | str) -> int:
        """Makes every reader of `old` (and the graph outputs) read `new`. Returns the count."""
        old, new = TensorRef.parse(old), TensorRef.parse(new)
        uses = self.consumers(old)
        for consumer, position in uses:
            self.set_input(consumer, position, new)
        count = len(uses)
        for i, output in enumerate(self.outputs):
            if output == old:
                self.outputs[i] = new
                count += 1
        return count

    def remove(self, name: str) -> None:
        """Removes a node that nothing reads.

        Raises:
            GraphError: if the node still has consumers or is an output.
        """
        users = self.node_consumers(name)
        if users:
            raise GraphError(f"cannot remove {name!r}: still read by {users[:5]}")
        if any(o.node == name for o in self.outputs):
            raise GraphError(f"cannot remove {name!r}: it produces a graph output")
        del self._nodes[name]
        self.keep.discard(name)
        self._changed(name)

    def prune(self) -> list[str]:
        """Removes nodes that no output, kept node or stateful op needs. Returns their names."""
        roots = {o.node for o in self.outputs} | (self.keep & self._nodes.keys())
        roots |= {n for n, node in self._nodes.items()
                  if node.op in ALWAYS_KEEP_OPS or is_stateful(node)}
        needed: set[str] = set()
        stack = list(roots)
        while stack:
            name = stack.pop()
            if name in needed:
                continue
            needed.add(name)
            stack.extend(self.producers(name))
        dead = [n for n in self._nodes if n not in needed]
        for name in dead:
            del self._nodes[name]
        if dead:
            self._changed(*dead)
        return dead

    def splice(self, build: Callable[..., Any], inputs: Sequence[TensorRef | str], *,
               scope: str = "tfmem") -> list[TensorRef]:
        """Adds the ops `build` creates from `inputs`; returns refs to its outputs.

        `build` receives one symbolic tensor per input (with the input's static dtype and
        shape) and returns a tensor or a sequence of tensors, built with ordinary TF ops.
        This is the op builder rewrites use: the new nodes get correct attrs and shapes.

        Example:
            >>> sq = graph.splice(lambda x: tf.reduce_sum(tf.square(x), -1), [x_ref])
        """
        refs = [TensorRef.parse(t) for t in inputs]
        with tf.Graph().as_default() as scratch:
            placeholders = [tf.compat.v1.placeholder(self.spec(r).dtype, self.spec(r).shape,
                                                     name=f"splice_input_{i}")
                            for i, r in enumerate(refs)]
            result = build(*placeholders)
            outputs = list(result) if isinstance(result, (list, tuple)) else [result]
        fragment = scratch.as_graph_def(add_shapes=True)
        keep_functions_alive(scratch)
        by_placeholder = {p.op.name: r for p, r in zip(placeholders, refs)}
        prefix = self.unique_scope(scope)
        renamed = {n.name: f"{prefix}/{n.name}" for n in fragment.node if n.name not in by_placeholder}

        def rewire(text: str) -> str:
            control = text.startswith("^")
            ref = TensorRef.parse(text.lstrip("^"))
            if ref.node in by_placeholder:
                if control:
                    return "^" + by_placeholder[ref.node].node
                return by_placeholder[ref.node].as_input()
            target = TensorRef(renamed[ref.node], ref.index)
            return "^" + target.node if control else target.as_input()

        for node in fragment.node:
            if node.name in by_placeholder:
                continue
            new = node_def_pb2.NodeDef()
            new.CopyFrom(node)
            new.name = renamed[node.name]
            del new.input[:]
            new.input.extend(rewire(t) for t in node.input)
            self._nodes[new.name] = new
        self.merge_library(fragment.library)
        self._changed(*renamed.values())
        result_refs = []
        for tensor in outputs:
            name = tensor.op.name
            if name in by_placeholder:
                result_refs.append(by_placeholder[name])
            else:
                result_refs.append(TensorRef(renamed[name], tensor.value_index))
        return result_refs

    def unique_scope(self, base: str) -> str:
        """A name scope no node lives under yet (`base`, or `base_1`, `base_2`, ...).

        `unique_name` alone would hand a second splice the same scope, and its nodes
        would overwrite the first splice's.
        """
        taken = {name.split("/", 1)[0] for name in self._nodes}
        scope, counter = base, 0
        while scope in taken:
            counter += 1
            scope = f"{base}_{counter}"
        return scope

    def constant_value(self, tensor: TensorRef | str) -> Any:
        """The value of a `Const` node's output as a numpy array, or None if not a constant.

        Example:
            >>> graph.constant_value("transpose/perm")
            array([1, 0], dtype=int32)
        """
        tensor = TensorRef.parse(tensor)
        node = self._nodes.get(tensor.node)
        if node is None or node.op != "Const" or tensor.index != 0:
            return None
        return tf.make_ndarray(node.attr["value"].tensor)

    def merge_library(self, library: function_pb2.FunctionDefLibrary) -> None:
        """Adds the functions (and gradients) of `library` that this graph lacks."""
        have = {f.signature.name for f in self.library.function}
        for function in library.function:
            if function.signature.name not in have:
                self.library.function.add().CopyFrom(function)
        have_gradients = {g.function_name for g in self.library.gradient}
        for gradient in library.gradient:
            if gradient.function_name not in have_gradients:
                self.library.gradient.add().CopyFrom(gradient)

    # --- checking and output -------------------------------------------------------

    def lint(self) -> list[str]:
        """Problems that would make the graph wrong or unimportable; empty when clean."""
        problems: list[str] = []
        try:
            self.topological_order()
        except GraphError as err:
            return [str(err)]
        for output in self.outputs:
            if output.node not in self._nodes:
                problems.append(f"output {output} names a missing node")
            elif output.index >= len(self.output_specs(output.node)):
                problems.append(f"output {output} is past the node's outputs")
        for name, node in self._nodes.items():
            try:
                specs = self.output_specs(name)
            except GraphError as err:
                problems.append(str(err))
                continue
            if specs and "_output_shapes" not in node.attr:
                problems.append(f"node {name!r} ({node.op}) has no static shapes")
            for ref in self.inputs(name):
                if ref.index >= len(self.output_specs(ref.node)):
                    problems.append(f"node {name!r} reads {ref}, past {ref.node!r}'s outputs")
        defined = {function.signature.name for function in self.library.function}
        calls = [(f"node {name!r}", node) for name, node in self._nodes.items()]
        calls += [(f"function {function.signature.name!r}'s node {node.name!r}", node)
                  for function in self.library.function for node in function.node_def]
        for where, node in calls:
            for called in called_functions(node):
                if called not in defined and op_def_registry.get(called) is None:
                    problems.append(f"{where} calls {called!r}, which the library does not define")
        return problems

    def check(self) -> None:
        """Raises GraphError listing every lint problem."""
        problems = self.lint()
        if problems:
            raise GraphError("; ".join(problems[:10]))

    def to_graph_def(self, *, drop: Iterable[str] = ()) -> graph_pb2.GraphDef:
        """A new GraphDef, nodes in topological order, with library and versions.

        Args:
            drop: nodes to leave out, with every control edge to them (a control edge
                on a missing node would not import). Data inputs that name them stay:
                the importer binds those through its `input_map` (how the wrapper feeds
                arguments without importing their placeholders, which XLA cannot run).
        """
        drop = set(drop)
        kept_nodes = set(self._nodes) - drop
        graph_def = graph_pb2.GraphDef()
        for name in self.topological_order():
            if name in drop:
                continue
            node = self._nodes[name]
            if drop and any(text.startswith("^") and text[1:] in drop for text in node.input):
                node = copy_node(node, name)
                kept = [text for text in node.input if not (text.startswith("^") and text[1:] in drop)]
                del node.input[:]
                node.input.extend(kept)
            graph_def.node.append(_colocated_within(node, kept_nodes))
        graph_def.library.CopyFrom(self.library)
        graph_def.versions.CopyFrom(self.versions)
        return graph_def

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self._nodes.values():
            counts[node.op] = counts.get(node.op, 0) + 1
        return counts

    def find(self, op: str | Iterable[str]) -> Iterator[node_def_pb2.NodeDef]:
        """Nodes whose op is `op` (or one of several), in topological order."""
        ops = {op} if isinstance(op, str) else set(op)
        return (n for n in self.nodes if n.op in ops)

