"""A loop's big accumulator of outer products, collected and summed after the loop
(`rewrites.split.accumulators`), and the facts it rests on: a static bound on the loop's
trips (`trip_bound`) and the element shapes of a gradient loop's lists
(`tfmem.memory.list_element_shapes`).

Each rewrite is checked against the program as TensorFlow runs it, on the graph itself.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfmem.graph import Graph
from tfmem.testing import run_graph
from tfmem.memory import list_element_shapes

from rewrites.split.accumulators import collect_outer_products, outer_product_accumulators, trip_bound


def _graph(fn, *args) -> tuple[Graph, tf.types.experimental.ConcreteFunction]:
    concrete = tf.function(fn).get_concrete_function(*args)
    return Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs]), concrete


def _loops(graph: Graph) -> list[str]:
    return [node.name for node in graph.nodes if node.op in ("While", "StatelessWhile")]


def _outer_sums(trips: int, *, transposed: bool, two_terms: bool):
    def fn(u, v):
        n, m = u.shape[0], v.shape[0]

        def body(i, acc, a, b):
            if transposed:  # aᵀ stored as a row: the product reads it with transpose_a
                update = tf.matmul(tf.transpose(a), tf.transpose(b), transpose_a=True, transpose_b=False)
            else:
                update = tf.matmul(a, b, transpose_b=True)
            if two_terms:
                update = tf.add_n([update, tf.matmul(a * 2.0, b - 1.0, transpose_b=True)])
            return i + 1, acc + update, a * 0.9 + 0.1, tf.sin(b)

        return tf.while_loop(lambda i, *_: i < trips, body, (tf.constant(0), tf.zeros([n, m], u.dtype), u, v))[1]
    return fn


@pytest.mark.parametrize("transposed,two_terms", [(False, False), (True, False), (False, True)])
def test_collected_outer_products_equal_the_running_sum(rng, transposed, two_terms):
    n, m, trips = 120, 90, 3
    u, v = tf.constant(rng.normal(size=(n, 1))), tf.constant(rng.normal(size=(m, 1)))
    fn = _outer_sums(trips, transposed=transposed, two_terms=two_terms)
    graph, concrete = _graph(fn, u, v)
    [loop] = _loops(graph)
    found = outer_product_accumulators(graph, loop, limit=1024)
    assert [(acc.trips, acc.width) for acc in found] == [(trips, 2 if two_terms else 1)]
    [total] = collect_outer_products(graph, found)
    assert graph.spec(total).shape.as_list() == [n, m]
    assert max(graph.nbytes(ref) or 0 for node in _loops(graph) for ref in graph.inputs(node)) < n * m * 8
    [got] = run_graph(graph, concrete, [u, v])
    np.testing.assert_allclose(got, fn(u, v), rtol=1e-12, atol=1e-12)


def test_a_running_sum_read_inside_the_loop_is_not_collected(rng):
    def fn(u):
        def body(i, acc, a):
            acc = acc + tf.matmul(a, a, transpose_b=True)
            return i + 1, acc, a + tf.reduce_sum(acc[:, :1], 1, keepdims=True)  # the body reads the sum
        return tf.while_loop(lambda i, *_: i < 3, body, (tf.constant(0), tf.zeros([50, 50], u.dtype), u))[1]

    graph, _ = _graph(fn, tf.constant(rng.normal(size=(50, 1))))
    [loop] = _loops(graph)
    reason = outer_product_accumulators(graph, loop, limit=1024)
    assert isinstance(reason, str) and "read inside the loop" in reason, reason


def test_a_loop_without_a_static_bound_is_not_collected(rng):
    def fn(u, trips):
        def body(i, acc, a):
            return i + 1, acc + tf.matmul(a, a, transpose_b=True), a * 0.5
        return tf.while_loop(lambda i, *_: i < trips, body, (tf.constant(0), tf.zeros([50, 50], u.dtype), u))[1]

    graph, _ = _graph(fn, tf.constant(rng.normal(size=(50, 1))), tf.constant(3))
    [loop] = _loops(graph)
    assert trip_bound(graph, loop) is None
    reason = outer_product_accumulators(graph, loop, limit=1024)
    assert isinstance(reason, str) and "no static bound" in reason, reason


@pytest.mark.parametrize("limit,maximum,want", [(7, None, 7), (7, 3, 3), (2, 5, 2)])
def test_trip_bound_reads_the_counter_and_maximum_iterations(limit, maximum, want):
    def fn(v):
        return tf.while_loop(lambda i, _: i < limit, lambda i, w: (i + 1, w * 2.0), (tf.constant(0), v),
                             maximum_iterations=maximum)[1]

    graph, _ = _graph(fn, tf.constant(1.0))
    [loop] = _loops(graph)
    assert trip_bound(graph, loop) == want


def test_a_gradient_loop_runs_as_often_as_its_forward_loop_and_its_lists_are_shaped(rng):
    def fn(a, v):
        with tf.GradientTape() as tape:
            tape.watch(a)
            w = tf.while_loop(lambda i, _: i < 100, lambda i, w: (i + 1, tf.tanh(a @ w)), (tf.constant(0), v),
                              maximum_iterations=4)[1]
            loss = tf.reduce_sum(w)
        return tape.gradient(loss, a)

    graph, _ = _graph(fn, tf.constant(rng.normal(size=(20, 20))), tf.constant(rng.normal(size=(20, 1))))
    forward, backward = sorted(_loops(graph), key=len)  # "while", "gradient_tape/while/while_grad"
    assert trip_bound(graph, forward) == trip_bound(graph, backward) == 4
    shapes = list_element_shapes(graph, graph.inputs(backward))
    assert shapes and all(shape.as_list() == [20, 1] for shape in shapes.values()), shapes


def test_a_loop_with_side_effects_is_not_collected(rng):
    def fn(u):
        def body(i, acc, a):
            tf.print(i)  # pruning the rebuilt body must not lose it: the loop is left alone
            return i + 1, acc + tf.matmul(a, a, transpose_b=True), a * 0.5
        return tf.while_loop(lambda i, *_: i < 3, body, (tf.constant(0), tf.zeros([50, 50], u.dtype), u))[1]

    graph, _ = _graph(fn, tf.constant(rng.normal(size=(50, 1))))
    [loop] = _loops(graph)
    reason = outer_product_accumulators(graph, loop, limit=1024)
    assert isinstance(reason, str) and "side effects" in reason, reason
