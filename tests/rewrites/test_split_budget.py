"""The budget planner: `memory_budget` alone splits, sizes chunks to fit, and says when it cannot."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from rewrites.split.planner import Planner
from tfmem.budget import PLANNING_FRACTION
from tfmem.memory import estimate_memory

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
    assert report.summary().startswith("fits 8.0 MiB: estimated peak")
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


def test_a_budget_that_cannot_be_met_is_loud_and_names_what_blocks_it(rng: np.random.Generator) -> None:
    x = tf.constant(rng.normal(size=(1000, 1000)))  # 7.6 MiB input: over the whole budget

    def solve(x):
        return tf.linalg.cholesky(x @ tf.transpose(x) + 1000.0 * tf.eye(1000, dtype=x.dtype))

    wrapped = tfmem.function(solve, config={"memory_budget": "4MiB"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_allclose(wrapped(x).numpy(), solve(x).numpy(), rtol=1e-10)  # still runs
    report = wrapped.report(x)
    assert report.fits is False and report.summary().startswith("does NOT fit 4.0 MiB")
    (missed,) = [r for r in report.rejected if r.kind == "budget"]
    assert "stays over the plan" in missed.reason and "MiB" in missed.reason
    shown = [str(w.message) for w in caught if issubclass(w.category, tfmem.TfmemWarning)]
    assert len(shown) == 1 and "may not fit its memory budget" in shown[0], shown
    strict = tfmem.function(solve, config={"memory_budget": "4MiB", "strict": True})
    with pytest.raises(tfmem.TfmemError, match="may not fit its memory budget"):
        strict(x)


def test_without_a_budget_or_threshold_nothing_is_split(kernel_inputs) -> None:
    report = tfmem.TfmemFunction(kernel_times).report(*kernel_inputs)
    assert report.budget is None and not report.splits
    assert report.summary().startswith("no budget:") and "nothing split" in report.summary()


def test_zero_config_under_a_real_allocator_limit_fits_where_stock_xla_does_not() -> None:
    # No tfmem config at all: the budget comes from TF_CPU_BFC_MEM_LIMIT_IN_MB (160 MiB). GPflow
    # SGPR loss and gradients at N=20,000, M=400: stock XLA plans ~430 MiB.
    from benchmarks.budget_checks import sgpr_step

    step, _ = sgpr_step(20_000, 400)
    assert tfmem.xla_planned_bytes(tf.function(step, jit_compile=True)) > 160 * 2**20
    result = tfmem.run_isolated("benchmarks.budget_checks:run", "sgpr", (20_000, 400), "tfmem", None,
                                memory_limit_mb=160, timeout=None)
    assert result.ok, result.error
    assert result.value["summary"].startswith("fits "), result.value["summary"]
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB=160" in result.value["budget"], result.value["budget"]
    assert result.peak_bytes <= 160 * 2**20


def test_planning_again_for_another_budget_reuses_the_cleaned_up_graph(kernel_inputs, monkeypatch) -> None:
    prefixes = []
    run_prefix = tfmem.PassManager.run_prefix
    monkeypatch.setattr(tfmem.PassManager, "run_prefix",
                        lambda self, *args: prefixes.append(run_prefix(self, *args)) or prefixes[-1])
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    loose = traced.rewrite(tfmem.Config(memory_budget="64MiB"))
    tight = traced.rewrite(tfmem.Config(memory_budget="8MiB"))
    assert len(prefixes) == 1  # the budget-free passes ran once
    assert tight.memory.peak_bytes < loose.memory.peak_bytes
    # The same graphs as a trace that plans for one budget only.
    again = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs).rewrite(tfmem.Config(memory_budget="8MiB"))
    assert again.graph.op_counts() == tight.graph.op_counts()
    assert again.memory.peak_bytes == tight.memory.peak_bytes


def test_a_threshold_that_misses_the_budget_gives_way_to_the_budget() -> None:
    from benchmarks.cases import sgpr_loss_and_gradients

    traced = tfmem.TfmemFunction(sgpr_loss_and_gradients(10_000, 300)).trace()
    both = traced.rewrite(tfmem.Config(tensor_size_threshold="1MB", memory_budget="6MiB"))
    (gave_way,) = [r for r in both.records if "planned by the memory budget alone" in r.reason]
    assert gave_way.details["budget_peak_bytes"] < gave_way.details["threshold_peak_bytes"]
    alone = traced.rewrite(tfmem.Config(memory_budget="6MiB"))
    assert both.memory.peak_bytes == alone.memory.peak_bytes
    assert both.graph.op_counts() == alone.graph.op_counts()


def test_a_re_plan_that_comes_out_worse_under_xla_is_not_kept(kernel_inputs, monkeypatch) -> None:
    from tfmem import stages
    from tfmem.memory import XlaPlan

    budget = 8 * 2**20
    plans = iter([2 * budget, 5 * budget, 4 * budget])  # the first is over, each re-plan is worse
    monkeypatch.setattr(stages.Compiled, "xla_plan", lambda self, *a, **k: XlaPlan(next(plans), budget // 2))
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=budget), kernel_inputs, {})
    assert kept.checked_plan.total_bytes == 2 * budget  # the first plan, the least over
    assert any("came out worse" in r.reason for r in kept.rewritten.records)
    np.testing.assert_allclose(kept(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)


def test_no_re_plan_when_the_static_plan_already_misses_its_target(kernel_inputs, monkeypatch) -> None:
    from tfmem import stages
    from tfmem.memory import XlaPlan

    budget = 64 * 2**10  # under the inputs alone: nothing split or shrunk reaches it
    checked = []
    monkeypatch.setattr(stages.Compiled, "xla_plan",
                        lambda self, *a, **k: checked.append(self) or XlaPlan(4 * budget, budget))
    traced = tfmem.TfmemFunction(kernel_times).trace(*kernel_inputs)
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=budget), kernel_inputs, {})
    assert len(checked) == 1  # one XLA compile, not 1 + _REPLANS
    assert any(r.rule == "MemoryBudget" and r.status == "rejected" for r in kept.rewritten.records)
    assert any("not planning again" in r.reason for r in kept.rewritten.records)
    np.testing.assert_allclose(kept(*kernel_inputs).numpy(), kernel_times(*kernel_inputs).numpy(), rtol=1e-10)
