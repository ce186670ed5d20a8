"""`Report`: what tfmem did to one traced signature of a function, and what it cost.

Example:
    >>> report = tfmem.explain(f, x)
    >>> print(report)                      # a readable table
    >>> [r.rule for r in report.fired]     # structured access
    >>> report.write_pbtxt("rewritten.pbtxt"); report.write_tensorboard("logs/")
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfmem.config import Config, format_size
from tfmem.memory import MemoryEstimate
from tfmem.passes import RewriteRecord

Status = Literal["rewritten", "unchanged", "fallback"]


@dataclasses.dataclass
class Report:
    """The outcome of rewriting one signature of a function.

    Attributes:
        function_name: the user's function.
        signature: the traced input signature, as text.
        status: "rewritten" (some pass changed the graph), "unchanged" (no pass did; the
            graph still runs under XLA), or "fallback" (the original function runs).
        reason: why it fell back.
        records: every rule that fired or was rejected, every split, with reasons.
        pass_seconds: time spent in each pass.
        pipeline_seconds: capture + passes + import, the one-off cost per signature.
        memory_before, memory_after: static estimates of the original and rewritten graph.
        xla_bytes_before, xla_bytes_after: XLA's planned bytes for the original under
            `tf.function(jit_compile=True)` and for the rewritten graph (`explain` only).
    """

    function_name: str
    signature: str
    config: Config
    status: Status = "unchanged"
    reason: str = ""
    records: list[RewriteRecord] = dataclasses.field(default_factory=list)
    pass_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    pipeline_seconds: float = 0.0
    memory_before: MemoryEstimate | None = None
    memory_after: MemoryEstimate | None = None
    xla_bytes_before: int | None = None
    xla_bytes_after: int | None = None
    nodes_before: int = 0
    nodes_after: int = 0
    original_graph_def: graph_pb2.GraphDef | None = dataclasses.field(default=None, repr=False)
    rewritten_graph_def: graph_pb2.GraphDef | None = dataclasses.field(default=None, repr=False)

    @property
    def fired(self) -> list[RewriteRecord]:
        return [r for r in self.records if r.status in ("fired", "split")]

    @property
    def rejected(self) -> list[RewriteRecord]:
        return [r for r in self.records if r.status in ("rejected", "unsplit")]

    def __str__(self) -> str:
        lines = [f"tfmem report for {self.function_name}{self.signature}: {self.status}"
                 + (f" ({self.reason})" if self.reason else "")]
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
            lines.append(f"  passes: {timing}; pipeline total {self.pipeline_seconds * 1e3:.1f} ms")
        else:
            lines.append("  passes: none enabled")
        lines += [f"  {record}" for record in self.records] or ["  no rule fired or was rejected"]
        return "\n".join(lines)

    def write_pbtxt(self, path: str | os.PathLike[str], *, rewritten: bool = True) -> str:
        """Writes the rewritten (or original) GraphDef as text; returns the path."""
        graph_def = self.rewritten_graph_def if rewritten else self.original_graph_def
        if graph_def is None:
            raise ValueError(f"no {'rewritten' if rewritten else 'original'} graph: status is {self.status}")
        directory, name = os.path.split(os.fspath(path))
        return tf.io.write_graph(graph_def, directory or ".", name, as_text=True)

    def write_tensorboard(self, logdir: str | os.PathLike[str]) -> None:
        """Writes the rewritten graph (or the original, after a fallback) for TensorBoard.

        View it with `tensorboard --logdir LOGDIR`, tab "Graphs".
        """
        graph_def = self.rewritten_graph_def or self.original_graph_def
        if graph_def is None:
            raise ValueError(f"no graph to write: status is {self.status}")
        writer = tf.summary.create_file_writer(os.fspath(logdir))
        with writer.as_default():
            tf.summary.graph(graph_def)
        writer.flush()
