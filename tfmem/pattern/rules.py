"""The two shapes of a rewrite: `RewriteRule` (pattern → replacement) and `RegionRule`.

A `RewriteRule` pairs a `Pattern` with a `check` (returning a *reason* when it rejects
a match, never a bare False) and a replacement built from real TF ops through
`Graph.splice`. A rule only fires on self-contained matches: when an inner tensor of
the match is read outside it, the subgraph stays alive anyway and rewriting it saves
no memory, so the match is rejected with that reason. A `RuleSet` applies several
rules largest-pattern-first. Rules and rule sets are `GraphPass`es of the
"match_and_replace" stage and record every firing and every rejection.

A `RegionRule` is the same contract for rewrites that need analysis a pattern cannot
express (a region grown from a seed, a chain of products of any length): `find`
candidate regions, `check` each with a reason, `emit` the replacement. Its `run`
records every region it was offered, fired or rejected with the reason.

Example:
    >>> from tfmem.capture import capture
    >>> f = tf.function(lambda x: tf.reduce_sum(tf.square(x), axis=1))
    >>> graph = capture(f.get_concrete_function(tf.TensorSpec([3, 4]))).to_graph()
    >>> def square_then_sum(op, x):
    ...     return op.Sum(op.Square(x), op.const(name="axis"), keep_dims=False)
    >>> rule = RewriteRule(
    ...     "SumOfSquaresAsDot", square_then_sum,
    ...     replacement=lambda x, axis: tf.reduce_sum(x * x, axis=axis),
    ...     check=lambda graph, match: None if graph.spec(match["x"]).dtype.is_floating
    ...     else "only floating-point tensors")
    >>> result = rule.run(graph, PassContext(Config()))
    >>> [str(r) for r in result.records]
    ['[SumOfSquaresAsDot] SumOfSquaresAsDot fired at Sum']
"""
from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import tensorflow as tf
from tensorflow.core.framework.node_def_pb2 import NodeDef

from tfmem.config import Config
from tfmem.context import PassContext
from tfmem.graph import Graph, TensorRef
from tfmem.passes import GraphPass, PassResult, RewriteRecord
from tfmem.pattern.containment import outside_uses
from tfmem.pattern.language import PatternNode
from tfmem.pattern.matcher import Match, Pattern

logger = logging.getLogger(__name__)


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
        >>> from tfmem.capture import capture
        >>> f = tf.function(lambda x: -(-x))
        >>> graph = capture(f.get_concrete_function(tf.TensorSpec([3]))).to_graph()
        >>> rule = RewriteRule("DoubleNegation", lambda op, x: op.Neg(op.Neg(x)),
        ...                    replacement=lambda x: tf.identity(x))
        >>> rule.run(graph, PassContext(Config())).records[0].status
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

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        return RuleSet([self], name=self.name).run(graph, context)


# --- region rules ------------------------------------------------------------------------


def live_nodes(graph: Graph, ops: Iterable[str], *, consumers_first: bool = False) -> Iterator[NodeDef]:
    """The nodes of `ops`, listed now in topological order (or reversed), each yielded only
    while it is still in the graph: for a lazy `RegionRule.find`, whose earlier regions'
    emits may remove nodes.

    Example:
        >>> from tfmem.capture import capture
        >>> spec = tf.TensorSpec([3, 3])
        >>> cf = tf.function(lambda a, b, v: (a @ b) @ v).get_concrete_function(spec, spec, spec)
        >>> graph = capture(cf).to_graph()
        >>> [n.name for n in live_nodes(graph, {"MatMul", "BatchMatMulV2"}, consumers_first=True)]
        ['matmul_1', 'matmul']
    """
    found = list(graph.find(ops))
    for node in reversed(found) if consumers_first else found:
        if node.name in graph:
            yield node


class MatchedRegion(Protocol):
    """What a `RegionRule` finds: anything naming its nodes (records name them, anchor first)."""

    @property
    def nodes(self) -> tuple[str, ...]: ...


RegionT = TypeVar("RegionT", bound=MatchedRegion)


@dataclasses.dataclass(frozen=True)
class Emitted:
    """What `RegionRule.emit` did: the fired record's details and new nodes worth naming.

    Attributes:
        details: sizes, orders, counts for the report.
        nodes: nodes the rewrite made or rebuilt, named after the region's own in the record.
    """

    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    nodes: tuple[str, ...] = ()


class RegionRule(GraphPass, Generic[RegionT]):
    """A rewrite found by analysis: find regions → check each with a reason → emit.

    Subclasses set `name` (the pass, in records), `rule` (the rule, in records) and
    `stage`, and implement the three steps. `run` prunes dead nodes (they must not count
    as readers), then offers each region `find` yields to `check`: a reason is recorded
    as a rejection; otherwise `emit` rewrites the graph and the firing is recorded (an
    `emit` that finds its result unusable returns a reason instead, and what it spliced
    is pruned). A region whose nodes an earlier firing consumed or removed is skipped.

    Example:
        >>> from tfmem.capture import capture
        >>> from tfmem.pattern.containment import outside_uses
        >>> f = tf.function(lambda x: -(-x))
        >>> graph = capture(f.get_concrete_function(tf.TensorSpec([3]))).to_graph()
        >>> class DropDoubleNegation(RegionRule):
        ...     name = rule = "drop_double_negation"; stage = "match_and_replace"
        ...     def find(self, graph):
        ...         return (m for m in Pattern(lambda op, x: op.Neg(op.Neg(x))).matches(graph))
        ...     def check(self, graph, match, config):
        ...         return outside_uses(graph, match.inner, match.nodes)
        ...     def emit(self, graph, match):
        ...         graph.replace_all_uses(match.root, match["x"])
        ...         return Emitted()
        >>> [r.status for r in DropDoubleNegation().run(graph, PassContext(Config())).records]
        ['fired']
    """

    rule: ClassVar[str]

    @abc.abstractmethod
    def find(self, graph: Graph) -> Iterable[RegionT]:
        """Candidate regions, in the order to try them (lazily: earlier emits change the graph)."""

    @abc.abstractmethod
    def check(self, graph: Graph, region: RegionT, config: Config) -> str | None:
        """Why the region must not be rewritten, or None. May store its plan on the region."""

    @abc.abstractmethod
    def emit(self, graph: Graph, region: RegionT) -> Emitted | str:
        """Rewrites the region (rewiring its readers); a reason if the result proved unusable."""

    def rule_name(self, region: RegionT) -> str:
        """The rule named in the region's record."""
        return self.rule

    def rejection_details(self, region: RegionT) -> Mapping[str, Any]:
        """Details for a rejected region's record (none by default)."""
        return {}

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        return self.rewrite(graph, context.config, self.find(graph))

    def rewrite(self, graph: Graph, config: Config, regions: Iterable[RegionT]) -> PassResult:
        """The loop `run` runs over `find`'s regions; for a pass that finds them its own way."""
        graph.prune()  # dead readers (e.g. unused gradient branches) must not block a region
        records: list[RewriteRecord] = []
        consumed: set[str] = set()
        for region in regions:
            nodes, rule = tuple(region.nodes), self.rule_name(region)
            if consumed & set(nodes) or any(n not in graph for n in nodes):
                continue  # an earlier firing already rewrote (or removed) these nodes
            reason = self.check(graph, region, config)
            if not reason:
                outcome = self.emit(graph, region)
                graph.prune()  # the replaced region, or an unusable splice
                if isinstance(outcome, Emitted):
                    consumed |= set(nodes)
                    records.append(RewriteRecord(self.name, rule, "fired", nodes + outcome.nodes,
                                                 details=dict(outcome.details)))
                    continue
                reason = outcome
            logger.debug("%s rejected at %s: %s", rule, nodes[0] if nodes else "-", reason)
            records.append(RewriteRecord(self.name, rule, "rejected", nodes, reason,
                                         dict(self.rejection_details(region))))
        return PassResult(graph, any(r.status == "fired" for r in records), records)


@dataclasses.dataclass(frozen=True)
class RuleMatch:
    """A match of one rule of a `RuleSet`: the region a rule set offers for checking."""

    rule: RewriteRule
    match: Match

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.match.nodes


class RuleSet(RegionRule[RuleMatch]):
    """Applies rules largest-pattern-first; every firing and rejection becomes a record.

    Args:
        rules: the rules; a rule with a larger pattern (more op nodes) is tried first, so
            e.g. `sqrt(sqdist)` is claimed before its inner `sqdist`.
        name: the pass name in records.

    Example:
        >>> from rewrites.grappler_cleanup import no_op_folds
        >>> from tfmem.capture import capture
        >>> f = tf.function(lambda x: tf.exp(tf.reshape(x, [2, 3])))   # x is [2, 3]: a no-op reshape
        >>> graph = capture(f.get_concrete_function(tf.TensorSpec([2, 3]))).to_graph()
        >>> result = RuleSet(no_op_folds()).run(graph, PassContext(Config()))
        >>> [(r.rule, r.status, r.reason) for r in result.records]
        [('FoldNoOpReshape', 'fired', '')]
    """

    stage = "match_and_replace"

    def __init__(self, rules: Sequence[RewriteRule], *, name: str = "match_and_replace") -> None:
        self.name = name  # type: ignore[misc]
        self.rules = sorted(rules, key=lambda r: -r.size)  # stable: ties keep the given order

    def find(self, graph: Graph) -> Iterator[RuleMatch]:
        for rule in self.rules:
            # Each rule's matches are taken before it rewrites anything: its own firings
            # must not create matches for it in the same run.
            yield from [RuleMatch(rule, match) for match in rule.pattern.matches(graph)]

    def rule_name(self, region: RuleMatch) -> str:
        return region.rule.name

    def check(self, graph: Graph, region: RuleMatch, config: Config) -> str | None:
        rule, match = region.rule, region.match
        return rule.self_contained(graph, match) or rule.check(graph, match, config)

    def emit(self, graph: Graph, region: RuleMatch) -> Emitted:
        for old, new in region.rule.apply(graph, region.match).items():
            graph.replace_all_uses(old, new)
        return Emitted(details=dict(region.match.state.get("details", {})))


__all__ = ["Emitted", "MatchedRegion", "RegionRule", "RewriteRule", "RuleMatch", "RuleSet", "live_nodes"]
