"""CanonicalizeSplats: large one-value tensors become Fill, and a Fill splits for free."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from rewrites.splats import CanonicalizeSplats, proto_splat_value, splat_value
from tfmem.host_folding import LARGE_TENSOR_BYTES
from tfmem.capture import capture
from tfmem.config import Config
from tfmem.context import PassContext
from tfmem.graph import TensorRef
from tfmem.passes import PassManager

N = 700  # [N, N] float64 is 3.9 MB: over LARGE_TENSOR_BYTES


def graph_of(fn, *specs):
    return capture(tf.function(fn, autograph=False).get_concrete_function(*specs)).to_graph()


@pytest.mark.parametrize("make", [
    lambda x: tf.raw_ops.ZerosLike(x=x),
    lambda x: tf.raw_ops.OnesLike(x=x),
    lambda x: tf.broadcast_to(tf.constant(2.5, tf.float64), [N, N]),
], ids=["zeros_like", "ones_like", "broadcast_to"])
def test_large_splats_become_fill_and_stop_reading_their_input(make) -> None:
    graph = graph_of(lambda x: make(x) * x, tf.TensorSpec([N, N], tf.float64))
    result = PassManager([CanonicalizeSplats()], lint=True).run(graph, PassContext(Config()))
    ops = result.graph.op_counts()
    assert ops.get("Fill") == 1 and not {"ZerosLike", "OnesLike", "BroadcastTo"} & set(ops), ops
    (fill,) = result.graph.find("Fill")
    assert all(result.graph.node(r.node).op == "Const" for r in result.graph.inputs(fill.name))
    assert [r.kind for r in result.records] == ["cleanup"]


def test_small_splats_are_left_to_grappler() -> None:
    graph = graph_of(lambda x: tf.raw_ops.ZerosLike(x=x) + x, tf.TensorSpec([4, 3], tf.float64))
    result = PassManager([CanonicalizeSplats()]).run(graph, PassContext(Config()))
    assert "ZerosLike" in result.graph.op_counts() and not result.records


def test_splat_value_reads_the_proto_without_expanding_it() -> None:
    proto = tf.make_tensor_proto(7.0, tf.float32, shape=[3, 4])  # how TF stores a splat
    assert proto_splat_value(proto) == 7.0 and not proto.tensor_content
    assert proto_splat_value(tf.make_tensor_proto(np.arange(12.0).reshape(3, 4))) is None
    graph = graph_of(lambda x: tf.fill([N, 2], tf.constant(-1.0, tf.float64)) + x[:, :2],
                     tf.TensorSpec([N, N], tf.float64))
    (fill,) = graph.find("Fill")
    assert splat_value(graph, TensorRef(fill.name)) == -1.0
    assert N * 2 * 8 < LARGE_TENSOR_BYTES  # the splat value is known at any size


def test_a_gradient_zeros_like_is_sliced_per_chunk_not_materialised(rng: np.random.Generator) -> None:
    # d/dx of Σ relu(x @ yᵀ) builds an [n, m] zeros_like for the relu's inactive side.
    n, m = 600, 500
    x, y = (tf.constant(rng.normal(size=(k, 3))) for k in (n, m))

    def fn(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.where(x @ tf.transpose(y) > 0.0, x @ tf.transpose(y), tf.zeros([n, m], x.dtype)))
        return loss, tape.gradient(loss, x)

    threshold = n * m * 8 // 3
    wrapped = tfmem.TfmemFunction(fn, config={"tensor_size_threshold": threshold, "strict": True}, lint=True)
    report = wrapped.report(x, y)
    assert report.splits, str(report)
    graph = tfmem.Graph(report.rewritten_graph_def)
    top_level = [graph.nbytes(TensorRef(node.name)) or 0 for node in graph.nodes if node.op in ("Fill", "Const")]
    assert max(top_level) <= threshold, str(report)  # no [n, m] splat outside the loop
    got, want = wrapped(x, y), fn(x, y)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-10)
