"""DetachConstants: constants stop waiting on ops by control edge; values are unchanged."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrites.detach_constants import DetachConstants
from tfmem.capture import capture, import_as_function
from tfmem.config import Config
from tfmem.context import PassContext
from tfmem.passes import PassManager


def test_a_constant_waiting_on_an_op_is_detached_and_the_values_stay() -> None:
    def fn(x):
        y = tf.exp(x)
        with tf.control_dependencies([y]):
            two = tf.constant(2.0)
        return y * two

    captured = capture(tf.function(fn, autograph=False).get_concrete_function(tf.TensorSpec([3], tf.float32)))
    graph = captured.to_graph()
    waiting = [n.name for n in graph.find("Const") if graph.control_inputs(n.name)]
    assert waiting  # the traced graph has the edge
    result = PassManager([DetachConstants()], lint=True).run(graph, PassContext(Config()))
    assert not [n.name for n in result.graph.find("Const") if result.graph.control_inputs(n.name)]
    assert [r.details["edges"] for r in result.records] == [len(waiting)]
    x = tf.constant([0.0, 1.0, -1.0])
    got = import_as_function(captured, result.graph, jit_compile=False)(x)
    np.testing.assert_allclose(got.numpy(), fn(x).numpy(), rtol=1e-7)


def test_nothing_to_detach_changes_nothing() -> None:
    captured = capture(tf.function(lambda x: x * 2.0).get_concrete_function(tf.TensorSpec([3], tf.float32)))
    result = DetachConstants().run(captured.to_graph(), PassContext(Config()))
    assert not result.modified and result.records == []
