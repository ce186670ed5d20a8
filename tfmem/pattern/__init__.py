"""Patterns, matches and the rules built from them: the one shape every rewrite takes.

- `tfmem.pattern.language`: the pattern language — `op.Foo(...)`, alternatives,
  captures, constants (`PatternNode`, `OpBuilder`, ...).
- `tfmem.pattern.matcher`: `Pattern` (built from a pattern function) and `Match`.
- `tfmem.pattern.rules`: `RewriteRule(pattern, replacement, check)` and `RuleSet`, and
  `RegionRule` (find a region → check it with a reason → emit) for rewrites that need
  analysis a pattern cannot express.
- `tfmem.pattern.containment`: the one self-containment question every rule asks —
  who outside a region reads its tensors (`outside_readers`), worded as a reason
  (`self_containment_reason`).

Every rejection carries a reason; records say what fired and what was rejected, and why.

Example:
    >>> import tensorflow as tf
    >>> from tfmem.capture import capture
    >>> from tfmem.config import Config
    >>> from tfmem.context import PassContext
    >>> graph = capture(tf.function(lambda x: -(-x)).get_concrete_function(tf.TensorSpec([3]))).to_graph()
    >>> rule = RewriteRule("DoubleNegation", lambda op, x: op.Neg(op.Neg(x)),
    ...                    replacement=lambda x: tf.identity(x))
    >>> [str(r) for r in rule.run(graph, PassContext(Config())).records]
    ['[DoubleNegation] DoubleNegation fired at Neg_1']
"""
from __future__ import annotations

from tfmem.pattern.containment import (GRAPH_OUTPUT, KEPT, OutsideReader, describe_reader, outside_readers,
                                       outside_uses, self_containment_reason, sole_reader)
from tfmem.pattern.language import (COMMUTATIVE_OPS, AnyOf, ConstPattern, OpBuilder, OpFactory, OpNode,
                                    PatternNode, SpecPredicate, Var, attr_value)
from tfmem.pattern.matcher import Match, Pattern, Requirement
from tfmem.pattern.rules import Emitted, MatchedRegion, RegionRule, RewriteRule, RuleMatch, RuleSet, live_nodes

__all__ = ["COMMUTATIVE_OPS", "GRAPH_OUTPUT", "KEPT", "AnyOf", "ConstPattern", "Emitted", "Match", "MatchedRegion", "OpBuilder",
           "OpFactory", "OpNode", "OutsideReader", "Pattern", "PatternNode", "RegionRule",
           "Requirement", "RewriteRule", "RuleMatch", "RuleSet", "SpecPredicate", "Var", "attr_value",
           "describe_reader", "live_nodes", "outside_readers", "outside_uses", "self_containment_reason", "sole_reader"]
