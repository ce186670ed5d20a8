"""PassManager: fixed point, lint naming the culprit, records kept once, timings."""
from __future__ import annotations

import pytest
import tensorflow as tf

from rewrites import PASSES_BY_STAGE, passes_for
from rewrites.cleanup import ForwardIdentities
from tfmem import Config, Graph, GraphPass, PassError, PassManager, PassResult, RewriteRecord, TensorRef


def graph_of(fn, *specs) -> Graph:
    concrete = tf.function(fn).get_concrete_function(*specs)
    return Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])


def _identities(x):
    return tf.exp(tf.identity(tf.identity(x)))


class _RemoveOneIdentity(GraphPass):
    """Forwards a single Identity per run, so reaching the fixed point takes rounds."""

    name, stage = "remove_one", "cleanup"

    def run(self, graph: Graph, config: Config) -> PassResult:
        for node in graph.find("Identity"):
            ref = TensorRef(node.name)
            if not graph.is_output(ref):
                graph.replace_all_uses(ref, graph.inputs(node.name)[0])
                graph.remove(node.name)
                return PassResult(graph, True, [RewriteRecord(self.name, "forward", "fired", (node.name,))])
        return PassResult(graph, False, [RewriteRecord(self.name, "forward", "rejected", (), "nothing left")])


class _BreakGraph(GraphPass):
    name, stage = "break_graph", "cleanup"

    def run(self, graph: Graph, config: Config) -> PassResult:
        (exp,) = list(graph.find("Exp"))
        graph.node(exp.name).input[0] = "missing_node"
        graph._changed()
        return PassResult(graph, True)


def test_runs_to_a_fixed_point_and_keeps_records_once() -> None:
    graph = graph_of(_identities, tf.TensorSpec([3], tf.float32))
    result = PassManager([_RemoveOneIdentity()], lint=True).run(graph, Config())
    assert "Identity" in graph.op_counts()  # the input graph is untouched
    ops = result.graph.op_counts()
    assert ops["Identity"] == 1  # only the output's Identity stays
    assert result.iterations == 3  # two rounds that fire, one that finds nothing
    assert [r.status for r in result.records] == ["fired", "fired", "rejected"]
    assert result.modified and set(result.seconds) == {"remove_one"}


def test_lint_names_the_pass_that_broke_the_graph() -> None:
    graph = graph_of(_identities, tf.TensorSpec([3], tf.float32))
    with pytest.raises(PassError, match="break_graph.*missing") as info:
        PassManager([_BreakGraph()], lint=True).run(graph, Config())
    assert info.value.pass_name == "break_graph"


def test_forward_identities_keeps_outputs_and_effects() -> None:
    v = tf.Variable(0.0)

    def fn(x):
        v.assign_add(tf.reduce_sum(tf.identity(x)))
        return tf.identity(tf.exp(tf.identity(x)))

    graph = graph_of(fn, tf.TensorSpec([3], tf.float32))
    result = PassManager([ForwardIdentities()], lint=True).run(graph, Config())
    assert result.graph.op_counts()["AssignAddVariableOp"] == 1
    assert all(result.graph.node(o.node).op == "Identity" for o in result.graph.outputs)
    assert result.graph.op_counts()["Identity"] < graph.op_counts()["Identity"]


def test_registry_follows_config_stages() -> None:
    assert [p.stage for p in passes_for(Config(passes=["cleanup"]))] == ["cleanup"] * len(PASSES_BY_STAGE["cleanup"])
    assert passes_for(Config(passes=[])) == []
    stages = [p.stage for p in passes_for(Config())]
    assert stages == sorted(stages, key=["cleanup", "match_and_replace", "reorder", "split"].index)


class _CountRuns(_RemoveOneIdentity):
    """_RemoveOneIdentity that counts its runs."""

    def __init__(self) -> None:
        self.runs = 0

    def run(self, graph: Graph, config: Config) -> PassResult:
        self.runs += 1
        return super().run(graph, config)


class _RecordBudget(GraphPass):
    """Reads the budget: records it, changes nothing."""

    name, stage, reads_budget = "record_budget", "split", True

    def run(self, graph: Graph, config: Config) -> PassResult:
        return PassResult(graph, False, [RewriteRecord(self.name, "budget", "info",
                                                       details={"budget": config.memory_budget})])


def test_the_budget_free_prefix_runs_once_and_is_reused_for_another_budget() -> None:
    graph = graph_of(_identities, tf.TensorSpec([3], tf.float32))
    counter = _CountRuns()
    manager = PassManager([counter, _RecordBudget()], lint=True)
    prefix = manager.run_prefix(graph, Config())
    assert counter.runs == 3 and prefix.graph.op_counts()["Identity"] == 1  # to its fixed point
    runs_before = counter.runs
    for budget in (1 << 20, 1 << 10):
        result = manager.run(graph, Config(memory_budget=budget), prefix=prefix)
        assert [r.details["budget"] for r in result.records if r.pass_name == "record_budget"] == [budget]
        assert result.graph.op_counts() == prefix.graph.op_counts()
    # From a reused prefix the first round starts at the budget pass; it changed nothing,
    # so the prefix pass does not run again.
    assert counter.runs == runs_before
    assert prefix.graph.op_counts()["Identity"] == 1  # the shared prefix is not edited


def test_run_without_a_prefix_equals_run_with_it() -> None:
    graph = graph_of(_identities, tf.TensorSpec([3], tf.float32))
    manager = PassManager([_RemoveOneIdentity(), _RecordBudget()])
    alone = manager.run(graph, Config(memory_budget=1024))
    shared = manager.run(graph, Config(memory_budget=1024), prefix=manager.run_prefix(graph, Config()))
    assert alone.graph.to_graph_def() == shared.graph.to_graph_def()
    assert [str(r) for r in alone.records] == [str(r) for r in shared.records]
