"""`PassContext`: what every pass is handed beside the graph.

The config as the user gave it, the budget resolved from it (or from the device), and
the target the static estimate of the rewritten program must reach. The budget's path
through the code is one straight line: config → `Budget` (`tfmem.budget`, which applies
the planning margin) → this context → the split planner → loop chunk sizes. A re-plan
tightens the target here; it never rewrites the user's config.

Example:
    >>> from tfmem.budget import Budget
    >>> context = PassContext.for_budget(Config(memory_budget="1GiB"), Budget(2**30, "config"))
    >>> context.target_bytes == Budget(2**30, "config").plan_bytes
    True
    >>> context.tightened(500 * 2**20).target_bytes, context.tightened(500 * 2**20).config == context.config
    (524288000, True)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, MutableMapping
from typing import Any

from tfmem.budget import Budget
from tfmem.config import Config
from tfmem.memory import MemoryEstimate


@dataclasses.dataclass(frozen=True)
class PassContext:
    """The inputs of a pass other than the graph.

    Attributes:
        config: the config as the user gave it (never rewritten by tfmem).
        budget: the resolved memory budget (None: no bound, nothing is planned to one).
        target_bytes: what the static estimate of the rewritten program must reach
            (`budget.plan_bytes` at first; `compile_within_budget` tightens it when XLA's
            plan needs more); None without a budget.
        xla_peaks: what XLA kept alive at its peak in each earlier compile of this plan
            that did not fit (`XlaPlan.peak`), oldest first: passes may make again what XLA
            holds across one (`rewrites.split.recompute`), or take smaller chunks in a loop
            XLA peaks in (`Planner.shrink_at_xla_peaks`). Empty on a first plan.
        peak_rules: the passes that may act on each of `xla_peaks`, by position (missing
            or None: all): `compile_within_budget` tries them one at a time on the newest
            peak when together they did not help, and keeps, for each older peak, only the
            passes its plan was kept with.
        memo: results a pass computed earlier on this trace, by a key the pass makes
            (None: none kept). `compile_within_budget` runs the pipeline again for each
            of its rounds, from the same graph; a pass whose work depends only on what
            the key names (the split planner: the graph's fingerprint and the sizes it
            plans to) does it once.

    `budget` and `target_bytes` derive from the config key `memory_budget` (and the
    device): a pass that reads them declares `memory_budget` in its `GraphPass.reads`.
    """

    config: Config
    budget: Budget | None = None
    target_bytes: int | None = None
    xla_peaks: tuple[MemoryEstimate, ...] = ()
    peak_rules: tuple[frozenset[str] | None, ...] = ()
    memo: MutableMapping[Hashable, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def rules_at_peak(self, position: int) -> frozenset[str] | None:
        """The passes that may act on `xla_peaks[position]` (None: all)."""
        return self.peak_rules[position] if position < len(self.peak_rules) else None

    @classmethod
    def for_budget(cls, config: Config, budget: Budget | None) -> PassContext:
        """The context of a first plan: the target is the budget's planning share."""
        return cls(config, budget, budget.plan_bytes if budget is not None else None)

    def tightened(self, target_bytes: int) -> PassContext:
        """The same context planning to a smaller target (a re-plan)."""
        return dataclasses.replace(self, target_bytes=target_bytes)

    def seeing(self, *xla_peaks: MemoryEstimate) -> PassContext:
        """The same context, told what XLA kept alive at its peaks so far (oldest first)."""
        return dataclasses.replace(self, xla_peaks=(*self.xla_peaks, *xla_peaks))
