"""The matcher: a `Pattern` built from a pattern function, and the `Match`es it finds.

A `Pattern` calls its function once with an `OpBuilder` and one capture variable per
parameter, then walks the graph from each tensor, consumers before producers, binding
the pattern's nodes to graph nodes. A binding becomes a `Match`: the root tensor, the
captures, the matched nodes and constants.

Structural conditions the pattern language cannot say (e.g. "the output has the
shape of the input") go in `require`, which returns why a candidate is *not a match*,
or None. Such a candidate is skipped — it is not a rejected rewrite, so it makes no
record — but its reason is logged at debug level, never a bare False. Conditions under
which a real match is declined belong in a rule's `check`, whose reasons are recorded.

Example:
    >>> import tensorflow as tf
    >>> from tfmem.capture import capture
    >>> spec = tf.TensorSpec([3, 3])
    >>> cf = tf.function(lambda a, b: tf.exp(tf.matmul(a, b))).get_concrete_function(spec, spec)
    >>> graph = capture(cf).to_graph()
    >>> p = Pattern(lambda op, a, b: (op.MatMul | op.BatchMatMulV2)(a, b))
    >>> [m.root.node for m in p.matches(graph)]
    ['MatMul']
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tfmem.graph import Graph, TensorRef
from tfmem.pattern.language import Bindings, OpBuilder, PatternNode, SpecPredicate, Var

logger = logging.getLogger(__name__)


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


# A structural condition over a whole match: why it is not a match, or None.
Requirement = Callable[[Graph, Match], "str | None"]


class Pattern:
    """A pattern built by calling `fn(op, *vars)` once.

    Args:
        fn: the pattern function; parameters after `op` become capture variables.
        where: optional per-parameter spec predicates, e.g. `{"x": lambda s: s.shape.rank == 2}`.
        require: optional structural condition over a whole match, `(graph, match) ->
            reason | None` (e.g. "the output shape equals the input shape"); a candidate
            given a reason is not a match (the reason is logged at debug level).

    Example:
        >>> import tensorflow as tf
        >>> from tfmem.capture import capture
        >>> f = tf.function(lambda x: tf.reshape(tf.reshape(x, [6]), [6]))   # the second is a no-op
        >>> graph = capture(f.get_concrete_function(tf.TensorSpec([2, 3]))).to_graph()
        >>> p = Pattern(lambda op, x: op.Reshape(x, op.any()),
        ...             require=lambda g, m: None if g.spec(m.root) == g.spec(m["x"])
        ...             else "the reshape changes the shape")
        >>> [m.root.node for m in p.matches(graph)]   # only the no-op reshapes
        ['Reshape_1']
    """

    def __init__(self, fn: Callable[..., PatternNode], *,
                 where: Mapping[str, SpecPredicate] | None = None,
                 require: Requirement | None = None) -> None:
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
        """The first match rooted at `ref` that meets `require`, or None."""
        ref = TensorRef.parse(ref)
        for bound in self.root._match(graph, ref, {}):
            found = _to_match(ref, bound)
            reason = self.require(graph, found) if self.require is not None else None
            if isinstance(reason, bool):  # the old contract: a silent True/False
                raise TypeError(f"`require` of pattern {self.name} must return a reason string "
                                f"or None, not {reason}")
            if reason is None:
                return found
            logger.debug("pattern %s: %s is not a match: %s", self.name, ref, reason)
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


def _to_match(ref: TensorRef, bound: Bindings) -> Match:
    nodes = [ref.node] + [r.node for k, r in bound.items() if k[0] == "node" and r != ref]
    return Match(root=ref,
                 captures={k[1]: r for k, r in bound.items() if k[0] == "var"},
                 nodes=tuple(dict.fromkeys(nodes)),
                 constants=tuple(dict.fromkeys(r.node for k, r in bound.items() if k[0] == "const")),
                 value_captures=frozenset(k[1] for k in bound if k[0] == "cvar"))


__all__ = ["Match", "Pattern", "Requirement"]
