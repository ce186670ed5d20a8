"""The split planner plans a graph once per trace: `compile_within_budget` runs the
pipeline again for each of its rounds from the same graph, and `PassContext.memo` hands
the later rounds a copy of the first plan (`rewrites.split._planned_within`)."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from rewrites.split import SplitOversizedRegions
from rewrites.split.planner import Planner
from tfmem.budget import Budget
from tfmem.capture import capture
from tfmem.context import PassContext
from tfmem.report import XLA_PEAK_RULES
from tfmem.stages import Traced
from tfmem.testing import max_in_loss, pairwise_distances, run_graph

N = 400


def kernel_rows(x: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.exp(-pairwise_distances(x)), 1)


def _context(memo: dict | None, target: int = N * N * 8 // 4) -> PassContext:
    """A context planning to `target` (a quarter of one [N, N] matrix by default)."""
    return PassContext(tfmem.Config(), Budget(2 * target, "config"), target, memo=memo)


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The planner's runs: the fingerprint of the graph each planned, and its target."""
    calls: list[tuple[str, int]] = []
    within = Planner.within

    def counted(pass_name, graph, target, *args, **kwargs):
        calls.append((graph.fingerprint(), target))
        return within(pass_name, graph, target, *args, **kwargs)

    monkeypatch.setattr(Planner, "within", counted)
    return calls


def test_a_second_run_on_the_same_graph_plans_once_and_gets_the_same_loops(planned: list[tuple[str, int]]) -> None:
    concrete = tf.function(kernel_rows).get_concrete_function(tf.TensorSpec([N, 3], tf.float64))
    captured = capture(concrete)
    memo: dict = {}
    first = SplitOversizedRegions().run(captured.to_graph(), _context(memo))
    second = SplitOversizedRegions().run(captured.to_graph(), _context(memo))
    assert len(planned) == 1
    assert first.modified and [r.reason for r in second.records] == [r.reason for r in first.records]
    assert second.graph is not first.graph
    assert [(n.name, n.op) for n in second.graph.nodes] == [(n.name, n.op) for n in first.graph.nodes]
    # What a later pass does to one run's graph does not reach the plan kept for the next.
    loop = next(n.name for n in second.graph.nodes if n.op in ("While", "StatelessWhile"))
    second.graph.node(loop).attr.clear()
    third = SplitOversizedRegions().run(captured.to_graph(), _context(memo))
    assert len(planned) == 1
    assert [(n.name, n.op) for n in third.graph.nodes] == [(n.name, n.op) for n in first.graph.nodes]
    x = tf.constant(np.random.default_rng(0).normal(size=(N, 3)))
    np.testing.assert_allclose(run_graph(third.graph, concrete, [x])[0], kernel_rows(x), rtol=1e-12)


def test_another_graph_or_target_plans_again_and_without_a_memo_every_run_plans(planned: list[tuple[str, int]]) -> None:
    concrete = tf.function(kernel_rows).get_concrete_function(tf.TensorSpec([N, 3], tf.float64))
    captured = capture(concrete)
    memo: dict = {}
    SplitOversizedRegions().run(captured.to_graph(), _context(memo))
    other = captured.to_graph()
    other.splice(tf.identity, [other.outputs[0]])  # one node more
    SplitOversizedRegions().run(other, _context(memo))
    assert len(planned) == 2
    SplitOversizedRegions().run(captured.to_graph(), _context(memo, target=N * N * 8 // 8))
    assert len(planned) == 3
    SplitOversizedRegions().run(captured.to_graph(), _context(None))
    SplitOversizedRegions().run(captured.to_graph(), _context(None))
    assert len(planned) == 5


def test_a_budget_call_plans_each_graph_once_across_its_rounds(planned: list[tuple[str, int]],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A program XLA plans over its budget: the rounds around XLA's peaks run the pipeline
    again, and the planner runs once per graph and target, not once per run."""
    runs: list[int] = []
    rewrite = Traced.rewrite

    def counted(self, *args, **kwargs):
        runs.append(1)
        return rewrite(self, *args, **kwargs)

    monkeypatch.setattr(Traced, "rewrite", counted)
    n = 300
    rng = np.random.default_rng(3)
    q, k = (tf.constant(rng.normal(size=(n, 16)) * 0.5) for _ in range(2))
    wrapped = tfmem.function(max_in_loss, config=tfmem.Config(memory_budget=2 * n * n * 8))
    got = wrapped(q, k)
    report = wrapped.report(q, k)
    assert any(r.pass_name == "compile_within_budget" and r.rule in XLA_PEAK_RULES for r in report.records), \
        report.summary()
    # No graph was planned twice to one target, though the pipeline ran again for each round.
    assert len(set(planned)) == len(planned) < len(runs), (len(set(planned)), len(planned), len(runs))
    want = tf.function(max_in_loss, jit_compile=True)(q, k)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9 * float(tf.reduce_max(tf.abs(w))))
