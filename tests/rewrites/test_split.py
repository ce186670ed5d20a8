"""SplitOversizedRegions: split == unsplit, bounded chunks, reasons for what stays whole."""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmem
from benchmarks.cases import kernel_matrix, knn_indices, sgpr_model
from rewrites.split import SplitOversizedRegions
from rewrites.split.loops import in_split_loop
from rewrites.split.op_rules import DimClass, Operand, dim_classes
from tfmem import Config, Graph, TensorRef
from tfmem.memory import while_passthrough


def split_config(threshold: int, split: int | None = None) -> Config:
    return Config(tensor_size_threshold=threshold, tensor_split_size=split, strict=True)


def top_level_bytes(graph_def: Any) -> list[tuple[str, int]]:
    """(tensor, bytes) of every top-level tensor a node allocates (loop bodies live in the
    library; loop invariants a While hands back unchanged allocate nothing)."""
    graph = Graph(graph_def)
    sizes = []
    for node in graph_def.node:
        passed = while_passthrough(graph, node.name)
        for index in range(len(graph.output_specs(node.name))):
            if index not in passed:
                sizes.append((f"{node.name}:{index}", graph.nbytes(TensorRef(node.name, index)) or 0))
    return sizes


def assert_split_bounded(wrapped: tfmem.TfmemFunction, args: tuple, threshold: int) -> tfmem.Report:
    report = wrapped.report(*args)
    assert report.status == "rewritten", report.reason
    splits = report.splits
    assert splits, str(report)
    # No materialised top-level tensor over the threshold, except graph inputs.
    inputs = {n.name for n in report.rewritten_graph_def.node if n.op in ("Placeholder", "Const")}
    oversized = [(t, b) for t, b in top_level_bytes(report.rewritten_graph_def)
                 if b > threshold and t.split(":")[0] not in inputs]
    assert not oversized, oversized
    assert report.memory_after.peak_bytes < report.memory_before.peak_bytes
    return report


def _relative_error(got: Any, want: Any) -> float:
    """Largest error over the finite entries, relative to the largest finite value; inf when
    the two disagree on which entries are infinite or NaN (overflow must overflow alike)."""
    errors = []
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        finite = np.isfinite(w)
        if not np.array_equal(finite, np.isfinite(g)) or not np.array_equal(g[~finite], w[~finite],
                                                                           equal_nan=True):
            return float("inf")
        scale = max(np.max(np.abs(w[finite]), initial=0.0), 1e-300)
        errors.append(np.max(np.abs(g[finite] - w[finite]), initial=0.0) / scale)
    return max(errors)


def test_kernel_matmul_split_equals_unsplit(rng: np.random.Generator) -> None:
    x, v = tf.constant(rng.normal(size=(500, 3))), tf.constant(rng.normal(size=(500, 16)))
    fn = lambda x, v: kernel_matrix(x, x) @ v  # noqa: E731
    wrapped = tfmem.TfmemFunction(fn, config=split_config(400_000), lint=True)
    report = assert_split_bounded(wrapped, (x, v), 400_000)
    assert _relative_error(wrapped(x, v), fn(x, v)) <= 1e-10
    (split,) = report.splits
    assert split.details["chunks"] >= 2 and split.details["chunk_bytes"] <= 400_000
    assert report.xla_bytes_after is None  # report() does not compile
    explained = wrapped.explain(x, v)
    assert explained.xla_bytes_after < explained.xla_bytes_before / 2


def test_outer_tape_backward_is_split_too(rng: np.random.Generator) -> None:
    x, v = tf.constant(rng.normal(size=(300, 3))), tf.constant(rng.normal(size=(300, 16)))

    def fn(x, v):
        return kernel_matrix(x, x) @ v

    wrapped = tfmem.TfmemFunction(fn, config=split_config(200_000), lint=True)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        got = tf.reduce_sum(wrapped(x, v) ** 2)
        want = tf.reduce_sum(fn(x, v) ** 2)
    assert _relative_error(tape.gradient(got, x), tape.gradient(want, x)) <= 1e-10
    (signature,) = wrapped._signatures.values()
    (backward,) = signature.backward.values()
    (backward_signature,) = backward._signatures.values()
    assert backward_signature.report.splits


@pytest.mark.parametrize("n_queries, n_data, sinks", [
    (200, 3000, "-"),  # many queries: split them, each chunk's top-k is final
    (4, 30001, "topk"),  # few: one query row is over the split size, so split the data with a running merge
    (3, 30000, "topk"),
])
def test_knn_split_gives_identical_indices(n_queries: int, n_data: int, sinks: str,
                                           rng: np.random.Generator) -> None:
    queries = tf.constant(rng.normal(size=(n_queries, 8)), tf.float32)
    data = tf.constant(rng.normal(size=(n_data, 8)), tf.float32)
    threshold = n_queries * n_data * 4 // 4
    wrapped = tfmem.TfmemFunction(knn_indices, config=split_config(threshold, split=60_000), lint=True)
    report = assert_split_bounded(wrapped, (queries, data), threshold)
    assert [r.details["sinks"] for r in report.splits] == [sinks]
    np.testing.assert_array_equal(wrapped(queries, data).numpy(), knn_indices(queries, data).numpy())


def _cross(x, y):
    return tf.exp(-tf.square(x @ tf.transpose(y)) / 10.0)  # [n, m]


SINKS: list[tuple[str, Callable[..., Any]]] = [
    ("sum_rows", lambda x, y: tf.reduce_sum(_cross(x, y), axis=1)),
    ("sum_cols", lambda x, y: tf.reduce_sum(_cross(x, y), axis=0)),
    ("sum_all", lambda x, y: tf.reduce_sum(_cross(x, y))),
    ("mean_cols", lambda x, y: tf.reduce_mean(_cross(x, y), axis=0)),
    ("max_rows", lambda x, y: tf.reduce_max(_cross(x, y), axis=1)),
    ("min_cols", lambda x, y: tf.reduce_min(_cross(x, y), axis=0, keepdims=True)),
    ("argmax_rows", lambda x, y: tf.argmax(_cross(x, y), axis=1)),
    ("argmin_cols", lambda x, y: tf.argmin(_cross(x, y), axis=0)),
    ("contract", lambda x, y: _cross(x, y) @ y),
    ("contract_t", lambda x, y: tf.matmul(_cross(x, y), x, transpose_a=True)),
    ("write_out_small", lambda x, y: tf.reduce_sum(_cross(x, y), axis=1, keepdims=True) * x),
    ("any_rows", lambda x, y: tf.reduce_any(_cross(x, y) > 0.99, axis=1)),
    ("all_cols", lambda x, y: tf.reduce_all(_cross(x, y) > 0.01, axis=0)),
]


@pytest.mark.parametrize("name, fn", SINKS, ids=[s[0] for s in SINKS])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_every_sink_combines_correctly(name: str, fn: Callable[..., Any], dtype: tf.DType,
                                       rng: np.random.Generator) -> None:
    x = tf.constant(rng.normal(size=(257, 4)), dtype)
    y = tf.constant(rng.normal(size=(301, 4)), dtype)
    threshold = 257 * 301 * dtype.size // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (x, y), threshold)
    got, want = wrapped(x, y), fn(x, y)
    if want.dtype.is_integer or want.dtype == tf.bool:
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    else:
        assert _relative_error(got, want) <= (1e-5 if dtype == tf.float32 else 1e-12)


def test_largest_body_tensor_respects_split_size(rng: np.random.Generator) -> None:
    x, v = tf.constant(rng.normal(size=(400, 3))), tf.constant(rng.normal(size=(400, 16)))
    wrapped = tfmem.TfmemFunction(lambda x, v: kernel_matrix(x, x) @ v,
                                  config=split_config(800_000, split=100_000), lint=True)
    report = wrapped.report(x, v)
    (split,) = report.splits
    # Chunks are as long as they can be with the body's largest tensor within 100 kB.
    chunk, chunk_bytes = split.details["chunk"], split.details["chunk_bytes"]
    assert chunk_bytes <= 100_000 < chunk_bytes // chunk * (chunk + 1)


def test_unsupported_op_stays_whole_with_reason(rng: np.random.Generator) -> None:
    def fn(x, y):
        return tf.reduce_sum(tf.roll(_cross(x, y), shift=3, axis=1), axis=1)

    x, y = tf.constant(rng.normal(size=(200, 4))), tf.constant(rng.normal(size=(300, 4)))
    wrapped = tfmem.TfmemFunction(fn, config=split_config(100_000), lint=True)
    report = wrapped.report(x, y)
    unsplit = [r for r in report.rejected if r.kind == "split"]
    assert any("Roll" in r.reason for r in unsplit), str(report)
    assert _relative_error(wrapped(x, y), fn(x, y)) <= 1e-12


def test_no_threshold_means_no_split(rng: np.random.Generator) -> None:
    x, y = tf.constant(rng.normal(size=(50, 4))), tf.constant(rng.normal(size=(60, 4)))
    wrapped = tfmem.TfmemFunction(lambda x, y: tf.reduce_sum(_cross(x, y)), passes=[SplitOversizedRegions()])
    assert wrapped.report(x, y).status == "unchanged"


def test_sgpr_loss_and_gradients_split_equal_stock() -> None:
    model = sgpr_model(3000, 40)

    def step():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)

    threshold = 40 * 3000 * 8 // 4  # every [M, N] tensor is over it
    wrapped = tfmem.TfmemFunction(step, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (), threshold)
    assert _relative_error(wrapped(), tf.function(step, jit_compile=True)()) <= 1e-8


def test_dim_classes_of_matmul_name_the_contraction() -> None:
    concrete = tf.function(lambda a, b: tf.matmul(a, b, transpose_b=True)).get_concrete_function(
        tf.TensorSpec([5, 3]), tf.TensorSpec([7, 3]))
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True))
    (matmul,) = list(graph.find("MatMul"))
    a, b = (Operand(matmul.name, i, ref) for i, ref in enumerate(graph.inputs(matmul.name)))
    out = TensorRef(matmul.name)
    assert dim_classes(graph, matmul.name) == [DimClass(((a, 0), (out, 0))), DimClass(((b, 0), (out, 1))),
                                               DimClass(((a, 1), (b, 1)), combine="sum")]


def test_one_tensor_in_two_roles_is_sliced_in_one_and_read_whole_in_the_other(rng: np.random.Generator) -> None:
    # K(X, X) in GPflow's expanded form: X @ Xᵀ split by rows slices X as input 0 and
    # reads all of X as input 1.
    x = tf.constant(rng.normal(size=(700, 3)))
    v = tf.constant(rng.normal(size=(700, 4)))

    def fn(x, v):
        sq = tf.reduce_sum(x ** 2, -1)
        dist = sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)
        return tf.exp(-0.5 * dist) @ v

    threshold = 700 * 700 * 8 // 3
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (x, v), threshold)
    assert _relative_error(wrapped(x, v), fn(x, v)) <= 1e-12


ELEMENTWISE = [tf.exp, tf.tanh, tf.sigmoid, tf.square, lambda t: tf.maximum(t, 0.1), lambda t: t * 2.0 + 1.0,
               lambda t: tf.where(t > 0, t, -t), lambda t: tf.cast(tf.cast(t, tf.float32), tf.float64),
               lambda t: tf.transpose(tf.transpose(t)), lambda t: tf.sqrt(tf.abs(t) + 1.0)]
SINK_FNS = [lambda t: tf.reduce_sum(t, 1), lambda t: tf.reduce_max(t, 0), lambda t: tf.reduce_mean(t),
            lambda t: tf.math.top_k(t, 3).values, lambda t: t @ tf.ones([t.shape[1], 2], t.dtype),
            lambda t: tf.argmin(t, 1)]


@settings(max_examples=12, deadline=None)
@given(ops=st.lists(st.integers(0, len(ELEMENTWISE) - 1), min_size=1, max_size=4),
       sink=st.integers(0, len(SINK_FNS) - 1), n=st.integers(40, 90), m=st.integers(40, 90),
       seed=st.integers(0, 10_000))
def test_random_graphs_split_equals_unsplit(ops: list[int], sink: int, n: int, m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, y = tf.constant(rng.normal(size=(n, 3))), tf.constant(rng.normal(size=(m, 3)))

    def fn(x, y):
        t = x @ tf.transpose(y)  # [n, m]: the oversized intermediate
        for op in ops:
            t = ELEMENTWISE[op](t)
        return SINK_FNS[sink](t)

    threshold = n * m * 8 // 3
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    report = wrapped.report(x, y)
    # Split, or (e.g. a reordered chain) no longer needing a split: nothing oversized is left.
    assert max(b for _, b in top_level_bytes(report.rewritten_graph_def)) <= threshold, str(report)
    got, want = wrapped(x, y), fn(x, y)
    if want.dtype.is_integer or want.dtype == tf.bool:
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    else:
        assert _relative_error(got, want) <= 1e-10


def test_memory_budget_splits_tensors_under_the_threshold(rng: np.random.Generator) -> None:
    def fn(x, y):
        t = x @ tf.transpose(y)  # [n, m], with three more like it live at once below
        return tf.reduce_sum(tf.exp(t) * tf.sin(t) + tf.cos(t), axis=1)

    n, m = 600, 500
    x, y = tf.constant(rng.normal(size=(n, 3)) / 3), tf.constant(rng.normal(size=(m, 3)) / 3)
    one = n * m * 8
    no_budget = tfmem.TfmemFunction(fn, config=split_config(2 * one), lint=True)
    assert not no_budget.report(x, y).splits
    assert no_budget.report(x, y).memory_after.peak_bytes > 2 * one
    budget = Config(tensor_size_threshold=2 * one, memory_budget=one, strict=True)
    wrapped = tfmem.TfmemFunction(fn, config=budget, lint=True)
    report = wrapped.report(x, y)
    assert report.splits
    fits = [r for r in report.records if r.rule == "MemoryBudget"]
    (fit,) = fits
    assert fit.status == "info" and fit.details["peak_bytes"] <= one
    assert report.memory_after.peak_bytes <= one
    assert _relative_error(wrapped(x, y), fn(x, y)) <= 1e-12


SELECTS: list[tuple[str, Callable[..., Any]]] = [
    # TF1's Select: the condition has the values' shape, is a scalar, or picks whole rows.
    ("same_shape", lambda s, x: tf.raw_ops.Select(condition=s > 0.5, x=s, y=-s)),
    ("scalar", lambda s, x: tf.raw_ops.Select(condition=tf.reduce_sum(x) > 0, x=s, y=2.0 * s)),
    ("rows", lambda s, x: tf.raw_ops.Select(condition=x[:, 0] > 0, x=s, y=tf.sqrt(s))),
]


@pytest.mark.parametrize("name, select", SELECTS, ids=[s[0] for s in SELECTS])
@pytest.mark.parametrize("sink_axis", [0, 1])
def test_select_splits_along_either_axis(name: str, select: Callable[..., Any], sink_axis: int,
                                         rng: np.random.Generator) -> None:
    def fn(x, y):
        return tf.reduce_sum(select(_cross(x, y), x), axis=sink_axis)

    x, y = tf.constant(rng.normal(size=(240, 4))), tf.constant(rng.normal(size=(310, 4)))
    threshold = 240 * 310 * 8 // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    report = assert_split_bounded(wrapped, (x, y), threshold)
    assert not [r for r in report.rejected if "Select" in r.reason], str(report)
    assert _relative_error(wrapped(x, y), fn(x, y)) <= 1e-12


# Maps of the [n, m] `_cross` matrix (values in (0, 1]) kept in each one's domain; their
# gradients are other ops (EluGrad, IgammaGradA, ...) that must split too.
MAPS: list[tuple[str, Callable[..., Any]]] = [
    ("asinh", tf.math.asinh), ("acosh", lambda s: tf.math.acosh(1.5 + s)),
    ("atanh", lambda s: tf.math.atanh(0.9 * s)), ("erfinv", lambda s: tf.math.erfinv(0.9 * s - 0.45)),
    ("ndtri", lambda s: tf.math.ndtri(0.05 + 0.9 * s)), ("bessel_i0e", tf.math.bessel_i0e),
    ("bessel_i1e", tf.math.bessel_i1e), ("leaky_relu", lambda s: tf.nn.leaky_relu(s - 0.5, alpha=0.3)),
    ("xlog1py", lambda s: tf.math.xlog1py(s, 2.0 * s)),
    ("igamma", lambda s: tf.math.igamma(1.0 + s, tf.constant(1.5, tf.float64))),
    ("igammac", lambda s: tf.math.igammac(1.0 + s, tf.constant(0.7, tf.float64))),
    ("elu", lambda s: tf.nn.elu(s - 0.5)), ("selu", lambda s: tf.nn.selu(s - 0.5)),
    ("relu6", lambda s: tf.nn.relu6(8.0 * s - 1.0)), ("softsign", lambda s: tf.nn.softsign(s - 0.5)),
]


@pytest.mark.parametrize("name, op", MAPS, ids=[m[0] for m in MAPS])
def test_maps_and_their_gradients_split(name: str, op: Callable[..., Any], rng: np.random.Generator) -> None:
    def fn(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            rows = tf.reduce_sum(op(_cross(x, y)), axis=1)
            loss = tf.reduce_sum(rows * rows)
        return rows, tape.gradient(loss, x)

    x, y = tf.constant(rng.normal(size=(240, 4))), tf.constant(rng.normal(size=(310, 4)))
    threshold = 240 * 310 * 8 // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (x, y), threshold)  # no [n, m] forward or backward
    got, want = wrapped(x, y), fn(x, y)
    assert want[1] is not None and _relative_error(got, want) <= 1e-12


def _stack_unstack(s):
    a, b = tf.unstack(tf.stack([s, s * s], axis=0), axis=0)
    return a + 2.0 * b


_LEVELS = tf.constant(np.linspace(0.1, 1.0, 10))
# Ops that move elements: each splits on the axes it does not move, and so does its gradient
# (Slice for Pad, MirrorPadGrad, Unpack for Pack, StridedSliceGrad for a slice).
MOVES: list[tuple[str, Callable[..., Any]]] = [
    ("reverse", lambda s: tf.reverse(s, axis=[1]) * s),
    ("pad", lambda s: tf.pad(s, [[0, 0], [2, 3]])),
    ("pad_value", lambda s: tf.pad(s, [[0, 0], [1, 1]], constant_values=0.5)),
    ("mirror_pad", lambda s: tf.pad(s, [[0, 0], [2, 2]], mode="REFLECT")),
    ("stack", lambda s: tf.stack([s, 2.0 * s], axis=1)),
    ("stack_unstack", _stack_unstack),
    ("batch_band_part", lambda s: tf.linalg.band_part(tf.reshape(s, [240, 10, 31]), 2, 3)),
    ("gather_by_value", lambda s: tf.gather(_LEVELS, tf.cast(s * 9.0, tf.int32)) * s),
    ("slice_columns", lambda s: s[:, 10:250]),
    ("slice_rows", lambda s: s[7:]),
    ("slice_new_axis", lambda s: s[:, None, ::2]),
]


@pytest.mark.parametrize("name, op", MOVES, ids=[m[0] for m in MOVES])
def test_ops_that_move_elements_split_with_their_gradients(name: str, op: Callable[..., Any],
                                                           rng: np.random.Generator) -> None:
    def fn(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            moved = op(_cross(x, y))
            total = tf.reduce_sum(moved, axis=list(range(1, len(moved.shape))))
            loss = tf.reduce_sum(total * total)
        return total, tape.gradient(loss, x)

    x, y = tf.constant(rng.normal(size=(240, 4))), tf.constant(rng.normal(size=(310, 4)))
    threshold = 240 * 310 * 8 // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (x, y), threshold)
    got, want = wrapped(x, y), fn(x, y)
    assert want[1] is not None and _relative_error(got, want) <= 1e-12


def test_a_small_slice_gradient_stays_outside_the_loop(rng: np.random.Generator) -> None:
    """The gradient of `r[:, 0]` ([n, 1] from [n]) is smaller than a chunk: the loop that
    computes `r`'s rows writes the [n] out and the slice's gradient runs after it (in a
    loop it only took the region further and made the chunks narrower; see
    `rewrites.split.regions.SMALL_PAD_OPS`)."""
    def fn(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            r = tf.reduce_sum(tf.math.log1p(_cross(x, y)), axis=1, keepdims=True)  # [n, 1]
            loss = tf.reduce_sum(tf.square(r[:, 0]))
        return loss, tape.gradient(loss, x)

    x, y = tf.constant(rng.normal(size=(240, 4))), tf.constant(rng.normal(size=(310, 4)))
    threshold = 240 * 310 * 8 // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    report = assert_split_bounded(wrapped, (x, y), threshold)
    slice_gradients = [node.name for node in report.rewritten_graph_def.node if node.op == "StridedSliceGrad"]
    assert slice_gradients and not any(in_split_loop(name) for name in slice_gradients), slice_gradients
    assert _relative_error(wrapped(x, y), fn(x, y)) <= 1e-12


@pytest.mark.parametrize("ids_shape", ["rows", "pairs"])
def test_the_gradient_of_a_gather_splits(ids_shape: str, rng: np.random.Generator) -> None:
    """`tf.gather(table, ids)`'s gradient sums the rows of the [n, m, d] gradient into the
    table's rows (`UnsortedSegmentSum`): in chunks, each chunk's segments added together.
    Ids of one row per point, or one per pair of points (flattened by TensorFlow's
    gradient, unflattened by `UnflattenSegmentIds`)."""
    x, y = tf.constant(rng.normal(size=(240, 4))), tf.constant(rng.normal(size=(310, 4)))
    table = tf.constant(rng.normal(size=(10, 3 if ids_shape == "pairs" else 310)))

    def fn(x, y, table):
        with tf.GradientTape() as tape:
            tape.watch(table)
            s = _cross(x, y)
            if ids_shape == "pairs":
                rows = tf.gather(table, tf.cast(s * 9.0, tf.int32))  # [n, m, 3]
                loss = tf.reduce_sum(rows * s[..., None])
            else:
                rows = tf.gather(table, tf.cast(tf.reduce_mean(s, 1) * 9.0, tf.int32))  # [n, m]
                loss = tf.reduce_sum(rows * s)
        return loss, tf.convert_to_tensor(tape.gradient(loss, table))

    threshold = 240 * 310 * 8 // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (x, y, table), threshold)  # the [n, m, 3] / [n, m] gradients too
    got, want = wrapped(x, y, table), fn(x, y, table)
    assert _relative_error(got, want) <= 1e-12


@pytest.mark.parametrize("batch_dims, axis", [(1, 1), (1, -1), (-1, 1), (0, 1)])
def test_a_gather_with_batch_dims_splits_along_them(batch_dims: int, axis: int, rng: np.random.Generator) -> None:
    """`tf.gather(s, ids, batch_dims=1)`: each row picks its own columns (the values of a
    row's nearest neighbours); the rows split, for the gather as for the [n, m] it reads."""
    x, y = tf.constant(rng.normal(size=(240, 4))), tf.constant(rng.normal(size=(310, 4)))

    def fn(x, y):
        s = _cross(x, y)
        _, ids = tf.math.top_k(s, k=8)  # [n, 8]
        picked = tf.gather(s, ids if batch_dims else ids[0], axis=axis, batch_dims=batch_dims)
        return tf.reduce_sum(picked * picked, axis=-1) + tf.reduce_sum(tf.math.log1p(s), axis=1)

    threshold = 240 * 310 * 8 // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (x, y), threshold)
    assert _relative_error(wrapped(x, y), fn(x, y)) <= 1e-12


@settings(max_examples=16, deadline=None)
@given(op=st.sampled_from(["sum", "max", "min", "prod"]), segments=st.integers(1, 34),
       axis=st.sampled_from([0, 1]), seed=st.integers(0, 2**16))
def test_segment_reductions_split_along_either_axis(op: str, segments: int, axis: int, seed: int) -> None:
    """`unsorted_segment_{sum,max,min,prod}` of an [n, m] matrix by row ids (some segments
    empty: they hold the reduction's identity, chunk by chunk as whole) equals the unsplit
    result, split along the rows (chunks merged) or the columns (mapped through). At most 34
    segments (37 with the empty ones): the returned [n, segments + 3] stays under the
    threshold, n·m/5 elements, that every tensor is checked against (with 36 it was over)."""
    rng = np.random.default_rng(seed)
    n, m = 230, 190
    x, y = tf.constant(rng.normal(size=(n, 4))), tf.constant(rng.normal(size=(m, 4)))
    ids = tf.constant(rng.integers(0, segments, size=(n, m)[axis]).astype(np.int32))
    reduce = getattr(tf.math, f"unsorted_segment_{op}")

    def fn(x, y, ids):
        s = 0.5 + _cross(x, y)  # (0.5, 1.5]: products neither vanish nor overflow
        if axis == 1:  # segments of columns
            return tf.transpose(reduce(tf.transpose(s), ids, segments + 3))
        return reduce(s, ids, segments + 3)  # three segments always empty

    threshold = n * m * 8 // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (x, y, ids), threshold)
    assert _relative_error(wrapped(x, y, ids), fn(x, y, ids)) <= 1e-12


@settings(max_examples=12, deadline=None)
@given(op=st.sampled_from(["cumsum", "cumprod", "cumulative_logsumexp"]), axis=st.sampled_from([0, 1]),
       exclusive=st.booleans(), reverse=st.booleans(), n=st.integers(150, 260), m=st.integers(150, 260),
       seed=st.integers(0, 2**16))
def test_running_sums_split_along_their_other_axis(op: str, axis: int, exclusive: bool, reverse: bool,
                                                   n: int, m: int, seed: int) -> None:
    running = getattr(tf.math, op)
    rng = np.random.default_rng(seed)
    x, y = tf.constant(rng.normal(size=(n, 3))), tf.constant(rng.normal(size=(m, 3)))

    def fn(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            s = running(0.5 + _cross(x, y), axis=axis, exclusive=exclusive, reverse=reverse)
            out = tf.reduce_sum(tf.math.log1p(s), axis=1 - axis)  # reduced along the other axis
            loss = tf.reduce_sum(out)
        return out, tape.gradient(loss, x)

    threshold = n * m * 8 // 5
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    assert_split_bounded(wrapped, (x, y), threshold)
    got, want = wrapped(x, y), fn(x, y)
    assert want[1] is not None and _relative_error(got, want) <= 1e-11


def test_pow_gradient_splits(rng: np.random.Generator) -> None:
    """d(base ** e)/de is Select(base > 0, log(base), 0) * out: GPflow's RationalQuadratic."""
    x, y = tf.constant(rng.normal(size=(200, 4))), tf.constant(rng.normal(size=(260, 4)))
    alpha = tf.constant(0.7, tf.float64)

    def fn(x, y, alpha):
        with tf.GradientTape() as tape:
            tape.watch(alpha)
            loss = tf.reduce_sum((1.0 + tf.square(x @ tf.transpose(y)) / alpha) ** (-alpha))
        return loss, tape.gradient(loss, alpha)

    threshold = 200 * 260 * 8 // 4
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold), lint=True)
    report = assert_split_bounded(wrapped, (x, y, alpha), threshold)
    assert not [r for r in report.rejected if "Select" in r.reason], str(report)
    assert _relative_error(wrapped(x, y, alpha), fn(x, y, alpha)) <= 1e-12


def test_a_loop_whose_partial_results_are_as_large_as_what_it_avoids_is_not_emitted(
        rng: np.random.Generator) -> None:
    # s = K Kᵀ is worth a loop over N. The chain (s @ b) @ sᵀ split along its inner
    # dimension is not: each trip computes a [300, 300] partial product to add into the
    # accumulator, as large as the largest tensor it avoids. (SGPR's Cholesky-gradient
    # chains at M=3000 did this with 68 MiB tensors: XLA planned 1.24 GB instead of 813 MB.)
    x, z = tf.constant(rng.normal(size=(4000, 3))), tf.constant(rng.normal(size=(300, 3)))
    b = tf.constant(rng.normal(size=(300, 300)))

    def fn(x, z, b):
        k = kernel_matrix(z, x)
        s = k @ tf.transpose(k)
        t = (s @ b) @ tf.transpose(s)
        return tf.linalg.cholesky(t + 1e3 * tf.eye(300, dtype=t.dtype))

    wrapped = tfmem.TfmemFunction(fn, config=split_config(400_000), passes=[SplitOversizedRegions()], lint=True)
    report = wrapped.explain(x, z, b)
    reasons = [r.reason for r in report.rejected if r.kind == "split"]
    assert any("partial results per chunk" in reason for reason in reasons), str(report)
    assert report.splits, str(report)  # the loop over N stays
    # With the chain's loop, XLA planned 7.1 MB of the unsplit 12.3 MB; without it, 4.4 MB.
    assert report.xla_bytes_after < report.xla_bytes_before / 2, str(report)
    assert _relative_error(wrapped(x, z, b), fn(x, z, b)) <= 1e-10


@pytest.mark.parametrize("n", [2400, 2417], ids=["chunks_divide", "remainder"])
def test_order_free_loops_start_from_a_chunk_not_a_filled_accumulator(n: int, rng: np.random.Generator) -> None:
    """A filled accumulator is a whole tensor XLA merges across loops and holds from the
    first loop to the last; the sum starts from a chunk computed before the loop."""
    x = tf.constant(rng.normal(size=(n, 40)), tf.float64)
    y = tf.constant(rng.normal(size=(300, 40)), tf.float64)
    v = tf.constant(rng.normal(size=(n, 512)), tf.float64)

    def fn(x: tf.Tensor, y: tf.Tensor, v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        cross = tf.exp(-tf.matmul(y, x, transpose_b=True) / 40)  # [300, n]: split along n
        # [300, 512] summed over n's chunks; the arg-max keeps its ordered, filled start.
        return cross @ v, tf.argmax(cross, axis=1)

    threshold = 300 * n * 8 // 4
    wrapped = tfmem.TfmemFunction(fn, config=split_config(threshold, 300 * 600 * 8), lint=True)
    report = assert_split_bounded(wrapped, (x, y, v), threshold)
    # A loop's filled start is named by its scope (Grappler may fold a small one to a Const).
    fills = [node.name for node in report.rewritten_graph_def.node
             if re.fullmatch(r"tfmem_split(_\d+)?/Fill(_\d+)?", node.name)]
    assert not fills, fills
    got, want = wrapped(x, y, v), fn(x, y, v)
    assert _relative_error(got[0], want[0]) <= 1e-12
    np.testing.assert_array_equal(got[1].numpy(), want[1].numpy())


@pytest.mark.parametrize("size, chunk, even", [(3000, 314, 300), (3001, 314, 314), (1500, 750, 750),
                                               (1000, 7, 7), (1000, 9, 8), (12, 100, 100)])
def test_even_chunk_divides_the_length_when_a_quarter_smaller_does(size, chunk, even) -> None:
    from rewrites.split.loops import even_chunk

    assert even_chunk(size, chunk) == even


# --- A large product summed over the chunks, accumulated in row blocks (`loops.row_blocks`) ---

def projected_gram(z, x):
    """Σ over X of K(Z, X) K(Z, X)ᵀ, weighted: the [M, M] product a split over X sums
    chunk by chunk (GPflow SGPR's A Aᵀ, in small)."""
    def kernel(a, b):
        sq = tf.reduce_sum(a * a, 1)[:, None] + tf.reduce_sum(b * b, 1)[None, :]
        return tf.exp(-0.5 * (sq - 2.0 * tf.matmul(a, b, transpose_b=True)))

    k = kernel(z, x)
    return tf.reduce_sum(tf.matmul(k, k, transpose_b=True) * kernel(z, z))


def _loop_ops(report: Any) -> set[str]:
    return {node.op for function in report.rewritten_graph_def.library.function for node in function.node_def}


@pytest.mark.parametrize("m", [1100, 1200])  # 1100 rows split in 5 blocks, 1200 in 4
def test_a_summed_product_is_added_in_row_blocks_and_xla_holds_one_block(m: int, rng: np.random.Generator,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from rewrites.split import loops

    z, x = tf.constant(rng.normal(size=(m, 3))), tf.constant(rng.normal(size=(12_000, 3)))
    product = m * m * 8  # 9.2 / 11.0 MiB: over BLOCKED_PRODUCT_BYTES
    config = Config(memory_budget=f"{int(5 * product)}B")
    blocked = tfmem.function(projected_gram, config=config)
    report = blocked.report(z, x)
    assert report.splits and "TensorScatterAdd" in _loop_ops(report), report.summary()
    want = float(tf.function(projected_gram, jit_compile=True)(z, x))
    assert float(blocked(z, x)) == pytest.approx(want, rel=1e-12)
    # The same plan with the product formed whole in every trip: XLA holds most of a
    # product more (the blocks' ties keep XLA from making all blocks at once).
    monkeypatch.setattr(loops, "BLOCKED_PRODUCT_BYTES", 1 << 60)
    whole = tfmem.function(projected_gram, config=config).report(z, x)
    assert "TensorScatterAdd" not in _loop_ops(whole)
    assert report.xla_bytes_after <= whole.xla_bytes_after - product / 2, (report.xla_bytes_after / product,
                                                                          whole.xla_bytes_after / product)
