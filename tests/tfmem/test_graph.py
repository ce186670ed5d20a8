"""Graph: parsing, indexes, edits, splice, lint, and the caller's GraphDef left alone."""
from __future__ import annotations

import pytest
import tensorflow as tf

from tfmem import Graph, GraphError, TensorRef
from tfmem.graph import rename_functions


def traced(fn, *specs) -> tuple[Graph, object]:
    concrete = tf.function(fn).get_concrete_function(*specs)
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    return Graph(graph_def, outputs=[t.name for t in concrete.outputs]), graph_def


def _two_outputs(x):
    values, indices = tf.math.top_k(x, k=2)
    return tf.exp(values) + 1.0, indices


SPEC = tf.TensorSpec([4, 5], tf.float32)


@pytest.mark.parametrize("text, ref", [("a", TensorRef("a", 0)), ("a:0", TensorRef("a", 0)),
                                       ("scope/a:2", TensorRef("scope/a", 2)),
                                       ("a:b", TensorRef("a:b", 0))])
def test_tensor_ref_parse(text: str, ref: TensorRef) -> None:
    assert TensorRef.parse(text) == ref


def test_tensor_ref_rejects_control_input() -> None:
    with pytest.raises(GraphError, match="control"):
        TensorRef.parse("^a")


def test_specs_consumers_and_order() -> None:
    graph, _ = traced(_two_outputs, SPEC)
    (topk,) = list(graph.find("TopKV2"))
    assert graph.spec(TensorRef(topk.name, 0)) == tf.TensorSpec([4, 2], tf.float32)
    assert graph.spec(TensorRef(topk.name, 1)) == tf.TensorSpec([4, 2], tf.int32)
    assert graph.nbytes(TensorRef(topk.name, 0)) == 4 * 2 * 4
    (exp,) = list(graph.find("Exp"))
    assert graph.consumers(TensorRef(topk.name, 0)) == [(exp.name, 0)]
    order = graph.topological_order()
    assert order.index(topk.name) < order.index(exp.name)
    assert graph.lint() == []


def test_replace_all_uses_remove_and_prune() -> None:
    graph, _ = traced(_two_outputs, SPEC)
    (exp,) = list(graph.find("Exp"))
    (topk,) = list(graph.find("TopKV2"))
    with pytest.raises(GraphError, match="still read by"):
        graph.remove(exp.name)
    assert graph.replace_all_uses(TensorRef(exp.name), TensorRef(topk.name)) == 1
    graph.remove(exp.name)
    assert exp.name not in graph
    assert graph.lint() == []


def test_prune_keeps_outputs_placeholders_and_state() -> None:
    v = tf.Variable(1.0)

    def fn(x):
        v.assign_add(1.0)
        unused = tf.exp(x)  # noqa: F841 - dead on purpose
        return x + 1.0

    graph, _ = traced(fn, tf.TensorSpec([3], tf.float32))
    dead = graph.prune()
    assert any("Exp" in graph_name or "Exp" == graph_name for graph_name in dead)
    ops = graph.op_counts()
    assert "Exp" not in ops and ops["AssignAddVariableOp"] == 1 and ops["Placeholder"] >= 2


def test_splice_builds_ops_with_shapes() -> None:
    graph, _ = traced(lambda x: tf.reduce_sum(x, axis=0), SPEC)
    (x,) = [TensorRef(n.name) for n in graph.find("Placeholder")]
    norm, total = graph.splice(lambda t: (tf.reduce_sum(t * t, -1), tf.reduce_sum(t)), [x])
    assert graph.spec(norm) == tf.TensorSpec([4], tf.float32)
    assert graph.spec(total) == tf.TensorSpec([], tf.float32)
    assert graph.node(norm.node).op == "Sum"
    (same,) = graph.splice(lambda t: t, [x])  # an input passed straight through
    assert same == x
    graph.outputs.append(norm)
    assert graph.lint() == []


def test_lint_reports_missing_nodes_and_cycles() -> None:
    graph, _ = traced(lambda x: tf.exp(x) + 1.0, SPEC)
    (exp,) = list(graph.find("Exp"))
    graph.node(exp.name).input[0] = "nowhere"
    graph._changed()
    assert any("missing" in problem for problem in graph.lint())
    cyclic, _ = traced(lambda x: tf.exp(tf.sin(x)), SPEC)
    (sin,) = list(cyclic.find("Sin"))
    (exp,) = list(cyclic.find("Exp"))
    cyclic.set_input(sin.name, 0, TensorRef(exp.name))
    assert any("cycle" in problem for problem in cyclic.lint())
    with pytest.raises(GraphError, match="cycle"):
        cyclic.check()


def test_graph_copies_the_graph_def() -> None:
    graph, graph_def = traced(lambda x: tf.exp(x), SPEC)
    before = graph_def.SerializeToString(deterministic=True)
    (exp,) = list(graph.find("Exp"))
    graph.node(exp.name).op = "Log"
    graph.splice(tf.sin, [TensorRef(exp.name)])
    assert graph_def.SerializeToString(deterministic=True) == before
    rebuilt = graph.to_graph_def()
    assert rebuilt.versions == graph_def.versions
    assert [n.name for n in rebuilt.node].index(exp.name) < len(rebuilt.node)


def test_the_fingerprint_follows_what_passes_read() -> None:
    graph, _ = traced(lambda x: tf.exp(x) * 2.0, SPEC)
    same = graph.copy()
    assert same.fingerprint() == graph.fingerprint()
    (exp,) = list(graph.find("Exp"))
    same.node(exp.name).op = "Log"
    assert same.fingerprint() != graph.fingerprint()  # a node's content
    kept = graph.copy()
    kept.keep.add(exp.name)
    assert kept.fingerprint() != graph.fingerprint()  # what pruning keeps
    named = graph.copy()
    named.unique_name(exp.name)  # taken: the counter fresh names come from moves on
    assert len(named) == len(graph) and named.fingerprint() != graph.fingerprint()


def test_library_functions_are_carried() -> None:
    def fn(x):
        return tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2.0), (0, x))[1]

    graph, graph_def = traced(fn, tf.TensorSpec([3], tf.float32))
    assert len(graph_def.library.function) >= 2
    (loop,) = list(graph.find(("While", "StatelessWhile")))
    assert graph.function(loop.attr["body"].func.name) is not None
    assert len(graph.to_graph_def().library.function) == len(graph_def.library.function)


def test_rename_functions_renames_every_reference() -> None:
    """Signatures, While cond/body, a call's `f` inside a loop body, a cond's branches: all
    renamed; names not in the mapping stay."""
    inner = tf.function(lambda a: a * 2.0)

    def fn(x):
        looped = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, inner(a)), (0, x))[1]
        return tf.cond(tf.reduce_sum(looped) > 0, lambda: looped, lambda: -looped)

    _, graph_def = traced(fn, tf.TensorSpec([3], tf.float32))
    names = {f.signature.name for f in graph_def.library.function}
    renamed = {name: f"{name}_x" for name in names}
    rename_functions(graph_def, renamed)

    def referenced(nodes) -> set[str]:
        found = set()
        for node in nodes:
            for value in node.attr.values():
                kind = value.WhichOneof("value")
                found |= {value.func.name} if kind == "func" else {f.name for f in value.list.func}
        return found

    functions = graph_def.library.function
    assert {f.signature.name for f in functions} == set(renamed.values())
    inside = [n for f in functions for n in f.node_def]
    assert referenced(graph_def.node) | referenced(inside) <= set(renamed.values())
    assert len(referenced(graph_def.node) | referenced(inside)) >= 5  # cond, body, call, two branches
    assert not {n.op for n in inside} & names


def test_only_the_graph_view_parses_graphdef_input_strings() -> None:
    # "node:port" and "^control" strings are Graph's business: everything else speaks in
    # TensorRefs and node names (a hand-written edit elsewhere is how control edges got lost).
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    forbidden = re.compile(r"""split\(["']:["']\)|rpartition\(["']:["']\)|lstrip\(["']\^["']\)|"""
                           r"""startswith\(["']\^["']\)|\.input\.(append|extend)\(|del [\w.]+\.input\[""")
    offenders = [f"{path.relative_to(repo)}:{number}: {line.strip()}"
                 for package in ("tfmem", "rewrites", "gpflow_integration", "benchmarks")
                 for path in sorted((repo / package).rglob("*.py")) if path.name != "graph.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if forbidden.search(line)]
    assert not offenders, offenders


def _returned_through_views(x):
    square = tf.matmul(x, x, transpose_b=True)              # [4, 4]
    moved = tf.transpose(square[None], [1, 0, 2])           # [4, 1, 4]: only the unit axis moves
    flipped = tf.transpose(square)                           # a real transpose
    return tf.reshape(moved, [16]), flipped + 1.0


def test_views_and_returned_tensors() -> None:
    graph, _ = traced(_returned_through_views, tf.TensorSpec([4, 5], tf.float32))
    (product,) = list(graph.find("MatMul"))
    transposes = {tuple(graph.spec(TensorRef(n.name)).shape.as_list()): n.name for n in graph.find("Transpose")}
    assert graph.aliases_input(transposes[(4, 1, 4)]) and not graph.aliases_input(transposes[(4, 4)])
    assert graph.aliases_input(next(n.name for n in graph.find("Reshape")))
    assert not graph.aliases_input(product.name)
    # Returned through a reshape: held whole at the end; the product is also read by a real
    # transpose, so it is not.
    assert graph.is_returned(TensorRef(transposes[(4, 1, 4)]))
    assert not graph.is_returned(TensorRef(product.name))


def test_a_colocation_with_a_node_no_longer_in_the_graph_is_dropped_on_export() -> None:
    """A pass that removes a node (a no-op Reshape) leaves its readers' `_class: loc:@…`
    naming it, and the importer refuses a colocation with an unknown node."""
    def fn(x):
        y = tf.reshape(x, [4])
        with tf.compat.v1.colocate_with(y.op):
            z = tf.identity(x) * 2.0
        return z + y

    graph, _ = traced(fn, tf.TensorSpec([4], tf.float32))
    reshape = next(graph.find("Reshape")).name
    colocated = [n.name for n in graph.to_graph_def().node if f"loc:@{reshape}".encode() in n.attr["_class"].list.s]
    assert colocated, "the trace has no colocation to test"
    exported = graph.to_graph_def(drop={reshape})
    for node in exported.node:
        assert not any(entry == f"loc:@{reshape}".encode() for entry in node.attr["_class"].list.s), node
    names = {n.name for n in exported.node}
    with tf.Graph().as_default():  # imports: the dropped node's tensor is fed, nothing names it
        tf.graph_util.import_graph_def(exported, input_map={f"{reshape}:0": tf.zeros([4])}, name="")
        assert names <= {op.name for op in tf.compat.v1.get_default_graph().get_operations()}


def test_a_derived_fact_is_computed_once_per_version_and_dropped_by_an_edit() -> None:
    """`Graph.derived` (e.g. `host_folding.computable_nodes`, read at every estimate) is
    computed once while the graph is unchanged; an edit, a copy's edit or `assign` gives
    the fact of the graph as it is then, never a stale one."""
    graph, _ = traced(_two_outputs, SPEC)
    calls: list[int] = []

    def names(g: Graph) -> frozenset[str]:
        calls.append(1)
        return frozenset(n.name for n in g.nodes)

    before = graph.derived(names)
    assert graph.derived(names) is before and len(calls) == 1
    copy = graph.copy()
    assert copy.derived(names) is before and len(calls) == 1  # shared while neither is edited
    (exp,) = [n.name for n in copy.find("Exp")]
    added = copy.add_node(copy.node(exp))
    assert added in copy.derived(names) and len(calls) == 2
    assert graph.derived(names) is before and added not in graph.derived(names)
    graph.assign(copy)
    assert added in graph.derived(names)
