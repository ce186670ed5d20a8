"""Large constants are left to XLA: TensorFlow's folding before XLA builds none on the host."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.graph import Graph
from tfmem.host_folding import BARRIER_OP, LARGE_TENSOR_BYTES, leave_large_constants_to_xla
from tfmem.isolation import run_isolated
from tfmem.testing import CONSTANT_MAKERS, CONSTANT_MAKERS_N

N = CONSTANT_MAKERS_N
# Constants TensorFlow folds to one repeated value: tf2xla hands those to XLA as a broadcast
# of a scalar, so only the host's allocator sees that they were built.
SPLATS = {"fill", "outer_product", "batch_outer_product"}


def _largest_hlo_constant(function: tf.types.experimental.GenericFunction, x: tf.Tensor) -> int:
    """Bytes of the largest literal in the HLO TensorFlow hands XLA (after its folding)."""
    hlo = function.experimental_get_compiler_ir(x)(stage="hlo")
    sizes = {"pred": 1, "s32": 4, "f32": 4, "f64": 8, "s64": 8}
    largest = 0
    for dtype, dims in re.findall(r"= (pred|s32|s64|f32|f64)\[([0-9,]*)\]\{[^}]*\} constant\(", hlo):
        largest = max(largest, sizes[dtype] * int(np.prod([int(d) for d in dims.split(",") if d])))
    return largest


@pytest.mark.parametrize("name", sorted(CONSTANT_MAKERS))
def test_a_large_constant_reaches_xla_unfolded_and_the_values_equal_stock(name: str) -> None:
    program = CONSTANT_MAKERS[name]
    x = tf.random.stateless_normal([N, N], seed=[1, 2])
    stock = tf.function(program, jit_compile=True)
    if name not in SPLATS:  # TensorFlow folds it into a literal: the test can fail
        assert _largest_hlo_constant(stock, x) > LARGE_TENSOR_BYTES
    rewritten = tfmem.function(program, config=tfmem.Config(memory_budget="1GiB"))
    compiled = rewritten.compiled(x)
    assert compiled is not None, "tfmem fell back to the original"
    assert _largest_hlo_constant(compiled.function, x) <= LARGE_TENSOR_BYTES
    np.testing.assert_allclose(rewritten(x).numpy(), stock(x).numpy(), rtol=1e-6, atol=1e-6)


def test_only_large_computable_nodes_are_shielded_and_only_through_their_data_operands() -> None:
    def program(x):
        small = tf.fill([N // 4], 2.0) * 3.0  # 256 floats: folding it is cheap, left alone
        big = tf.fill([N, N], 0.5)  # its dims stay a constant (XLA needs them); its 0.5 goes through
        return x * big + tf.reduce_sum(small) + tf.reduce_sum(x * x)  # x * x: not a constant

    concrete = tf.function(program).get_concrete_function(tf.TensorSpec([N, N]))
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    shielded, names = leave_large_constants_to_xla(graph)
    assert names == ["Fill_1"]
    [barrier] = list(shielded.find(BARRIER_OP))
    fill_inputs = shielded.inputs("Fill_1")
    assert fill_inputs[1].node == barrier.name and shielded.node(fill_inputs[0].node).op == "Const"
    assert not list(graph.find(BARRIER_OP)), "the graph given is left as it was"


def test_a_graph_without_large_constants_comes_back_as_it_was() -> None:
    concrete = tf.function(lambda x: x * 2.0 + tf.eye(8)).get_concrete_function(tf.TensorSpec([8, 8]))
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    shielded, names = leave_large_constants_to_xla(graph)
    assert shielded is graph and names == []


def test_without_xla_the_import_keeps_constants_for_tensorflow() -> None:
    x = tf.random.stateless_normal([N, N], seed=[3, 4])
    program = CONSTANT_MAKERS["eye"]
    rewritten = tfmem.function(program, config=tfmem.Config(memory_budget="1GiB", jit_compile=False))
    compiled = rewritten.compiled(x)
    assert compiled is not None
    ops = {op.type for op in compiled.function.get_concrete_function(x).graph.get_operations()}
    assert BARRIER_OP not in ops  # no CPU kernel: only the XLA import may hold one
    np.testing.assert_allclose(rewritten(x).numpy(), program(x).numpy(), rtol=1e-6)


def test_compiling_builds_no_large_constant_on_the_allocator_the_program_runs_on() -> None:
    result = run_isolated("tfmem.testing:compile_allocator_growth", sorted(CONSTANT_MAKERS),
                          memory_limit_mb=1024, timeout=None)
    assert result.status == "ok", result.error
    for name, growth in result.value.items():
        assert growth["stock"] > LARGE_TENSOR_BYTES, name  # stock's compile builds it there: the test can fail
        assert growth["tfmem"] < LARGE_TENSOR_BYTES, (name, growth)
