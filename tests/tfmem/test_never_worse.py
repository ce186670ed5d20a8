"""Never worse than the program as written: a rewrite under which XLA plans more, while the
rewritten program does not fit, is dropped with its reason, and XLA's plan of the program
as written decides the verdict (`tfmem.stages._never_worse_than_written`)."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.graph import Graph
from tfmem.passes import GraphPass, PassResult, RewriteRecord
from tfmem.report import NEVER_WORSE_RULE, XLA_CHECKED_RULE

ROWS, COLS = 3000, 20  # x: 469 KiB; x @ xᵀ: [3000, 3000] float64, 68.7 MiB


def column_sums(x):
    return tf.reduce_sum(tf.sin(x), 0)


class AddsABigProduct(GraphPass):
    """A pass that makes the program worse: `out → out + 0·Σ(x @ xᵀ)` (a whole [n, n] product)."""

    name = "adds_a_big_product"
    stage = "match_and_replace"

    def run(self, graph: Graph, context) -> PassResult:
        (x,) = [tfmem.TensorRef(n.name) for n in graph.find("Placeholder")]
        out = graph.outputs[0]
        (worse,) = graph.splice(lambda o, v: o + 0.0 * tf.reduce_sum(tf.matmul(v, v, transpose_b=True)),
                                [out, x], scope="worse")
        graph.outputs[0] = worse
        return PassResult(graph, True, [RewriteRecord(self.name, "AddsABigProduct", "fired", (worse.node,))])


@pytest.fixture
def x(rng: np.random.Generator) -> tf.Tensor:
    return tf.constant(rng.normal(size=(ROWS, COLS)))


def test_a_rewrite_xla_plans_more_for_is_dropped_and_the_program_runs_as_written(x) -> None:
    wrapped = tfmem.TfmemFunction(column_sums, config={"memory_budget": "16MiB"}, passes=[AddsABigProduct()])
    report = wrapped.report(x)
    dropped = [r for r in report.rejected if r.rule == NEVER_WORSE_RULE]
    assert len(dropped) == 1, str(report)
    assert dropped[0].details["xla_as_written_bytes"] < 2**20 < 64 * 2**20 < dropped[0].details["xla_rewritten_bytes"]
    assert report.status == "unchanged" and not report.fired
    assert report.fits and report.xla_bytes_after < 2**20, str(report)
    assert "the rewrite is dropped" in report.summary() and report.summary().startswith("fits 16.0 MiB")
    np.testing.assert_allclose(wrapped(x).numpy(), column_sums(x).numpy(), rtol=1e-12)


def test_a_rewrite_that_lowers_xlas_plan_is_kept_even_when_it_does_not_fit(x) -> None:
    # Split into chunks, the product still cannot fit 600 KiB, but XLA plans less for it
    # than for the program as written: the rewrite stays, and the record says why.
    def gram_sum(v):
        return tf.reduce_sum(tf.exp(-tf.matmul(v, v, transpose_b=True)), 0)

    report = tfmem.function(gram_sum, config={"memory_budget": "600KiB"}).report(x)
    assert report.fits is False and report.status == "rewritten" and report.splits, str(report)
    (kept,) = [r for r in report.records if r.rule == NEVER_WORSE_RULE]
    assert kept.status == "info" and kept.reason.startswith("kept: XLA plans"), str(kept)


def test_a_program_that_fits_is_not_compiled_again_as_written(x) -> None:
    report = tfmem.TfmemFunction(column_sums, config={"memory_budget": "1GiB"}, passes=[AddsABigProduct()]).report(x)
    assert report.fits and report.status == "rewritten"
    assert not [r for r in report.records if r.rule == NEVER_WORSE_RULE]


# --- Passes XLA decides on (`GraphPass.xla_checked`, `stages._with_xla_checked_passes`) ---


class XlaCheckedBigProduct(AddsABigProduct):
    """The same harm, from a pass that says only XLA's plan shows its payoff."""

    name = "xla_checked_big_product"
    xla_checked = True


def gram_sum(v):
    return tf.reduce_sum(tf.exp(-tf.matmul(v, v, transpose_b=True)), 0)


def test_a_pass_xla_decides_on_is_held_back_where_the_plan_fits_without_it(x) -> None:
    wrapped = tfmem.TfmemFunction(column_sums, config={"memory_budget": "16MiB"}, passes=[XlaCheckedBigProduct()])
    report = wrapped.report(x)
    assert report.fits and report.status == "unchanged", str(report)
    assert not [r for r in report.records if r.pass_name == XlaCheckedBigProduct.name or r.rule == XLA_CHECKED_RULE]
    np.testing.assert_allclose(wrapped(x).numpy(), column_sums(x).numpy(), rtol=1e-12)


def test_a_pass_xla_decides_on_is_tried_where_the_plan_does_not_fit_and_not_kept_when_xla_plans_more(x) -> None:
    config = tfmem.Config(memory_budget="600KiB")  # split into chunks, the product still does not fit
    passes = [*tfmem.passes.default_pipeline(config), XlaCheckedBigProduct()]
    report = tfmem.TfmemFunction(gram_sum, config=config, passes=passes).report(x)
    # One compile for the variant with the pass: XLA plans it far over the plan kept, so it is
    # not planned around its peaks too (`stages._OTHER_VARIANT_RANGE`).
    (tried,) = [r for r in report.records if r.rule == XLA_CHECKED_RULE]
    tried_passes, _, why = tried.reason.partition(" not kept: ")  # every held-back pass that fired
    assert tried.status == "rejected" and "xla_checked_big_product" in tried_passes.split(", ")
    assert why.startswith("XLA plans"), tried.reason
    assert tried.details["xla_without_bytes"] < 2**20 < 64 * 2**20 < tried.details["xla_with_bytes"]
    assert not [r for r in report.records if r.pass_name == XlaCheckedBigProduct.name]  # the plan without it ran
    assert report.fits is False and report.splits and report.xla_bytes_after < 2**20, str(report)


def test_the_verdict_reads_the_allocator_after_the_last_check(x, monkeypatch) -> None:
    # The checks after a plan is judged compile too (a variant not kept, the program as
    # written), and the regions they grow stay: the verdict is the allocator's as it is
    # when the call comes. Here the last check leaves a grown 16 MiB region (stubbed).
    from tfmem import stages
    from tfmem.budget import NOTHING_HELD, Held

    grown = {"now": False}
    monkeypatch.setattr(stages, "allocator_held", lambda device=None: Held(peak=16 * 2**20) if grown["now"]
                        else NOTHING_HELD)
    last_check = stages._never_worse_than_written

    def then_grow(*args, **kwargs):
        compiled = last_check(*args, **kwargs)
        grown["now"] = True
        return compiled

    monkeypatch.setattr(stages, "_never_worse_than_written", then_grow)
    wrapped = tfmem.TfmemFunction(lambda v: tf.exp(v) @ tf.transpose(v), config={"memory_budget": "16MiB"},
                                  passes=[])
    report = wrapped.report(x[:1200])  # XLA plans 11 MiB, a 11 MiB output: it fits beside nothing held
    assert report.compiled.checked_plan is not None and report.compiled.held == Held(peak=16 * 2**20)
    assert not report.fits, report.summary()
    assert "the call's outputs and the allocator's peak" in report.summary()


def _padded_kernel_loss(x, y):
    """A loss over a kernel matrix padded on both axes: its split leaves the slices'
    gradients whole, and XLA plans more for the loops than for the program as written
    (fuzz round 10's program)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        xx = tf.reduce_sum(x * x, 1)[:, None]
        yy = tf.reduce_sum(y * y, 1)[None, :]
        k = tf.exp(-tf.maximum(xx + yy - 2.0 * tf.matmul(x, y, transpose_b=True), 0.0))
        padded = tf.pad(k, [[1, 1], [1, 1]])
        out = tf.reduce_sum(padded[1:-1, 2:] + padded[2:, 1:-1], axis=1)
        loss = tf.reduce_sum(out)
    return out, tape.gradient(loss, x)


def test_without_a_budget_the_summary_says_xla_was_not_asked_and_explain_says_when_it_plans_more(
        rng: np.random.Generator) -> None:
    """Only `tensor_size_threshold`: nothing weighs the loops against XLA's plan (no budget
    to keep), so the summary does not let the estimate pass for XLA's word, and `explain`,
    which compiles both, says when XLA plans more for the rewritten program."""
    n = 600
    x, y = tf.constant(rng.normal(size=(n, 3))), tf.constant(rng.normal(size=(n, 3)))
    wrapped = tfmem.function(_padded_kernel_loss, config={"tensor_size_threshold": (n + 2) ** 2 * 8 // 5})
    assert "XLA's plan not asked without a memory_budget" in wrapped.report(x, y).summary()
    explained = wrapped.explain(x, y)
    assert explained.xla_bytes_after > explained.xla_bytes_before, explained.summary()
    assert (f"XLA plans {tfmem.config.format_size(explained.xla_bytes_after)}, more than the "
            f"{tfmem.config.format_size(explained.xla_bytes_before)} it plans for the program as written"
            in explained.summary()), explained.summary()
