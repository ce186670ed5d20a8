"""Pattern machinery: alternatives, captures, predicates, check reasons, rule sets."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfmem.capture import capture, import_as_function
from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.passes import PassManager
from tfmem.pattern import Pattern, RewriteRule, RuleSet

SPEC = tf.TensorSpec([4, 3], tf.float32)


def graph_of(fn, *specs: tf.TensorSpec) -> Graph:
    return capture(tf.function(fn).get_concrete_function(*specs)).to_graph()


def run_rewritten(fn, graph: Graph, *args: np.ndarray):
    specs = [tf.TensorSpec(a.shape, a.dtype) for a in args]
    captured = capture(tf.function(fn).get_concrete_function(*specs))
    return import_as_function(captured, graph.to_graph_def(), graph.outputs, jit_compile=False)(*args)


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
        graph, Config())
    assert [r.status for r in result.records] == ["fired"]
    assert int(seen["axis"]) == -1
    assert "Square" not in ops_of(result.graph) and not result.graph.lint()
    np.testing.assert_allclose(run_rewritten(fn, result.graph, x), np.sum(x * x, -1), rtol=1e-6)


def test_check_rejects_with_a_reason():
    graph = graph_of(lambda x: tf.reduce_sum(tf.square(x), -1), SPEC)
    rule = RewriteRule("SumOfSquaresAsProduct", _sum_of_squares,
                       replacement=lambda x, axis: tf.reduce_sum(x * x, axis),
                       check=lambda g, m: "only float64" if g.spec(m["x"]).dtype != tf.float64 else None)
    result = rule.run(graph, Config())
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
    (record,) = rule.run(graph, Config()).records
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
    result = rule_set.run(graph, Config())
    assert [(r.rule, r.status) for r in result.records] == [("SqrtOfSquareAsAbs", "fired")]
    assert "Abs" in ops_of(result.graph) and not {"Square", "Sqrt"} & ops_of(result.graph)


def test_rules_run_under_the_pass_manager(rng):
    fn = lambda x: -(-x)  # noqa: E731
    graph = graph_of(fn, SPEC)
    rule = RewriteRule("DoubleNegation", lambda op, x: op.Neg(op.Neg(x)),
                       replacement=lambda x: tf.identity(x))
    assert rule.stage == "match_and_replace"
    result = PassManager([rule], lint=True).run(graph, Config())
    assert "Neg" not in ops_of(result.graph)
    x = rng.normal(size=(4, 3)).astype(np.float32)
    np.testing.assert_array_equal(run_rewritten(fn, result.graph, x), x)
