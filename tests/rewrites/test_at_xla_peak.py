"""What XLA holds whole at its peak is computed in chunks (`rewrites.split.at_xla_peak`).

A kernel's gradient holds several `[n, n]` maps at once (`dK`, the distances, the maps
between), each summed into a small gradient. The split planner never saw them at XLA's
peak, and the copies the other rules make for late readers wait for the very tensors a
loop would compute in chunks (`order.computed_after`). Checked on the graph (the loop is
there, the maps are gone, no cycle) and by values against the program as written.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from rewrites.split.at_xla_peak import split_at_xla_peak
from rewrites.split.order import computed_after, tied_leaves
from tfmem.graph import Graph, TensorRef
from tfmem.testing import pairwise_distances, run_graph, xla_peak_holding

SPLIT = "SplitAtXlaPeak"
N = 400
SQRT5 = np.sqrt(5.0)


def matern_gradient(x: tf.Tensor, w: tf.Tensor, ell: tf.Tensor) -> tf.Tensor:
    """The gradient of `Σ K ⊙ W` in the lengthscales, K a Matérn-5/2 kernel matrix."""
    with tf.GradientTape() as tape:
        tape.watch(ell)
        r = pairwise_distances(x / ell)
        k = (1.0 + SQRT5 * r + 5.0 / 3.0 * tf.square(r)) * tf.exp(-SQRT5 * r)
        loss = tf.reduce_sum(k * w)
    return tape.gradient(loss, ell)


def tied_rows(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Row sums of `e ⊙ d'`, `d'` a copy of the distances that waits for `e` (as a copy
    `recompute` makes does), and a reader of the passed points after them."""
    e = tf.exp(-pairwise_distances(x))
    [later] = computed_after(e, x)
    return tf.reduce_sum(e * pairwise_distances(later), 1), tf.reduce_sum(later)


def _captured(fn, *specs):
    """The graph of `fn` after the cleanup stage (as the rule sees it in the pipeline)."""
    traced = tfmem.function(fn).trace(*specs)
    cleaned = traced.rewrite(tfmem.Config(passes=["cleanup"], memory_budget="off"))
    return cleaned.graph, traced.captured.concrete


def _big(graph: Graph, n: int, op: str) -> list[str]:
    return [node.name for node in graph.find(op) if graph.nbytes(TensorRef(node.name)) == n * n * 8]


def _peak_at(graph: Graph, held: list[str], n: int):
    return xla_peak_holding(held[-1], held, held, n=n)


def _gradient_program(n: int = N):
    specs = (tf.TensorSpec([n, 3], tf.float64), tf.TensorSpec([n, n], tf.float64), tf.TensorSpec([3], tf.float64))
    return _captured(matern_gradient, *specs)


def _gradient_values(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.uniform(-1, 1, (n, 3))), tf.constant(rng.normal(size=(n, n))),
            tf.constant([0.8, 1.3, 0.6], tf.float64)]


def _whole(graph: Graph, n: int) -> list[str]:
    """The ops outside any loop that make an `[n, n]` tensor or larger."""
    return [node.name for node in graph.nodes if (graph.nbytes(TensorRef(node.name)) or 0) >= n * n * 8]


def _gradient_maps(graph: Graph, n: int, count: int) -> list[str]:
    return [name for name in _big(graph, n, "Mul") if name.startswith("gradient_tape/")][:count]


def test_the_kernel_gradients_maps_xla_holds_are_made_in_chunks():
    graph, concrete = _gradient_program()
    before = _whole(graph, N)
    held = _gradient_maps(graph, N, 3)
    records = split_at_xla_peak(graph, _peak_at(graph, held, N), "test", target=16 * N * N * 8, split_size=None)
    fired = [r for r in records if r.status == "fired"]
    assert fired and all(r.rule == SPLIT and r.details["chunks"] >= 2 for r in fired), records
    assert len(list(graph.find(("While", "StatelessWhile")))) == len(fired)
    assert held[0] not in graph  # made in its loop, nowhere else
    assert len(_whole(graph, N)) <= len(before) - 5, (before, _whole(graph, N))
    graph.topological_order()  # no cycle
    values = _gradient_values(N, 1)
    [got] = run_graph(graph, concrete, values)
    np.testing.assert_allclose(got, concrete(*values).numpy(), rtol=1e-11)


def test_a_peak_of_tensors_nothing_sums_is_left_as_it_is():
    # The factor of a Cholesky is needed whole: no region, no change.
    def logdet(x):
        chol = tf.linalg.cholesky(tf.exp(-pairwise_distances(x)) + 0.1 * tf.eye(x.shape[0], dtype=x.dtype))
        return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol)))

    graph, _ = _captured(logdet, tf.TensorSpec([N, 3], tf.float64))
    before = graph.to_graph_def().SerializeToString(deterministic=True)
    held = _big(graph, N, "Cholesky")
    records = split_at_xla_peak(graph, _peak_at(graph, held, N), "test", target=16 * N * N * 8, split_size=None)
    assert records and all(r.status == "rejected" for r in records), records
    assert "Cholesky" in records[0].reason
    assert graph.to_graph_def().SerializeToString(deterministic=True) == before


def test_a_copy_waiting_for_what_the_loop_makes_reads_its_leaf_in_the_loop_and_waits_for_the_loop_after_it():
    graph, concrete = _captured(tied_rows, tf.TensorSpec([N, 3], tf.float64))
    [waits] = tied_leaves(graph)
    assert graph.node(waits.tie.node).op == "Exp" and waits.leaf.node == "x", waits
    held, before_node = [waits.tie.node], waits.node
    records = split_at_xla_peak(graph, _peak_at(graph, held, N), "test", target=16 * N * N * 8, split_size=None)
    assert [r.status for r in records] == ["fired"], records
    graph.topological_order()  # no cycle: the copy no longer waits for a tensor inside the loop
    [loop] = list(graph.find(("While", "StatelessWhile")))
    # The reader after the loop still reads x through a wait, now on what the loop sums; the
    # loop reads x through a wait on what it reads itself (its first chunk is made outside it).
    waits = {tied.node: tied for tied in tied_leaves(graph)}
    after = waits.pop(waits_node := next(name for name in waits if not name.startswith("tfmem_split_after")))
    assert loop.name in graph.ancestors(after.tie.node), after
    [inside] = waits.values()
    assert loop.name in graph.descendants(inside.node) and inside.tie.node in graph.ancestors(loop.name), inside
    assert waits_node == before_node
    x = tf.constant(np.random.default_rng(2).uniform(-1, 1, (N, 3)))
    got = run_graph(graph, concrete, [x])
    for g, w in zip(got, concrete(x)):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-12)


def test_ties_are_found_by_their_shape_and_a_plain_difference_is_not_one():
    def program(x, y):
        [passed] = computed_after(y, x)
        # The program's own test of a value: not a tie (the factor is no zero).
        unknown = tf.math.not_equal(y[0, 0], y[0, 0])
        return passed * 2.0, x - y[0, :3], x - tf.cast(unknown, x.dtype) * 5.0

    graph, _ = _captured(program, tf.TensorSpec([3], tf.float64), tf.TensorSpec([4, 4], tf.float64))
    found = tied_leaves(graph)
    assert [(t.leaf.node, t.tie.node) for t in found] == [("x", "y")], found
    assert graph.node(found[0].first).op == "Reshape"


@settings(max_examples=3, deadline=None, derandomize=True)
@given(n=st.integers(150, 420), share=st.sampled_from([8, 16, 64]), seed=st.integers(0, 3))
def test_property_kernel_gradients_split_at_xla_peak_equal_the_program_as_written(n, share, seed):
    graph, concrete = _gradient_program(n)
    held = _gradient_maps(graph, n, 3)
    split_at_xla_peak(graph, _peak_at(graph, held, n), "test", target=share * n * n * 8, split_size=None)
    graph.topological_order()
    values = _gradient_values(n, seed)
    [got] = run_graph(graph, concrete, values)
    np.testing.assert_allclose(got, concrete(*values).numpy(), rtol=1e-10)


@pytest.mark.parametrize("split_size", [64 * N, 8 * N * 8])
def test_chunks_stay_within_the_users_split_size(split_size):
    graph, _ = _gradient_program()
    held = _gradient_maps(graph, N, 1)
    records = split_at_xla_peak(graph, _peak_at(graph, held, N), "test", target=16 * N * N * 8,
                                split_size=split_size)
    [fired] = [r for r in records if r.status == "fired"]
    assert fired.details["chunk_bytes"] <= split_size, fired
    assert fired.details["chunks"] >= N * N * 8 // split_size // 8, fired
