"""The pattern language: patterns written as small Python functions over an op builder.

A pattern is a function whose first parameter is an op builder and whose other
parameters are capture variables. Calling `op.<OpType>(...)` describes a node of that
type; the function returns the root of the subgraph to find:

    def naive_sqdist(op, x, y):
        diff = op.Sub(op.ExpandDims(x, op.const()), op.ExpandDims(y, op.const()))
        return op.Sum(op.Square(diff) | op.Mul(diff, diff), op.const([-1]))

The vocabulary:

- `op.Foo(*inputs, **attrs)` matches a node of type `Foo` whose data inputs match
  `inputs` (exactly that many) and whose attrs equal `attrs` (or satisfy them, when an
  attr value is a callable). `(op.MatMul | op.BatchMatMulV2)(a, b)` accepts either type.
  Commutative ops (`Add`, `Mul`, ...) also try their inputs swapped.
- `p | q` or `op.any_of(p, q, ...)` matches whichever alternative matches first.
- Parameters of the pattern function and `op.var(name)` capture any tensor; a name
  used twice must bind the same tensor. `op.any()` matches any tensor without
  capturing it. Both take `where=` — a predicate on the tensor's `tf.TensorSpec`.
- `op.const(value, where=, name=)` matches a `Const` node, optionally with that value
  or a value satisfying `where`; when named, the replacement receives its numpy value.
- `p.named("d")` captures the tensor a sub-pattern matched. A sub-pattern object used
  twice (like `diff` above) must match the same tensor both times.

The nodes here only describe and match; `tfmem.pattern.matcher` turns a pattern
function into a `Pattern` and its bindings into `Match`es.

Example:
    >>> root = (lambda op, x: op.Neg(op.Neg(x)))(OpBuilder(), Var("x"))
    >>> root.size
    2
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tfmem.graph import Graph, TensorRef

# Binary ops whose inputs may be swapped without changing the result.
COMMUTATIVE_OPS = frozenset({"Add", "AddV2", "Mul", "Maximum", "Minimum", "SquaredDifference",
                             "Equal", "NotEqual", "LogicalAnd", "LogicalOr"})

SpecPredicate = Callable[[tf.TensorSpec], bool]
# What a partial match has bound: ("var", name) / ("node", id) / ("const", id) / ("cvar", name) → tensor.
Bindings = dict[Any, TensorRef]


# --- pattern nodes -----------------------------------------------------------------


class PatternNode:
    """A node of a pattern. Combine with `|`, capture with `.named(...)`."""

    capture: str | None = None

    def __or__(self, other: PatternNode) -> AnyOf:
        return AnyOf((self, other))

    def named(self, name: str) -> PatternNode:
        """This sub-pattern, capturing the tensor it matches under `name`."""
        self.capture = name
        return self

    @property
    def size(self) -> int:
        """Op nodes in the pattern (for alternatives, the largest alternative)."""
        return len(self._op_nodes(set()))

    def _op_nodes(self, seen: set[int]) -> set[int]:
        return set()

    def _match(self, graph: Graph, ref: TensorRef, bound: Bindings) -> Iterator[Bindings]:
        raise NotImplementedError


@dataclasses.dataclass(eq=False)
class Var(PatternNode):
    """Any tensor, captured under `name` (None: not captured), optionally filtered by `where`."""

    name: str | None = None
    where: SpecPredicate | None = None

    def _match(self, graph: Graph, ref: TensorRef, bound: Bindings) -> Iterator[Bindings]:
        key = ("var", self.name) if self.name else None
        if key is not None and key in bound:
            if bound[key] == ref:
                yield bound
            return
        if self.where is not None and not self.where(graph.spec(ref)):
            return
        if key is None:
            yield bound
        else:
            yield {**bound, key: ref}


@dataclasses.dataclass(eq=False)
class ConstPattern(PatternNode):
    """A `Const` node, optionally with a given value or one satisfying `where`."""

    value: Any = None
    where: Callable[[np.ndarray], bool] | None = None
    name: str | None = None

    def _match(self, graph: Graph, ref: TensorRef, bound: Bindings) -> Iterator[Bindings]:
        value = graph.constant_value(ref)
        if value is None:
            return
        if self.value is not None:
            expected = np.asarray(self.value)
            if np.broadcast(value, expected).shape != value.shape or not np.all(value == expected):
                return
        if self.where is not None and not self.where(value):
            return
        if self.name is None:
            yield {**bound, ("const", id(self)): ref}
        else:  # "cvar": the replacement gets this capture as a value, not a tensor
            yield {**bound, ("const", id(self)): ref, ("var", self.name): ref, ("cvar", self.name): ref}


@dataclasses.dataclass(eq=False)
class OpNode(PatternNode):
    """A node of one of `ops`, whose `index`-th output is the tensor, with matching inputs and attrs."""

    ops: tuple[str, ...]
    inputs: tuple[PatternNode, ...]
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    index: int = 0

    def _op_nodes(self, seen: set[int]) -> set[int]:
        if id(self) in seen:
            return set()
        seen.add(id(self))
        found = {id(self)}
        for child in self.inputs:
            found |= child._op_nodes(seen)
        return found

    def _match(self, graph: Graph, ref: TensorRef, bound: Bindings) -> Iterator[Bindings]:
        key = ("node", id(self))
        if key in bound:  # a shared sub-pattern: it must be the same tensor again
            if bound[key] == ref:
                yield bound
            return
        node = graph.node(ref.node)
        if node.op not in self.ops or ref.index != self.index:
            return
        for attr, expected in self.attrs.items():
            if attr not in node.attr:
                return
            actual = attr_value(node.attr[attr])
            if not (expected(actual) if callable(expected) and not isinstance(expected, tf.DType)
                    else actual == expected):
                return
        inputs = graph.inputs(ref.node)
        if len(inputs) != len(self.inputs):
            return
        bound = {**bound, key: ref}
        if self.capture:
            bound[("var", self.capture)] = ref
        orders = [self.inputs]
        if node.op in COMMUTATIVE_OPS and len(self.inputs) == 2:
            orders.append(self.inputs[::-1])
        for order in orders:
            yield from _match_all(graph, list(zip(order, inputs)), bound)


def _match_all(graph: Graph, pairs: list[tuple[PatternNode, TensorRef]],
               bound: Bindings) -> Iterator[Bindings]:
    if not pairs:
        yield bound
        return
    (pattern, ref), rest = pairs[0], pairs[1:]
    for partial in pattern._match(graph, ref, bound):
        yield from _match_all(graph, rest, partial)


@dataclasses.dataclass(eq=False)
class AnyOf(PatternNode):
    """The first of several alternative sub-patterns that matches."""

    alternatives: tuple[PatternNode, ...]

    def __or__(self, other: PatternNode) -> AnyOf:
        return AnyOf((*self.alternatives, other))

    def _op_nodes(self, seen: set[int]) -> set[int]:
        return max((a._op_nodes(set(seen)) for a in self.alternatives), key=len, default=set())

    def _match(self, graph: Graph, ref: TensorRef, bound: Bindings) -> Iterator[Bindings]:
        for alternative in self.alternatives:
            for result in alternative._match(graph, ref, bound):
                if self.capture:
                    result = {**result, ("var", self.capture): ref}
                yield result


class OpFactory:
    """`op.Sub` and friends: calling it makes an `OpNode`; `|` widens the accepted op types."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        self.ops = ops

    def __or__(self, other: OpFactory) -> OpFactory:
        return OpFactory(self.ops + other.ops)

    def __call__(self, *inputs: PatternNode, _index: int = 0, **attrs: Any) -> OpNode:
        for i, child in enumerate(inputs):
            if not isinstance(child, PatternNode):
                raise TypeError(f"input {i} of {'|'.join(self.ops)} must be a pattern, got "
                                f"{type(child).__name__}; wrap constants with op.const(...)")
        return OpNode(self.ops, tuple(inputs), dict(attrs), _index)

    def __repr__(self) -> str:
        return f"OpFactory({'|'.join(self.ops)})"


class OpBuilder:
    """The `op` argument of a pattern function: `op.Sub(...)`, `op.var(...)`, `op.const(...)`."""

    def __getattr__(self, op_type: str) -> OpFactory:
        if op_type.startswith("_"):
            raise AttributeError(op_type)
        return OpFactory((op_type,))

    @staticmethod
    def var(name: str | None = None, *, where: SpecPredicate | None = None) -> Var:
        """Any tensor, captured under `name`."""
        return Var(name, where)

    @staticmethod
    def any(*, where: SpecPredicate | None = None) -> Var:
        """Any tensor, not captured."""
        return Var(None, where)

    @staticmethod
    def const(value: Any = None, *, where: Callable[[np.ndarray], bool] | None = None,
              name: str | None = None) -> ConstPattern:
        """A `Const` node (with `value`, or one satisfying `where`), captured under `name`."""
        return ConstPattern(value, where, name)

    @staticmethod
    def any_of(*alternatives: PatternNode) -> AnyOf:
        """The first alternative that matches."""
        return AnyOf(tuple(alternatives))


def attr_value(value: attr_value_pb2.AttrValue) -> Any:
    """A NodeDef attr as a Python value (bool, int, float, str, DType, shape list, list)."""
    kind = value.WhichOneof("value")
    if kind == "list":
        lst = value.list
        for field in ("i", "f", "b", "s", "type", "shape"):
            items = list(getattr(lst, field))
            if items:
                return [attr_value(attr_value_pb2.AttrValue(**{field: x})) for x in items]
        return []
    if kind == "s":
        return value.s.decode()
    if kind == "type":
        return tf.as_dtype(value.type)
    if kind == "shape":
        return tf.TensorShape(value.shape).as_list() if not value.shape.unknown_rank else None
    if kind == "tensor":
        return tf.make_ndarray(value.tensor)
    return getattr(value, kind) if kind else None


__all__ = ["COMMUTATIVE_OPS", "AnyOf", "Bindings", "ConstPattern", "OpBuilder", "OpFactory", "OpNode",
           "PatternNode", "SpecPredicate", "Var", "attr_value"]
