"""The first call under a budget: where its time goes, one compilation when the estimate
settles the question, an out-of-memory of an unchecked plan re-planned with XLA, and
plans kept between processes (`Config.plan_cache`)."""
from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem import budget as budget_module
from tfmem import stages
from tfmem.plan_cache import FORMAT

N = 1200  # [N, N] float64: 11 MiB


def kernel_times(x, v):
    sq = tf.reduce_sum(tf.square(x), -1)
    return tf.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * tf.matmul(x, x, transpose_b=True))) @ v


@pytest.fixture
def inputs(rng: np.random.Generator) -> tuple[tf.Tensor, tf.Tensor]:
    return tf.constant(rng.normal(size=(N, 3))), tf.constant(rng.normal(size=(N, 8)))


def _expected(inputs) -> np.ndarray:
    return kernel_times(*inputs).numpy()


def test_the_report_says_where_the_first_calls_time_went(inputs) -> None:
    wrapped = tfmem.function(kernel_times, config={"memory_budget": "8MiB"})
    np.testing.assert_allclose(wrapped(*inputs).numpy(), _expected(inputs), rtol=1e-10)
    report = wrapped.report(*inputs)
    parts = report.first_call_seconds
    assert list(parts) == ["trace", "rewrite", "xla check", "compile and run"]
    assert all(seconds >= 0 for seconds in parts.values()) and parts["trace"] > 0 and parts["compile and run"] > 0
    assert "first call" in str(report)
    assert tfmem.function(kernel_times).report(*inputs).first_run_seconds is None  # not called yet


def test_an_unchecked_plan_that_runs_out_of_memory_is_planned_again_with_xla(inputs, monkeypatch) -> None:
    calls = {"n": 0}
    original_call = stages.Compiled.__call__

    def out_of_memory_once(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise tf.errors.ResourceExhaustedError(None, None, "Out of memory while trying to allocate 9.0MiB")
        return original_call(self, *args, **kwargs)

    monkeypatch.setattr(stages.Compiled, "__call__", out_of_memory_once)
    wrapped = tfmem.function(kernel_times, config={"memory_budget": "256MiB"})  # far under: not checked
    assert wrapped.report(*inputs).xla_bytes_after is None  # the estimate settled it: XLA not asked
    with pytest.warns(tfmem.TfmemWarning, match="ran out of memory on its first call"):
        got = wrapped(*inputs)
    np.testing.assert_allclose(got.numpy(), _expected(inputs), rtol=1e-10)
    report = wrapped.report(*inputs)
    assert report.xla_bytes_after is not None and report.fits  # asked XLA this time


def test_an_out_of_memory_of_a_plan_xla_checked_is_raised(inputs, monkeypatch) -> None:
    def out_of_memory(self, *args, **kwargs):
        raise tf.errors.ResourceExhaustedError(None, None, "Out of memory")

    monkeypatch.setattr(stages.Compiled, "__call__", out_of_memory)
    monkeypatch.setattr(budget_module, "ESTIMATE_ERROR", 1000.0)  # every plan is checked with XLA
    wrapped = tfmem.function(kernel_times, config={"memory_budget": "8MiB"})
    with pytest.raises(tf.errors.ResourceExhaustedError):
        wrapped(*inputs)


def test_a_second_function_finds_the_plan_in_the_plan_cache(inputs, tmp_path, monkeypatch) -> None:
    config = {"memory_budget": "8MiB", "plan_cache": str(tmp_path)}
    first = tfmem.function(kernel_times, config=config)
    np.testing.assert_allclose(first(*inputs).numpy(), _expected(inputs), rtol=1e-10)
    assert first.report(*inputs).plan_from_cache == ""
    (plan_file,) = os.listdir(tmp_path)

    def must_not_plan(*args, **kwargs):
        raise AssertionError("planned again despite the plan cache")

    monkeypatch.setattr("tfmem.wrapper.compile_within_budget", must_not_plan)
    second = tfmem.function(kernel_times, config=config)
    np.testing.assert_allclose(second(*inputs).numpy(), _expected(inputs), rtol=1e-10)
    report, made = second.report(*inputs), first.report(*inputs)
    assert report.plan_from_cache == str(tmp_path / plan_file)
    assert report.summary() == made.summary() and report.fits == made.fits
    assert len(report.splits) == len(made.splits) >= 1


def test_another_budget_or_a_damaged_file_makes_a_new_plan(inputs, tmp_path) -> None:
    tfmem.function(kernel_times, config={"memory_budget": "8MiB", "plan_cache": str(tmp_path)})(*inputs)
    other = tfmem.function(kernel_times, config={"memory_budget": "6MiB", "plan_cache": str(tmp_path)})
    other(*inputs)
    assert other.report(*inputs).plan_from_cache == "" and len(os.listdir(tmp_path)) == 2
    for name in os.listdir(tmp_path):
        (tmp_path / name).write_text("{not json")
    again = tfmem.function(kernel_times, config={"memory_budget": "8MiB", "plan_cache": str(tmp_path)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfmem.TfmemWarning)  # a damaged file is not the user's problem
        np.testing.assert_allclose(again(*inputs).numpy(), _expected(inputs), rtol=1e-10)
    assert again.report(*inputs).plan_from_cache == ""
    readable = []
    for path in tmp_path.iterdir():
        try:
            readable.append(json.loads(path.read_text())["format"])
        except ValueError:
            pass
    assert readable == [FORMAT]  # the 8 MiB plan was written again, whole


def test_plan_cache_must_be_a_directory(tmp_path) -> None:
    a_file = tmp_path / "plans"
    a_file.write_text("")
    with pytest.raises(ValueError, match="plan_cache: .* is not a directory"):
        tfmem.Config(plan_cache=str(a_file))
    assert tfmem.Config(plan_cache="").plan_cache is None


@pytest.mark.parametrize("planned, fits", [(0.97, True), (1.02, False)])
def test_a_plan_inside_the_budget_but_over_xlas_share_fits_with_little_to_spare(inputs, monkeypatch, planned,
                                                                               fits) -> None:
    from tfmem.memory import XlaPlan

    budget = 8 * 2**20
    plan = XlaPlan(int(planned * budget), int((planned - 0.01) * budget))
    monkeypatch.setattr(stages.Compiled, "xla_plan_or_refusal", lambda self, *a, **k: (plan, ""))
    monkeypatch.setattr(budget_module, "ESTIMATE_ERROR", 1000.0)  # every plan is checked with XLA
    traced = tfmem.TfmemFunction(kernel_times).trace(*inputs)
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=budget), inputs, {})
    assert kept.xla_overshoot > 1  # over the share planning aims for: it planned again
    report = tfmem.Report.of(traced, kept)
    assert report.fits is fits
    summary = report.summary()
    assert summary.startswith("fits" if fits else "does NOT fit")
    assert ("to spare, under the 5% margin" in summary) is fits


def test_the_allocators_peak_is_read_after_the_check_that_grew_it(inputs, monkeypatch) -> None:
    from tfmem.memory import XlaPlan

    mib = 2**20
    grown = {"peak": 0}

    def check(self, *args, **kwargs):  # XLA's compile grows the allocator's regions, as the rewrite can
        grown["peak"] = 3 * mib
        return XlaPlan(6 * mib, int(5.9 * mib)), ""

    monkeypatch.setattr(stages.Compiled, "xla_plan_or_refusal", check)
    monkeypatch.setattr(stages, "allocator_held", lambda: budget_module.Held(peak=grown["peak"]))
    monkeypatch.setattr(budget_module, "ESTIMATE_ERROR", 1000.0)  # every plan is checked with XLA
    traced = tfmem.TfmemFunction(kernel_times).trace(*inputs)
    kept = stages.compile_within_budget(traced, tfmem.Config(memory_budget=8 * mib), inputs, {})
    assert kept.held.peak == 3 * mib
    # Beside regions of up to 2 × 3 MiB the 5.9 MiB block has no room in 8 MiB; before them it had.
    budget = tfmem.Budget(8 * mib, "config")
    assert budget.fits_xla_plan(6 * mib, int(5.9 * mib))
    assert tfmem.Report.of(traced, kept).fits is False


def _plan_in_this_process(plan_cache: str) -> str:
    """Runs `kernel_times` under a budget with `plan_cache` (in a child process): its report's summary."""
    x, v = (tf.constant(np.random.default_rng(0).normal(size=(N, k))) for k in (3, 8))
    wrapped = tfmem.function(kernel_times, config={"memory_budget": "8MiB", "plan_cache": plan_cache, "strict": True})
    wrapped(x, v)
    return wrapped.report(x, v).summary()


def test_a_plan_made_in_another_process_runs(inputs, tmp_path) -> None:
    """The split loop's functions of a plan read from the cache were never registered in this
    process: the import registers them (before, "Function while_cond_… is not defined" and a
    fallback)."""
    made = tfmem.run_isolated("tests.tfmem.test_first_call:_plan_in_this_process", str(tmp_path))
    assert made.ok, made.error
    here = tfmem.function(kernel_times, config={"memory_budget": "8MiB", "plan_cache": str(tmp_path), "strict": True})
    np.testing.assert_allclose(here(*inputs).numpy(), _expected(inputs), rtol=1e-10)
    report = here.report(*inputs)
    assert report.plan_from_cache and report.splits and report.summary() == made.value


def test_a_plan_from_the_plan_cache_is_judged_beside_this_process_allocator(inputs, tmp_path, monkeypatch) -> None:
    # A cached plan was judged beside the allocator of the process that made it. Here this
    # process's allocator holds 7 MiB already (stubbed), and the call's 2.4 MiB plan does not
    # fit beside it under 8 MiB: the verdict says so.
    from tfmem.budget import Held

    monkeypatch.setattr(budget_module, "ESTIMATE_ERROR", 1000.0)  # every plan is checked with XLA
    config = {"memory_budget": "8MiB", "plan_cache": str(tmp_path)}
    first = tfmem.function(kernel_times, config=config)
    first(*inputs)
    assert first.report(*inputs).fits and first.report(*inputs).xla_bytes_after is not None
    monkeypatch.setattr(stages, "allocator_held", lambda device=None: Held(in_use=7 * 2**20, peak=8 * 2**20,
                                                                         regions=2 * 2**20))
    second = tfmem.function(kernel_times, config=config)
    report = second.report(*inputs)
    assert report.plan_from_cache and not report.fits, report.summary()
