"""Without XLA, TensorFlow's executor runs the program as the static estimate counted it."""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

import tfmem
from tfmem.capture import capture
from tfmem.executor_order import GraphModeFunction, heavy_ops_in_turn
from tfmem.memory import WHILE_LOOP_OPS, FunctionCall, estimate_memory, function_calls


def two_outer_products_per_trip(x, y):
    """A loop whose body makes two [n, n] matrices that no data orders."""
    def body(i, total):
        a = tf.reduce_sum(tf.exp(x[:, None] * x[None, :]))
        b = tf.reduce_sum(tf.sin(y[:, None] * y[None, :]))
        return i + 1, total + a + b

    return tf.while_loop(lambda i, _: i < 3, body, (0, tf.constant(0.0, tf.float64)))[1]


def test_large_ops_inside_a_loop_body_wait_on_each_other_in_the_estimates_order() -> None:
    # Before, only the program's own nodes were chained: inside a body the executor ran
    # both matrices side by side (a CG gradient's split loop beside its last chunk: 77 MiB
    # where the estimate said 37).
    n = 500  # [500, 500] float64: 1.9 MiB, over LARGE_TENSOR_BYTES
    args = (tf.constant(np.linspace(0.0, 1.0, n)), tf.constant(np.linspace(1.0, 2.0, n)))
    graph = capture(tf.function(two_outer_products_per_trip, autograph=False).get_concrete_function(*args)).to_graph()
    loop = next(graph.find(WHILE_LOOP_OPS))
    call = next(c for c in function_calls(graph, loop.name) if c.loop_body)
    body = call.graph(graph)
    schedule = list(estimate_memory(body).steps)
    large = [name for name in schedule if body.node(name).op in ("Exp", "Sin")]
    assert len(large) == 2 and large[0] not in body.ancestors(large[1])

    ordered = heavy_ops_in_turn(graph)
    ordered_body = FunctionCall(call.function, ordered.inputs(loop.name)).graph(ordered)
    assert large[0] in ordered_body.ancestors(large[1])
    assert not body.control_inputs(large[1])  # a copy: the plan itself is left as it was
    got = tfmem.function(two_outer_products_per_trip, config=tfmem.Config(memory_budget="64MiB", jit_compile=False))
    np.testing.assert_allclose(got(*args).numpy(), two_outer_products_per_trip(*args).numpy(), rtol=1e-12)


def test_a_graph_mode_function_is_called_with_grapplers_arithmetic_rewrites_off() -> None:
    seen: list[Any] = []

    def record(x):
        config = config_pb2.ConfigProto()
        config.ParseFromString(context.context().function_call_options.config_proto_serialized)
        seen.append(config.graph_options.rewrite_options.arithmetic_optimization)
        return 2.0 * x

    before = context.context().function_call_options.config_proto_serialized
    function = GraphModeFunction(tf.function(record))
    assert float(function(tf.constant(1.5))) == 3.0
    assert seen == [rewriter_config_pb2.RewriterConfig.OFF]
    # The thread's own options are as they were: only these calls run without the rewrites.
    assert context.context().function_call_options.config_proto_serialized == before
    assert function.python_function is record  # the rest is the tf.function's


def cg_gradient_without_xla(n: int, budget: str, split_size: str) -> dict[str, Any]:
    """The verdict on, and a call of, the gradient of 15 conjugate-gradient steps, run
    without XLA with a split size far under the budget."""
    from benchmarks.corpus.programs import _conjugate_gradients_grad

    loss_and_grad, args = _conjugate_gradients_grad(n, bounded=False, noise=200.0)
    config = tfmem.Config(memory_budget=budget, jit_compile=False, tensor_split_size=split_size)
    wrapped = tfmem.function(loss_and_grad, config=config)
    report = wrapped.report(*args)
    loss, _ = wrapped(*args)
    return {"fits": report.fits, "estimate": report.memory_after.peak_bytes, "loss": float(loss)}


def test_without_xla_a_split_loop_in_a_loop_body_stays_near_its_estimate_under_a_real_limit() -> None:
    # The estimate is 13.2 MiB. With no limit, the real peak was 21–23 MiB before (18.8
    # without Grappler's arithmetic rewrites at the call, which made each chunk's sum of a
    # row and a column a whole temporary; more with them but the body's order), and is
    # 13.3–13.8 MiB now. Under 20 and 24 MiB limits the old code ran out of memory (3 runs of
    # 3), the new one ran (peak 15.5 MiB under 20: the allocator's regions add some).
    result = tfmem.run_isolated(cg_gradient_without_xla, 2500, "64MiB", "4MiB", memory_limit_mb=22, timeout=None)
    assert result.ok, result.error
    assert result.value["fits"] and result.value["estimate"] < 14 * 2**20, result.value
