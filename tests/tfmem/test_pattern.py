"""Pattern machinery: alternatives, captures, predicates, check reasons, rule sets, region
rules and the self-containment question they share."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfmem.capture import capture, import_as_function
from tfmem.config import Config
from tfmem.context import PassContext
from tfmem.graph import Graph, TensorRef
from tfmem.passes import PassManager
from tfmem.pattern import (KEPT, Emitted, Pattern, RegionRule, RewriteRule, RuleSet, describe_reader,
                           outside_readers, self_containment_reason, sole_reader)

SPEC = tf.TensorSpec([4, 3], tf.float32)


def graph_of(fn, *specs: tf.TensorSpec) -> Graph:
    return capture(tf.function(fn).get_concrete_function(*specs)).to_graph()


def run_rewritten(fn, graph: Graph, *args: np.ndarray):
    specs = [tf.TensorSpec(a.shape, a.dtype) for a in args]
    captured = capture(tf.function(fn).get_concrete_function(*specs))
    return import_as_function(captured, graph, jit_compile=False)(*args)


def ops_of(graph: Graph) -> set[str]:
    return {n.op for n in graph.nodes}


@pytest.mark.parametrize("fn, expected", [
    (lambda a, b: tf.matmul(a, b, transpose_b=True), "MatMul"),
    (lambda a, b: tf.matmul(a[None], b[None], transpose_b=True), "BatchMatMulV2"),
])
def test_op_alternatives_match_either_type(fn, expected):
    graph = graph_of(fn, SPEC, SPEC)
    pattern = Pattern(lambda op, a, b: (op.MatMul | op.BatchMatMulV2)(a, b))
    roots = [graph.node(m.root.node).op for m in pattern.matches(graph)]
    assert roots == [expected]


@pytest.mark.parametrize("fn", [lambda x: tf.square(x), lambda x: x * x])
def test_any_of_with_a_shared_sub_pattern(fn):
    graph = graph_of(fn, SPEC)
    pattern = Pattern(lambda op, x: op.any_of(op.Square(x), op.Mul(x, x)))
    (match,) = list(pattern.matches(graph))
    assert match["x"] == TensorRef("x")


def test_shared_variable_must_bind_the_same_tensor():
    graph = graph_of(lambda x, y: x * y, SPEC, SPEC)
    assert list(Pattern(lambda op, x: op.Mul(x, x)).matches(graph)) == []
    assert len(list(Pattern(lambda op, x, y: op.Mul(x, y)).matches(graph))) == 1


def test_commutative_ops_match_in_either_order():
    graph = graph_of(lambda x: 2.0 * x, SPEC)
    (match,) = Pattern(lambda op, x: op.Mul(x, op.const(2.0))).matches(graph)
    assert match["x"] == TensorRef("x")


@pytest.mark.parametrize("transpose_b, matches", [(True, 1), (False, 0)])
def test_attribute_predicates(transpose_b, matches):
    graph = graph_of(lambda a, b: tf.matmul(a, b, transpose_b=transpose_b),
                     SPEC, SPEC if transpose_b else tf.TensorSpec([3, 4]))
    literal = Pattern(lambda op, a, b: op.MatMul(a, b, transpose_b=True))
    predicate = Pattern(lambda op, a, b: op.MatMul(a, b, transpose_b=lambda v: v is True))
    assert len(list(literal.matches(graph))) == matches
    assert len(list(predicate.matches(graph))) == matches


def test_constant_predicates_and_spec_predicates():
    graph = graph_of(lambda x: tf.reduce_sum(x, -1), SPEC)
    last_axis = Pattern(lambda op, x: op.Sum(x, op.const(where=lambda v: np.all(v == -1), name="axis")))
    (match,) = last_axis.matches(graph)
    assert match.constants and "axis" in match.captures
    assert list(Pattern(lambda op, x: op.Sum(x, op.const(0))).matches(graph)) == []
    rank_three = Pattern(lambda op, x: op.Sum(x, op.any()), where={"x": lambda s: s.shape.rank == 3})
    assert list(rank_three.matches(graph)) == []


def test_named_sub_patterns_are_captured():
    graph = graph_of(lambda x: tf.exp(tf.square(x)), SPEC)
    (match,) = Pattern(lambda op, x: op.Exp(op.Square(x).named("sq"))).matches(graph)
    assert graph.node(match["sq"].node).op == "Square"
    assert match.nodes[0] == match.root.node and len(match.nodes) == 2


def test_pattern_size_counts_ops_and_takes_the_largest_alternative():
    pattern = Pattern(lambda op, x: op.any_of(op.Neg(x), op.Exp(op.Neg(op.Square(x)))))
    assert pattern.size == 3


def test_pattern_must_return_a_node_and_inputs_must_be_patterns():
    with pytest.raises(TypeError, match="must return a pattern node"):
        Pattern(lambda op, x: 3)
    with pytest.raises(TypeError, match="op.const"):
        Pattern(lambda op, x: op.Mul(x, 2.0))


def _sum_of_squares(op, x):
    return op.Sum(op.Square(x), op.const(name="axis"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rule_fires_and_replacement_gets_constants_as_values(rng, dtype):
    fn = lambda x: tf.reduce_sum(tf.square(x), -1)  # noqa: E731
    x = rng.normal(size=(4, 3)).astype(dtype)
    graph = graph_of(fn, tf.TensorSpec(x.shape, x.dtype))
    seen = {}

    def replacement(x, axis):
        seen["axis"] = axis
        return tf.reduce_sum(x * x, axis=axis)

    result = RewriteRule("SumOfSquaresAsProduct", _sum_of_squares, replacement=replacement).run(
        graph, PassContext(Config()))
    assert [r.status for r in result.records] == ["fired"]
    assert int(seen["axis"]) == -1
    assert "Square" not in ops_of(result.graph) and not result.graph.lint()
    np.testing.assert_allclose(run_rewritten(fn, result.graph, x), np.sum(x * x, -1), rtol=1e-6)


def test_check_rejects_with_a_reason():
    graph = graph_of(lambda x: tf.reduce_sum(tf.square(x), -1), SPEC)
    rule = RewriteRule("SumOfSquaresAsProduct", _sum_of_squares,
                       replacement=lambda x, axis: tf.reduce_sum(x * x, axis),
                       check=lambda g, m: "only float64" if g.spec(m["x"]).dtype != tf.float64 else None)
    result = rule.run(graph, PassContext(Config()))
    (record,) = result.records
    assert (record.status, record.reason) == ("rejected", "only float64")
    assert not result.modified and "Square" in ops_of(result.graph)


def test_rejects_matches_that_are_not_self_contained():
    def fn(x):
        square = tf.square(x)
        return tf.reduce_sum(square, -1), tf.exp(square)  # the square is needed elsewhere too

    graph = graph_of(fn, SPEC)
    rule = RewriteRule("SumOfSquaresAsProduct", _sum_of_squares,
                       replacement=lambda x, axis: tf.reduce_sum(x * x, axis))
    (record,) = rule.run(graph, PassContext(Config())).records
    assert record.status == "rejected"
    assert record.reason.startswith("not self-contained: Square:0 is also read by Exp")


def test_rule_set_applies_the_largest_pattern_first():
    fn = lambda x: tf.sqrt(tf.square(x))  # noqa: E731
    graph = graph_of(fn, SPEC)
    small = RewriteRule("SquareAsProduct", lambda op, x: op.Square(x), replacement=lambda x: x * x)
    large = RewriteRule("SqrtOfSquareAsAbs", lambda op, x: op.Sqrt(op.Square(x)),
                        replacement=lambda x: tf.abs(x))
    rule_set = RuleSet([small, large])
    assert [r.name for r in rule_set.rules] == ["SqrtOfSquareAsAbs", "SquareAsProduct"]
    result = rule_set.run(graph, PassContext(Config()))
    assert [(r.rule, r.status) for r in result.records] == [("SqrtOfSquareAsAbs", "fired")]
    assert "Abs" in ops_of(result.graph) and not {"Square", "Sqrt"} & ops_of(result.graph)


def test_rules_run_under_the_pass_manager(rng):
    fn = lambda x: -(-x)  # noqa: E731
    graph = graph_of(fn, SPEC)
    rule = RewriteRule("DoubleNegation", lambda op, x: op.Neg(op.Neg(x)),
                       replacement=lambda x: tf.identity(x))
    assert rule.stage == "match_and_replace"
    result = PassManager([rule], lint=True).run(graph, PassContext(Config()))
    assert "Neg" not in ops_of(result.graph)
    x = rng.normal(size=(4, 3)).astype(np.float32)
    np.testing.assert_array_equal(run_rewritten(fn, result.graph, x), x)


# --- structural conditions give reasons ---------------------------------------------------

def test_require_reason_skips_the_candidate_and_says_why(caplog):
    graph = graph_of(lambda x: tf.reshape(tf.reshape(x, [3, 4]), [3, 4]), SPEC)

    def same_shape(g, m):
        return None if g.spec(m.root).shape == g.spec(m["x"]).shape else "the reshape changes the shape"

    pattern = Pattern(lambda op, x: op.Reshape(x, op.any()), require=same_shape)
    with caplog.at_level("DEBUG", logger="tfmem.pattern.matcher"):
        (match,) = pattern.matches(graph)
    assert graph.spec(match["x"]).shape == [3, 4]
    assert "is not a match: the reshape changes the shape" in caplog.text


def test_require_must_not_return_a_bare_bool():
    graph = graph_of(lambda x: -x, SPEC)
    pattern = Pattern(lambda op, x: op.Neg(x), require=lambda g, m: True)
    with pytest.raises(TypeError, match="reason string or None"):
        list(pattern.matches(graph))


# --- self-containment: one question for every rule -------------------------------------------

def _square_read_twice(x):
    square = tf.square(x)
    return tf.reduce_sum(square, -1), tf.exp(square)


def test_outside_readers_lists_readers_outputs_and_kept_nodes():
    graph = graph_of(_square_read_twice, SPEC)
    square = TensorRef("Square")
    (reader,) = outside_readers(graph, [square], {"Sum"})
    assert (reader.tensor, reader.reader, reader.control_only) == (square, "Exp", False)
    assert outside_readers(graph, [square], {"Sum", "Exp"}) == []
    graph.keep.add("Square")
    assert [r.reader for r in outside_readers(graph, [square], {"Sum", "Exp"})] == [KEPT]
    returned = graph.outputs[1]
    (output,) = outside_readers(graph, [returned], set())
    assert self_containment_reason(graph, [output]) == f"not self-contained: {returned} is a graph output"


def test_reason_names_up_to_three_readers_with_their_ops():
    graph = graph_of(lambda x: (lambda s: (tf.exp(s), tf.sin(s), s / 2.0))(tf.square(x)), SPEC)
    readers = outside_readers(graph, [TensorRef("Square")], set())
    reason = self_containment_reason(graph, readers, subject="square {node}", consequence="kept anyway")
    assert reason == "square Square is also read by Exp, Sin, truediv (RealDiv): kept anyway"


def test_a_constant_waiting_by_control_edge_may_be_detached():
    graph = graph_of(lambda x: tf.reduce_sum(tf.square(x), -1), SPEC)
    waiting = graph.node(graph.inputs("Sum")[1].node).__class__()
    waiting.CopyFrom(graph.node(graph.inputs("Sum")[1].node))
    waiting.name = "waiting"
    waiting.input.append("^Square")
    graph.add_node(waiting)
    (reader,) = outside_readers(graph, [TensorRef("Square")], {"Sum"})
    assert reader.control_only and reader.waiting_constant
    assert describe_reader(graph, reader) == "waiting (control edge)"
    assert self_containment_reason(graph, [reader], allow_waiting_constants=True) is None
    assert self_containment_reason(graph, [reader]) == \
        "not self-contained: Square:0 is also read by waiting (control edge)"


def test_sole_reader_needs_one_data_read_and_nothing_else():
    graph = graph_of(lambda x: (tf.exp(tf.square(x)), x * x), SPEC)
    assert sole_reader(graph, TensorRef("Square")) == "Exp"
    assert sole_reader(graph, TensorRef("x")) is None  # read twice by Mul, and by Square
    assert sole_reader(graph, graph.outputs[0]) is None  # a graph output


# --- region rules ------------------------------------------------------------------------------

class _NegatedExp(RegionRule):
    """exp(-x) found by a pattern; rejects float64 with a reason; `emit` may fail."""

    name, rule, stage = "negated_exp", "NegatedExp", "match_and_replace"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def find(self, graph):
        return Pattern(lambda op, x: op.Exp(op.Neg(x))).matches(graph)

    def check(self, graph, match, config):
        return "only float32" if graph.spec(match.root).dtype != tf.float32 else None

    def emit(self, graph, match):
        (new,) = graph.splice(lambda x: 1.0 / tf.exp(x), [match["x"]], scope="negated_exp")
        if self.fail:
            return "internal: refused"
        graph.replace_all_uses(match.root, new)
        return Emitted({"how": "reciprocal"}, (new.node,))


@pytest.mark.parametrize("dtype, fail, status, reason", [
    (tf.float32, False, "fired", ""), (tf.float64, False, "rejected", "only float32"),
    (tf.float32, True, "rejected", "internal: refused")])
def test_region_rule_records_every_region(dtype, fail, status, reason, rng):
    fn = lambda x: tf.exp(-x)  # noqa: E731
    graph = graph_of(fn, tf.TensorSpec([4, 3], dtype))
    result = _NegatedExp(fail).run(graph, PassContext(Config()))
    (record,) = result.records
    assert (record.pass_name, record.rule, record.status, record.reason) == ("negated_exp", "NegatedExp", status, reason)
    assert result.modified == (status == "fired")
    assert not result.graph.lint()
    ops = ops_of(result.graph)
    assert ("Neg" in ops) == (status != "fired")
    assert ("RealDiv" in ops) == (status == "fired")  # an unusable splice is pruned
    if status == "fired":
        assert record.details == {"how": "reciprocal"} and len(record.nodes) == 3
        x = rng.normal(size=(4, 3)).astype(np.float32)
        np.testing.assert_allclose(run_rewritten(fn, result.graph, x), np.exp(-x), rtol=1e-6)
