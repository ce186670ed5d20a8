"""Patterns written as small Python functions, and the rules and rule sets built from them.

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

A `RewriteRule` pairs a pattern with a `check` (returning a *reason* when it rejects a
match, never a bare False) and a replacement built from real TF ops through
`Graph.splice`. A rule only fires on self-contained matches: when an inner tensor of
the match is read outside it, the subgraph stays alive anyway and rewriting it saves
no memory, so the match is rejected with that reason. A `RuleSet` applies several
rules largest-pattern-first. Rules and rule sets are `GraphPass`es of the
"match_and_replace" stage and record every firing and every rejection.

Example:
    >>> import numpy as np
    >>> def square_then_sum(op, x):
    ...     return op.Sum(op.Square(x), op.const(name="axis"), keep_dims=False)
    >>> rule = RewriteRule(
    ...     "SumOfSquaresAsDot", square_then_sum,
    ...     replacement=lambda x, axis: tf.reduce_sum(x * x, axis=axis),
    ...     check=lambda graph, match: None if graph.spec(match["x"]).dtype.is_floating
    ...     else "only floating-point tensors")
    >>> result = rule.run(graph, Config())
    >>> [str(r) for r in result.records]
    ['[SumOfSquaresAsDot] SumOfSquaresAsDot fired at Sum']
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.passes import GraphPass, PassResult, RewriteRecord

logger = logging.getLogger(__name__)

# Binary ops whose inputs may be swapped without changing the result.
COMMUTATIVE_OPS = frozenset({"Add", "AddV2", "Mul", "Maximum", "Minimum", "SquaredDifference",
                             "Equal", "NotEqual", "LogicalAnd", "LogicalOr"})

SpecPredicate = Callable[[tf.TensorSpec], bool]
_Bindings = dict[Any, TensorRef]


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

    def _match(self, graph: Graph, ref: TensorRef, bound: _Bindings) -> Iterator[_Bindings]:
        raise NotImplementedError


@dataclasses.dataclass(eq=False)
class Var(PatternNode):
    """Any tensor, captured under `name` (None: not captured), optionally filtered by `where`."""

    name: str | None = None
    where: SpecPredicate | None = None

    def _match(self, graph: Graph, ref: TensorRef, bound: _Bindings) -> Iterator[_Bindings]:
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

    def _match(self, graph: Graph, ref: TensorRef, bound: _Bindings) -> Iterator[_Bindings]:
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

    def _match(self, graph: Graph, ref: TensorRef, bound: _Bindings) -> Iterator[_Bindings]:
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
               bound: _Bindings) -> Iterator[_Bindings]:
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

    def _match(self, graph: Graph, ref: TensorRef, bound: _Bindings) -> Iterator[_Bindings]:
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


# --- matches ------------------------------------------------------------------------


@dataclasses.dataclass
class Match:
    """One place a pattern matched.

    Attributes:
        root: the tensor the pattern's root matched (the tensor a rule replaces).
        captures: capture name → tensor (pattern parameters, `op.var`, `.named`, named consts).
        nodes: the graph nodes the pattern's op nodes matched, root first.
        value_captures: the captures that named `op.const(...)` patterns matched.
        constants: the `Const` nodes the pattern matched.
        state: scratch space a rule's `check` may fill for its replacement.
    """

    root: TensorRef
    captures: dict[str, TensorRef]
    nodes: tuple[str, ...]
    constants: tuple[str, ...] = ()
    value_captures: frozenset[str] = frozenset()
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __getitem__(self, name: str) -> TensorRef:
        return self.captures[name]

    @property
    def inner(self) -> list[TensorRef]:
        """Outputs of the matched op nodes other than the root (those the match consumes)."""
        return [TensorRef(n) for n in self.nodes[1:]]


class Pattern:
    """A pattern built by calling `fn(op, *vars)` once.

    Args:
        fn: the pattern function; parameters after `op` become capture variables.
        where: optional per-parameter spec predicates, e.g. `{"x": lambda s: s.shape.rank == 2}`.
        require: optional structural condition over a whole match, `(graph, match) -> bool`
            (e.g. "the output shape equals the input shape"); a match failing it is simply
            not a match. Conditions that deserve a reason belong in a rule's `check`.

    Example:
        >>> p = Pattern(lambda op, a, b: (op.MatMul | op.BatchMatMulV2)(a, b))
        >>> [m.root.node for m in p.matches(graph)]
        ['MatMul']
    """

    def __init__(self, fn: Callable[..., PatternNode], *,
                 where: Mapping[str, SpecPredicate] | None = None,
                 require: Callable[[Graph, Match], bool] | None = None) -> None:
        names = list(inspect.signature(fn).parameters)[1:]
        where = dict(where or {})
        unknown = set(where) - set(names)
        if unknown:
            raise ValueError(f"`where` names {sorted(unknown)}, which are not parameters of "
                             f"{getattr(fn, '__name__', fn)}")
        self.variables = tuple(names)
        self.root = fn(OpBuilder(), *(Var(n, where.get(n)) for n in names))
        if not isinstance(self.root, PatternNode):
            raise TypeError(f"pattern {getattr(fn, '__name__', fn)} must return a pattern node, "
                            f"got {type(self.root).__name__}")
        self.name = getattr(fn, "__name__", "pattern")
        self.require = require

    @property
    def size(self) -> int:
        return self.root.size

    def match(self, graph: Graph, ref: TensorRef | str) -> Match | None:
        """The first match rooted at `ref`, or None."""
        ref = TensorRef.parse(ref)
        for bound in self.root._match(graph, ref, {}):
            nodes = [ref.node] + [r.node for k, r in bound.items() if k[0] == "node" and r != ref]
            found = Match(root=ref,
                          captures={k[1]: r for k, r in bound.items() if k[0] == "var"},
                          nodes=tuple(dict.fromkeys(nodes)),
                          constants=tuple(dict.fromkeys(r.node for k, r in bound.items()
                                                        if k[0] == "const")),
                          value_captures=frozenset(k[1] for k in bound if k[0] == "cvar"))
            if self.require is None or self.require(graph, found):
                return found
        return None

    def matches(self, graph: Graph) -> Iterator[Match]:
        """Every match, consumers before producers (so an outer match is seen first)."""
        for name in reversed(graph.topological_order()):
            if name not in graph:
                continue
            for index in range(len(graph.output_specs(name))):
                found = self.match(graph, TensorRef(name, index))
                if found is not None:
                    yield found


# --- rules --------------------------------------------------------------------------


class RewriteRule(GraphPass):
    """A pattern, a check and a replacement; usable on its own as a pass.

    Args:
        name: the rule's name in records and reports.
        pattern: a `Pattern` or a pattern function.
        replacement: builds the replacement from the captures with ordinary TF ops; it is
            called with one keyword per capture — a symbolic tensor, or for a named
            `op.const` its numpy value — and returns the tensor that replaces the root.
        check: `(graph, match) -> reason | None`; a reason rejects the match.

    Subclasses may override `check`, `self_contained` and `apply` instead; an overriding
    `check` also sees the run's `Config`, for rules whose payoff depends on it (e.g. on
    whether XLA compiles the result).

    Example:
        >>> rule = RewriteRule("DoubleNegation", lambda op, x: op.Neg(op.Neg(x)),
        ...                    replacement=lambda x: tf.identity(x))
        >>> rule.run(graph, Config()).records[0].status
        'fired'
    """

    stage = "match_and_replace"

    def __init__(self, name: str, pattern: Pattern | Callable[..., PatternNode], *,
                 replacement: Callable[..., Any] | None = None,
                 check: Callable[[Graph, Match], str | None] | None = None) -> None:
        self.name = name  # type: ignore[misc]  # instance-level name of a GraphPass
        self.pattern = pattern if isinstance(pattern, Pattern) else Pattern(pattern)
        self._replacement = replacement
        self._check = check

    def __repr__(self) -> str:
        return f"<RewriteRule {self.name} size={self.size}>"

    @property
    def size(self) -> int:
        return self.pattern.size

    def check(self, graph: Graph, match: Match, config: Config) -> str | None:
        """Why the match must not be rewritten, or None to rewrite it."""
        return self._check(graph, match) if self._check is not None else None

    def self_contained(self, graph: Graph, match: Match) -> str | None:
        """A reason if a tensor inside the match is read from outside it (or must survive)."""
        return outside_uses(graph, match.inner, set(match.nodes))

    def apply(self, graph: Graph, match: Match) -> dict[TensorRef, TensorRef]:
        """Builds the replacement; returns old tensor → new tensor (the caller rewires)."""
        if self._replacement is None:
            raise NotImplementedError(f"rule {self.name} has no replacement")
        values = {n: graph.constant_value(match[n]) for n in match.value_captures}
        tensor_names = [n for n in match.captures if n not in values]
        replacement = self._replacement

        def build(*tensors: tf.Tensor) -> tf.Tensor:
            return replacement(**dict(zip(tensor_names, tensors)), **values)

        (new,) = graph.splice(build, [match[n] for n in tensor_names], scope=self.name)
        return {match.root: new}

    def run(self, graph: Graph, config: Config) -> PassResult:
        return RuleSet([self], name=self.name).run(graph, config)


class RuleSet(GraphPass):
    """Applies rules largest-pattern-first; every firing and rejection becomes a record.

    Args:
        rules: the rules; a rule with a larger pattern (more op nodes) is tried first, so
            e.g. `sqrt(sqdist)` is claimed before its inner `sqdist`.
        name: the pass name in records.

    Example:
        >>> result = RuleSet([ExpandSquaredDistance()]).run(graph, Config())
        >>> [(r.rule, r.status, r.reason) for r in result.records]
        [('ExpandSquaredDistance', 'fired', '')]
    """

    stage = "match_and_replace"

    def __init__(self, rules: Sequence[RewriteRule], *, name: str = "match_and_replace") -> None:
        self.name = name  # type: ignore[misc]
        self.rules = sorted(rules, key=lambda r: -r.size)  # stable: ties keep the given order

    def run(self, graph: Graph, config: Config) -> PassResult:
        graph.prune()  # dead readers (e.g. unused gradient branches) must not block matches
        records: list[RewriteRecord] = []
        consumed: set[str] = set()
        fired = False
        for rule in self.rules:
            for match in list(rule.pattern.matches(graph)):
                if consumed & set(match.nodes) or any(n not in graph for n in match.nodes):
                    continue  # a larger or earlier match already rewrote these nodes
                reason = rule.self_contained(graph, match) or rule.check(graph, match, config)
                if reason:
                    records.append(RewriteRecord(self.name, rule.name, "rejected", match.nodes, reason))
                    logger.debug("%s rejected at %s: %s", rule.name, match.root, reason)
                    continue
                mapping = rule.apply(graph, match)
                for old, new in mapping.items():
                    graph.replace_all_uses(old, new)
                consumed |= set(match.nodes)
                graph.prune()
                fired = True
                records.append(RewriteRecord(self.name, rule.name, "fired", match.nodes,
                                             details=dict(match.state.get("details", {}))))
        return PassResult(graph, fired, records)


# --- helpers shared by rules -----------------------------------------------------------


def outside_uses(graph: Graph, inner: Sequence[TensorRef], inside: set[str]) -> str | None:
    """A reason if any of `inner` is a graph output, kept, or read by a node not in `inside`."""
    for tensor in inner:
        if graph.is_output(tensor):
            return f"not self-contained: {tensor} is a graph output"
        if tensor.node in graph.keep:
            return f"not self-contained: {tensor.node} must be kept"
        for consumer in graph.node_consumers(tensor.node):
            if consumer not in inside:
                return (f"not self-contained: {tensor} is also read by {consumer} "
                        f"({graph.node(consumer).op})")
    return None


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


__all__ = ["AnyOf", "ConstPattern", "Match", "OpBuilder", "OpFactory", "OpNode", "Pattern",
           "PatternNode", "RewriteRule", "RuleSet", "Var", "attr_value",
           "outside_uses"]
