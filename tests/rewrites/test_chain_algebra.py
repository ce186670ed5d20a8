"""Tests for `rewrites._chain_algebra`: the chain walk and the bracketing planner."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrites._chain_algebra import ChainPlanner, extract_chain
from tfmem.graph import Graph
from tfmem.testing import random_inputs as inputs


def test_planner_minimises_peak_before_flops() -> None:
    # (x @ y) @ z holds a [100, 100] intermediate and the [100, 100] result at once;
    # x @ (y @ z) only a [1, 100] and the result.
    planner = ChainPlanner([(100, 1), (1, 100), (100, 100)], 8)
    tree, cost = planner.best()
    assert tree == (0, (1, 2))
    assert cost.peak == planner.cost(tree).peak == 100 * 8 + 100 * 100 * 8
    assert planner.cost(((0, 1), 2)).peak == 2 * 100 * 100 * 8


def test_extract_chain_through_transposes(rng: np.random.Generator) -> None:
    args = inputs(rng, [[4, 3], [3, 5], [4, 2]], tf.float32)
    concrete = tf.function(lambda a, b, c: tf.transpose(a @ b) @ c).get_concrete_function(*args)
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    chain = extract_chain(graph, "matmul_1")
    assert chain.describe() == "((bᵀ @ aᵀ) @ c)"
    assert set(chain.interior) == {"matmul_1", "transpose", "matmul"}
