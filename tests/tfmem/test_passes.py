"""PassManager: fixed point, lint naming the culprit, records kept once, timings."""
from __future__ import annotations

import pytest
import tensorflow as tf

from rewrites import PASSES_BY_STAGE, passes_for
from rewrites.cleanup import ForwardIdentities
from tfmem import Config, Graph, GraphPass, PassContext, PassError, PassManager, PassResult, RewriteRecord, TensorRef


def graph_of(fn, *specs) -> Graph:
    concrete = tf.function(fn).get_concrete_function(*specs)
    return Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])


def _identities(x):
    return tf.exp(tf.identity(tf.identity(x)))


class _RemoveOneIdentity(GraphPass):
    """Forwards a single Identity per run, so reaching the fixed point takes rounds."""

    name, stage, reads = "remove_one", "cleanup", frozenset()

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        for node in graph.find("Identity"):
            ref = TensorRef(node.name)
            if not graph.is_output(ref):
                graph.replace_all_uses(ref, graph.inputs(node.name)[0])
                graph.remove(node.name)
                return PassResult(graph, True, [RewriteRecord(self.name, "forward", "fired", (node.name,))])
        return PassResult(graph, False, [RewriteRecord(self.name, "forward", "rejected", (), "nothing left")])


class _BreakGraph(GraphPass):
    name, stage = "break_graph", "cleanup"

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        (exp,) = list(graph.find("Exp"))
        graph.node(exp.name).input[0] = "missing_node"
        graph._changed()
        return PassResult(graph, True)


def test_runs_to_a_fixed_point_and_keeps_records_once() -> None:
    graph = graph_of(_identities, tf.TensorSpec([3], tf.float32))
    result = PassManager([_RemoveOneIdentity()], lint=True).run(graph, PassContext(Config()))
    assert "Identity" in graph.op_counts()  # the input graph is untouched
    ops = result.graph.op_counts()
    assert ops["Identity"] == 1  # only the output's Identity stays
    assert result.iterations == 3  # two rounds that fire, one that finds nothing
    assert [r.status for r in result.records] == ["fired", "fired", "rejected"]
    assert result.modified and set(result.seconds) == {"remove_one"}


def test_lint_names_the_pass_that_broke_the_graph() -> None:
    graph = graph_of(_identities, tf.TensorSpec([3], tf.float32))
    with pytest.raises(PassError, match="break_graph.*missing") as info:
        PassManager([_BreakGraph()], lint=True).run(graph, PassContext(Config()))
    assert info.value.pass_name == "break_graph"


def test_forward_identities_keeps_outputs_and_effects() -> None:
    v = tf.Variable(0.0)

    def fn(x):
        v.assign_add(tf.reduce_sum(tf.identity(x)))
        return tf.identity(tf.exp(tf.identity(x)))

    graph = graph_of(fn, tf.TensorSpec([3], tf.float32))
    result = PassManager([ForwardIdentities()], lint=True).run(graph, PassContext(Config()))
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

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        self.runs += 1
        return super().run(graph, context)


class _RecordTarget(GraphPass):
    """Runs once, reads the context's target: records it, changes nothing."""

    name, stage, runs_once, reads = "record_target", "split", True, frozenset({"memory_budget"})

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        return PassResult(graph, False, [RewriteRecord(self.name, "target", "info",
                                                       details={"target": context.target_bytes})],
                          verdict=("target", context.target_bytes))


def test_the_prefix_runs_once_and_is_reused_for_another_target_and_budget() -> None:
    graph = graph_of(_identities, tf.TensorSpec([3], tf.float32))
    counter = _CountRuns()
    manager = PassManager([counter, _RecordTarget()], lint=True)
    cache: dict = {}
    first = manager.run(graph, PassContext(Config()), cache=cache)
    assert counter.runs == 3 and first.prefix.graph.op_counts()["Identity"] == 1  # to its fixed point
    assert list(cache.values()) == [first.prefix]
    runs_before = counter.runs
    for budget, target in ((1 << 20, 1 << 19), (1 << 10, 1 << 9)):
        result = manager.run(graph, PassContext(Config(memory_budget=budget), None, target), cache=cache)
        assert [r.details["target"] for r in result.records if r.pass_name == "record_target"] == [target]
        assert result.verdicts == {"record_target": ("target", target)}
        assert result.graph.op_counts() == first.prefix.graph.op_counts()
        assert result.prefix is first.prefix and result.seconds["remove_one"] == 0.0
    # From a reused prefix the first round starts at the pass that runs once; it changed
    # nothing, so the prefix pass does not run again.
    assert counter.runs == runs_before
    assert first.prefix.graph.op_counts()["Identity"] == 1  # the shared prefix is not edited


def test_the_prefix_key_follows_the_config_keys_its_passes_read() -> None:
    manager = PassManager([_RemoveOneIdentity(), _RecordTarget()])
    key = manager.prefix_key(PassContext(Config()))
    assert key == manager.prefix_key(PassContext(Config(memory_budget="1GiB", strict=True)))

    class _ReadsAnything(_RemoveOneIdentity):
        reads = None  # says nothing: any config key may change its result

    careful = PassManager([_ReadsAnything(), _RecordTarget()])
    assert careful.prefix_key(PassContext(Config())) != careful.prefix_key(PassContext(Config(strict=True)))


def test_run_with_a_cached_prefix_equals_run_without() -> None:
    graph = graph_of(_identities, tf.TensorSpec([3], tf.float32))
    manager = PassManager([_RemoveOneIdentity(), _RecordTarget()])
    context = PassContext(Config(memory_budget=1024), None, 1000)
    alone = manager.run(graph, context)
    cache: dict = {}
    manager.run(graph, PassContext(Config()), cache=cache)
    shared = manager.run(graph, context, cache=cache)
    assert alone.graph.to_graph_def() == shared.graph.to_graph_def()
    assert [str(r) for r in alone.records] == [str(r) for r in shared.records]
