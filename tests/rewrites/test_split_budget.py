"""The budget planner: `memory_budget` alone splits, sizes chunks to fit, and says when it cannot."""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import tensorflow as tf

import tfmem
from rewrites.split.planner import Planner
from tests import background
from tfmem.budget import PLANNING_FRACTION
from tfmem.graph import Graph
from tfmem.memory import LiveTensor, MemoryEstimate, estimate_memory
from tfmem.report import XLA_SHRINK_RULE
from tfmem.testing import run_graph

N = 1500  # [N, N] float64: 17.2 MiB


def kernel_times(x, v):
    """K(X, X) @ V in GPflow's expanded form: X is read sliced and whole."""
    sq = tf.reduce_sum(tf.square(x), -1)
    dist = sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)
    return tf.exp(-0.5 * dist) @ v


@pytest.fixture
def kernel_inputs(rng: np.random.Generator) -> tuple[tf.Tensor, tf.Tensor]:
    return tf.constant(rng.normal(size=(N, 3))), tf.constant(rng.normal(size=(N, 8)))


def test_budget_alone_splits_until_the_estimate_fits(kernel_inputs) -> None:
    budget = 8 * 2**20
    wrapped = tfmem.TfmemFunction(kernel_times, config={"memory_budget": budget, "strict": True}, lint=True)
    report = wrapped.report(*kernel_inputs)
    assert report.fits and report.memory_after.peak_bytes <= budget * PLANNING_FRACTION, str(report)
    assert report.memory_before.peak_bytes > budget and report.splits
    assert report.summary().startswith("fits 8.0 MiB (memory_budget): estimated peak")
    np.testing.assert_allclose(wrapped(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def test_a_split_size_under_one_slice_splits_a_slice_at_a_time_and_says_so(kernel_inputs) -> None:
    # One row of the [1500, 1500] kernel is 11.7 KiB, over a 4 KiB split size: nothing was
    # split, and a program the budget alone fits said "does NOT fit" and ran out of memory
    # (fuzz 15). The budget holds; the warning names the split size it could not honour.
    config = {"memory_budget": "24MiB", "tensor_split_size": "4KiB", "strict": True}
    wrapped = tfmem.TfmemFunction(kernel_times, config=config)
    with pytest.warns(tfmem.TfmemWarning, match="tensor_split_size not honoured.*4.0 KiB is under one slice"):
        report = wrapped.report(*kernel_inputs)
    assert report.fits and report.splits, str(report)
    assert all(r.details["chunk"] == 1 for r in report.splits), [r.details for r in report.splits]
    np.testing.assert_allclose(wrapped(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def test_without_xla_the_plan_leaves_the_executors_margin(kernel_inputs) -> None:
    # No XLA plan checks a program TensorFlow's executor runs, and it holds up to 1.4× the
    # estimate: the estimate must fit the planning share divided by that.
    budget = tfmem.Budget(8 * 2**20, "config")
    wrapped = tfmem.TfmemFunction(kernel_times, config={"memory_budget": budget.nbytes, "jit_compile": False})
    report = wrapped.report(*kernel_inputs)
    assert report.fits and report.splits, str(report)
    assert report.memory_after.peak_bytes <= budget.graph_mode_plan_bytes < budget.plan_bytes
    assert not budget.fits_estimate(budget.graph_mode_plan_bytes + 1, with_xla=False)
    np.testing.assert_allclose(wrapped(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def test_a_larger_budget_takes_fewer_larger_chunks(kernel_inputs) -> None:
    chunks = {}
    for budget in ("6MiB", "12MiB", "24MiB"):
        report = tfmem.TfmemFunction(kernel_times, config={"memory_budget": budget}).report(*kernel_inputs)
        assert report.fits, str(report)
        chunks[budget] = sum(r.details["chunks"] for r in report.splits)
    assert chunks["6MiB"] > chunks["12MiB"] > chunks["24MiB"] >= 2, chunks
    # A budget the program fits whole: nothing is split (every trip costs time).
    roomy = tfmem.TfmemFunction(kernel_times, config={"memory_budget": "1GiB"}).report(*kernel_inputs)
    assert roomy.fits and not roomy.splits and roomy.summary().startswith("fits 1.0 GiB")


def test_a_split_size_set_beside_the_budget_caps_every_chunk(kernel_inputs) -> None:
    # The budget alone grows chunks as far as it leaves room (here past 2 MiB); the user's
    # tensor_split_size still bounds every loop body's tensors.
    alone = tfmem.TfmemFunction(kernel_times, config={"memory_budget": "24MiB"}).report(*kernel_inputs)
    assert max(r.details["chunk_bytes"] for r in alone.splits) > 2 * 2**20, str(alone)
    for split_size in (2 * 2**20, 2**20):
        config = {"memory_budget": "24MiB", "tensor_split_size": split_size, "strict": True}
        wrapped = tfmem.TfmemFunction(kernel_times, config=config)
        report = wrapped.report(*kernel_inputs)
        assert report.fits and report.splits, str(report)
        assert all(r.details["chunk_bytes"] <= split_size for r in report.splits), str(report)
        np.testing.assert_allclose(wrapped(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(),
                                   rtol=1e-10)


def test_a_loop_at_the_peak_is_shrunk_until_it_fits(kernel_inputs) -> None:
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    graph = traced.graph.copy()
    planner = Planner("split", graph)
    planner.split_all(threshold=N * N * 8 // 2, split_size=N * N * 8 // 2)  # two chunks: bodies of 8 MiB
    (loop,) = planner.loops
    assert loop.chunks == 2
    plan = 6 * 2**20
    estimate = planner.fit_budget(plan, None)
    assert estimate.peak_bytes <= plan and estimate_memory(graph).peak_bytes == estimate.peak_bytes
    (shrunk,) = planner.loops
    assert shrunk.chunks > 2
    (record,) = [r for r in planner.records if r.kind == "split"]
    assert record.details["chunks"] == shrunk.chunks  # the record follows the re-chunking


def _planned_in_chunks(x, v, chunks: int) -> tuple[Planner, Any]:
    concrete = tf.function(kernel_times).get_concrete_function(x, v)
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    planner = Planner("split", graph)
    planner.split_all(threshold=N * N * 8 // 2, split_size=N * N * 8 // chunks)
    return planner, concrete


def _xla_peak_in(loop, chunk_buffers: int, rest: int) -> MemoryEstimate:
    """What XLA's plan might show: its peak inside `loop`'s body, with `chunk_buffers`
    buffers of one chunk [N, chunk] and `rest` bytes of whole matrices."""
    chunked = tuple(LiveTensor(f"XLA's fusion.{i}", N * loop.chunk * 8, (N, loop.chunk), "float64")
                    for i in range(chunk_buffers))
    whole = (LiveTensor("tfmem_step/x", rest, (rest // 8,), "float64"),)
    return MemoryEstimate(peak_bytes=N * loop.chunk * 8 * chunk_buffers + rest,
                          peak_node=f"tfmem_step/{loop.scope}/while (chunk/Exp)", live_at_peak=chunked + whole)


def test_a_loop_xla_peaks_in_takes_the_smaller_chunks_xla_asks_for(kernel_inputs) -> None:
    planner, concrete = _planned_in_chunks(*kernel_inputs, chunks=4)
    (loop,) = planner.loops
    peak = _xla_peak_in(loop, chunk_buffers=5, rest=2**20)
    over = int(1.5 * N * loop.chunk * 8)  # 1.5 of its 5 chunk-sized buffers too many
    planner.shrink_at_xla_peaks([peak], goal=peak.peak_bytes - over)
    (shrunk,) = planner.loops
    assert shrunk.chunk <= math.floor(loop.chunk * 3.5 / 5 * 0.9) and shrunk.chunks > loop.chunks, (loop, shrunk)
    assert N % shrunk.chunk == 0, shrunk  # a divisor within half the chunk asked for: no remainder body
    (fired,) = [r for r in planner.records if r.rule == XLA_SHRINK_RULE]
    assert fired.status == "fired" and fired.details["chunk"] == shrunk.chunk, fired
    assert f"XLA peaks in loop {loop.scope} ({loop.chunks} chunks of {loop.chunk})" in fired.reason
    [got] = run_graph(planner.graph, concrete, list(kernel_inputs))
    np.testing.assert_allclose(got, kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def test_a_loop_xla_peaks_in_is_left_when_smaller_chunks_cannot_take_off_enough(kernel_inputs) -> None:
    planner, _ = _planned_in_chunks(*kernel_inputs, chunks=4)
    (loop,) = planner.loops
    peak = _xla_peak_in(loop, chunk_buffers=2, rest=64 * 2**20)  # over by more than all its chunks
    planner.shrink_at_xla_peaks([peak], goal=peak.peak_bytes - 3 * N * loop.chunk * 8)
    assert planner.loops == [loop]
    (rejected,) = [r for r in planner.records if r.rule == XLA_SHRINK_RULE]
    assert rejected.status == "rejected" and rejected.reason.endswith("smaller chunks would not take off enough")
    # An XLA peak outside every loop of the plan leaves the plan as it is, without a word.
    planner.shrink_at_xla_peaks([dataclasses.replace(peak, peak_node="tfmem_step/MatMul")], goal=0)
    assert planner.loops == [loop] and len([r for r in planner.records if r.rule == XLA_SHRINK_RULE]) == 1


def test_a_loop_takes_other_chunks_without_region_nodes_nothing_reads_any_more(kernel_inputs) -> None:
    # A region node whose readers other rewrites took away since the loop was emitted
    # is pruned as soon as the region is put back: the loop is emitted again without it.
    planner, concrete = _planned_in_chunks(*kernel_inputs, chunks=4)
    (loop,) = planner.loops
    some_node = next(n for n in loop.saved if n.name in loop.region.nodes and n.op == "Exp")
    unread = tf.compat.v1.NodeDef()
    unread.CopyFrom(some_node)
    unread.name = "unread_copy_of_exp"
    loop = dataclasses.replace(loop, saved=(*loop.saved, unread),
                               region=dataclasses.replace(loop.region, nodes=[*loop.region.nodes, unread.name]))
    planner.loops = [loop]
    rechunked = planner.rechunk(loop, loop.chunk // 2)
    assert unread.name not in rechunked.region.nodes and unread.name not in planner.graph
    assert rechunked.chunks > loop.chunks and planner._while_node(rechunked) is not None
    [got] = run_graph(planner.graph, concrete, list(kernel_inputs))
    np.testing.assert_allclose(got, kernel_times(*kernel_inputs).numpy(), rtol=1e-10)
    # Without its seed the region is not what was planned: not emitted again.
    seedless = dataclasses.replace(rechunked, region=dataclasses.replace(
        rechunked.region, seed=tfmem.graph.TensorRef("unread_copy_of_exp")))
    planner.loops = [seedless]
    with pytest.raises(tfmem.graph.GraphError, match="cannot restore a split region: unread_copy_of_exp is gone"):
        planner.rechunk(seedless, loop.chunk)


def test_a_budget_that_cannot_be_met_is_loud_and_names_what_blocks_it(rng: np.random.Generator) -> None:
    x = tf.constant(rng.normal(size=(1000, 3)))  # the Cholesky's [1000, 1000] factor alone is 7.6 MiB

    wrapped = tfmem.function(kernel_log_det_grad, config={"memory_budget": "4MiB"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = wrapped(x)  # still runs
    for value, want in zip(got, tf.function(kernel_log_det_grad)(x)):
        np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=1e-9)
    report = wrapped.report(x)
    assert report.fits is False and report.summary().startswith("does NOT fit 4.0 MiB")
    (missed,) = [r for r in report.rejected if r.kind == "plan"]
    assert "stays over the plan" in missed.reason and "Cholesky:0" in missed.reason and "stays whole" in missed.reason
    verdict = report.verdict  # the split pass's typed verdict, not a record to search for
    assert verdict is not None and not verdict.fits and verdict.reason == missed.reason
    assert verdict.peak_bytes > verdict.target_bytes == report.budget.plan_bytes
    shown = [str(w.message) for w in caught if issubclass(w.category, tfmem.TfmemWarning)]
    assert len(shown) == 1 and "may not fit its memory budget" in shown[0], shown
    strict = tfmem.function(kernel_log_det_grad, config={"memory_budget": "4MiB", "strict": True})
    with pytest.raises(tfmem.TfmemError, match="may not fit its memory budget"):
        strict(x)


def gram_style_loss(a: tf.Tensor, b: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """((AᵀA − BᵀB)/N)² summed, and its gradients: [64, 64] Gram matrices of [N, 64] inputs."""
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        gram_a = tf.transpose(a) @ a / a.shape[0]
        gram_b = tf.transpose(b) @ b / b.shape[0]
        loss = tf.reduce_sum((gram_a - gram_b) ** 2)
    return (loss, *tape.gradient(loss, [a, b]))


def gram_style_loss_under_a_limit(rows: int, budget: int) -> dict[str, Any]:
    """The verdict on `gram_style_loss` and how its call went, in a process under a real limit.

    The inputs are made by TensorFlow (a cast), so the allocator holds them as a user's data
    would be held, each in a whole chunk (a numpy array may be aliased instead, or not).
    """
    rng = np.random.default_rng(8)
    a, b = (tf.cast(tf.constant(rng.normal(size=(rows, 64)).astype(np.float32)), tf.float64) for _ in range(2))
    return verdict_and_call(gram_style_loss, tfmem.Config(memory_budget=budget), a, b)


def verdict_and_call(fn: Any, config: tfmem.Config, *args: Any) -> dict[str, Any]:
    """tfmem's verdict on `fn(*args)` under `config`, then how the call went ("ok", "oom")."""
    wrapped = tfmem.function(fn, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmem.TfmemWarning)
        report = wrapped.report(*args)
    try:
        [t.numpy() for t in tf.nest.flatten(wrapped(*args))]
        status = "ok"
    except tf.errors.ResourceExhaustedError:
        status = "oom"
    return {"fits": report.fits, "loops": len(report.splits), "summary": report.summary(), "status": status}


_GRAM_BUDGET = 2 * 64 * 64 * 8 * 1000  # 62.5 MiB


@background.job("gram_loss_under_a_limit")
def gram_loss_under_a_limit_job() -> dict[str, Any]:
    result = tfmem.run_isolated(gram_style_loss_under_a_limit, 20_000, _GRAM_BUDGET,
                                memory_limit_mb=math.ceil(_GRAM_BUDGET / 2**20), timeout=300)
    assert result.ok, result.error
    return result.value


@pytest.mark.background("gram_loss_under_a_limit")
def test_a_program_whose_inputs_fill_the_allocator_is_not_said_to_fit() -> None:
    # The inputs (two [20000, 64] float64, 9.8 MiB each) live in the allocator the budget
    # bounds, in a 16 MiB chunk each; XLA planned 53.7 MiB for the call, inputs included, and the
    # report said "fits 62.5 MiB", but 32 MiB held + 19.5 MiB of outputs left no room for its
    # 14.6 MiB block. A "fits" must be what the call does under that limit. The other way is
    # not a matter of the verdict alone: the same "does NOT fit" (XLA plans 48.9 MiB, its block
    # 9.9 MiB) ran out of memory in one run and ran in another (a CI run at 7aa2dd6), the
    # allocator's peak before the call 59.5 and 51.5 MiB: the regions' model errs that way.
    outcome = background.result("gram_loss_under_a_limit")
    assert not (outcome["fits"] and outcome["status"] != "ok"), outcome
    if not outcome["fits"]:
        assert "the allocator" in outcome["summary"], outcome["summary"]  # what it holds, or the regions it grew


def kernel_sum(x, v):
    """One [n, n] kernel read twice: one split loop."""
    d = tf.reduce_sum((x[:, None] - x[None]) ** 2, -1)
    return tf.reduce_sum(tf.exp(-0.5 * d) @ v, 0), tf.reduce_logsumexp(-d, 1)


def two_kernel_sums(x, v):
    """Two [n, n] kernels no data orders: two split loops."""
    dx = tf.reduce_sum((x[:, None] - x[None]) ** 2, -1)
    dv = tf.reduce_sum((v[:, None] - v[None]) ** 2, -1)
    return tf.reduce_sum(tf.exp(-dx) @ x, 0), tf.reduce_sum(tf.exp(-dv) @ v, 0)


def without_xla_under_a_limit(program: str, n: int, budget: str) -> dict[str, Any]:
    """The verdict on `program` with jit_compile off, and how its call went, in a process
    under a real limit."""
    fn = {"kernel_sum": kernel_sum, "two_kernel_sums": two_kernel_sums}[program]
    rng = np.random.default_rng(3)
    x, v = tf.constant(rng.normal(size=(n, 4))), tf.constant(rng.normal(size=(n, 4)))
    return verdict_and_call(fn, tfmem.Config(memory_budget=budget, jit_compile=False), x, v)


@pytest.mark.parametrize("program", ["kernel_sum", "two_kernel_sums"])
def test_without_xla_a_fit_holds_under_a_real_limit(program: str) -> None:
    # jit_compile off, [4000, 4000] f64 kernels (122 MiB each) under a 40 MiB limit.
    # TensorFlow's executor starts every op whose inputs are ready: a loop ran up to 10
    # trips at once (`parallel_iterations`), and two loops no data orders ran side by side
    # (and beside the last chunk the other computes after its trips), each holding its
    # chunks where the plan counts one; the "fits" ran out of memory (in one run of two to
    # four: how much overlaps depends on the machine's threads).
    result = tfmem.run_isolated(without_xla_under_a_limit, program, 4000, "40MiB", memory_limit_mb=40, timeout=None)
    assert result.ok, result.error
    assert result.value["fits"] and result.value["status"] == "ok", result.value


def test_without_xla_no_chunk_is_over_an_eighth_of_the_plan(kernel_inputs) -> None:
    # Each chunk tensor is an allocation of its own without XLA, and BFC gave one needing a
    # new region the whole region: 34 MiB chunks under 128 MiB peaked at 130-164 MiB where
    # the estimate said 70.1 (chunks of at most 10 MiB: 41.9 MiB).
    config = tfmem.Config(memory_budget="24MiB", jit_compile=False)
    report = tfmem.function(kernel_times, config=config).report(*kernel_inputs)
    share = report.budget.graph_mode_split_bytes
    assert report.fits and report.splits, report.summary()
    assert all(r.details["chunk_bytes"] <= share for r in report.splits), [dict(r.details) for r in report.splits]
    with_xla = tfmem.function(kernel_times, config=tfmem.Config(memory_budget="24MiB")).report(*kernel_inputs)
    assert any(r.details["chunk_bytes"] > share for r in with_xla.splits)  # XLA allocates one block


def test_without_xla_loops_and_large_ops_run_in_the_estimates_order(rng: np.random.Generator) -> None:
    from tfmem.executor_order import heavy_ops_in_turn
    from tfmem.memory import WHILE_LOOP_OPS

    x, v = tf.constant(rng.normal(size=(600, 4))), tf.constant(rng.normal(size=(500, 4)))  # two loops, not one
    config = tfmem.Config(memory_budget="2MiB", jit_compile=False, strict=True)
    rewritten = tfmem.TfmemFunction(two_kernel_sums).trace(x, v).rewrite(config)
    graph = rewritten.graph
    schedule = list(estimate_memory(graph).steps)  # the estimate's order
    loops = [name for name in schedule if graph.node(name).op in WHILE_LOOP_OPS]
    assert len(loops) == 2 and loops[0] not in graph.ancestors(loops[1])
    ordered = heavy_ops_in_turn(graph)
    assert loops[0] in ordered.ancestors(loops[1])
    assert loops[0] not in graph.ancestors(loops[1])  # a copy: the plan itself is left as it was
    # Each op waits on the one before it in the estimate's order, and on nothing else new.
    added = {name: set(ordered.control_inputs(name)) - set(graph.control_inputs(name)) for name in (node.name for node in graph.nodes)}
    chained = [name for name in schedule if added[name] or any(name in a for a in added.values())]
    assert all(added[after] == {before} for before, after in zip(chained, chained[1:])), added
    assert not added[chained[0]] and set(loops) <= set(chained)
    small = tf.constant(rng.normal(size=(20, 4)))
    plain = tfmem.TfmemFunction(kernel_sum).trace(small, small).rewrite(config).graph
    assert heavy_ops_in_turn(plain) is plain  # nothing large: nothing to order
    got = tfmem.function(two_kernel_sums, config=config)(x, v)
    for a, b in zip(got, two_kernel_sums(x, v)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10)


def test_without_a_budget_or_threshold_nothing_is_split(kernel_inputs) -> None:
    report = tfmem.TfmemFunction(kernel_times).report(*kernel_inputs)
    assert report.budget is None and not report.splits
    assert report.summary().startswith("no budget:") and "nothing split" in report.summary()


def _sgpr_under_160_mib(config: dict[str, Any] | None) -> tuple[int, tfmem.IsolatedResult]:
    """GPflow SGPR loss and gradients at N=20,000, M=400 with tfmem (`config`; None: no config
    at all) in a process limited to 160 MiB; and what stock XLA plans for it."""
    stock = tfmem.run_isolated("benchmarks.budget_checks:stock_planned_bytes", "sgpr", (20_000, 400), timeout=None)
    assert stock.ok, stock.error
    result = tfmem.run_isolated("benchmarks.budget_checks:run", "sgpr", (20_000, 400), "tfmem", config,
                                memory_limit_mb=160, timeout=None)
    assert result.ok, result.error
    return stock.value, result


background.job("sgpr_zero_config_160_mib")(lambda: _sgpr_under_160_mib(None))
background.job("sgpr_threshold_160_mib")(lambda: _sgpr_under_160_mib({"tensor_size_threshold": "100MB"}))


@pytest.mark.background("sgpr_zero_config_160_mib")
def test_zero_config_under_a_real_allocator_limit_fits_where_stock_xla_does_not() -> None:
    # No tfmem config at all: the budget comes from TF_CPU_BFC_MEM_LIMIT_IN_MB (160 MiB). GPflow
    # SGPR loss and gradients at N=20,000, M=400: stock XLA plans ~430 MiB.
    stock, result = background.result("sgpr_zero_config_160_mib")
    assert stock > 160 * 2**20
    assert result.value["summary"].startswith("fits "), result.value["summary"]
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB=160" in result.value["budget"], result.value["budget"]
    assert result.peak_bytes <= 160 * 2**20


@pytest.mark.background("sgpr_threshold_160_mib")
def test_a_threshold_under_a_real_allocator_limit_keeps_its_bound() -> None:
    # A threshold over every tensor of this program (Kuf is 61 MiB) splits nothing by itself,
    # and stock XLA plans over 160 MiB for it (see above): the allocator's 160 MiB still
    # bounds it (before, any threshold switched that bound off, and this ran out of memory).
    stock, result = background.result("sgpr_threshold_160_mib")
    assert stock > 160 * 2**20
    assert result.value["summary"].startswith("fits "), result.value["summary"]
    assert "(90% of TF_CPU_BFC_MEM_LIMIT_IN_MB=160" in result.value["summary"], result.value["summary"]
    assert result.peak_bytes <= 160 * 2**20


def test_planning_again_for_another_budget_reuses_the_cleaned_up_graph(kernel_inputs, monkeypatch) -> None:
    prefixes = []
    fixed_point = tfmem.PassManager._fixed_point

    def counting(self, graph, context, passes, **kwargs):
        if not kwargs.get("skip_first_round") and not any(p.runs_once for p in passes):
            prefixes.append(passes)
        return fixed_point(self, graph, context, passes, **kwargs)

    monkeypatch.setattr(tfmem.PassManager, "_fixed_point", counting)
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    loose = traced.rewrite(tfmem.Config(memory_budget="64MiB"))
    tight = traced.rewrite(tfmem.Config(memory_budget="8MiB"))
    assert len(prefixes) == 1  # the passes before the split ran once
    assert loose.config.memory_budget == 64 * 2**20 and tight.config.memory_budget == 8 * 2**20
    assert tight.memory.peak_bytes < loose.memory.peak_bytes
    # The same graphs as a trace that plans for one budget only.
    again = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs).rewrite(tfmem.Config(memory_budget="8MiB"))
    assert again.graph.op_counts() == tight.graph.op_counts()
    assert again.memory.peak_bytes == tight.memory.peak_bytes


def test_a_threshold_that_misses_the_budget_gives_way_to_the_budget() -> None:
    from benchmarks.cases import sgpr_loss_and_gradients

    traced = tfmem.TfmemFunction(sgpr_loss_and_gradients(10_000, 300)).trace()
    both = traced.rewrite(tfmem.Config(tensor_size_threshold="1MB", memory_budget="4MiB"))
    (gave_way,) = [r for r in both.records if "planned by the memory budget alone" in r.reason]
    assert gave_way.details["budget_peak_bytes"] < gave_way.details["threshold_peak_bytes"]
    alone = traced.rewrite(tfmem.Config(memory_budget="4MiB"))
    assert both.memory.peak_bytes == alone.memory.peak_bytes
    assert both.graph.op_counts() == alone.graph.op_counts()


def _block_plan(total_bytes: int, budget: int) -> Any:
    """An XLA plan of `total_bytes`, all but a sixteenth of `budget` in its block of temporaries."""
    from tfmem.memory import XlaPlan

    return XlaPlan(total_bytes, total_bytes - budget // 16)


def test_a_re_plan_that_comes_out_worse_under_xla_is_not_kept(kernel_inputs, monkeypatch) -> None:
    from tfmem import stages
    from tfmem.memory import XlaPlan

    budget = 8 * 2**20
    # The first is over, each re-plan is worse; the program as written, asked last, is worse still.
    plans = iter([2 * budget, 5 * budget, 4 * budget, 6 * budget])
    # Blocks beside little else (a block beside much finds no room: no plan could fit, none is made).
    monkeypatch.setattr(stages.Compiled, "xla_plan_or_refusal", lambda self, *a, **k: (_block_plan(next(plans), budget), ""))
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    config = tfmem.Config(memory_budget=budget)
    kept = stages.compile_within_budget(traced, config, kernel_inputs, {}, ask_xla=True)
    assert kept.checked_plan.total_bytes == 2 * budget  # the first plan, the least over
    assert any("came out worse" in r.reason for r in kept.rewritten.records)
    np.testing.assert_allclose(kept(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def test_no_re_plan_when_the_static_plan_already_misses_its_target(kernel_inputs, monkeypatch) -> None:
    from tfmem import stages
    from tfmem.memory import XlaPlan

    budget = 64 * 2**10  # under the inputs alone: nothing split or shrunk reaches it
    checked = []
    monkeypatch.setattr(stages.Compiled, "xla_plan_or_refusal",
                        lambda self, *a, **k: (checked.append(self) or XlaPlan(4 * budget, budget), ""))
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=budget), kernel_inputs, {},
                                        ask_xla=True)
    assert len(checked) == 1  # one XLA compile, not 1 + _REPLANS
    assert any(r.rule == "MemoryBudget" and r.status == "rejected" for r in kept.rewritten.records)
    assert any("not planning again" in r.reason for r in kept.rewritten.records)
    np.testing.assert_allclose(kept(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def test_a_plan_within_the_budget_but_over_xlas_share_is_planned_again_around_xlas_peak(
        kernel_inputs, monkeypatch) -> None:
    """Planning aims at XLA's share of the budget (`XLA_FRACTION`): a plan between the share
    and the budget fits, with less margin than planned for, and is planned again around
    XLA's peak (SGPR N=20,000, M=3,800 under 512 MiB: 505.5 MiB, then 485.1 MiB in smaller
    chunks, and it runs). That round's peak is the whole plan: the block is allocated in
    one piece, gaps and all."""
    from tfmem import stages
    from tfmem.memory import LiveTensor, MemoryEstimate, XlaPlan

    budget = tfmem.Budget(8 * 2**20, "config")
    total = (budget.xla_bytes + budget.nbytes) // 2  # over the share, within the budget
    peak = MemoryEstimate(total // 2, "tfmem_step/MatMul", (LiveTensor("tfmem_step/MatMul", total // 2, (512, 512), "float64", "MatMul"),))
    monkeypatch.setattr(stages.Compiled, "xla_plan_or_refusal", lambda self, *a, **k: (XlaPlan(total, total - 4096, peak), ""))
    seen: list[tuple[MemoryEstimate, ...]] = []
    rewrite = stages.Traced.rewrite

    def spy(self, config, **kwargs):
        seen.append(tuple(kwargs.get("xla_peaks", ())))
        return rewrite(self, config, **kwargs)

    monkeypatch.setattr(stages.Traced, "rewrite", spy)
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=budget.nbytes), kernel_inputs, {},
                                        ask_xla=True)
    assert budget.fits_plan(kept.checked_plan) and kept.xla_overshoot > 1
    rounds = [peaks for peaks in seen if peaks]
    assert rounds, "no round was planned around XLA's peak"
    assert rounds[0][0].peak_bytes == total  # the whole block, not only what is live at its peak
    np.testing.assert_allclose(kept(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def test_a_re_plan_tightens_the_target_and_leaves_the_users_config_alone(kernel_inputs, monkeypatch) -> None:
    from tfmem import stages
    from tfmem.memory import XlaPlan

    budget = 8 * 2**20
    plans = iter([2 * budget, budget // 2])  # the first plan is twice over; the re-plan fits
    monkeypatch.setattr(stages.Compiled, "xla_plan_or_refusal", lambda self, *a, **k: (_block_plan(next(plans), budget), ""))
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    config = tfmem.Config(memory_budget=budget)
    kept = stages.compile_within_budget(traced, config, kernel_inputs, {}, ask_xla=True)
    (note,) = [r for r in kept.rewritten.records if "next_target_bytes" in r.details]
    first_target = tfmem.Budget(budget, "config").plan_bytes
    assert kept.rewritten.context.target_bytes == note.details["next_target_bytes"] < first_target
    assert kept.rewritten.verdict.target_bytes == kept.rewritten.context.target_bytes
    assert kept.rewritten.config == config and kept.rewritten.budget.nbytes == budget
    report = tfmem.Report.of(traced, kept, config=config)
    assert report.config == config and report.config.memory_budget == budget


def test_a_budget_from_the_device_plans_without_writing_itself_into_the_config(kernel_inputs) -> None:
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    device = tfmem.Budget(8 * 2**20, "a device's")
    from_device = traced.rewrite(tfmem.Config(), budget=device)
    from_config = traced.rewrite(tfmem.Config(memory_budget=8 * 2**20))
    assert from_device.config == tfmem.Config() and from_device.budget == device
    assert from_device.context.target_bytes == device.plan_bytes == from_config.context.target_bytes
    assert from_device.graph.op_counts() == from_config.graph.op_counts()  # the same plan either way
    assert from_device.verdict.fits and from_device.report.config.memory_budget is None


def test_a_threshold_keeps_the_device_bound_unless_the_budget_is_off(kernel_inputs, monkeypatch) -> None:
    # The device's limit (here the CPU allocator's, as its environment states it) bounds the
    # whole program whatever threshold is set: a threshold over every tensor splits nothing,
    # the bound still splits the [N, N] kernel matrix (17.2 MiB) to fit 90% of 16 MiB.
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "1")
    monkeypatch.setenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16")
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    bounded = traced.rewrite(tfmem.Config(tensor_size_threshold="100MB"), device="CPU:0")
    assert bounded.budget is not None and "TF_CPU_BFC_MEM_LIMIT_IN_MB=16" in bounded.budget.source
    assert bounded.verdict.fits and bounded.memory.peak_bytes <= bounded.budget.plan_bytes
    assert bounded.graph.op_counts().get("StatelessWhile", 0) + bounded.graph.op_counts().get("While", 0) >= 1
    assert bounded.report.summary().startswith("fits ") and "(90% of TF_CPU_BFC_MEM_LIMIT_IN_MB=16)" in \
        bounded.report.summary()
    off = traced.rewrite(tfmem.Config(tensor_size_threshold="100MB", memory_budget="off"), device="CPU:0")
    assert off.budget is None and off.verdict is None and not off.modified or not any(
        r.kind == "split" and r.status == "fired" for r in off.records)
    assert off.memory.peak_bytes > bounded.budget.nbytes  # per-tensor semantics: nothing over 100 MB
    assert off.report.summary().startswith("no bound (memory_budget: off)")


def test_a_threshold_that_gives_way_to_the_budget_warns_naming_both_numbers() -> None:
    from benchmarks.cases import sgpr_loss_and_gradients

    wrapped = tfmem.function(sgpr_loss_and_gradients(10_000, 300),
                             config={"tensor_size_threshold": "1MB", "memory_budget": "4MiB"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = wrapped.report()
    shown = [str(w.message) for w in caught if issubclass(w.category, tfmem.TfmemWarning)]
    assert report.verdict.threshold_dropped and len(shown) == 1, shown
    # One warning, naming the threshold, the budget, and the plan each one reached.
    assert "tensor_size_threshold not honoured" in shown[0] and "4.0 MiB" in shown[0], shown[0]
    assert "tensor_size_threshold 976.6 KiB left the static peak at" in shown[0], shown[0]
    assert "planned by the memory budget alone" in shown[0], shown[0]


def _xla_must_not_be_asked(self, *args, **kwargs):
    raise AssertionError("XLA's plan was asked for")


def _igamma_rows(a, x):
    return tf.reduce_sum(tf.math.igamma(a, x * x + 0.5), axis=1)


def test_a_program_whose_ops_xla_expands_asks_xla_however_small_its_estimate() -> None:
    # XLA lowers igamma to loops holding several temporaries of its output's size: its
    # plan was 11.6× the estimate of this program (fuzz 9: a false "fits" at 353 MiB).
    from tfmem import stages

    rng = np.random.default_rng(3)
    inputs = (tf.constant(rng.uniform(0.5, 3.0, (300, 400))), tf.constant(rng.uniform(0.1, 2.0, (300, 400))))
    traced = tfmem.TfmemFunction(_igamma_rows).trace(*inputs)
    budget = tfmem.Budget(int(2.5 * traced.memory.peak_bytes), "config")
    assert budget.fits_unchecked(traced.memory.peak_bytes)  # the estimate alone would say "fits"
    as_written = tfmem.memory.xla_plan(tf.function(_igamma_rows, jit_compile=True), *inputs)
    assert as_written.total_bytes > budget.nbytes, (as_written.total_bytes, budget.nbytes)
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=budget.nbytes), inputs, {})
    assert kept.checked_plan is not None  # XLA's plan decided
    (asked,) = [r for r in kept.rewritten.records if r.rule == "XlaPlan" and r.reason.startswith("asked")]
    assert "Igamma" in asked.reason, asked.reason
    report = tfmem.Report.of(traced, kept)
    assert "XLA's plan not asked" not in report.summary() and "XLA plans" in report.summary(), report.summary()
    np.testing.assert_allclose(kept(*inputs).numpy(), _igamma_rows(*inputs).numpy(), rtol=1e-10)


def _soft_min_rows_grad(x: tf.Tensor, z: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Each row's soft-min squared distance to the centres, by `map_fn`, and the gradient
    with respect to the centres: the backward pass reads values the forward loop kept for
    every row, in TensorLists (fuzz 14's `mapfn_rows_grad`, scaled down)."""
    with tf.GradientTape() as tape:
        tape.watch(z)
        per_row = tf.map_fn(lambda row: tf.reduce_logsumexp(-2.0 * tf.reduce_sum((row[None, :] - z) ** 2, -1)), x,
                            fn_output_signature=x.dtype)
        loss = tf.reduce_sum(per_row)
    return per_row, tape.gradient(loss, z)


def test_a_program_that_keeps_values_in_tensor_lists_asks_xla_however_small_its_estimate() -> None:
    # The estimate counts no element of a TensorList (how many there are is set when the
    # loop runs): fuzz 14 found XLA planning 224× the estimate of a `map_fn` gradient, and
    # the unchecked "fits" ran out of memory under a real limit.
    from tfmem import stages

    rng = np.random.default_rng(4)
    inputs = (tf.constant(rng.normal(size=(300, 4))), tf.constant(rng.normal(size=(400, 4))))
    traced = tfmem.TfmemFunction(_soft_min_rows_grad).trace(*inputs)
    as_written = tfmem.memory.xla_plan(tf.function(_soft_min_rows_grad, jit_compile=True), *inputs)
    budget = tfmem.Budget(max(int(2.5 * traced.memory.peak_bytes), 2**20), "config")
    assert budget.fits_unchecked(traced.memory.peak_bytes)  # the estimate alone would say "fits"
    assert as_written.total_bytes > 2 * budget.nbytes, (as_written.total_bytes, traced.memory.peak_bytes)
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=budget.nbytes), inputs, {})
    assert kept.checked_plan is not None  # XLA's plan decided
    (asked,) = [r for r in kept.rewritten.records if r.rule == "XlaPlan" and r.reason.startswith("asked")]
    assert "TensorList" in asked.reason, asked.reason
    report = tfmem.Report.of(traced, kept)
    assert not report.fits and "XLA's plan not asked" not in report.summary(), report.summary()
    for got, want in zip(kept(*inputs), _soft_min_rows_grad(*inputs)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)


def test_a_plan_far_enough_under_the_budget_compiles_once_without_asking_xla(kernel_inputs, monkeypatch) -> None:
    from tfmem import stages

    monkeypatch.setattr(stages.Compiled, "xla_plan_or_refusal", _xla_must_not_be_asked)
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    budget = tfmem.Budget(4 * traced.memory.peak_bytes, "config")  # the unchanged program, far under
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=budget.nbytes), kernel_inputs, {})
    assert kept.checked_plan is None and kept.check_seconds == 0
    assert kept.rewritten.memory.peak_bytes * tfmem.budget.ESTIMATE_ERROR <= budget.xla_bytes
    assert any(r.rule == "XlaPlan" and r.reason.startswith("not asked") for r in kept.rewritten.records)
    report = tfmem.Report.of(traced, kept)
    assert report.fits and "XLA's plan not asked" in report.summary() and not report.splits
    np.testing.assert_allclose(kept(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def covariance(x, z):
    """K(X, X) − 0.01 K(Z, X)ᵀ K(Z, X): the program returns a whole [n, n] matrix."""
    kzx = tf.exp(-0.5 * tf.reduce_sum((z[:, None] - x[None]) ** 2, -1))
    kxx = tf.exp(-0.5 * tf.reduce_sum((x[:, None] - x[None]) ** 2, -1))
    return kxx - 0.01 * tf.matmul(kzx, kzx, transpose_a=True)


def test_a_plan_whose_output_takes_half_the_budget_asks_xla_however_small_its_estimate(rng) -> None:
    # The output is allocated first, in a region of its own that takes up to twice its
    # size: what is left may hold no block of temporaries at all (fuzz 15: SGPR's full
    # covariance, a 68.7 MiB output, "fits 140 MiB" unchecked at an estimate of 69 MiB,
    # ran out of memory allocating a 25.8 MiB block).
    from tfmem import stages

    args = tf.constant(rng.normal(size=(1000, 3))), tf.constant(rng.normal(size=(50, 3)))
    traced = tfmem.TfmemFunction(covariance).trace(*args)
    # Twice the output; small chunks leave the estimate at the output and little more.
    config = tfmem.Config(memory_budget=2 * 1000 * 1000 * 8, tensor_split_size="256KiB")
    budget = tfmem.Budget(config.memory_budget, "config")
    first = traced.rewrite(config, budget=budget)  # the plan compile_within_budget starts from
    assert budget.fits_unchecked(first.memory.peak_bytes), "the estimate alone would not ask"
    compiled = stages.compile_within_budget(traced, config, args, {}, budget=budget)
    assert compiled.checked_plan is not None, "XLA's plan was not asked"
    assert not any(r.rule == "XlaPlan" and r.reason.startswith("not asked") for r in compiled.rewritten.records)
    np.testing.assert_allclose(compiled(*args).numpy(), covariance(*args).numpy(), rtol=1e-12, atol=1e-14)


def test_a_plan_near_the_budget_asks_xla_and_is_not_split_further_to_avoid_it(kernel_inputs, monkeypatch) -> None:
    from tfmem import stages
    from tfmem.memory import XlaPlan

    checked = []
    monkeypatch.setattr(stages.Compiled, "xla_plan_or_refusal",
                        lambda self, *a, **k: (checked.append(self) or XlaPlan(2**20, 2**19), ""))
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    config = tfmem.Config(memory_budget=8 * 2**20)
    kept = stages.compile_within_budget(traced, config, kernel_inputs, {})
    assert len(checked) == 1 and kept.checked_plan == XlaPlan(2**20, 2**19)
    # The plan is the one the usual target gives: no smaller chunks to skip XLA's check.
    assert kept.rewritten.context.target_bytes == tfmem.Budget(8 * 2**20, "config").plan_bytes
    # (the passes XLA decides on stay held back: the plan fits)
    assert kept.rewritten.memory.peak_bytes == traced.rewrite(config, xla_checked=False).memory.peak_bytes


def kernel_log_det(x):
    """log det(K + n·I) of an SE kernel matrix: the Cholesky reads K + n·I whole."""
    sq = tf.reduce_sum(tf.square(x), -1)
    k = tf.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)))  # [n, n]
    n = x.shape[0]
    chol = tf.linalg.cholesky(k + n * tf.eye(n, dtype=x.dtype))
    return 2.0 * tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol)))


def kernel_log_det_grad(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = kernel_log_det(x)
    return value, tape.gradient(value, x)


@pytest.mark.parametrize("program", [kernel_log_det, kernel_log_det_grad, kernel_times])
def test_every_split_the_report_names_is_a_loop_in_the_rewritten_graph(program, rng) -> None:
    # A region whose every output is read whole outside it (K + n·I by the Cholesky) keeps
    # nothing it computes: its loop would be pruned as soon as it was emitted. Such a split
    # is rejected with that reason, never reported as a loop the program does not have.
    x = tf.constant(rng.normal(size=(600, 3)))
    inputs = (x,) if program is not kernel_times else (x, tf.constant(rng.normal(size=(600, 8))))
    report = tfmem.TfmemFunction(program, config={"memory_budget": "5MiB"}).report(*inputs)
    graph = tfmem.Graph(report.rewritten_graph_def)
    loops = [r.details["loop"] for r in report.splits if r.rule == "SplitOversizedRegions"]
    assert len(set(loops)) == len(loops), loops
    for scope in loops:
        assert any(n.name.startswith(f"{scope}/") and n.op in ("While", "StatelessWhile") for n in graph.nodes), (
            f"{scope} is reported but not in the graph:\n{report}")
    if program is not kernel_times:  # the Cholesky's input is the region that keeps nothing
        assert any("its loop would keep nothing it computes" in r.reason for r in report.rejected), str(report)


def returned_covariance(x, z):
    """A covariance the program returns whole: Kxx − (XZᵀ)(XZᵀ)ᵀ / 100, as [1, n, n]."""
    sq = tf.reduce_sum(tf.square(x), -1)
    kxx = tf.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True)))  # [n, n]
    a = tf.matmul(x, z, transpose_b=True)  # [n, m]
    return (kxx - tf.matmul(a, a, transpose_b=True) / 100.0)[None]


def test_a_loop_assembles_what_the_program_returns_and_avoids_the_rest(rng) -> None:
    # What the program returns is held whole anyway: the loop that computes it in chunks
    # writes it out, and the [n, n] tensors before it are never whole. (The output is
    # allocated before the block of temporaries, in a region of up to twice its size: a
    # budget of three outputs leaves the block room; stock XLA plans all three.)
    x, z = tf.constant(rng.normal(size=(N, 3))), tf.constant(rng.normal(size=(50, 3)))
    whole = N * N * 8
    stock = tf.function(returned_covariance, jit_compile=True)
    assert tfmem.xla_planned_bytes(stock, x, z) > 2.9 * whole
    wrapped = tfmem.function(returned_covariance, config={"memory_budget": f"{3 * whole}B"})
    report = wrapped.report(x, z)
    assert report.fits and len(report.splits) == 1, str(report)
    assert report.xla_bytes_after < 2 * whole, str(report)  # the output and a block of chunks, never a whole
    (split,) = report.splits
    assert N % split.details["chunk"] == 0  # no remainder chunk to join with a copy of the output
    np.testing.assert_allclose(wrapped(x, z).numpy(), stock(x, z).numpy(), rtol=1e-12, atol=1e-14)


def test_a_loop_shrunk_past_what_its_peak_needs_takes_back_the_larger_chunks(rng: np.random.Generator) -> None:
    # The body's [M, M] partial product does not shrink with the chunk: shrinking to a plan
    # no chunk can reach asks for chunks of 1, yet the peak then moves to the Cholesky
    # after the loop, and chunks of 1,024 reach that same peak (GPflow's SVGP gradient,
    # M=1,200, 20,000 points, took 20,000 chunks and 20 times stock's first call).
    m, n, p = 256, 8192, 700

    def two_phases(x, z, w):
        dist = (tf.reduce_sum(tf.square(z), -1)[:, None] + tf.reduce_sum(tf.square(x), -1)[None, :]
                - 2.0 * tf.matmul(z, x, transpose_b=True))
        kzx = tf.exp(-0.5 * dist)                                 # [M, N]: split along N
        gram = tf.matmul(kzx, kzx, transpose_b=True)              # [M, M]: summed over the chunks
        factor = tf.linalg.cholesky(tf.matmul(w, w, transpose_b=True) + 700.0 * tf.eye(p, dtype=w.dtype))
        return tf.reduce_sum(gram) + tf.reduce_sum(factor)

    inputs = [tf.constant(rng.normal(size=shape)) for shape in [(n, 3), (m, 3), (p, p)]]
    concrete = tf.function(two_phases).get_concrete_function(*inputs)
    graph = Graph(concrete.graph.as_graph_def(add_shapes=True), outputs=[t.name for t in concrete.outputs])
    planner = Planner("split", graph)
    planner.split_all(threshold=m * n * 8 // 2, split_size=m * n * 8 // 2)
    (loop,) = planner.loops
    estimate = estimate_memory(graph)
    live, _ = estimate.at(planner._while_node(loop))
    assert estimate.peak_node == planner._while_node(loop)
    shrunk = planner._shrink(loop, estimate, plan=live + 1)  # over by all but one byte of its body
    (after,) = planner.loops
    assert shrunk is not None and shrunk.peak_node != planner._while_node(after), shrunk
    assert after.chunk >= 512, after
    at_one = planner._try_rechunk(after, 1)
    assert at_one is not None and shrunk.peak_bytes <= at_one.peak_bytes  # the same peak as chunks of 1
    [got] = run_graph(graph, concrete, inputs)
    np.testing.assert_allclose(got, two_phases(*inputs).numpy(), rtol=1e-10)


def attention_with_dropout_mask(q, k, v):
    """A dropout mask drawn for the [n, n] probabilities (no split rule for the draw): a loop
    emitted after the one that reads the mask makes it."""
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        s = tf.matmul(q, k, transpose_b=True)
        p = tf.nn.softmax(s)
        keep = tf.cast(tf.random.stateless_uniform(tf.shape(p), seed=[1, 2], dtype=p.dtype) > 0.1, p.dtype)
        loss = tf.reduce_sum(((p * keep / 0.9) @ v) ** 2) + 1e-3 * tf.reduce_sum(s ** 2)
    return (loss, *tape.gradient(loss, [q, k, v]))


def test_a_loop_emitted_again_slices_what_a_later_loop_makes_now(rng) -> None:
    # A loop re-chunked after a later loop took over a tensor its region reads (here the
    # mask, which the later loop makes) reads that loop's output instead: sliced along the
    # split axis as the original was, not whole ("Dimensions must be equal", a fallback).
    program, matrices, n = attention_with_dropout_mask, 3, 400
    q, k, v = (tf.constant(rng.normal(size=(n, 16)) * 0.3) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = tfmem.function(program, config={"memory_budget": matrices * n * n * 8})
        got = wrapped(q, k, v)
        report = wrapped.report(q, k, v)
    assert not [w for w in caught if issubclass(w.category, tfmem.TfmemWarning)], [str(w.message) for w in caught]
    assert report.status == "rewritten" and len(report.splits) >= 2, str(report)
    want = tf.function(program, jit_compile=True)(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=0, atol=1e-9 * np.max(np.abs(w.numpy())))


# --- a diagonal written over (leave-one-out statistics, contrastive losses) -------------------

def _loo_log_density(x, h):
    """Leave-one-out kernel density: each point's log density under the others."""
    d2 = tf.reduce_sum(tf.square(x[:, None, :] - x[None, :, :]), -1)
    logk = tf.linalg.set_diag(-0.5 * d2 / (h * h), tf.fill([x.shape[0]], tf.constant(-np.inf, x.dtype)))
    return tf.reduce_mean(tf.reduce_logsumexp(logk, axis=1))


def _contrastive_loss(z, temperature):
    """NT-Xent-like: row i's positive is row i ± n/2, its own pair masked out by a large negative."""
    z = z / tf.norm(z, axis=1, keepdims=True)
    logits = tf.linalg.set_diag(z @ tf.transpose(z) / temperature, tf.fill([z.shape[0]], tf.constant(-1e9, z.dtype)))
    positives = tf.reduce_sum(z * tf.roll(z, shift=z.shape[0] // 2, axis=0), axis=1) / temperature
    return tf.reduce_mean(tf.reduce_logsumexp(logits, axis=1) - positives)


def _penalised_self_pairs(x, v):
    """A matrix made from a computed diagonal, subtracted (`S - diag(e^v)`), then read by rows."""
    s = -tf.reduce_sum(tf.square(x[:, None, :] - x[None, :, :]), -1)
    return tf.reduce_logsumexp(s - 50.0 * tf.linalg.diag(tf.exp(v)), axis=1)


def _with_gradient(fn):
    def loss_and_gradients(x, s):
        with tf.GradientTape() as tape:
            tape.watch([x, s])
            loss = fn(x, s)
        return (loss, *tape.gradient(loss, [x, s]))
    return loss_and_gradients


@pytest.mark.parametrize("program, n, d, scale", [
    (_loo_log_density, 1600, 3, 0.7), (_with_gradient(_loo_log_density), 1600, 3, 0.7),
    (_with_gradient(_contrastive_loss), 1600, 16, 0.3), (_penalised_self_pairs, 1500, 3, None)],
    ids=["loo_kde", "loo_kde_grad", "contrastive_grad", "made_diagonal"])
def test_a_diagonal_written_over_or_made_a_matrix_splits_by_rows_under_a_budget(program, n: int, d: int, scale: float,
                                                                rng: np.random.Generator) -> None:
    second = tf.constant(scale, tf.float64) if scale is not None else tf.constant(rng.normal(size=(n,)))
    inputs = (tf.constant(rng.normal(size=(n, d))), second)
    stock = tfmem.memory.xla_plan(tf.function(program, jit_compile=True), *inputs).total_bytes
    budget = stock // 4
    wrapped = tfmem.function(program, config={"memory_budget": budget, "strict": True})
    report = wrapped.report(*inputs)
    assert report.fits and report.splits, report.summary()
    assert report.xla_bytes_after <= budget, report.summary()
    assert not any(node.op.startswith(("MatrixSetDiag", "MatrixDiag")) for node in report.rewritten_graph_def.node)
    want = tf.function(program, jit_compile=True)(*inputs)
    for got, expected in zip(tf.nest.flatten(wrapped(*inputs)), tf.nest.flatten(want)):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-9, atol=1e-12)


def _jittered_cholesky_logdet(x, s):
    k = tf.exp(-tf.reduce_sum(tf.square(x[:, None, :] - x[None, :, :]), -1) / (s * s))
    k = tf.linalg.set_diag(k, tf.fill([x.shape[0]], tf.constant(1.5, x.dtype)))
    return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(tf.linalg.cholesky(k))))


def test_a_diagonal_written_over_stays_an_op_when_no_loop_comes_of_it(rng: np.random.Generator) -> None:
    # The Cholesky needs the matrix whole: lowering its set_diag to a select splits nothing,
    # so the set_diag is put back (the graph as it was, the reason kept).
    inputs = (tf.constant(rng.normal(size=(600, 3))), tf.constant(1.3, tf.float64))
    graph = Graph(tf.function(_jittered_cholesky_logdet).get_concrete_function(*inputs).graph.as_graph_def())
    planner = Planner("split", graph)
    planner.split_all(threshold=600 * 600 * 8 // 4, split_size=600 * 600 * 8 // 8)
    ops = {node.op for node in planner.graph.nodes}
    assert "MatrixSetDiagV3" in ops and not planner.loops, sorted(ops)
    assert not any("lowered" in node.name for node in planner.graph.nodes)


def _loo_density_and_jittered_logdet(x, s):
    """A leave-one-out density beside the log-determinant of x xᵀ with its diagonal written
    over (diagonally dominant, so positive definite)."""
    gram = tf.linalg.set_diag(x @ tf.transpose(x), tf.fill([x.shape[0]], tf.constant(1e4, x.dtype)))
    return _loo_log_density(x, s) + tf.reduce_sum(tf.math.log(tf.linalg.diag_part(tf.linalg.cholesky(gram))))


def test_a_diagonal_written_over_that_no_loop_takes_stays_an_op_beside_one_that_splits(
        rng: np.random.Generator) -> None:
    # The leave-one-out diagonal splits by rows; the Cholesky's jitter would stay a whole
    # select beside its [n, n] mask, where set_diag writes in place: it is put back alone.
    inputs = (tf.constant(rng.normal(size=(800, 3))), tf.constant(1.3, tf.float64))
    program = _loo_density_and_jittered_logdet
    wrapped = tfmem.function(program, config={"tensor_size_threshold": 800 * 800 * 8 // 4})
    report = wrapped.report(*inputs)
    assert report.splits, report.summary()
    nodes = {node.name: node for node in report.rewritten_graph_def.node}
    set_diags = [name for name, node in nodes.items() if node.op == "MatrixSetDiagV3"]
    assert len(set_diags) == 1 and any(node.op == "Cholesky" and node.input[0].split(":")[0] == set_diags[0]
                                       for node in nodes.values()), set_diags
    want = tf.function(program, jit_compile=True)(*inputs)
    np.testing.assert_allclose(wrapped(*inputs).numpy(), want.numpy(), rtol=1e-9)


_ROW_READERS = {
    "logsumexp": lambda s: tf.reduce_logsumexp(s, axis=1),
    "max": lambda s: tf.reduce_max(s, axis=1),
    "softmax_weighted": lambda s: tf.reduce_sum(tf.nn.softmax(s, axis=1) * tf.tanh(s), axis=1),
    "sum_exp": lambda s: tf.reduce_sum(tf.exp(tf.minimum(s, 0.0)), axis=1),
}


@settings(max_examples=10, deadline=None)
@given(n=st.integers(300, 700), fill=st.sampled_from(["-inf", "-1e9", "zero", "vector", "made"]),
       reader=st.sampled_from(sorted(_ROW_READERS)), seed=st.integers(0, 2**16))
def test_property_diagonals_written_over_then_read_by_rows_equal_stock(n: int, fill: str, reader: str,
                                                                       seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, v = tf.constant(rng.normal(size=(n, 3))), tf.constant(rng.normal(size=(n,)))

    def program(x, v):
        with tf.GradientTape() as tape:
            tape.watch(x)
            s = -tf.reduce_sum(tf.square(x[:, None, :] - x[None, :, :]), -1)
            diagonal = {"-inf": tf.fill([n], tf.constant(-np.inf, tf.float64)), "zero": tf.zeros([n], tf.float64),
                        "-1e9": tf.fill([n], tf.constant(-1e9, tf.float64)), "vector": v, "made": v}[fill]
            if fill == "made":  # a matrix made from a diagonal, subtracted
                rows = _ROW_READERS[reader](s - 3.0 * tf.linalg.diag(tf.exp(v)))
            else:
                rows = _ROW_READERS[reader](tf.linalg.set_diag(s, diagonal))
            loss = tf.reduce_sum(rows * rows)
        return rows, tape.gradient(loss, x)

    threshold = n * n * 8 // 4
    wrapped = tfmem.function(program, config={"tensor_size_threshold": threshold, "strict": True})
    report = wrapped.report(x, v)
    assert report.splits, report.summary()
    want = program(x, v)
    for got, expected in zip(wrapped(x, v), want):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-9, atol=1e-12)


def _banded_kernels(x, lengthscales):
    """A batch of kernel matrices [b, n, n] read through band parts: it splits only on b."""
    with tf.GradientTape() as tape:
        tape.watch(lengthscales)
        xx = tf.reduce_sum(x * x, 1)
        d = tf.maximum(xx[:, None] + xx[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True), 0.0)
        kernels = tf.exp(-d[None] / tf.square(lengthscales)[:, None, None])
        out = (tf.reduce_sum(tf.linalg.band_part(kernels, 20, 0), axis=[1, 2])
               + tf.reduce_sum(tf.linalg.band_part(kernels, 0, -1), axis=[1, 2]))
        loss = tf.reduce_sum(tf.math.log(out))
    return out, tape.gradient(loss, lengthscales)


def test_a_budget_alone_splits_a_batch_one_matrix_at_a_time(rng: np.random.Generator) -> None:
    # Fuzz 10: one [n, n] slice is over the first chunk's share of the plan, so the budget
    # alone split nothing ("does NOT fit", XLA 129.7 MiB at n=1000 under 95.4 MiB) where chunks
    # of one matrix fit (XLA 40.1 MiB). With no split size from the user, they are tried.
    inputs = (tf.constant(rng.normal(size=(700, 3))), tf.constant(np.linspace(0.5, 2.0, 8)))
    stock = tfmem.memory.xla_plan(tf.function(_banded_kernels, jit_compile=True), *inputs).total_bytes
    budget = stock // 2
    wrapped = tfmem.function(_banded_kernels, config={"memory_budget": budget, "strict": True})
    report = wrapped.report(*inputs)
    assert report.fits and [split.details["chunk"] for split in report.splits] == [1], report.summary()
    assert report.xla_bytes_after <= budget, report.summary()
    for got, want in zip(wrapped(*inputs), tf.function(_banded_kernels, jit_compile=True)(*inputs)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)


def _causal_attention(q, k, v):
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        s = q @ tf.transpose(k) / 4.0
        s = tf.linalg.band_part(s, -1, 0) - 1e9 * (1.0 - tf.linalg.band_part(tf.ones_like(s), -1, 0))
        out = tf.nn.softmax(s, axis=1) @ v
        loss = tf.reduce_sum(out * out)
    return (out, *tape.gradient(loss, [q, k, v]))


def test_a_causal_mask_splits_by_rows_under_a_budget(rng: np.random.Generator) -> None:
    # band_part(S, -1, 0) has no split rule for its rows (the band moves with the chunk): as
    # a select by iota compares it splits (n=1500 with gradients under a quarter of stock's
    # 55.5 MiB: XLA plans 6.2 MiB; was "does NOT fit, nothing split").
    inputs = tuple(tf.constant(rng.normal(size=(900, 16))) for _ in range(3))
    stock = tfmem.memory.xla_plan(tf.function(_causal_attention, jit_compile=True), *inputs).total_bytes
    wrapped = tfmem.function(_causal_attention, config={"memory_budget": stock // 4, "strict": True})
    report = wrapped.report(*inputs)
    assert report.fits and report.splits and report.xla_bytes_after <= stock // 4, report.summary()
    assert not any(node.op == "MatrixBandPart" for node in report.rewritten_graph_def.node)
    for got, want in zip(wrapped(*inputs), tf.function(_causal_attention, jit_compile=True)(*inputs)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("lower, upper", [(-1, 0), (0, -1), (20, 0), (3, 5), (0, 0)])
def test_bands_of_a_big_matrix_split_by_rows_and_equal_stock(lower: int, upper: int,
                                                             rng: np.random.Generator) -> None:
    x, y = tf.constant(rng.normal(size=(420, 3))), tf.constant(rng.normal(size=(380, 3)))

    def program(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            banded = tf.linalg.band_part(tf.exp(-tf.square(x @ tf.transpose(y))), lower, upper)
            rows = tf.reduce_logsumexp(banded, axis=1)
            loss = tf.reduce_sum(rows * rows)
        return rows, tape.gradient(loss, x)

    wrapped = tfmem.function(program, config={"tensor_size_threshold": 420 * 380 * 8 // 5, "strict": True})
    report = wrapped.report(x, y)
    assert report.splits and not any(node.op == "MatrixBandPart" for node in report.rewritten_graph_def.node)
    # The band is made of the compares its limits ask for: no mask of the matrix's size is
    # kept as a constant (a limit of -1 once made a `ones` [420, 380] beside them).
    sizes = [np.prod([d.size for d in node.attr["value"].tensor.tensor_shape.dim])
             for node in report.rewritten_graph_def.node if node.op == "Const"]
    assert max(sizes) < 420 * 380, max(sizes)
    for got, want in zip(wrapped(x, y), program(x, y)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-13)
