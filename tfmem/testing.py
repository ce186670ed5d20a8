"""Helpers for testing rewrites: seeded inputs and dtype-aware closeness.

Example:
    >>> import numpy as np, tensorflow as tf, tfmem
    >>> from tfmem.testing import assert_close, random_inputs
    >>> a, b = random_inputs(np.random.default_rng(0), [[4, 3], [3, 2]], tf.float64)
    >>> assert_close(tfmem.function(tf.matmul)(a, b), a @ b, tf.float64)
"""
from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf


def random_inputs(rng: np.random.Generator, shapes: Sequence[Sequence[int]], dtype: tf.DType) -> list[tf.Tensor]:
    """One standard-normal tensor per shape."""
    return [tf.constant(rng.normal(size=s), dtype) for s in shapes]


def pairwise_distances(x: tf.Tensor) -> tf.Tensor:
    """The `[n, n]` Euclidean distances between `x`'s rows, as GPflow's stationary kernels
    compute them (`‖x‖² + ‖y‖² − 2xyᵀ`, kept off zero before the square root): the maps
    of a kernel's distances are what the XLA-peak rules' tests split, copy and order."""
    sq = tf.reduce_sum(x * x, 1)
    return tf.sqrt(tf.maximum(sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True), 1e-36))


def max_in_loss(q: tf.Tensor, k: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """A hand-written softmax with its row maximum differentiated, plus `max(s)`, and its
    gradients: under a budget of a few `[n, n]` matrices (`s` is `[n, n]`), XLA's plan
    does not fit at first and the rounds around XLA's peaks act."""
    with tf.GradientTape() as tape:
        tape.watch([q, k])
        s = q @ tf.transpose(k) / 4.0
        e = tf.exp(s - tf.reduce_max(s, axis=1, keepdims=True))
        p = e / tf.reduce_sum(e, 1, keepdims=True)
        loss = tf.reduce_sum(p * s) + tf.reduce_max(s)
    return (loss, *tape.gradient(loss, [q, k]))


def assert_close(got: Any, want: Any, dtype: tf.DType) -> None:
    """Equal structures of tensors, within 1e-4 (float32) or 1e-10 (float64) relative.

    A rewrite reorders float arithmetic, so results agree up to rounding; the absolute
    tolerance scales with the largest value, so entries near zero do not dominate.
    """
    rtol = 1e-4 if dtype == tf.float32 else 1e-10
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * max(1.0, np.abs(w).max()))


def with_gradient(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` that also returns the gradients of Σ sin(outputs) w.r.t. its inputs (a tape inside).

    The sine makes every output's gradient depend on its value, so a rewrite of the
    backward cannot hide behind a constant upstream gradient.
    """
    def value_and_gradients(*args: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = fn(*args)
            loss = tf.add_n([tf.reduce_sum(tf.sin(t)) for t in tf.nest.flatten(y)])
        return y, tape.gradient(loss, args)
    return value_and_gradients


def run_graph(graph: Any, concrete: Any, values: Sequence[Any]) -> list[np.ndarray]:
    """Runs a (rewritten) `tfmem.graph.Graph` of `concrete`'s function on `values`, fed to
    the function's inputs in order, and returns its outputs: a rewrite checked on the
    graph itself, before any wrapper."""
    names = [t.name for t in concrete.inputs]
    graph_def = graph.to_graph_def()

    def run(*tensors: tf.Tensor) -> Any:
        return tf.graph_util.import_graph_def(graph_def, input_map=dict(zip(names, tensors)),
                                              return_elements=[o.name for o in graph.outputs])

    return [t.numpy() for t in tf.function(run)(*values)]


def whole_masks_into_loops(function: Any, args: Sequence[Any], n: int) -> list[str]:
    """The `while` loops of XLA's optimized program of `function(*args)` that take a bool or
    int32 `[n, n]` (a whole mask XLA hoisted out of the loop and made before it), by their
    result types; [] when none does. Raises AssertionError when the program has no loop.
    (`test_held` and `test_whole_input` check the one-trip loops of `rewrites.split` so.)
    """
    hlo = function.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    loops = [line.split(" while(")[0].strip() for line in hlo.splitlines() if " while(" in line]
    assert loops, "XLA's program has no loop"
    mask = re.compile(rf"(pred|s32)\[{n},{n}\]")
    return [loop for loop in loops if mask.search(loop)]


def xla_peak_holding(at: str, held: Sequence[str], order: Sequence[str], *, n: int,
                     dtype: tf.DType = tf.float64) -> Any:
    """An XLA live set at its peak, as `XlaPlan.peak` reads it, for tests of the rules
    that read one: at op `at`, holding the `[n, n]` outputs of the nodes `held`, with
    `order` the ops that have a step of their own in XLA's schedule (named as XLA names
    them: `tfmem_step/<node>`).

    Example:
        >>> peak = xla_peak_holding("MatMul_1", ["MatMul"], ["MatMul", "MatMul_1"], n=10)
        >>> peak.peak_node, peak.peak_bytes, list(peak.steps)
        ('tfmem_step/MatMul_1', 800, ['tfmem_step/MatMul', 'tfmem_step/MatMul_1'])
    """
    from tfmem.memory import LiveTensor, MemoryEstimate

    whole = n * n * dtype.size
    tensors = tuple(LiveTensor(f"tfmem_step/{name}", whole, (n, n), dtype.name) for name in held)
    return MemoryEstimate(len(held) * whole, f"tfmem_step/{at}", tensors,
                          steps={f"tfmem_step/{name}": (i * whole, 0) for i, name in enumerate(order)})


def cleanup_host_memory(rows: int, cols: int) -> dict[str, Any]:
    """Runs the cleanup stage on a program with [rows, cols] float64 tensors; returns the
    growth of this process's resident-set high-water mark and the op counts after.

    Meant for `tfmem.run_isolated` (a fresh process, so the high-water mark is its own):
    the cleanup stage must never build such a tensor on the host, whatever its size.
    """
    import resource

    from tfmem.config import Config
    from tfmem.context import PassContext
    from tfmem.passes import PassManager, default_pipeline

    def program(x):  # x: [rows, cols]
        zeros = tf.zeros_like(x)
        ones = tf.ones([rows, cols], tf.float64)
        eye = tf.eye(rows, dtype=tf.float64)
        return tf.reduce_sum(zeros + ones * x, 1) + tf.reduce_sum(eye, 1)

    concrete = tf.function(program).get_concrete_function(tf.TensorSpec([rows, cols], tf.float64))
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    from tfmem.graph import Graph, TensorRef

    graph = Graph(graph_def, outputs=[t.name for t in concrete.outputs])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    config = Config(passes=["cleanup"])
    result = PassManager(default_pipeline(config)).run(graph, PassContext(config))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    consts = [result.graph.nbytes(TensorRef(node.name)) or 0 for node in result.graph.find("Const")]
    return {"rss_growth_bytes": after - before, "ops": result.graph.op_counts(),
            "largest_const_bytes": max(consts, default=0)}


def cleanup_allocator_peak(n: int) -> dict[str, Any]:
    """Runs the cleanup stage on a Laplace GP classifier's first Newton step (from f = 0, so
    `sW ∘ K ∘ sWᵀ` has constant factors) at n points; returns the CPU allocator's peak.

    Meant for `tfmem.run_isolated` (TensorFlow's BFC allocator, a fresh process): Grappler
    must not fold `sW ∘ sWᵀ`, an [n, n] outer product, on the allocator the program runs on.
    """
    from tfmem.config import Config
    from tfmem.context import PassContext
    from tfmem.graph import Graph
    from tfmem.passes import PassManager, default_pipeline

    def newton_step(x, y):  # x: [n, 2], y: [n, 1]
        k = tf.exp(-0.5 * tf.reduce_sum((x[:, None, :] - x[None, :, :]) ** 2, -1))
        f = tf.zeros_like(y)
        pi = tf.sigmoid(f)
        root_w = tf.sqrt(pi * (1 - pi))
        return tf.linalg.cholesky(tf.eye(n, dtype=tf.float64) + root_w * k * tf.transpose(root_w))

    tf.zeros([8]) + 1.0  # an op on the CPU first: its allocator is then the BFC one the peak is read from
    specs = (tf.TensorSpec([n, 2], tf.float64), tf.TensorSpec([n, 1], tf.float64))
    concrete = tf.function(newton_step).get_concrete_function(*specs)
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    config = Config(passes=["cleanup"])
    PassManager(default_pipeline(config)).run(graph, PassContext(config))
    return {"peak_bytes": int(tf.config.experimental.get_memory_info("CPU:0")["peak"])}


# A float32 [N, N] is 4.6 MiB and a bool one 1.2 MiB: over `LARGE_TENSOR_BYTES`, under the
# 10 MiB up to which TensorFlow folds constants on the host before XLA compiles.
CONSTANT_MAKERS_N = 1100
# Programs that make a large tensor from constants alone, through each op
# `tfmem.host_folding` shields, and combine it with their input x [N, N] float32.
CONSTANT_MAKERS: dict[str, Callable[[tf.Tensor], tf.Tensor]] = {
    "diagonal_mask": lambda x: tf.where(tf.equal(tf.range(CONSTANT_MAKERS_N)[:, None],
                                                 tf.range(CONSTANT_MAKERS_N)[None, :]), 0.0, x),
    "band_compare": lambda x: tf.where(tf.range(CONSTANT_MAKERS_N)[:, None] - tf.range(CONSTANT_MAKERS_N)[None, :]
                                       <= 3, x, -x),
    "eye": lambda x: x + 3.0 * tf.eye(CONSTANT_MAKERS_N),
    "eye_mask": lambda x: tf.where(tf.eye(CONSTANT_MAKERS_N) > 0.5, x, 0.0),
    "matrix_diag": lambda x: x @ tf.linalg.diag(tf.linspace(1.0, 2.0, CONSTANT_MAKERS_N)),
    "fill": lambda x: x * tf.fill([CONSTANT_MAKERS_N, CONSTANT_MAKERS_N], 0.5),
    "broadcast_to": lambda x: x - tf.broadcast_to(tf.linspace(0.0, 1.0, CONSTANT_MAKERS_N),
                                                  [CONSTANT_MAKERS_N, CONSTANT_MAKERS_N]),
    "tile": lambda x: x + tf.tile(tf.constant([[1.0, 2.0]]), [CONSTANT_MAKERS_N, CONSTANT_MAKERS_N // 2]),
    "transposed_grid": lambda x: x + tf.transpose(tf.cast(
        tf.range(CONSTANT_MAKERS_N)[:, None] % 7 + tf.range(CONSTANT_MAKERS_N)[None, :], tf.float32)),
    "outer_product": lambda x: x + tf.matmul(tf.ones([CONSTANT_MAKERS_N, 1]) * 0.25,
                                             tf.ones([1, CONSTANT_MAKERS_N])),
    "batch_outer_product": lambda x: x + tf.linalg.matmul(tf.ones([1, CONSTANT_MAKERS_N, 1]),
                                                          tf.ones([1, 1, CONSTANT_MAKERS_N]))[0],
    "set_diag": lambda x: x + tf.linalg.set_diag(tf.ones([CONSTANT_MAKERS_N, CONSTANT_MAKERS_N]),
                                                 tf.range(CONSTANT_MAKERS_N, dtype=tf.float32)),
    "band_part": lambda x: x + tf.linalg.band_part(tf.ones([CONSTANT_MAKERS_N, CONSTANT_MAKERS_N]) * 1.5, 2, 0),
}


def compile_allocator_growth(names: Sequence[str]) -> dict[str, dict[str, int]]:
    """Compiles each of `CONSTANT_MAKERS[names]` for XLA, stock and through tfmem, without
    running it; returns how far the CPU allocator's peak rose while each compiled.

    Meant for `tfmem.run_isolated` (TensorFlow's BFC allocator, a fresh process): before XLA
    compiles, TensorFlow folds constant subgraphs on the host, from that allocator;
    tfmem's import leaves large ones to XLA (`tfmem.host_folding`).
    """
    import tfmem

    def growth(function: Any, x: tf.Tensor) -> int:
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        function.experimental_get_compiler_ir(x)(stage="hlo")
        return int(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)

    # Also puts the CPU's allocator in place: the BFC one the peak is read from.
    x = tf.zeros([CONSTANT_MAKERS_N, CONSTANT_MAKERS_N])
    results = {}
    for name in names:
        program = CONSTANT_MAKERS[name]
        ours = tfmem.function(program, config=tfmem.Config(memory_budget="1GiB")).compiled(x).function
        results[name] = {"stock": growth(tf.function(program, jit_compile=True), x), "tfmem": growth(ours, x)}
    return results


def run_scenarios(scenarios: Mapping[str, Callable[[Any], dict[str, Any]]], argument: Any) -> dict[str, dict[str, Any]]:
    """Runs every scenario on `argument`; one that raises gives `{"error": <its traceback>}`.

    For many checks that share one fresh process (e.g. one whose CPU was split into
    logical devices before TensorFlow started), each then asserted by its own test
    with `scenario_outcome`.
    """
    results: dict[str, dict[str, Any]] = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = scenario(argument)
        except Exception:  # noqa: BLE001 - reported by the test that checks this scenario
            results[name] = {"error": traceback.format_exc()}
    return results


def scenario_outcome(results: Mapping[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """What scenario `name` returned; an AssertionError with its traceback if it raised."""
    outcome = results[name]
    assert "error" not in outcome, outcome.get("error")
    return outcome
