"""The split planner: which tensors become loops, and in chunks of what length.

Two ways to decide, which may be combined:

- by threshold (the expert override): every tensor over `tensor_size_threshold`, largest
  first, becomes a loop whose largest body tensor is at most `tensor_split_size`;
- by budget: while the whole program's static peak is over the budget,
  1. if the peak is inside a loop this pass emitted, shrink that loop's chunks (its body
     is, to first order, proportional to the chunk length; where it is not, the chunk
     is doubled back as far as the peak it reached allows);
  2. otherwise take the largest computed tensor live at the peak: recompute it inside
     the user's loops that read it (`sink`), or for its readers after the peak when it
     is cheap to make (`recompute`), or else split it;
  then, once it fits, grow every loop's chunks as far as the budget allows (by the
  proportional estimate, else by doubling): fewer, larger chunks run faster (every
  trip costs time).

A loop is kept only if the program's peak does not rise (by threshold) or falls (by
budget): a split whose loop keeps as much alive as it saves is undone, and says so.
Every decision is a record: a fired split (tensor, axis, chunks, chunk bytes), a
rejected one (with the reason), and the budget's verdict.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tfmem.budget import PlanVerdict
from tfmem.config import format_size
from tfmem.errors import first_line
from tfmem.graph import Graph, GraphError, TensorRef, node_inputs
from tfmem.memory import WHILE_LOOP_OPS, MemoryEstimate, estimate_memory, graph_node_for
from tfmem.passes import RewriteRecord
from tfmem.report import SPLIT_RULE, XLA_SHRINK_RULE

from rewrites.split.accumulators import collect_outer_products, outer_product_accumulators
from rewrites.split.diagonals import lower_band_parts, lower_diagonals, lower_matrix_diags, overwritten_diagonals
from rewrites.split.loops import SPLIT_SCOPE, emit_loop, even_chunk, written_out
from rewrites.split.recompute import RECOMPUTE_RULE, cheap_cone, late_readers, recompute_for
from rewrites.split.regions import GRAPH_INPUT_OPS, SliceRegion, evaluated_once, grow_region, mixed_in_loop
from rewrites.split.sink import invariant_slots, loop_invariant, read_through_loops, sink_invariant

RULE = SPLIT_RULE
SINK_RULE = "RecomputeLoopInvariant"
COLLECT_RULE = "CollectOuterProducts"
_MAX_LOOPS = 64
_MAX_BUDGET_STEPS = 48
# The shares of the target the budget's first splits are sized by (its chunks are then
# shrunk or grown to fit). A program over its target first splits every tensor over an
# eighth of it (what it surely cannot hold whole), in bodies of a sixteenth; each later
# split at the peak starts with a largest body tensor of an eighth: a body holds a
# handful of chunk-sized tensors at once.
_SURELY_SPLIT_SHARE = 8
_FIRST_BODY_SHARE = 16
FIRST_CHUNK_SHARE = 8
# Chunk lengths are planned to this share of the room a loop's body has (the body is only
# roughly proportional to its chunk length), and grown only when that gains a quarter.
_CHUNK_MARGIN = 0.9
# How far below the chunk XLA's peak asks for a loop looks for one that divides its length
# (`even_chunk`): smaller chunks only cost trips, a remainder can cost a whole matrix.
_SHRINK_EVEN_DOWN_TO = 0.5
# A loop body an invariant is sunk into may take at least this share of the plan, however
# much is live around the loop then: what is (a gradient program's [n, n] tensors kept for
# the backward) is mostly split after, and a smaller body would not fit a row of K.
_SUNK_BODY_FLOOR = 4
_WORTH_GROWING = 1.25
# A split that takes its tensor off the peak may leave the peak where it was, or a little
# higher (a loop keeps its inputs alive): the next split, now possible, lowers it. Each
# seed is tried once, so the search still ends.
_TOLERATED_RISE = 1.02
# A tensor under this share of what is over the plan (or of a chunk) is not worth a loop.
_WORTH_SPLITTING = 16
# A shrink must win back at least this share of the overshoot (each one doubles the trips).
_SHRINK_GAIN = 0.1
# How many times a loop's chunk is doubled where the proportional estimate cannot say how
# far it may grow (`_double_chunks`): ×1024 at most, one static estimate each.
_DOUBLINGS = 10
# How the reasons a loop invariant stays whole begin (`_sink_into_loops`).
_NOT_RECOMPUTED = "not recomputed inside"


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop this pass emitted, with what it needs to be undone or re-chunked.

    Attributes:
        scope: the name scope of its nodes.
        region: what it computes.
        chunk: its chunk length.
        per_unit: bytes of its largest body tensor per unit of chunk length.
        saved: the region's nodes as they were before the loop replaced them.
        replaced: original tensor → the loop's tensor that replaced it.
        record: the index of its record in the planner's records.
    """

    scope: str
    region: SliceRegion
    chunk: int
    per_unit: int
    saved: tuple[node_def_pb2.NodeDef, ...]
    replaced: tuple[tuple[TensorRef, TensorRef], ...]
    record: int

    @property
    def chunks(self) -> int:
        return -(-self.region.size // self.chunk)


class Planner:
    """One run of the split pass over one graph: its loops, records and given-up seeds."""

    @classmethod
    def within(cls, pass_name: str, graph: Graph, target: int, threshold: int | None,
               split_size: int | None, *, loop_body: bool = False) -> tuple[Planner, PlanVerdict]:
        """Splits `graph` in place by `threshold` (if any), then until its static peak is at
        most `target` bytes; the planner (whose graph is the result) and its verdict.

        The threshold is an expert's override, the target a promise: when the threshold's
        loops leave the program over the target, it plans again by the target alone, on
        the graph as it was, and keeps whichever plan has the lower peak.
        """
        before = graph.copy() if threshold is not None else None
        planner = cls(pass_name, graph, loop_body=loop_body, split_size=split_size)
        verdict = planner._fit(target, threshold, split_size)
        if before is None or verdict.fits:
            return planner, planner._with_split_size_check(verdict)
        alone = cls(pass_name, before, loop_body=loop_body, split_size=split_size)
        alone_verdict = alone._fit(target, None, split_size)
        if alone_verdict.peak_bytes >= verdict.peak_bytes:
            return planner, verdict
        dropped = (f"splitting every tensor over tensor_size_threshold {format_size(threshold)} left the static "
                   f"peak at {format_size(verdict.peak_bytes)}, over the plan {format_size(target)}; planned by "
                   f"the memory budget alone ({format_size(alone_verdict.peak_bytes)})")
        alone.records.insert(0, RewriteRecord(
            pass_name, "MemoryBudget", "info", kind="plan", reason=dropped,
            details={"threshold_peak_bytes": verdict.peak_bytes, "budget_peak_bytes": alone_verdict.peak_bytes}))
        return alone, alone._with_split_size_check(dataclasses.replace(alone_verdict, threshold_dropped=dropped))

    def _with_split_size_check(self, verdict: PlanVerdict) -> PlanVerdict:
        """`verdict`, saying which loops hold more than the user's `tensor_split_size`:
        one slice of their tensor is over it, and they take one slice at a time."""
        over = [loop for loop in self.loops if self.split_size and loop.per_unit * loop.chunk > self.split_size]
        if not over:
            return verdict
        named = ", ".join(dict.fromkeys(f"{loop.region.seed.name} (one slice {format_size(loop.per_unit)})"
                                        for loop in over))
        return dataclasses.replace(verdict, split_size_dropped=(
            f"tensor_split_size {format_size(self.split_size)} is under one slice of {named}: split one slice at "
            "a time, over it, so that the budget holds"))

    def _fit(self, target: int, threshold: int | None, split_size: int | None) -> PlanVerdict:
        """Splits by threshold (if any; else, when over `target`, every tensor surely too
        large to hold), then to fit `target`."""
        if threshold is not None:
            self.sink_all(min(threshold, target // _SURELY_SPLIT_SHARE), target, split_size)
            self.split_all(threshold, split_size)
        elif estimate_memory(self.graph).peak_bytes > target:
            self.sink_all(target // _SURELY_SPLIT_SHARE, target, split_size)
            # A slice over the user's split size is split one slice at a time rather than
            # not at all: the budget holds, and the verdict says the split size did not.
            self.split_all(target // _SURELY_SPLIT_SHARE, min(split_size or target, target // _FIRST_BODY_SHARE),
                           slice_limit=target // _SURELY_SPLIT_SHARE)
        return self.fit_budget(target, split_size)

    def __init__(self, pass_name: str, graph: Graph, *, loop_body: bool = False,
                 split_size: int | None = None) -> None:
        self.pass_name = pass_name
        self.graph = graph
        # The user's `tensor_split_size`: no loop body's tensor grows past it, whatever
        # room the budget leaves (chunks are sized by it, and grown only up to it).
        self.split_size = split_size
        # A program's outputs are held whole at its end, so a loop may assemble one from its
        # chunks; a loop body's outputs are its next trip's state, assembled on every trip.
        self.assemble_returned = not loop_body
        self.records: list[RewriteRecord] = []
        self.loops: list[Loop] = []
        self.given_up: set[TensorRef] = set()
        self.not_recomputed: set[tuple[TensorRef, str | None]] = set()  # (tensor, peak node) tried
        self.seen_regions: set[tuple[str, ...]] = set()

    def copy(self) -> Planner:
        """An independent copy: its own graph, records, loops and seeds tried."""
        other = copy.copy(self)
        other.graph = self.graph.copy()
        other.records, other.loops = list(self.records), list(self.loops)
        other.given_up, other.not_recomputed = set(self.given_up), set(self.not_recomputed)
        other.seen_regions = set(self.seen_regions)
        return other

    # --- by threshold -----------------------------------------------------------------

    def split_all(self, threshold: int, split_size: int, *, slice_limit: int = 0,
                  keep_written: frozenset[str] = frozenset()) -> None:
        """Splits around every tensor over `threshold`, largest first (`slice_limit`: see
        `best_region`). `keep_written`: diagonals written over that stay `set_diag`s."""
        graph = self.graph
        before = estimate_memory(graph).peak_bytes
        checkpoint = self._checkpoint()
        search = (set(self.seen_regions), set(self.given_up))  # what the loop below adds to
        # A diagonal written over (set_diag(S, -inf) before a row's logsumexp), a matrix
        # made from one (S - diag(v)) or a band of a matrix (a causal mask) ends every region
        # as an op; as a select by an iota mask it splits by rows. Undone below when no loop
        # comes of it.
        written = overwritten_diagonals(graph, threshold) - keep_written
        lowered = {**lower_diagonals(graph, threshold, written),
                   **lower_matrix_diags(graph, threshold), **lower_band_parts(graph, threshold)}
        while len(self.loops) < _MAX_LOOPS:
            seed = _largest_computed(graph, threshold, self.given_up, skip_returned=self.assemble_returned)
            if seed is None:
                break
            if self._loop_running(seed.node) is not None:
                self.given_up.add(seed)  # a loop's own assembly of what it writes out
                continue
            region, reason = best_region(graph, seed, threshold, split_size,
                                         assemble_returned=self.assemble_returned, slice_limit=slice_limit)
            if region is None or tuple(region.nodes) in self.seen_regions:
                self.given_up.add(seed)
                if region is None:
                    self._reject(seed, reason)
                continue  # a region that came back: its readers need it whole
            self.seen_regions.add(tuple(region.nodes))
            self.emit(region, chunk_length(graph, region, split_size), max_write_out=threshold)
        # One loop may raise the peak a little on its own and enable the next ones: judge
        # the splits together, and undo them together if they made the program worse.
        after = estimate_memory(graph).peak_bytes if self.loops else before
        # A diagonal written over whose select no loop took is made whole all the same, by a
        # select and its [n, n] mask where set_diag wrote in place: XLA plans more (GPflow
        # SGPR's jitter at M=3,600: 510.9 MiB against 491.7). Split again with those put
        # back, and keep that unless the estimate says it holds more.
        whole = frozenset(name for name in written
                          if (select := lowered.get(TensorRef(name))) is not None and select.node in graph)
        if whole and len(self.loops) > len(checkpoint[1]):
            lowered_all, lowered_search = self._checkpoint(), (self.seen_regions, self.given_up)
            self._rollback(checkpoint)
            self.seen_regions, self.given_up = search
            self.split_all(threshold, split_size, slice_limit=slice_limit, keep_written=keep_written | whole)
            if estimate_memory(graph).peak_bytes > after:
                self._rollback(lowered_all)
                self.seen_regions, self.given_up = lowered_search
                return
            self.records.append(RewriteRecord(
                self.pass_name, RULE, "info", tuple(sorted(whole)), "the diagonal stays written in place "
                "(set_diag): no loop took its select, which would be made whole beside its [n, n] mask",
                kind="split"))
            return
        if lowered and len(self.loops) == len(checkpoint[1]):
            reasons = self.records[len(checkpoint[2]):]
            self._rollback(checkpoint)  # nothing split: the diagonals as they were, the reasons kept
            self.records.extend(reasons)
        elif after > before:
            tensors = [loop.region.seed.name for loop in self.loops]
            self._rollback(checkpoint)
            self.records.append(RewriteRecord(
                self.pass_name, RULE, "rejected", (), f"splitting {', '.join(tensors)} would raise the "
                f"program's peak from {format_size(before)} to {format_size(after)} (by {format_size(after - before)}, "
                "what is not split decides it): the loops keep more alive than they save, so nothing is split",
                kind="split"))

    def sink_all(self, limit: int, plan: int | None, split_size: int | None) -> None:
        """Recomputes every loop invariant over `limit` bytes inside its loop, in chunks
        (`_sink_into_loops`), where that does not raise the program's peak. A loop that
        reads several is rebuilt once for each."""
        graph = self.graph
        tried: set[TensorRef] = set()
        while True:
            candidates = [ref for loop in graph.find(WHILE_LOOP_OPS) if self._loop_running(loop.name) is None
                          for ref in graph.inputs(loop.name)
                          if ref not in tried and (graph.nbytes(ref) or 0) > limit and invariant_slots(graph, ref)]
            if not candidates:
                return
            original = candidates[0]
            tried.add(original)
            before, checkpoint = estimate_memory(graph), self._checkpoint()
            # K + σ²I's diagonal update, as selects: its rows can then be recomputed in chunks.
            ref = lower_diagonals(graph, limit, graph.ancestors(original.node)).get(original, original)
            if self._sink_into_loops(ref, before, plan, split_size, threshold=limit) is None:
                rejections = self.records[len(checkpoint[2]):]
                self._rollback(checkpoint)  # the diagonals too: the reasons name the tensor as it is again
                self.records.extend(dataclasses.replace(r, nodes=(original.node,), details={
                    **r.details, "tensor": original.name}) if r.details.get("tensor") == ref.name else r
                    for r in rejections)

    # --- by budget --------------------------------------------------------------------

    def fit_budget(self, plan: int, split_size: int | None) -> PlanVerdict:
        """Splits and re-chunks until the static peak is at most `plan` bytes, or nothing
        more helps; then grows chunks within it. Records and returns the verdict."""
        estimate = estimate_memory(self.graph)
        shrinkable = {loop.scope for loop in self.loops}
        for _ in range(_MAX_BUDGET_STEPS):
            if estimate.peak_bytes <= plan:
                break
            loop = self._loop_running(estimate.peak_node)
            if loop is not None and loop.scope in shrinkable:
                shrunk = self._shrink(loop, estimate, plan)
                if shrunk is None:
                    shrinkable.discard(loop.scope)
                else:
                    estimate = shrunk
                continue
            split = self._split_at_peak(estimate, plan, split_size)
            if split is None:
                break
            estimate = split
            shrinkable = {loop.scope for loop in self.loops}
        if estimate.peak_bytes <= plan:
            estimate = self._grow_chunks(estimate, plan)
            verdict = PlanVerdict(True, estimate.peak_bytes, plan, estimate.peak_node or "")
            self.records.append(RewriteRecord(self.pass_name, "MemoryBudget", "info", kind="plan", details={
                "peak_bytes": estimate.peak_bytes, "plan_bytes": plan}))
        else:
            verdict = PlanVerdict(False, estimate.peak_bytes, plan, estimate.peak_node or "",
                                  self._blocking_reason(estimate, plan))
            self.records.append(RewriteRecord(
                self.pass_name, "MemoryBudget", "rejected", (verdict.node,), verdict.reason, kind="plan",
                details={"peak_bytes": estimate.peak_bytes, "plan_bytes": plan}))
        return verdict

    def _split_at_peak(self, estimate: MemoryEstimate, plan: int,
                       split_size: int | None) -> MemoryEstimate | None:
        """Splits the largest computed tensor at the peak whose loop lowers the peak."""
        graph = self.graph
        chunk_budget = max(1, min(split_size or plan, plan // FIRST_CHUNK_SHARE))
        over = estimate.peak_bytes - plan
        for live in estimate.live_at_peak:
            seed = TensorRef.parse(live.name)
            # What the program returns is held whole whatever computes it: its producers
            # may be split (and write it out), never the tensor itself, nor a loop's own
            # assembly of what it writes out.
            if graph.node(seed.node).op in GRAPH_INPUT_OPS or self._loop_running(seed.node) is not None \
                    or self.assemble_returned and graph.is_returned(seed):
                continue
            if live.nbytes * _WORTH_SPLITTING < min(over, chunk_budget):
                break  # largest first: what is left is too small to matter (or to split)
            # Tried at every new peak, even for a tensor given up for splitting: what
            # keeps it alive depends on where the peak is.
            recomputed = self._recompute_later(seed, estimate)
            if recomputed is not None:
                return recomputed  # its early readers still read it: it may be split next
            if seed in self.given_up:
                continue
            sunk = self._sink_into_loops(seed, estimate, plan, split_size)
            if sunk is not None:
                return sunk  # its readers outside the loops (if any) are split next
            self.given_up.add(seed)
            # With no split size from the user, a chunk of one slice (a batch's [n, n] matrix,
            # split only on its batch axis) may take more than the first chunk's share of the
            # plan: the loop is kept only if the peak it leaves is lower.
            region, reason = best_region(graph, seed, live.nbytes - 1, chunk_budget,
                                         assemble_returned=self.assemble_returned,
                                         slice_limit=plan // _SURELY_SPLIT_SHARE)
            if region is None:
                self._reject(seed, reason)
                continue
            chunk = at_least_two_chunks(chunk_length(graph, region, chunk_budget), region.size)
            checkpoint = self._checkpoint()
            loop = self.emit(region, chunk, max_write_out=live.nbytes - 1)
            after = estimate_memory(graph)
            for _ in range(3):  # a loop that is now the peak may just need smaller chunks
                running = self._loop_running(after.peak_node)
                if after.peak_bytes < estimate.peak_bytes or running is None or running.scope != loop.scope:
                    break
                shrunk = self._shrink(loop, after, plan)
                if shrunk is None:
                    break
                after, loop = shrunk, self._loop(loop.scope)
            if after.peak_bytes < estimate.peak_bytes or (
                    after.peak_bytes <= estimate.peak_bytes * _TOLERATED_RISE and seed.name not in
                    {t.name for t in after.live_at_peak}):
                return after
            self._rollback(checkpoint)
            self.given_up.add(seed)
            self._reject(seed, f"splitting it does not lower the program's peak ({format_size(estimate.peak_bytes)}"
                               f" → {format_size(after.peak_bytes)}): what its loop keeps alive costs as much")
        return None

    def _sink_into_loops(self, seed: TensorRef, estimate: MemoryEstimate, plan: int | None,
                         split_size: int | None, threshold: int | None = None) -> MemoryEstimate | None:
        """Recomputes `seed`, a loop invariant, inside each loop that reads it, in chunks
        (`rewrites.split.sink`); the new estimate, or None when no loop reads it so or
        the program's peak does not fall (then nothing changes). Each body is planned to
        what the loop's surroundings leave of `plan`, or with no plan split by `threshold`."""
        graph = self.graph
        # The user's loops only: this planner's own loops read their whole inputs by design.
        if not any(self._loop_running(loop) is None for loop, _ in invariant_slots(graph, seed)):
            return None
        nbytes, spec = graph.nbytes(seed) or 0, graph.spec(seed)
        shape = f"{spec.dtype.name}{spec.shape.as_list()}"  # read now: the seed goes when sunk
        checkpoint = self._checkpoint()
        read_through_loops(graph, seed)  # a gradient loop reads it from the forward loop's output
        # A gradient loop that reads it also sums its gradient whole: collect that sum's
        # outer products instead (its loop is rebuilt, so the slots are found after).
        leaf_limit = max(1, nbytes // _WORTH_SPLITTING)  # what is small enough to hand a loop
        self._collect_outer_products(seed, leaf_limit)
        slots = [(loop, slot) for loop, slot in invariant_slots(graph, seed) if self._loop_running(loop) is None]
        fired = False
        body_verdicts: dict[str, PlanVerdict] = {}
        for loop, slot in slots:
            found = loop_invariant(graph, seed, loop, slot, leaf_limit=leaf_limit)
            if isinstance(found, str):
                self._reject(seed, f"{_NOT_RECOMPUTED} loop {loop}: {found}")
                continue
            # The body may take what the loop's surroundings leave of the plan, once K is gone.
            outside = max(0, estimate.at(loop)[0] - nbytes)

            def plan_body(body: Graph, loop: str = loop, outside: int = outside) -> list[RewriteRecord]:
                if plan is None:  # by threshold alone, as the program around it
                    inner = Planner(self.pass_name, body, loop_body=True, split_size=split_size)
                    inner.split_all(threshold or nbytes, split_size or threshold or nbytes)
                    verdict = PlanVerdict(True, estimate_memory(body).peak_bytes, 0)
                else:
                    arguments = sum(body.nbytes(TensorRef(p.name)) or 0 for p in body.find("Placeholder"))
                    body_plan = max(plan // _SUNK_BODY_FLOOR, int((plan - outside) * _CHUNK_MARGIN) + arguments)
                    inner, verdict = Planner.within(self.pass_name, body, body_plan, None, split_size,
                                                    loop_body=True)
                body.assign(inner.graph)
                body_verdicts[loop] = verdict
                return [dataclasses.replace(r, details={**r.details, "in_loop": loop})
                        for r in inner.records if r.kind == "split"]

            try:
                body_records = sink_invariant(graph, found, plan_body)
            except (GraphError, ValueError, TypeError, KeyError, tf.errors.OpError) as err:
                self._rollback(checkpoint)
                self._reject(seed, f"{_NOT_RECOMPUTED} loop {loop}: rebuilding it failed ({first_line(err)})")
                return None
            self.records.append(RewriteRecord(
                self.pass_name, SINK_RULE, "fired", (seed.node,), kind="split",
                reason=f"recomputed in each iteration of loop {loop} from "
                       f"{', '.join(leaf.name for leaf in found.leaves) or 'constants'}, not held whole",
                details={"tensor": seed.name, "bytes": nbytes, "recomputed_in": loop,
                         "shape": shape,
                         "nodes": len(found.cone),
                         "body_peak_bytes": body_verdicts[loop].peak_bytes,
                         "body_loops": sum(1 for r in body_records if r.rule == RULE and r.status == "fired")}))
            self.records.extend(body_records)
            fired = True
        if not fired:
            reasons = [r for r in self.records[len(checkpoint[2]):] if r.status == "rejected"]
            self._rollback(checkpoint)  # the collected gradient sums too: they only serve a sunk loop
            self.records.extend(reasons)
            return None
        after = estimate_memory(graph)
        # Kept when the peak falls; or, while readers outside the loops still hold the
        # tensor (they are split next), when it stays level and every body met its plan.
        if after.peak_bytes < estimate.peak_bytes or (
                graph.consumers(seed) and after.peak_bytes <= estimate.peak_bytes * _TOLERATED_RISE
                and all(v.fits for v in body_verdicts.values())):
            return after
        self._rollback(checkpoint)
        loops = ", ".join(loop for loop, _ in slots)
        self._reject(seed, f"{_NOT_RECOMPUTED} the loops that read it ({loops}): that does not lower the "
                           f"program's peak ({format_size(estimate.peak_bytes)} → {format_size(after.peak_bytes)}); "
                           "a loop that needs it whole, or a gradient loop that accumulates a gradient of its size, "
                           "holds as much")
        return None

    def _recompute_later(self, seed: TensorRef, estimate: MemoryEstimate) -> MemoryEstimate | None:
        """Gives the readers that keep `seed` alive across the peak their own copy, made
        just before them, when it is cheap to make (`rewrites.split.recompute`); the new
        estimate, or None when it is not or the program's peak does not fall."""
        graph = self.graph
        if (seed, estimate.peak_node) in self.not_recomputed:
            return None
        self.not_recomputed.add((seed, estimate.peak_node))
        readers = late_readers(graph, seed, estimate)
        if not readers:
            return None
        nbytes, spec = graph.nbytes(seed) or 0, graph.spec(seed)
        cone = cheap_cone(graph, seed, leaf_limit=max(1, nbytes // _WORTH_SPLITTING),
                          in_loop=not self.assemble_returned)
        if isinstance(cone, str):
            return None  # most tensors at a peak are not cheap: not worth a record each
        checkpoint = self._checkpoint()
        try:
            recompute_for(graph, cone, readers, estimate)
        except (GraphError, ValueError, TypeError, KeyError, tf.errors.OpError) as err:
            self._rollback(checkpoint)
            self._reject(seed, f"not recomputed for its late readers: {first_line(err)}")
            return None
        graph.prune()
        after = estimate_memory(graph)
        names = ", ".join(reader for reader, _ in readers)
        if after.peak_bytes >= estimate.peak_bytes:
            self._rollback(checkpoint)
            self._reject(seed, f"not recomputed for its late readers ({names}): the program's peak would not fall "
                               f"({format_size(estimate.peak_bytes)} → {format_size(after.peak_bytes)})")
            return None
        self.records.append(RewriteRecord(
            self.pass_name, RECOMPUTE_RULE, "fired", (seed.node,), kind="split",
            reason=f"made again from {', '.join(leaf.name for leaf in cone.leaves) or 'constants'} for {names}, "
                   "not held across the peak",
            details={"tensor": seed.name, "bytes": nbytes, "shape": f"{spec.dtype.name}{spec.shape.as_list()}",
                     "recomputed_for": names, "nodes": len(cone.nodes),
                     "peak_bytes_before": estimate.peak_bytes, "peak_bytes_after": after.peak_bytes}))
        return after

    def _collect_outer_products(self, seed: TensorRef, limit: int) -> None:
        """Rebuilds each user loop reading `seed` whose big accumulators sum outer
        products (a while loop's gradient: `dK += g pᵀ`) to collect the products and sum
        them after the loop (`rewrites.split.accumulators`), where the sum can be split."""
        graph = self.graph
        for loop in dict.fromkeys(loop for loop, _ in invariant_slots(graph, seed)):
            if self._loop_running(loop) is not None:
                continue
            found = outer_product_accumulators(graph, loop, limit)
            if isinstance(found, str):
                self.records.append(RewriteRecord(self.pass_name, COLLECT_RULE, "rejected", (loop,), found,
                                                  kind="split"))
                continue
            if not found:
                continue
            shapes = [graph.spec(graph.inputs(loop)[acc.slot]) for acc in found]
            checkpoint = self._checkpoint()
            try:
                sums = collect_outer_products(graph, found)
            except (GraphError, ValueError, TypeError, KeyError, tf.errors.OpError) as err:
                self._rollback(checkpoint)
                self.records.append(RewriteRecord(self.pass_name, COLLECT_RULE, "rejected", (loop,),
                                                  f"rebuilding loop {loop} failed ({first_line(err)})", kind="split"))
                continue
            for acc, spec, total in zip(found, shapes, sums):
                self.records.append(RewriteRecord(
                    self.pass_name, COLLECT_RULE, "fired", (loop,), kind="split",
                    reason=f"{spec.dtype.name}{spec.shape.as_list()} summed after loop {loop} from the outer "
                           f"products of its {acc.trips} trips ({acc.width} columns each), not carried whole",
                    details={"tensor": total.name, "loop": loop, "slot": acc.slot, "trips": acc.trips,
                             "width": acc.width, "bytes": graph.nbytes(total) or 0}))

    def _shrink(self, loop: Loop, estimate: MemoryEstimate, plan: int) -> MemoryEstimate | None:
        """Re-chunks the loop at the peak so its body fits; None when that does not help."""
        _, nested = estimate.at(estimate.peak_node)
        over = estimate.peak_bytes - plan
        if nested <= over or loop.chunk <= 1:
            return None  # even the smallest chunks would not fit: what keeps the peak is outside the body
        chunk = math.floor(loop.chunk * max(0.0, nested - over) / nested * _CHUNK_MARGIN)
        chunk = max(1, min(chunk, loop.chunk // 2 if chunk >= loop.chunk else chunk))
        if chunk >= loop.chunk:
            return None
        checkpoint = self._checkpoint()
        after = self._try_rechunk(loop, chunk)
        if after is None or after.peak_bytes >= estimate.peak_bytes - (estimate.peak_bytes - plan) * _SHRINK_GAIN:
            self._rollback(checkpoint)
            return None
        # The chunk above assumes the body's bytes all scale with it; those it holds whole
        # do not, and the chunk can come out far smaller than the peak it reached needs
        # (GPflow's SVGP gradient: chunks of 1 where 128 reach the same peak, elsewhere
        # in the program): grow it back as far as that peak allows.
        return self._double_chunks(self._loop(loop.scope), after, after.peak_bytes)

    def _grow_chunks(self, estimate: MemoryEstimate, plan: int) -> MemoryEstimate:
        """Fewer, larger chunks for every loop, as far as the budget allows.

        A body's bytes are in part per chunk and in part whole (matrices it holds, an
        accumulator): a chunk shrunk while the rest of the program was the peak can be
        far smaller than needed once the rest is split, and its body's bytes then say
        little about how far it may grow (GPflow's SVGP gradient, M=1,200, 20,000 points:
        a body of 23 MiB at chunks of 1 and of 96, 84 MiB at 782). Where the proportional
        estimate does not grow a loop, doubling its chunk does, while the peak stays
        within `plan`.
        """
        for scope in [loop.scope for loop in self.loops]:
            loop = self._loop(scope)
            node = self._while_node(loop)
            if node is None or loop.chunk >= loop.region.size:
                continue
            live, nested = estimate.at(node)
            if nested <= 0:
                continue
            chunk = min(loop.region.size, math.floor(loop.chunk * (plan - live) / nested * _CHUNK_MARGIN))
            grown = self._rechunk_within(loop, chunk, plan) if chunk >= loop.chunk * _WORTH_GROWING else None
            estimate = grown if grown is not None else self._double_chunks(self._loop(scope), estimate, plan)
        return estimate

    def _double_chunks(self, loop: Loop, estimate: MemoryEstimate, plan: int) -> MemoryEstimate:
        """`loop` in twice its chunk, and twice that, while the peak stays within `plan`;
        at most `_DOUBLINGS` tries, each one static estimate."""
        for _ in range(_DOUBLINGS):
            if loop.chunk >= loop.region.size:
                break
            after = self._rechunk_within(loop, min(loop.region.size, 2 * loop.chunk), plan)
            if after is None:
                break
            estimate, loop = after, self._loop(loop.scope)
        return estimate

    def shrink_at_xla_peaks(self, peaks: Sequence[MemoryEstimate], goal: int) -> None:
        """Smaller chunks for each loop of this plan that XLA's plan of an earlier compile
        peaked in, by what XLA held there in chunk-sized buffers.

        The static estimate of a loop body is not XLA's: XLA updates an accumulator in
        place and keeps several chunk-sized temporaries at once (GPflow's SGPR gradient,
        N=100,000, M=5,000: the body's [M, M] product and four whole matrices around the
        loop, and five [5000, 1250] chunks). Where XLA peaked `excess` bytes over `goal`
        (XLA's share of the budget) inside a loop, and buffers with the loop's chunk
        length as a dimension took `chunked` bytes there, the loop is emitted again in
        chunks `(chunked - excess) / chunked` as long (with the planning margin). The
        caller compiles the result and keeps it only if XLA's plan then fits better.
        """
        for peak in peaks:
            loop = self._loop_running(graph_node_for(self.graph, peak.peak_node or ""))
            if loop is None:
                continue
            excess = peak.peak_bytes - goal
            chunked = sum(t.nbytes for t in peak.live_at_peak if loop.chunk in t.shape)
            chunk = math.floor(loop.chunk * (chunked - excess) / chunked * _CHUNK_MARGIN) if chunked else 0
            where = (f"XLA peaks in loop {loop.scope} ({loop.chunks} chunks of {loop.chunk}) at "
                     f"{format_size(peak.peak_bytes)}, {format_size(max(0, excess))} over its share "
                     f"{format_size(goal)}, with {format_size(chunked)} in chunk-sized buffers")
            if excess <= 0 or not 1 <= chunk < loop.chunk:
                self.records.append(RewriteRecord(self.pass_name, XLA_SHRINK_RULE, "rejected", (loop.scope,),
                                                  f"{where}: smaller chunks would not take off enough", kind="split"))
                continue
            # One chunk length for every trip where one is near: a remainder chunk is a second
            # body XLA schedules on its own (SGPR N=20,000, M=4,000: 776 MiB in chunks of 395
            # and a remainder of 250, 527 MiB in chunks of 250).
            chunk = even_chunk(loop.region.size, chunk, down_to=_SHRINK_EVEN_DOWN_TO)
            checkpoint = self._checkpoint()
            try:
                new = self.rechunk(loop, chunk)
            except GraphError as err:
                self._rollback(checkpoint)
                self.records.append(RewriteRecord(self.pass_name, XLA_SHRINK_RULE, "rejected", (loop.scope,),
                                                  f"{where}: could not emit it again ({first_line(err)})", kind="split"))
                continue
            self.records.append(RewriteRecord(
                self.pass_name, XLA_SHRINK_RULE, "fired", (loop.scope,), kind="split",
                reason=f"{where}: now {new.chunks} chunks of {new.chunk}",
                details={"loop": loop.scope, "chunk_before": loop.chunk, "chunk": new.chunk,
                         "xla_peak_bytes": peak.peak_bytes, "chunked_bytes": chunked}))

    def _blocking_reason(self, estimate: MemoryEstimate, plan: int) -> str:
        """Why the peak stays over the plan: the largest tensor there, its op and why it stays."""
        over = f"the static peak {format_size(estimate.peak_bytes)} stays over the plan {format_size(plan)}"
        loop = self._loop_running(estimate.peak_node)
        if loop is not None and not estimate.nested_peak_bytes:
            return (f"{over}: at loop {loop.scope} ({loop.chunks} chunks of {loop.chunk}), whose body adds nothing "
                    "at the peak: what the loop reads and writes whole stays, whatever its chunks")
        if loop is not None:
            return (f"{over}: at loop {loop.scope} ({loop.chunks} chunks of {loop.chunk}), whose body needs "
                    f"{format_size(estimate.nested_peak_bytes)} even in the smallest chunks it can take")
        why = {r.details.get("tensor"): r.reason for r in self.records if r.status == "rejected" and r.kind == "split"}
        # Why a loop invariant was not recomputed in its loops says more than why no region
        # could grow through the loop that reads it.
        why.update({r.details.get("tensor"): r.reason for r in self.records if r.status == "rejected"
                    and r.kind == "split" and r.reason.startswith(_NOT_RECOMPUTED)})
        for live in estimate.live_at_peak:
            node = self.graph.node(TensorRef.parse(live.name).node)
            if node.op in GRAPH_INPUT_OPS:
                continue
            reason = why.get(live.name, "it is needed whole there")
            return f"{over}: {live.name} ({node.op}, {format_size(live.nbytes)}) stays whole: {reason}"
        inputs = sum(t.nbytes for t in estimate.live_at_peak)
        return f"{over}: the program's inputs and constants alone take {format_size(inputs)}"

    # --- loops ------------------------------------------------------------------------

    def emit(self, region: SliceRegion, chunk: int, *, max_write_out: int) -> Loop:
        """Replaces `region` by a loop in chunks of `chunk`; records it."""
        graph = self.graph
        scope = graph.unique_scope(SPLIT_SCOPE)
        # The region's nodes, and the constants it reads: the loop copies small ones into
        # its body, and pruning then removes them.
        constants = [f.ref.node for f in region.feeds(graph) if graph.node(f.ref.node).op == "Const"]
        saved = tuple(_copy(graph.node(name)) for name in dict.fromkeys([*region.nodes, *constants]))
        per_unit = region.per_unit_bytes(graph)
        chunk, replaced = self._loop_in_place(region, chunk, max_write_out, scope)
        loop = Loop(scope, region, chunk, per_unit, saved, tuple(replaced.items()), len(self.records))
        self.records.append(self._split_record(loop))
        self.loops.append(loop)
        return loop

    def rechunk(self, loop: Loop, chunk: int) -> Loop:
        """The same region as a loop in chunks of `chunk` (undo, then emit again)."""
        graph = self.graph
        self._retract(loop)
        region = _without_pruned(loop.region, graph)
        chunk, replaced = self._loop_in_place(_as_read_now(region, loop.saved, graph), chunk,
                                              _max_write_out(graph, loop), loop.scope)
        new = dataclasses.replace(loop, region=region, chunk=chunk, replaced=tuple(replaced.items()))
        self.loops[self.loops.index(loop)] = new
        self.records[loop.record] = self._split_record(new)
        return new

    def _loop_in_place(self, region: SliceRegion, chunk: int, max_write_out: int,
                       scope: str) -> tuple[int, dict[TensorRef, TensorRef]]:
        """Emits `region`'s loop and rewires its readers to it; the chunk length it took
        (one that divides the length, when it writes out: `even_chunk`) and what it replaced."""
        graph = self.graph
        mixed = mixed_in_loop(graph, region, max_write_out, assemble_returned=self.assemble_returned)
        if mixed:  # `best_region` keeps such nodes out; a loop emitted again must not bring them back
            name, comparison = min(mixed.items())
            raise GraphError(f"loop {scope} would make {name} beside its original, and {comparison} would "
                             "compare values made from each")
        if written_out(graph, region, max_write_out, assemble_returned=self.assemble_returned):
            chunk = even_chunk(region.size, chunk)
        replaced = emit_loop(graph, region, chunk, max_write_out=max_write_out,
                             assemble_returned=self.assemble_returned, scope=scope)
        for old, new in replaced.items():
            graph.replace_all_uses(old, new)
        graph.prune()
        return chunk, replaced

    def _rechunk_within(self, loop: Loop, chunk: int, limit: int) -> MemoryEstimate | None:
        """`loop` in larger chunks of `chunk` if the program's peak then stays within
        `limit` (its estimate); else the loop as it was, and None. Never past the user's
        `tensor_split_size`: the chunk is cut to the longest that keeps the body's
        largest tensor within it."""
        if self.split_size is not None:
            chunk = min(chunk, max(loop.chunk, self.split_size // max(loop.per_unit, 1)))
            if chunk <= loop.chunk:
                return None
        checkpoint = self._checkpoint()
        after = self._try_rechunk(loop, chunk)
        if after is None or after.peak_bytes > limit:
            self._rollback(checkpoint)
            return None
        return after

    def _try_rechunk(self, loop: Loop, chunk: int) -> MemoryEstimate | None:
        """Re-chunks and estimates; None if the region could not be restored (roll back)."""
        try:
            self.rechunk(loop, chunk)
        except GraphError:
            return None
        return estimate_memory(self.graph)

    def _retract(self, loop: Loop) -> None:
        """Puts the region's nodes back in place of the loop (reading, where a later loop
        replaced what they read, that loop's tensors)."""
        graph = self.graph
        restored = [graph.add_node(node) for node in loop.saved if node.name not in graph]
        for name in restored:
            for position, ref in enumerate(graph.inputs(name)):
                if ref.node not in graph:
                    graph.set_input(name, position, self._resolve(ref))
        for old, new in loop.replaced:
            graph.replace_all_uses(new, old)
        graph.prune()

    def _resolve(self, ref: TensorRef) -> TensorRef:
        """Where a tensor a later loop replaced lives now."""
        replacements = {old: new for loop in self.loops for old, new in loop.replaced}
        seen = set()
        while ref.node not in self.graph:
            if ref not in replacements or ref in seen:
                raise GraphError(f"cannot restore a split region: {ref} is gone")
            seen.add(ref)
            ref = replacements[ref]
        return ref

    def _split_record(self, loop: Loop) -> RewriteRecord:
        region = loop.region
        return RewriteRecord(self.pass_name, RULE, "fired", (region.seed.node,), kind="split", details={
            "tensor": region.seed.name, "dim": region.axes[region.seed], "size": region.size,
            "chunks": loop.chunks, "chunk": loop.chunk, "chunk_bytes": loop.per_unit * loop.chunk,
            "loop": loop.scope, "nodes": len(region.nodes),
            "sinks": ",".join(sorted(set(region.sinks.values()))) or "-"})

    def _loop(self, scope: str) -> Loop:
        return next(loop for loop in self.loops if loop.scope == scope)

    def _while_node(self, loop: Loop) -> str | None:
        prefix = f"{loop.scope}/"
        return next((n.name for n in self.graph.find(WHILE_LOOP_OPS) if n.name.startswith(prefix)),
                    None)

    def _loop_running(self, node: str | None) -> Loop | None:
        if node is None:
            return None
        return next((loop for loop in self.loops if node.startswith(f"{loop.scope}/")), None)

    def _reject(self, seed: TensorRef, reason: str) -> None:
        self.records.append(RewriteRecord(self.pass_name, RULE, "rejected", (seed.node,), reason,
                                          {"tensor": seed.name, "bytes": self.graph.nbytes(seed)}, kind="split"))

    def _checkpoint(self) -> tuple[Graph, list[Loop], list[RewriteRecord]]:
        return self.graph.copy(), list(self.loops), list(self.records)

    def _rollback(self, checkpoint: tuple[Graph, list[Loop], list[RewriteRecord]]) -> None:
        graph, self.loops, self.records = checkpoint
        self.graph.assign(graph)


def _copy(node: node_def_pb2.NodeDef) -> node_def_pb2.NodeDef:
    duplicate = node_def_pb2.NodeDef()
    duplicate.CopyFrom(node)
    return duplicate


def _without_pruned(region: SliceRegion, graph: Graph) -> SliceRegion:
    """`region` without the nodes that did not come back when its loop was taken out.

    A region node none of whose readers is left (later loops took them in) is pruned as
    soon as the region's nodes are put back, and the loop emitted again does without it.
    (GPflow's SGPR gradient, N=100,000, M=5,500: four nodes of a `truediv` gradient, and
    the loop XLA peaked in could not take smaller chunks.) Its seed and sinks must be back.
    """
    needed = [name for name in (region.seed.node, *region.sinks) if name not in graph]
    if needed:
        raise GraphError(f"cannot restore a split region: {needed[0]} is gone")
    gone = {name for name in region.nodes if name not in graph}
    if not gone:
        return region
    return dataclasses.replace(
        region, nodes=[n for n in region.nodes if n not in gone],
        axes={ref: axis for ref, axis in region.axes.items() if ref.node not in gone},
        boundaries={ref: why for ref, why in region.boundaries.items() if ref.node not in gone},
        whole_reads={(n, p) for n, p in region.whole_reads if n not in gone})


def _as_read_now(region: SliceRegion, saved: Sequence[node_def_pb2.NodeDef], graph: Graph) -> SliceRegion:
    """`region`, its split axes keyed by the tensors its nodes read now.

    A region and its saved nodes name the tensors they read when the loop was first
    emitted. A loop emitted after it may since have taken one of them over (written it
    out whole, or summed it): put back, the region's nodes read that loop's output
    instead (`Planner._retract`), and the axes must name it too, or the loop emitted
    again would feed it whole where it sliced the original (a [n, 1] row maximum beside
    a [c, n] chunk of the scores: "Dimensions must be equal"). The loop keeps `region`
    as it was: its saved nodes, which `_retract` resolves anew each time, name the same
    tensors.
    """
    read_then = {node.name: node_inputs(node) for node in saved}
    renamed = {now: region.axes[then] for name in region.nodes
               for then, now in zip(read_then.get(name, ()), graph.inputs(name))
               if then != now and then in region.axes}
    if not renamed:
        return region
    axes = {ref: axis for ref, axis in region.axes.items() if ref.node in graph}
    return dataclasses.replace(region, axes={**axes, **renamed})


def _max_write_out(graph: Graph, loop: Loop) -> int:
    """The write-out limit the loop was emitted with: the tensors it wrote out were within it."""
    written = [old for old, _ in loop.replaced if old.node not in loop.region.sinks]
    return max((graph.nbytes(ref) or 0 for ref in written), default=0)


def _largest_computed(graph: Graph, threshold: int, skip: set[TensorRef], *,
                      skip_returned: bool) -> TensorRef | None:
    best, best_bytes = None, threshold
    for node in graph.nodes:
        if node.op in GRAPH_INPUT_OPS:
            continue
        for index in range(len(graph.output_specs(node.name))):
            ref = TensorRef(node.name, index)
            nbytes = graph.nbytes(ref) or 0
            if nbytes > best_bytes and ref not in skip and not (skip_returned and graph.is_returned(ref)):
                best, best_bytes = ref, nbytes
    return best


def best_region(graph: Graph, seed: TensorRef, threshold: int, split_size: int, *,
                assemble_returned: bool = True, slice_limit: int = 0) -> tuple[SliceRegion | None, str]:
    """The region around `seed` that leaves fewest tensors over `threshold` whole, or why none works.

    `assemble_returned`: a tensor the program returns may be written out whatever its size
    (not in a loop body: see `Planner.assemble_returned`).
    `slice_limit`: a chunk of one slice may be this large when a slice is over `split_size`
    (a split size the budget chose, not the user: the loop is judged by the peak it leaves).
    """
    spec = graph.spec(seed)
    reasons = []
    best, best_score = None, None
    for axis, length in sorted(enumerate(spec.shape.as_list()), key=lambda p: -p[1]):
        if length <= 1:
            continue
        region = grow_region(graph, seed, axis, large=split_size)
        if isinstance(region, str):
            reasons.append(f"axis {axis}: {region}")
            continue
        if seed.node not in region.nodes or seed not in region.axes:
            reasons.append(f"axis {axis}: the seed could not stay in its region")
            continue
        region = evaluated_once(graph, region, threshold, assemble_returned=assemble_returned)
        if isinstance(region, str):
            reasons.append(f"axis {axis}: {region}")
            continue
        if region.per_unit_bytes(graph) > max(split_size, slice_limit):
            reasons.append(f"axis {axis}: a single slice is {region.per_unit_bytes(graph)} bytes, over the "
                           f"split size {max(split_size, slice_limit)} (splitting two axes at once is not supported)")
            continue
        oversized_out = region.left_whole(graph, threshold, assemble_returned=assemble_returned)
        if seed in oversized_out:
            why = region.boundaries.get(seed, "a reader needs it whole")
            reasons.append(f"axis {axis}: {why}")
            continue
        write_outs = region.write_outs(graph)
        if not region.sinks and all(r in oversized_out for r in write_outs):
            # `emit_loop` leaves tensors over the threshold to their original ops, so such a
            # loop returns nothing anyone reads and is pruned as soon as it is emitted.
            held = ", ".join(f"{r.name} ({format_size(graph.nbytes(r) or 0)})" for r in write_outs)
            reasons.append(f"axis {axis}: its loop would keep nothing it computes: {held or 'nothing'} "
                           f"{'is' if len(write_outs) == 1 else 'are'} read whole outside it")
            continue
        written = sum(graph.nbytes(r) or 0 for r in write_outs if r not in oversized_out)
        avoided = [graph.nbytes(r) or 0 for r in region.axes if r.node in region.nodes
                   and r.node not in region.sinks and r not in write_outs]
        total, largest = sum(avoided), max(avoided, default=0)
        # Each trip also computes a partial result of every sink's full output size (a
        # contraction's product, a reduction's partial sum) to add into its accumulator:
        # a loop whose partials are as large as the largest tensor it avoids saves nothing
        # (SGPR's [M, M] Cholesky-gradient chains split along their inner dimension did that).
        partials = sum(graph.nbytes(TensorRef(sink, i)) or 0 for sink in region.sinks
                       for i in range(len(graph.output_specs(sink))))
        if written + partials >= total or partials >= largest:
            held = []
            if written:
                held.append(f"write {format_size(written)} back out whole")
            if partials:
                held.append(f"compute {format_size(partials)} of partial results per chunk")
            reasons.append(f"axis {axis}: its loop would {' and '.join(held)}, and avoid only {format_size(total)} "
                           f"(the largest {format_size(largest)})" if held
                           else f"axis {axis}: its loop would avoid nothing")
            continue
        eliminated = sum(1 for r in region.axes if r.node in region.nodes and r not in oversized_out
                         and (graph.nbytes(r) or 0) > threshold)
        # Merging candidates (top-k, arg-max) costs a sort per chunk; sums are nearly free.
        merges = sum(1 for kind in region.sinks.values() if kind in ("topk", "argmax", "argmin"))
        score = (-len(oversized_out), eliminated, -merges, -len(region.nodes))
        if best_score is None or score > best_score:
            best, best_score = region, score
    if best is None:
        return None, "; ".join(reasons) or "no axis longer than 1"
    return best, ""


def chunk_length(graph: Graph, region: SliceRegion, split_size: int) -> int:
    """The chunk length that keeps the region's largest tensor within `split_size`."""
    per_unit = max(region.per_unit_bytes(graph), 1)
    return int(min(region.size, max(1, split_size // per_unit)))


def at_least_two_chunks(chunk: int, size: int) -> int:
    """`chunk`, or half of `size` (rounded up) when `chunk` would take all of it in one:
    a loop of one chunk saves nothing.

    >>> at_least_two_chunks(300, 1000), at_least_two_chunks(1000, 1000), at_least_two_chunks(5000, 7)
    (300, 500, 4)
    """
    return chunk if chunk < size else -(-size // 2)
