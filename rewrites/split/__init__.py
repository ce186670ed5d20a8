"""Splitting: compute oversized tensors in `tf.while_loop` chunks.

    T = f(X) with bytes(T) > tensor_size_threshold, reduced by g
      →  acc = g(f(X[0:c])); for i in 1..n/c: acc = combine(acc, g(f(X[i·c:(i+1)·c])))

The planner (`planner`) chooses what to split: every tensor over
`tensor_size_threshold`, and then, while the program's static peak is over the memory
budget, the largest tensors at the peak; it sizes chunks to the budget (fewest, largest
chunks that fit). For each seed tensor it grows a region along each of its axes
(`regions`), keeps the one that leaves fewest oversized tensors behind, and emits the
loop (`loops`). Tensors it cannot split are left as they are, with the reason. A big
tensor a user's `tf.while_loop` reads unchanged in every trip (a kernel matrix in
conjugate gradients) is first recomputed inside that loop's body, which is then planned
like a program of its own (`sink`); when that loop is differentiated, TensorFlow's gradient
loop sums K's gradient whole, and that sum is collected as outer products and formed after
the loop, where it splits (`accumulators`). A whole matrix that is cheap to make (a
kernel matrix from its inputs) and is held across the peak only for readers after it
is made again for them instead (`recompute`). When XLA's own plan does not fit, rules read
its live set at its peak: what it holds there for later readers is made again for them
(`recompute`), a loss term it reduced there is reduced first (`earlier`), a big tensor it
holds only to fold later is folded first (`held`), a Cholesky factorization it computes
from its fused input's operands gets that input made whole first (`whole_input`), and
the big tensors it holds whole there are computed in chunks (`at_xla_peak`), where the
copies the other rules made, and the waits that order them, left no loop before.

Conditions: static shapes; ops on the path must have a split rule (`op_rules`); a region's
results must be sinks (reductions, contractions, top-k, arg-max/min) or tensors small
enough to hold whole.
"""
from __future__ import annotations

from collections.abc import Callable

from tfmem.budget import PlanVerdict
from tfmem.context import PassContext
from tfmem.graph import Graph
from tfmem.memory import MemoryEstimate
from tfmem.passes import GraphPass, PassResult, RewriteRecord

from rewrites.split.planner import Planner
from rewrites.split.at_xla_peak import split_at_xla_peak
from rewrites.split.op_rules import SUPPORTED_OPS
from rewrites.split.earlier import reduce_before_xla_peak
from rewrites.split.held import reduce_held_before_xla_peak
from rewrites.split.recompute import recompute_across_xla_peak
from rewrites.split.whole_input import whole_input_before_xla_peak

__all__ = ["RecomputeAcrossXlaPeak", "ReduceBeforeXlaPeak", "ReduceHeldBeforeXlaPeak", "SplitAtXlaPeak",
           "SplitOversizedRegions", "WholeInputBeforeXlaPeak", "SUPPORTED_OPS"]


class SplitOversizedRegions(GraphPass):
    """Computes oversized tensors in chunked loops, by threshold and to fit the budget.

    With `tensor_size_threshold`, every tensor over it is split (`Planner.split_all`).
    With a memory budget (from the config or the device), the planner then splits and
    re-chunks until the static estimate reaches the context's target
    (`PassContext.target_bytes`), and grows chunks as far as it allows
    (`Planner.fit_budget`); its verdict comes back in the `PassResult`. When XLA's plan
    of an earlier compile peaked inside one of its loops (`PassContext.xla_peaks`), that
    loop takes the smaller chunks XLA's live set there asks for (`Planner.shrink_at_xla_peaks`).
    """

    name = "split_oversized_regions"
    stage = "split"
    runs_once = True
    reads = frozenset({"memory_budget", "tensor_size_threshold", "tensor_split_size"})

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        config, target = context.config, context.target_bytes
        threshold = config.tensor_size_threshold
        if target is None:
            if threshold is None:
                return PassResult(graph, False, [])
            planner = Planner(self.name, graph, split_size=config.split_size)
            planner.sink_all(threshold, None, config.split_size)
            planner.split_all(threshold, config.split_size)
            return PassResult(graph, bool(planner.loops), planner.records)
        planner, verdict = _planned_within(self.name, graph, context)
        if context.xla_peaks and context.budget is not None:
            planner.shrink_at_xla_peaks(context.xla_peaks, context.budget.xla_bytes)
        return PassResult(planner.graph, bool(planner.loops), planner.records, verdict=verdict)


# Plans `_planned_within` keeps per trace: a plan for each target `compile_within_budget` tries.
_PLANS_KEPT = 4


def _planned_within(pass_name: str, graph: Graph, context: PassContext) -> tuple[Planner, PlanVerdict]:
    """`Planner.within` for the context's target, or a copy of the plan made earlier on this
    trace for the same graph and sizes (`PassContext.memo`): each round of
    `compile_within_budget` runs the pipeline again from the same graph, and the split
    planner, the longest pass, would plan the same loops again."""
    config, target = context.config, context.target_bytes
    assert target is not None
    key = ("split_within", pass_name, graph.fingerprint(), target, config.tensor_size_threshold, config.split_size)
    memo = context.memo
    found = memo.get(key) if memo is not None else None
    if found is not None:
        planner, verdict = found
        return planner.copy(), verdict
    planner, verdict = Planner.within(pass_name, graph, target, config.tensor_size_threshold, config.split_size)
    if memo is not None:
        # Replicas of a tf.distribute program may plan one trace from several threads: no
        # step below fails when another thread changes the memo between them.
        kept = [k for k in list(memo) if isinstance(k, tuple) and k[:1] == ("split_within",)]
        for old in kept[:max(0, len(kept) + 1 - _PLANS_KEPT)]:
            memo.pop(old, None)
        memo[key] = (planner.copy(), verdict)
    return planner, verdict


class _ActOnXlaPeaks(GraphPass):
    """A pass that changes the graph where XLA peaked in an earlier compile that did not fit.

    `compile_within_budget` runs the pipeline once more with XLA's live sets at its peaks
    in the context (`PassContext.xla_peaks`); `act` reads one of them and returns its
    records, and XLA's next plan decides whether the change stays. Without that context
    the pass does nothing.
    """

    stage = "split"
    runs_once = True
    reads = frozenset({"memory_budget"})
    act: Callable[[Graph, MemoryEstimate, str], list[RewriteRecord]]

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        records = [record for peak in self.peaks(context) for record in self.act_on(graph, peak, context)]
        return PassResult(graph, any(r.status == "fired" for r in records), records)

    def act_on(self, graph: Graph, peak: MemoryEstimate, context: PassContext) -> list[RewriteRecord]:
        """This rule on one of XLA's peaks (`act`, unless a rule needs more of the context)."""
        return type(self).act(graph, peak, self.name)

    def peaks(self, context: PassContext) -> list[MemoryEstimate]:
        """XLA's peaks this rule acts on: every one, but those kept with other rules alone."""
        return [peak for position, peak in enumerate(context.xla_peaks)
                if (rules := context.rules_at_peak(position)) is None or self.name in rules]


class RecomputeAcrossXlaPeak(_ActOnXlaPeaks):
    """Makes again what XLA held across its peak, when a plan XLA compiled did not fit:
    the tensors XLA kept alive there for readers after it, but did not read, are made
    again for those readers (`recompute.recompute_across_xla_peak`)."""

    name = "recompute_across_xla_peak"
    act = staticmethod(recompute_across_xla_peak)


class ReduceBeforeXlaPeak(_ActOnXlaPeaks):
    """Reduces first what XLA reduced at its peak, when a plan XLA compiled did not fit:
    when the op there makes a big temporary that is reduced to a small result no gradient
    waits for (a loss's variance term), the first tensor XLA made beside it after its
    inputs were ready waits for that result instead (`earlier.reduce_before_xla_peak`)."""

    name = "reduce_before_xla_peak"
    act = staticmethod(reduce_before_xla_peak)


class ReduceHeldBeforeXlaPeak(_ActOnXlaPeaks):
    """Folds first what XLA held across its peak only to fold later, when a plan XLA
    compiled did not fit: a big tensor that cheap ops reduce to small results or into a
    sum (a triangular parameter's gradient) is reduced in a loop of one trip that the op
    at the peak waits for (`held.reduce_held_before_xla_peak`)."""

    name = "reduce_held_before_xla_peak"
    act = staticmethod(reduce_held_before_xla_peak)


class WholeInputBeforeXlaPeak(_ActOnXlaPeaks):
    """Writes out first what XLA computed a factorization from, when a plan XLA compiled
    did not fit: when XLA peaks in a Cholesky factorization whose input cheap ops make,
    and holds that input's operands there to compute its blocks, the input is made whole
    in a loop of one trip before it (`whole_input.whole_input_before_xla_peak`)."""

    name = "whole_input_before_xla_peak"
    act = staticmethod(whole_input_before_xla_peak)


class SplitAtXlaPeak(_ActOnXlaPeaks):
    """Splits what XLA holds whole at its peak, when a plan XLA compiled did not fit: the
    big tensors in XLA's live set there are computed in loop chunks, with the waits of the
    copies made for them fitted to the loop (`at_xla_peak.split_at_xla_peak`). Runs after
    the other rules on XLA's peak: what it splits are often their copies."""

    name = "split_at_xla_peak"
    reads = frozenset({"memory_budget", "tensor_split_size"})

    def act_on(self, graph: Graph, peak: MemoryEstimate, context: PassContext) -> list[RewriteRecord]:
        if context.target_bytes is None:
            return []
        return split_at_xla_peak(graph, peak, self.name, target=context.target_bytes,
                                 split_size=context.config.split_size)
