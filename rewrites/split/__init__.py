"""Splitting: compute oversized tensors in `tf.while_loop` chunks.

    T = f(X) with bytes(T) > tensor_size_threshold, reduced by g
      →  acc = g(f(X[0:c])); for i in 1..n/c: acc = combine(acc, g(f(X[i·c:(i+1)·c])))

The planner (`planner`) chooses what to split: every tensor over
`tensor_size_threshold`, and then, while the program's static peak is over the memory
budget, the largest tensors at the peak; it sizes chunks to the budget (fewest, largest
chunks that fit). For each seed tensor it grows a region along each of its axes
(`regions`), keeps the one that leaves fewest oversized tensors behind, and emits the
loop (`loops`). Tensors it cannot split are left as they are, with the reason.

Conditions: static shapes; ops on the path must have a split rule (`rules`); a region's
results must be sinks (reductions, contractions, top-k, arg-max/min) or tensors small
enough to hold whole.
"""
from __future__ import annotations

from tfmem.budget import PLANNING_FRACTION
from tfmem.config import Config, format_size
from tfmem.graph import Graph
from tfmem.memory import estimate_memory
from tfmem.passes import GraphPass, PassResult, RewriteRecord

from rewrites.split.planner import Planner
from rewrites.split.rules import SUPPORTED_OPS

__all__ = ["SplitOversizedRegions", "SUPPORTED_OPS"]


class SplitOversizedRegions(GraphPass):
    """Computes oversized tensors in chunked loops, by threshold and to fit the budget.

    With `tensor_size_threshold`, every tensor over it is split (`Planner.split_all`).
    With `memory_budget` (from the config or the device), the planner then splits and
    re-chunks until the static estimate fits `PLANNING_FRACTION` of the budget, and
    grows chunks as far as it allows (`Planner.fit_budget`). When the threshold's loops
    leave the program over the budget, it plans again by the budget alone and keeps the
    plan with the lower peak (the threshold is an override; the budget is the promise).
    """

    name = "split_oversized_regions"
    stage = "split"
    once = True
    reads_budget = True

    def run(self, graph: Graph, config: Config) -> PassResult:
        threshold, budget = config.tensor_size_threshold, config.memory_budget
        if threshold is None and budget is None:
            return PassResult(graph, False, [])
        if budget is None:
            planner = Planner(self.name, graph)
            planner.split_all(threshold, config.split_size)
            return PassResult(graph, bool(planner.loops), planner.records)
        plan = int(budget * PLANNING_FRACTION)
        before = graph.copy() if threshold is not None else None
        planner, peak = self._fit(graph, threshold, plan, config.split_size)
        if before is not None and peak > plan:
            # The threshold is an expert's override, the budget a promise: when the
            # threshold's loops leave the program over the budget, plan by the budget alone
            # and keep whichever plan has the lower peak.
            alone, alone_peak = self._fit(before, None, plan, config.split_size)
            if alone_peak < peak:
                graph = before
                planner = alone
                planner.records.insert(0, RewriteRecord(
                    self.name, "MemoryBudget", "info", kind="budget",
                    details={"threshold_peak_bytes": peak, "budget_peak_bytes": alone_peak},
                    reason=f"splitting every tensor over tensor_size_threshold {format_size(threshold)} left "
                           f"the static peak at {format_size(peak)}, over the plan {format_size(plan)}; planned "
                           f"by the memory budget alone ({format_size(alone_peak)})"))
        return PassResult(graph, bool(planner.loops), planner.records)

    def _fit(self, graph: Graph, threshold: int | None, plan: int, split_size: int | None) -> tuple[Planner, int]:
        """Splits `graph` in place by threshold (if any), then to fit `plan`; the planner and its peak."""
        planner = Planner(self.name, graph)
        if threshold is not None:
            planner.split_all(threshold, split_size)
        elif estimate_memory(graph).peak_bytes > plan:
            # Every tensor over an eighth of the budget, in bodies of a sixteenth each
            # at first: what a program over budget surely cannot hold whole. What is
            # left at the peak after that, the budget loop splits one by one.
            planner.split_all(plan // 8, min(split_size or plan, plan // 16))
        return planner, planner.fit_budget(plan, split_size).peak_bytes
