"""`Report`: what tfmem did to one traced signature of a function, and what it cost.

A report is a frozen view over the stages (`Traced` → `Rewritten` → `Compiled`) of one
signature; `explain` adds XLA's planned bytes. Printing it leads with one line a
newcomer understands, then the details.

Example:
    >>> report = tfmem.explain(f, x)
    >>> print(report)                      # "fits 1.0 GiB: estimated peak 780 MiB, was 14.8 GiB; ..."
    >>> [r.rule for r in report.fired]     # structured access
    >>> report.write_pbtxt("rewritten.pbtxt"); report.write_tensorboard("logs/")
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from tfmem.budget import Budget
from tfmem.config import Config, format_size
from tfmem.memory import MemoryEstimate
from tfmem.passes import RewriteRecord

Status = Literal["rewritten", "unchanged", "fallback"]


def over_budget(records: Iterable[RewriteRecord]) -> RewriteRecord | None:
    """The split stage's record of why the static plan misses the budget, if it does."""
    return next((r for r in records if r.status == "rejected" and r.kind == "budget"), None)


@dataclasses.dataclass(frozen=True)
class Report:
    """The outcome of rewriting one signature of a function.

    Attributes:
        function_name: the user's function.
        signature: the traced input signature, as text.
        config: the config it was rewritten under.
        status: "rewritten" (some pass changed the graph), "unchanged" (no pass did; the
            graph still runs under XLA), or "fallback" (the original function runs).
        reason: why it fell back.
        budget: the memory budget worked to, and where it came from (None: no budget).
        records: every rule that fired or was rejected, every split, with reasons.
        pass_seconds: time spent in each pass.
        pipeline_seconds: capture + passes + import, the one-off cost per signature.
        memory_before, memory_after: static estimates of the original and rewritten graph.
        xla_bytes_before, xla_bytes_after: XLA's planned bytes for the original under
            `tf.function(jit_compile=True)` (`explain` only) and for the rewritten graph
            (checked against the budget when there is one; else `explain` only).
        xla_largest_bytes_after, xla_overshoot_after: the largest single allocation of
            that plan, and how far the plan is over the budget (`Budget.xla_overshoot`,
            ≤ 1 fits), as measured when it was checked.
        xla_check_seconds: the time that check took (an XLA compilation, or several).
        replica: the `tf.distribute` replica the signature was traced in (inside
            `strategy.run`; its budget is then that replica's), else None.
    """

    function_name: str
    signature: str
    config: Config
    status: Status = "unchanged"
    reason: str = ""
    budget: Budget | None = None
    records: tuple[RewriteRecord, ...] = ()
    pass_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    pipeline_seconds: float = 0.0
    memory_before: MemoryEstimate | None = None
    memory_after: MemoryEstimate | None = None
    xla_bytes_before: int | None = None
    xla_bytes_after: int | None = None
    xla_largest_bytes_after: int | None = None
    xla_overshoot_after: float | None = None
    xla_check_seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    replica: Any = None
    original_graph_def: Any = dataclasses.field(default=None, repr=False)
    rewritten_graph_def: Any = dataclasses.field(default=None, repr=False)

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
        if self.xla_bytes_after is not None and self.config.jit_compile:  # XLA's own plan: the closer bound
            if self.xla_overshoot_after is not None:
                return self.xla_overshoot_after <= 1
            return self.xla_bytes_after <= self.budget.xla_bytes
        return self.memory_after.peak_bytes <= self.budget.plan_bytes

    @property
    def over_budget(self) -> RewriteRecord | None:
        """The split stage's account of why the budget is not met, if it is not."""
        return over_budget(self.records)

    @property
    def where(self) -> str:
        """" under MirroredStrategy replica 0 of 2 on …" inside `strategy.run`, else ""."""
        return f" under {self.replica}" if self.replica is not None else ""

    def summary(self) -> str:
        """One line: does it fit, what the peak was and is, and what was split."""
        if self.status == "fallback":
            return f"fallback: {self.function_name} runs unchanged: {self.reason}"
        before = self.memory_before.peak_bytes if self.memory_before else None
        after = self.memory_after.peak_bytes if self.memory_after else None
        peaks = f"estimated peak {format_size(after)}, was {format_size(before)}"
        if self.xla_bytes_after is not None:
            peaks += f" (XLA plans {format_size(self.xla_bytes_after)})"
        loops = self.splits
        chunks = sum(int(r.details.get("chunks", 0)) for r in loops)
        split = (f"{len(loops)} loop{'s' * (len(loops) != 1)} in {chunks} chunks" if loops
                 else "nothing split")
        if self.budget is None:
            hint = "" if loops else " (no memory_budget set and none from the device)"
            return f"no budget: {peaks}; {split}{hint}"
        verdict = "fits" if self.fits else "does NOT fit"
        line = f"{verdict} {format_size(self.budget.nbytes)}: {peaks}; {split}"
        blocking = self.over_budget
        if not self.fits and blocking is not None:
            line += f" — {blocking.reason}"
        elif not self.fits and self.xla_bytes_after is not None and self.xla_bytes_after <= self.budget.xla_bytes:
            line += (f" — XLA's largest block, {format_size(self.xla_largest_bytes_after)}, may not find room in "
                     "one piece beside the allocator's earlier regions")
        return line

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
            lines.append(f"  peak before: {self.memory_before}")
            if self.memory_after is not None:
                lines.append(f"  peak after:  {self.memory_after}")
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
