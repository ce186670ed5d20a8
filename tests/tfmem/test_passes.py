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
