"""Segment reductions read their ids unflattened (`rewrites.segment_ids`).

TensorFlow's gradient of `tf.gather(table, ids)` flattens the gradient and the ids before
`UnsortedSegmentSum`; the pass reads them as they were made, so that the split engine can
cut the sum along the ids' axes. Checked: it fires on a gather's gradient (and the other
segment reductions), the values are the same bits, and what it leaves.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from rewrites.segment_ids import UnflattenSegmentIds
from tfmem.capture import capture
from tfmem.config import Config
from tfmem.context import PassContext
from tfmem.passes import PassManager
from tfmem.testing import run_graph


def _captured(fn, *specs):
    concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
    return capture(concrete).to_graph(), concrete


def _segment_nodes(graph):
    return [node.name for node in graph.nodes if node.op.startswith("UnsortedSegment")]


def test_a_gathers_gradient_sums_segments_by_the_ids_as_they_were_made(rng) -> None:
    def fn(table, ids, weights):
        with tf.GradientTape() as tape:
            tape.watch(table)
            loss = tf.reduce_sum(tf.gather(table, ids) * weights[..., None])
        return tf.convert_to_tensor(tape.gradient(loss, table))

    specs = (tf.TensorSpec([12, 5], tf.float64), tf.TensorSpec([30, 7], tf.int32), tf.TensorSpec([30, 7], tf.float64))
    graph, concrete = _captured(fn, *specs)
    result = PassManager([UnflattenSegmentIds()], lint=True).run(graph, PassContext(Config()))
    [name] = _segment_nodes(result.graph)
    data, ids = result.graph.inputs(name)[:2]
    assert result.graph.spec(ids).shape == [30, 7] and result.graph.spec(data).shape == [30, 7, 5]
    assert [r.rule for r in result.records] == ["UnflattenSegmentIds"]
    values = [tf.constant(rng.normal(size=(12, 5))), tf.constant(rng.integers(0, 12, (30, 7)), tf.int32),
              tf.constant(rng.normal(size=(30, 7)))]
    [got] = run_graph(result.graph, concrete, values)
    np.testing.assert_array_equal(got, concrete(*values).numpy())


@pytest.mark.parametrize("op", ["max", "min", "prod", "sum"])
def test_each_segment_reduction_reads_its_ids_unflattened(op, rng) -> None:
    reduce = getattr(tf.math, f"unsorted_segment_{op}")

    def fn(x, ids):
        return reduce(tf.reshape(x, [-1, 3]), tf.reshape(ids, [-1]), 6)

    graph, concrete = _captured(fn, tf.TensorSpec([4, 5, 3], tf.float32), tf.TensorSpec([4, 5], tf.int32))
    result = PassManager([UnflattenSegmentIds()], lint=True).run(graph, PassContext(Config()))
    assert result.records, "did not fire"
    values = [tf.constant(rng.normal(size=(4, 5, 3)), tf.float32), tf.constant(rng.integers(0, 4, (4, 5)), tf.int32)]
    [got] = run_graph(result.graph, concrete, values)
    np.testing.assert_array_equal(got, concrete(*values).numpy())  # segments 4 and 5 empty in both


@pytest.mark.parametrize("fn, specs", [
    # The data's rows are not the ids' elements in order (a transpose between).
    (lambda x, ids: tf.math.unsorted_segment_sum(tf.reshape(tf.transpose(x, [1, 0, 2]), [-1, 3]),
                                                 tf.reshape(ids, [-1]), 6),
     (tf.TensorSpec([4, 5, 3]), tf.TensorSpec([4, 5], tf.int32))),
    # The data is not reshaped: nothing to undo.
    (lambda x, ids: tf.math.unsorted_segment_sum(x, tf.reshape(ids, [-1]), 6),
     (tf.TensorSpec([20, 3]), tf.TensorSpec([4, 5], tf.int32))),
    # The flat data keeps more than the ids' axes in its rows.
    (lambda x, ids: tf.math.unsorted_segment_sum(tf.reshape(x, [-1, 5]), tf.reshape(ids, [-1]), 6),
     (tf.TensorSpec([4, 3, 5]), tf.TensorSpec([2, 6], tf.int32))),
], ids=["transposed", "data_not_reshaped", "other_rows"])
def test_what_is_not_a_flattening_is_left(fn, specs) -> None:
    graph, _ = _captured(fn, *specs)
    before = {name: graph.inputs(name) for name in _segment_nodes(graph)}
    result = PassManager([UnflattenSegmentIds()], lint=True).run(graph, PassContext(Config()))
    assert not result.records
    assert {name: result.graph.inputs(name) for name in _segment_nodes(result.graph)} == before
