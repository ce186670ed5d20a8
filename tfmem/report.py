"""`Report`: what tfmem did to one traced signature of a function, and what it cost.

A report is a frozen view over the stages (`Traced` → `Rewritten` → `Compiled`) of one
signature; `explain` adds XLA's planned bytes. Printing it leads with one line a
newcomer understands, then the details.

Example:
    >>> import tensorflow as tf, tfmem
    >>> def f(x):
    ...     return tf.reduce_sum(tf.exp(x @ tf.transpose(x)), -1)     # [n, n] inside
    >>> report = tfmem.explain(tfmem.function(f, config={"memory_budget": "8MiB"}),
    ...                        tf.ones([2000, 4], tf.float64))
    >>> print(report.summary())                                       # then print(report): the details
    fits 8.0 MiB (memory_budget): estimated peak ... MiB, was 61.1 MiB (XLA plans ... MiB); 1 loop in ... chunks
    >>> [(r.details["dim"], r.details["sinks"]) for r in report.splits]  # structured access
    [(1, 'sum')]
    >>> report.verdict.fits, report.config.memory_budget == 8 * 2**20
    (True, True)

    `report.write_pbtxt("rewritten.pbtxt")` and `report.write_tensorboard("logs/")` save
    the rewritten graph.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from tfmem.allocator import Replay
from tfmem.budget import ESTIMATE_ERROR, XLA_FRACTION, Budget, PlanVerdict
from tfmem.config import Config, format_size
from tfmem.memory import MemoryEstimate, XlaPlan
from tfmem.passes import RewriteRecord

if TYPE_CHECKING:  # the stages build reports: a runtime import would be circular
    from tfmem.stages import Compiled, Rewritten, Traced

Status = Literal["rewritten", "unchanged", "fallback"]


# The live tensors at the peak `str(report)` lists, each with what keeps it alive.
_PEAK_TENSORS_SHOWN = 6
# The rule of the record that says a rewrite was dropped: XLA plans less for the program
# as written (`tfmem.stages.compile_within_budget`).
NEVER_WORSE_RULE = "NeverWorseThanWritten"
# The rule of `stages._with_xla_checked_passes`: a plan that did not fit, compiled again with the passes XLA decides on.
XLA_CHECKED_RULE = "WithXlaCheckedPasses"
# The rule of `rewrites.split.recompute.recompute_across_xla_peak`: what XLA held across its peak, made again.
XLA_PEAK_RULE = "RecomputeAcrossXlaPeak"
# The rule of `rewrites.split.planner.Planner.shrink_at_xla_peaks`: a loop XLA peaks in, in smaller chunks.
XLA_SHRINK_RULE = "ShrinkLoopAtXlaPeak"
# The rule of `rewrites.split.earlier.reduce_before_xla_peak`: what XLA reduced at its peak, reduced first.
XLA_EARLIER_RULE = "ReduceBeforeXlaPeak"
# The rule of `rewrites.split.held.reduce_held_before_xla_peak`: what XLA held across its peak to fold, folded first.
XLA_HELD_RULE = "ReduceHeldBeforeXlaPeak"
# The rule of `rewrites.split.whole_input.whole_input_before_xla_peak`: a factorization's input made whole first.
XLA_WHOLE_RULE = "WholeInputBeforeXlaPeak"
# The rule of `rewrites.split.at_xla_peak.split_at_xla_peak`: what XLA holds whole at its peak, split.
XLA_SPLIT_RULE = "SplitAtXlaPeak"
# The rule of `rewrites.split.planner.Planner`: a region split into loop chunks (or why not).
SPLIT_RULE = "SplitOversizedRegions"
# The rules that act on XLA's peak (`PassContext.xla_peaks`): a plan they change is compiled and checked again.
XLA_PEAK_RULES = frozenset({XLA_PEAK_RULE, XLA_SHRINK_RULE, XLA_EARLIER_RULE, XLA_HELD_RULE, XLA_WHOLE_RULE,
                            XLA_SPLIT_RULE})


@dataclasses.dataclass(frozen=True)
class Report:
    """The outcome of rewriting one signature of a function: a view over its stages.

    Built in one place, `Report.of`; every number is read from the stages on access.

    Attributes:
        function_name: the user's function.
        signature: the traced input signature, as text.
        config: the config it was rewritten under, as the user gave it.
        traced, rewritten, compiled: its stages, as far as they got (None: not reached).
        fallback_reason: why the original function runs instead ("" when it does not).
        fallback_runs: how it runs then, in words ("unchanged, under XLA (...)"; "" for unchanged).
        replica: the `tf.distribute` replica the signature was traced in (inside
            `strategy.run`; its budget is then that replica's), else None.
        xla_bytes_before: XLA's planned bytes for the original under
            `tf.function(jit_compile=True)` (`explain` only).
        explained_xla_plan: XLA's plan for the rewritten program, where `explain` asked
            for it (no plan was checked against a budget).
        first_run_seconds: the first call of the compiled program (XLA compiles it
            then, and runs it), once it was made.
        without_xla: why the rewritten program runs in graph mode, without XLA, where the
            config asked for XLA (XLA could not compile it: the error); "" when it does not.

    Properties (computed from the stages): status, reason, budget, verdict, records,
    pass_seconds, pipeline_seconds, memory_before, memory_after, nodes_before,
    nodes_after, xla_plan_after, xla_peak_after, xla_bytes_after, xla_largest_bytes_after, xla_overshoot_after,
    xla_check_seconds, first_call_seconds, plan_from_cache, original_graph_def, rewritten_graph_def.
    """

    function_name: str
    signature: str
    config: Config
    traced: Traced | None = dataclasses.field(default=None, repr=False, compare=False)
    rewritten: Rewritten | None = dataclasses.field(default=None, repr=False, compare=False)
    compiled: Compiled | None = dataclasses.field(default=None, repr=False, compare=False)
    fallback_reason: str = ""
    fallback_runs: str = ""
    replica: Any = None
    xla_bytes_before: int | None = None
    explained_xla_plan: XlaPlan | None = None
    first_run_seconds: float | None = None
    without_xla: str = ""

    @classmethod
    def of(cls, traced: Traced, stage: Rewritten | Compiled, *, config: Config | None = None,
           replica: Any = None) -> Report:
        """The report of a signature whose stages reached `stage` (a Rewritten or Compiled).

        `config`: the config the user gave (default: the one the passes ran under).
        """
        compiled = stage if hasattr(stage, "rewritten") else None
        rewritten = compiled.rewritten if compiled is not None else stage
        return cls(traced.function_name, traced.signature, config or rewritten.config, traced=traced,
                   rewritten=rewritten, compiled=compiled, replica=replica,
                   without_xla=compiled.xla_refusal if compiled is not None else "")

    def fall_back(self, reason: str, runs: str = "") -> Report:
        """This report, for a signature that now runs the original function (`runs`: how)."""
        return dataclasses.replace(self, fallback_reason=reason, fallback_runs=runs)

    # --- what happened ----------------------------------------------------------------

    @property
    def status(self) -> Status:
        """"rewritten" (some pass changed the graph), "unchanged" (no pass did; the graph
        still runs under XLA), or "fallback" (the original function runs)."""
        if self.fallback_reason:
            return "fallback"
        return "rewritten" if self.rewritten is not None and self.rewritten.modified else "unchanged"

    @property
    def reason(self) -> str:
        """Why it fell back ("" when it did not)."""
        return self.fallback_reason

    @property
    def budget(self) -> Budget | None:
        """The memory budget worked to, and where it came from (None: no budget)."""
        return self.rewritten.budget if self.rewritten is not None else None

    @property
    def verdict(self) -> PlanVerdict | None:
        """The split planner's verdict on the static plan (None: no budget)."""
        return self.rewritten.verdict if self.rewritten is not None else None

    @property
    def records(self) -> tuple[RewriteRecord, ...]:
        """Every rule that fired or was rejected, every split, with reasons."""
        return self.rewritten.records if self.rewritten is not None else ()

    @property
    def panels_over_split_size(self) -> list[str]:
        """The in-place loops (`LeanCholeskyGradient`, `SolveInPlace`) whose panels are over
        the config's `tensor_split_size`: a panel is at least one row, so a split size under
        one row is not honoured there (the planner's own loops say so in `verdict`).
        """
        split_size = self.config.tensor_split_size
        if not split_size:
            return []
        return [f"{r.rule} at {r.nodes[0] if r.nodes else '?'}: panels of one row of {format_size(r.details['chunk_bytes'])}"
                for r in self.records if r.status == "fired" and r.details.get("block_rows") == 1
                and r.details.get("chunk_bytes", 0) > split_size]

    @property
    def pass_seconds(self) -> Mapping[str, float]:
        return self.rewritten.pass_seconds if self.rewritten is not None else {}

    @property
    def pipeline_seconds(self) -> float:
        """Capture + passes, the one-off cost per signature."""
        traced = self.traced.seconds if self.traced is not None else 0.0
        return traced + (self.rewritten.seconds if self.rewritten is not None else 0.0)

    @property
    def memory_before(self) -> MemoryEstimate | None:
        return self.traced.memory if self.traced is not None and self.rewritten is not None else None

    @property
    def memory_after(self) -> MemoryEstimate | None:
        return self.rewritten.memory if self.rewritten is not None else None

    @property
    def nodes_before(self) -> int:
        return len(self.traced.graph) if self.traced is not None and self.rewritten is not None else 0

    @property
    def nodes_after(self) -> int:
        return len(self.rewritten.graph) if self.rewritten is not None else 0

    @property
    def xla_plan_after(self) -> XlaPlan | None:
        """XLA's plan for the rewritten program: as checked against the budget, else as
        `explain` asked for it."""
        plan = self.compiled.checked_plan if self.compiled is not None else None
        return plan if plan is not None else self.explained_xla_plan

    @property
    def xla_peak_after(self) -> MemoryEstimate | None:
        """What XLA keeps alive at its peak in the rewritten program (`xla_live_at_peak`)."""
        plan = self.xla_plan_after
        return plan.peak if plan is not None else None

    @property
    def xla_bytes_after(self) -> int | None:
        """XLA's planned bytes for the rewritten program (`xla_plan_after`'s total)."""
        plan = self.xla_plan_after
        return plan.total_bytes if plan is not None else None

    @property
    def xla_largest_bytes_after(self) -> int | None:
        """The largest single allocation of the checked plan."""
        plan = self.compiled.checked_plan if self.compiled is not None else None
        return plan.largest_bytes if plan is not None else None

    @property
    def xla_overshoot_after(self) -> float | None:
        """How far the checked plan is over the budget (`Budget.xla_overshoot`, ≤ 1 fits)."""
        return self.compiled.xla_overshoot if self.compiled is not None else None

    @property
    def xla_check_seconds(self) -> float:
        """The time checking XLA's plan took (an XLA compilation, or several)."""
        return self.compiled.check_seconds if self.compiled is not None else 0.0

    @property
    def plan_from_cache(self) -> str:
        """The plan cache file the plan was read from ("" when made in this process)."""
        return self.rewritten.cached if self.rewritten is not None else ""

    @property
    def first_call_seconds(self) -> dict[str, float]:
        """Where the first call's time went: "trace" (tracing and taking the graph apart),
        "rewrite" (the passes, every plan), "xla check" (asking XLA for its plan: a
        compilation each time), "compile and run" (the first call of the compiled
        program). Stages not reached are left out.
        """
        parts = {"trace": self.traced.seconds if self.traced is not None else None,
                 "rewrite": self.rewritten.seconds if self.rewritten is not None else None,
                 "xla check": self.compiled.check_seconds if self.compiled is not None else None,
                 "compile and run": self.first_run_seconds}
        return {name: seconds for name, seconds in parts.items() if seconds is not None}

    @functools.cached_property
    def allocator_replay(self) -> Replay | None:
        """For a program TensorFlow's executor runs (without XLA) under a budget: its
        allocator replayed over the estimate's allocations under the budget (the verdict's
        second half: `Budget.fits_without_xla`); None otherwise."""
        if self.budget is None or self.memory_after is None or self.status == "fallback" or self.runs_with_xla:
            return None
        return self.budget.allocator_replay(self.memory_after)

    @functools.cached_property
    def original_graph_def(self) -> Any:
        return self.traced.captured.graph_def if self.traced is not None else None

    @functools.cached_property
    def rewritten_graph_def(self) -> Any:
        """The rewritten GraphDef (None when no rewrite was made, or after a fallback)."""
        if self.rewritten is None or self.status == "fallback":
            return None
        return self.rewritten.graph.to_graph_def()

    @property
    def fired(self) -> list[RewriteRecord]:
        return [r for r in self.records if r.status == "fired"]

    @property
    def rejected(self) -> list[RewriteRecord]:
        return [r for r in self.records if r.status == "rejected"]

    @property
    def splits(self) -> list[RewriteRecord]:
        """The loops the split stage emitted, one record each."""
        return [r for r in self.fired if r.kind == "split"]

    @property
    def fits(self) -> bool | None:
        """Whether the rewritten program's estimate fits the budget (None: no budget)."""
        if self.budget is None or self.status == "fallback" or self.memory_after is None:
            return None
        # The rules of tfmem.budget: XLA's plan where it was asked for, else the estimate
        # (a plan compiled without asking XLA passed `fits_unchecked`, stricter than this).
        plan = self.compiled.checked_plan if self.compiled is not None else None
        if plan is not None and self.config.jit_compile:
            return self.budget.fits_plan(plan, self.compiled.held)
        if self.xla_bytes_after is not None and self.config.jit_compile:  # `explain` asked XLA
            return self.budget.fits_xla_plan(self.xla_bytes_after, self.xla_bytes_after)
        if not self.runs_with_xla:
            return self.budget.fits_without_xla(self.memory_after, self.allocator_replay)
        return self.budget.fits_estimate(self.memory_after.peak_bytes)

    @property
    def runs_with_xla(self) -> bool:
        """Whether the rewritten program runs under XLA (the config asks for it, and XLA
        compiled it: `TfmemFunction._run_without_xla` runs it in graph mode otherwise)."""
        return self.compiled.with_xla if self.compiled is not None else self.config.jit_compile

    @property
    def where(self) -> str:
        """" under MirroredStrategy replica 0 of 2 on …" inside `strategy.run`, else ""."""
        return f" under {self.replica}" if self.replica is not None else ""

    def summary(self) -> str:
        """One line: does it fit, what the peak was and is, and what was split."""
        if self.status == "fallback":
            return f"fallback: {self.function_name} runs {self.fallback_runs or 'unchanged'}: {self.reason}"
        before = self.memory_before.peak_bytes if self.memory_before else None
        after = self.memory_after.peak_bytes if self.memory_after else None
        peaks = f"estimated peak {format_size(after)}, was {format_size(before)}"
        if self.xla_bytes_after is not None:
            worse = (self.xla_bytes_before is not None and self.xla_bytes_after > self.xla_bytes_before
                     and self.budget is None)  # under a budget, NeverWorseThanWritten decides and says so
            heaps = self.xla_plan_after.heap_bytes
            peaks += (f" (XLA plans {format_size(self.xla_bytes_after)}"
                      + (f" in {len(heaps)} heaps of up to {format_size(max(heaps))}" if len(heaps) > 1 else "")
                      + (f", more than the {format_size(self.xla_bytes_before)} it plans for the program as written"
                         if worse else "") + ")")
        elif self.without_xla:
            peaks += f" (runs without XLA, which cannot compile it: {self.without_xla})"
        elif self.budget is not None and self.compiled is not None and self.config.jit_compile:
            not_asked = any(r.rule == "XlaPlan" and r.reason.startswith("not asked") for r in self.records)
            peaks += (f" (XLA's plan not asked: {ESTIMATE_ERROR}× the estimate fits)" if not_asked else
                      " (no plan from XLA: it could not compile the rewritten program)")
        loops = [r for r in self.splits if not {"recomputed_in", "recomputed_for", "before"} & set(r.details)]
        if self.xla_bytes_after is None and self.budget is None and loops and self.config.jit_compile:
            # Without a budget nothing checks the loops against XLA's own plan, which can
            # hold more of a loop's chunks than the estimate counts (and exceed stock's).
            peaks += " (XLA's plan not asked without a memory_budget: explain() compiles it and stock's)"
        chunks = sum(int(r.details.get("chunks", 0)) for r in loops)
        split = (f"{len(loops)} loop{'s' * (len(loops) != 1)} in {chunks} chunks" if loops
                 else "nothing split")
        for sunk in (r for r in self.splits if "recomputed_in" in r.details):  # rewrites.split.sink
            split += (f"; {sunk.details['tensor']} {sunk.details.get('shape', '')} recomputed inside loop "
                      f"{sunk.details['recomputed_in']}, not held")
        for again in (r for r in self.splits if "recomputed_for" in r.details):  # rewrites.split.recompute
            split += f"; {again.details['tensor']} {again.details['shape']} made again for its late readers, not held"
        for earlier in (r for r in self.splits if "before" in r.details):
            if earlier.rule == XLA_HELD_RULE:  # rewrites.split.held
                split += f"; {earlier.details['tensor']} folded in a loop before {earlier.details['before']}, not held"
            elif earlier.rule == XLA_WHOLE_RULE:  # rewrites.split.whole_input
                split += (f"; {earlier.details['tensor']} made whole in a loop before {earlier.details['before']}, "
                          "its operands not held")
            else:  # rewrites.split.earlier
                split += f"; {earlier.details['results']} reduced before XLA makes {earlier.details['before']}"
        if self.budget is None:
            hint = "" if loops else self._why_nothing_split()
            if self.config.budget_off:
                return f"no bound (memory_budget: off): {peaks}; {split}{hint}"
            return f"no budget: {peaks}; {split}{hint}"
        outcome = "fits" if self.fits else "does NOT fit"
        line = f"{outcome} {format_size(self.budget.nbytes)} ({self.budget.origin}): {peaks}; {split}"
        dropped = next((r for r in self.rejected if r.rule == NEVER_WORSE_RULE), None)
        if dropped is not None:
            line += f" — {dropped.reason}"
        verdict = self.verdict
        checked = self.compiled.checked_plan if self.compiled is not None else None
        if not self.fits:
            # XLA's plan decides where it was checked; the static plan says what kept it from going lower.
            if checked is not None and self.config.jit_compile:
                line += f" — {self.budget.why_not(checked, self.compiled.held)}"
            if verdict is not None and not verdict.fits:
                line += f" — {verdict.reason}; {self.memory_after.in_words()}"
            elif self.allocator_replay is not None and not self.allocator_replay.fits:
                # The estimate fits; TensorFlow's allocator does not.
                line += f" — without XLA, {self.allocator_replay.why()}; {self.memory_after.in_words()}"
        elif self.xla_bytes_after is not None:
            spare = self.budget.nbytes - self.xla_bytes_after
            if self.xla_bytes_after > self.budget.xla_bytes:
                line += f" — with {format_size(spare)} to spare, under the {1 - XLA_FRACTION:.0%} margin planned for"
            if after is not None and after > self.budget.nbytes:
                line += " — XLA's plan decides: the static estimate counts more than XLA keeps alive"
        return line

    def _why_nothing_split(self) -> str:
        """Why a program without a budget has no loop, for the summary: the splitter's own
        reason where `tensor_size_threshold` asked for splits, else that nothing asked."""
        threshold = self.config.tensor_size_threshold
        refused = next((r for r in self.rejected if r.kind == "split" and r.rule == SPLIT_RULE), None)
        if threshold is not None and refused is not None:
            return f" (tensor_size_threshold {format_size(threshold)}: {refused.reason})"
        if threshold is None and not self.config.budget_off:
            return " (no memory_budget set and none from the device)"
        return ""

    def __str__(self) -> str:
        lines = [self.summary(),
                 f"tfmem report for {self.function_name}{self.signature}{self.where}: {self.status}"
                 + (f", {'per-replica ' if self.replica else ''}budget {self.budget}" if self.budget else "")]
        if self.memory_before is not None:
            rows = [("", "before", "after"),
                    ("nodes", str(self.nodes_before), str(self.nodes_after)),
                    ("static peak", format_size(self.memory_before.peak_bytes),
                     format_size(self.memory_after.peak_bytes if self.memory_after else None)),
                    ("XLA planned", format_size(self.xla_bytes_before),
                     format_size(self.xla_bytes_after))]
            widths = [max(len(r[i]) for r in rows) for i in range(3)]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
            lines.append(f"  peak before: {self.memory_before.in_words()}")
            if self.memory_after is not None:
                lines.append(f"  peak after:  {self.memory_after.in_words()}, at {self.memory_after.peak_node}")
                lines += [f"    {tensor.why(self.memory_after.peak_node)}"
                          for tensor in self.memory_after.live_at_peak[:_PEAK_TENSORS_SHOWN]]
            replayed = self.allocator_replay
            if replayed is not None:  # without XLA: what TensorFlow's allocator makes of the estimate
                regions = " + ".join(format_size(size) for size in replayed.regions) or "none"
                lines.append(f"  allocator:   {replayed.why() or 'every allocation finds room'} (replayed under the "
                             f"budget: peak {format_size(replayed.peak_bytes)} in whole chunks, regions {regions})")
            xla_peak = self.xla_peak_after
            if xla_peak is not None:  # what the estimate above tries to predict
                lines.append(f"  XLA's peak:  {xla_peak.in_words()}, at {xla_peak.peak_node} (packed into a "
                             f"{format_size(self.xla_plan_after.largest_bytes)} block)")
                lines += [f"    {tensor} ({tensor.op})" for tensor in xla_peak.live_at_peak[:_PEAK_TENSORS_SHOWN]]
        if self.first_run_seconds is not None:
            parts = self.first_call_seconds
            lines.append(f"  first call {sum(parts.values()):.2f} s: "
                         + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items()))
        if self.pass_seconds:
            timing = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in self.pass_seconds.items())
            lines.append(f"  passes: {timing}; pipeline total {self.pipeline_seconds * 1e3:.1f} ms"
                         + (f"; XLA's plan checked against the budget in {self.xla_check_seconds * 1e3:.1f} ms"
                            if self.xla_check_seconds else ""))
        else:
            lines.append("  passes: none enabled")
        record_lines = list(dict.fromkeys(f"  {record}" for record in self.records))  # once each
        lines += record_lines or ["  no rule fired or was rejected"]
        return "\n".join(lines)

    def write_pbtxt(self, path: str | os.PathLike[str], *, rewritten: bool = True) -> str:
        """Writes the rewritten (or original) GraphDef as text; returns the path."""
        import tensorflow as tf

        graph_def = self.rewritten_graph_def if rewritten else self.original_graph_def
        if graph_def is None:
            raise ValueError(f"no {'rewritten' if rewritten else 'original'} graph: status is {self.status}")
        directory, name = os.path.split(os.fspath(path))
        return tf.io.write_graph(graph_def, directory or ".", name, as_text=True)

    def write_tensorboard(self, logdir: str | os.PathLike[str]) -> None:
        """Writes the rewritten graph (or the original, after a fallback) for TensorBoard.

        View it with `tensorboard --logdir LOGDIR`, tab "Graphs".
        """
        import tensorflow as tf

        graph_def = self.rewritten_graph_def or self.original_graph_def
        if graph_def is None:
            raise ValueError(f"no graph to write: status is {self.status}")
        writer = tf.summary.create_file_writer(os.fspath(logdir))
        with writer.as_default():
            tf.summary.graph(graph_def)
        writer.flush()
