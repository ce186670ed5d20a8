"""The memory budget: the one number tfmem works to, from the config or from the device.

A budget is a promise about the *real* peak: a program tfmem reports as fitting runs
within it. It comes from, in order:

1. `Config.memory_budget`, when set; none at all when it is "off" (the opt-out: split by
   `tensor_size_threshold` only, the paper's per-tensor semantics);
2. the device the function runs on, when the split stage is on (a threshold does not
   lift it: thresholds only add splits and set their granularity):
   - a GPU: the memory TensorFlow's allocator may use on it (its logical device's
     `memory_limit`, as `device_lib` reports it) times `GPU_SAFETY_FRACTION`, which leaves
     room for what runs outside that allocator's accounting (cuBLAS/cuDNN workspaces,
     XLA's autotuning scratch);
   - the CPU: `TF_CPU_BFC_MEM_LIMIT_IN_MB` when `TF_CPU_ALLOCATOR_USE_BFC` is on (the
     allocator then refuses anything beyond it, so that limit *is* the budget);
   - otherwise no budget: nothing is split, as before budgets existed;
   in both cases less what the allocator already holds when the function is rewritten
   (the process's other tensors stay alive beside it), shared between the replicas of a
   `tf.distribute` strategy that use the same allocator.

The verdict — whether a rewritten program fits its budget (`Report.fits`, and the
warning when it does not) — is decided here and nowhere else:

- under XLA, without asking for its plan, `Budget.fits_unchecked`: the static estimate
  times `ESTIMATE_ERROR` (the most XLA's plan exceeded the estimate on the corpus), taken
  as one block beside the program's outputs (allocated first, in regions of their own),
  fits XLA's share beside what the allocator holds and the regions it grew;
- with XLA's plan (asked for only when the first rule cannot say yes: it costs a
  compilation), `Budget.fits_xla_plan`: the plan fits the budget, beside what the
  allocator holds already, and its block of temporaries finds room in one piece; where
  XLA packed them in several heaps (the process's heap limit, `tfmem.xla_heaps`), every
  heap finds room when the allocator is replayed over them (`Budget.heaps_replay`).
  (Planning aims lower, at `XLA_FRACTION` of the budget: `Budget.xla_overshoot` over that
  share makes the passes plan again, to `Budget.replan_target`);
- where there is no XLA plan to ask for (`jit_compile: false`, or XLA cannot compile
  the program), `Budget.fits_without_xla`: the estimate within the planning share, divided
  by `GRAPH_MODE_ERROR` (TensorFlow's executor holds more than the estimate counts), and
  every one of the estimate's allocations finding room when TensorFlow's BFC allocator is
  replayed over them under the budget (`tfmem.allocator`: without XLA each whole matrix
  is an allocation of its own, and one that needs a new region can take twice its size).

A configured budget bounds everything the allocator holds, as a real limit of that size
would: the call's inputs (each in the whole chunk BFC gave it, which can be near twice its
size), the process's other tensors, and what the call allocates. What the allocator holds
when a plan is judged (`Held`, read by `allocator_held`) counts against it. A budget taken
from the device has left out what its allocator held then (`Budget.in_use_excluded`).

The real peak TensorFlow's BFC allocator reports can come close to the limit even so:
a block that needs a new region gets the whole region when it is under twice the
block (BFC does not split it) and the whole region counts as in use. That is
bookkeeping, not a risk: on kxx_expanded_matmul XLA plans 74.7 MiB and the allocator
reports a 124 MiB peak under a 128 MiB limit, and the program runs. It is a risk for
the call's outputs, which come before its block: one over half a region takes all of it
(`Budget.block_room`). The corpus's verdict table (benchmarks/corpus/RESULTS.md) checks
both rules against real limits, and `benchmarks/allocator_grid.py` where the allocator
decides: outputs and temporaries of up to half the limit, after an earlier call grew a region.

Example:
    >>> resolve_budget(Config(memory_budget="1GiB"))
    Budget(nbytes=1073741824, source='config')
    >>> device_budget("CPU:0", environ={"TF_CPU_ALLOCATOR_USE_BFC": "1", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "1024"},
    ...               in_use=lambda device: (0, 0))
    Budget(nbytes=966367641, source='90% of TF_CPU_BFC_MEM_LIMIT_IN_MB=1024')
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tfmem.allocator import Allocate, Replay, replay
from tfmem.config import Config, format_size
from tfmem.xla_heaps import suggested_heap_bytes

if TYPE_CHECKING:  # the plan's and estimate's types only: tfmem.memory needs no budget
    from tfmem.memory import MemoryEstimate, XlaPlan

# Share of a GPU's allocator limit that tfmem plans for (see the module docstring).
GPU_SAFETY_FRACTION = 0.9
# Share of the CPU allocator's room a device-derived budget offers one program (see
# `device_budget` for what the room is: the allocator never gives memory back).
CPU_SAFETY_FRACTION = 0.9
# Share of any budget the static estimate may fill (`Budget.plan_bytes`, the one place
# it is applied). The estimate counts live tensors; the real peak adds what it cannot
# see: allocator fragmentation and rounding, XLA's own scratch, small runtime buffers.
# Calibrated on the corpus (benchmarks/corpus).
PLANNING_FRACTION = 0.9
# Share of a budget XLA's own plan for the compiled program may take ("Total bytes used":
# its one block of temporaries, constants, parameters and outputs). The rest is for what
# the runtime holds beside it: the allocator's rounding, inputs TensorFlow keeps.
XLA_FRACTION = 0.95
# How far TensorFlow's executor (jit_compile off, or a rewrite XLA cannot compile) went
# over the static estimate, which counts XLA's schedule and in-place updates: 1.21× for
# GPflow SGPR's loss and gradients (98.6 → 119.6 MiB), 1.21× and 1.39× for a
# conjugate-gradient loop's gradient in 26 and in smaller chunks (51.1 → 62.0 MiB,
# 39.6 → 54.9 MiB: its 25 trips' lists do not shrink), 1.35× for a kernel's row sums
# (46.3 → 62.6 MiB). Without XLA's plan to check, the estimate must fit the planning share
# divided by it. What the allocator's regions and chunks add is not in this margin: the
# allocator is replayed over the estimate's allocations for that (`Budget.fits_without_xla`).
GRAPH_MODE_ERROR = 1.4
# Without XLA each of a split loop's chunk tensors is an allocation of its own, and BFC gives
# one that needs a new region the whole region when it is under twice the chunk: chunks near
# a quarter of the budget then took twice their size (row-normalised scores under 128 MiB:
# estimate 70.1 MiB, real peak 129.7-163.8 MiB with 34 MiB chunks; 41.9 MiB with chunks of at
# most 10 MiB, 14.0 with 5 MiB). So without XLA no chunk tensor is over this share of the plan.
GRAPH_MODE_CHUNK_SHARE = 8
# XLA asks for a program's temporaries as one block. A growing allocator (TensorFlow's
# BFC with growth, as on the CPU) never hands a region back and grows regions by doubling,
# so after allocations that peaked at P it holds regions of up to REGION_SLACK × P, the
# largest at least P / REGION_SLACK: the block must fit in that or in what is left to grow.
# Seen on the corpus: SVGP planned 177 MiB of the 182 allowed, and its 166 MiB block was
# refused under 192 MiB after 24 MiB of data had grown the regions; accounting for them,
# it is split further and runs.
REGION_SLACK = 2.0
# The smallest region a BFC allocator grows (its first, `min(limit, 2 MiB)` in TensorFlow's
# bfc_allocator.cc): once anything is allocated, at least this much is held in regions. A
# CG solve's gradient under 76 MiB, a 74.2 MiB block beside 0.2 MiB of inputs: room for it
# counted as 75.6 MiB, and the first region left 74.0.
BFC_FIRST_REGION = 2 << 20
# The most XLA's plan for a rewritten program exceeded tfmem's static estimate of it on
# the corpus (benchmarks/corpus at e6f299d, 46 programs at their budgets: row_normalised 1.58,
# gpr_predict_mean_var 1.53, sgpr_predict_mean_var 1.27; most plan less than the
# estimate), with a margin. A plan whose estimate times this fits XLA's share in one
# block fits without asking XLA (`Budget.fits_unchecked`): the check is a full XLA
# compilation of the program, as long as the one that runs it.
ESTIMATE_ERROR = 1.75
# An overshoot this large means the block found (next to) no room: its size over one byte.
_NO_ROOM_OVERSHOOT = 1000.0
# A re-plan aims this much under what XLA's plan had to shed (`Budget.replan_target`): the
# estimate and XLA's plan do not move byte for byte.
REPLAN_MARGIN = 0.95

_DEVICE_RE = re.compile(r"(?:device:)?(?P<kind>CPU|GPU|TPU):(?P<index>\d+)$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Held:
    """What a device's allocator holds when a plan for it is judged (`allocator_held`).

    Attributes:
        in_use: bytes in use now: the call's inputs, the process's other tensors, each in
            the chunk the allocator gave it (BFC hands out a whole chunk under twice the
            request: a 9.8 MiB input can hold 16 MiB).
        peak: the allocator's peak so far, where it grows in regions that it never gives
            back (TensorFlow's BFC on the CPU); 0 elsewhere (see `Budget.xla_overshoot`).
        regions: what such an allocator holds in regions at least, whatever its peak: its
            first region (`BFC_FIRST_REGION`) once it has allocated anything.
    """

    in_use: int = 0
    peak: int = 0
    regions: int = 0


NOTHING_HELD = Held()


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget in bytes, and where it came from (for reports).

    `in_use_excluded`: what the device's allocator held when this budget was derived from
    it, left out of `nbytes` already (`device_budget`); 0 for a configured budget, which
    bounds all the allocator holds.
    """

    nbytes: int
    source: str
    in_use_excluded: int = dataclasses.field(default=0, repr=False)

    @property
    def plan_bytes(self) -> int:
        """What the static estimate may reach for the program to count as fitting."""
        return int(self.nbytes * PLANNING_FRACTION)

    @property
    def graph_mode_plan_bytes(self) -> int:
        """What the static estimate may reach for a program TensorFlow's executor runs,
        without XLA (`GRAPH_MODE_ERROR`)."""
        return int(self.plan_bytes / GRAPH_MODE_ERROR)

    @property
    def graph_mode_split_bytes(self) -> int:
        """The largest chunk tensor a split loop makes in a program TensorFlow's executor
        runs, without XLA (`GRAPH_MODE_CHUNK_SHARE`)."""
        return self.graph_mode_plan_bytes // GRAPH_MODE_CHUNK_SHARE

    def fits_estimate(self, estimate_bytes: int, *, with_xla: bool = True) -> bool:
        """The verdict where no XLA plan was asked for: the static estimate within the
        planning share (`plan_bytes`; a plan that passed `fits_unchecked` passes this
        too), or, for a program that runs without XLA, within `graph_mode_plan_bytes`.

        Example:
            >>> Budget(1000, "config").fits_estimate(800), Budget(1000, "config").fits_estimate(800, with_xla=False)
            (True, False)
        """
        return estimate_bytes <= (self.plan_bytes if with_xla else self.graph_mode_plan_bytes)

    def fits_without_xla(self, estimate: MemoryEstimate, replayed: Replay | None = None) -> bool:
        """The verdict for a program TensorFlow's executor runs: its estimate within
        `graph_mode_plan_bytes`, and its allocations all finding room in the allocator
        under the budget (`allocator_replay`, or `replayed` where the caller holds it)."""
        if not self.fits_estimate(estimate.peak_bytes, with_xla=False):
            return False
        return (replayed if replayed is not None else self.allocator_replay(estimate)).fits

    def allocator_replay(self, estimate: MemoryEstimate) -> Replay:
        """TensorFlow's BFC allocator replayed over the estimate's allocations, in its
        schedule, under the whole budget (`tfmem.allocator`); the program's inputs first,
        in a fresh allocator.

        Example:
            >>> from tfmem.allocator import Allocate
            >>> from tfmem.memory import MemoryEstimate
            >>> matrix = 1500 * 1500 * 8  # 17.2 MiB: BFC gives each of the first two a 32 MiB region
            >>> three = MemoryEstimate(3 * matrix, "solve", (), allocations=(
            ...     Allocate("x", 24_000), Allocate("K", matrix), Allocate("L", matrix), Allocate("solve", matrix)))
            >>> Budget(82 << 20, "config").fits_estimate(three.peak_bytes, with_xla=False)
            True
            >>> Budget(82 << 20, "config").fits_without_xla(three), Budget(90 << 20, "config").fits_without_xla(three)
            (False, True)
        """
        return replay(estimate.allocations, self.nbytes)

    def fits_unchecked(self, estimate_bytes: int, held: Held = NOTHING_HELD, output_bytes: int = 0) -> bool:
        """Whether a program estimated at `estimate_bytes` fits with no XLA check: even
        with XLA planning `ESTIMATE_ERROR` times the estimate, all in one block but the
        program's outputs (`output_bytes`, allocated first: see `xla_overshoot`), beside
        what the allocator holds (`held`).

        This is the rule for skipping XLA's check; with XLA's plan, the rule is
        `fits_xla_plan` (see the module docstring for all three).

        Example:
            >>> budget = Budget(1000, "config")       # XLA's share 950; unchecked 542
            >>> budget.fits_unchecked(500), budget.fits_unchecked(600), budget.fits_unchecked(500, Held(peak=100))
            (True, False, False)
            >>> budget.fits_unchecked(400), budget.fits_unchecked(400, output_bytes=390)  # regions of 780
            (True, False)
        """
        planned = int(estimate_bytes * ESTIMATE_ERROR)
        outputs = min(output_bytes, planned)
        return self.xla_overshoot(planned, planned - outputs, held, other_bytes=outputs) <= 1

    @property
    def xla_bytes(self) -> int:
        """What XLA's planned allocation may reach for the program to count as fitting."""
        return int(self.nbytes * XLA_FRACTION)

    def beside(self, held: Held) -> int:
        """What the allocator holds that this budget must hold too: all it holds, for a
        configured budget; what it took since, for one derived from the device."""
        return max(0, held.in_use - self.in_use_excluded)

    def block_room(self, total_bytes: int, largest_bytes: int, held: Held = NOTHING_HELD, *,
                   other_bytes: int = 0, limit: int | None = None) -> float:
        """The room XLA's block of temporaries (`largest_bytes`) finds in one piece under
        `limit` (default: XLA's share); at most 0 when it finds none, however small.

        The larger of two: what the largest region the allocator grew has left (regions
        double, so it holds at least `held.peak / REGION_SLACK`, and all that is in use may
        sit in it), and what is left to grow once regions of `REGION_SLACK` times what
        came before the block are held (and at least `held.regions`): the allocator's peak
        and the call's outputs (`other_bytes`), or the plan's buffers other than the block,
        whichever is more.

        The outputs come first and may land in that largest region too. BFC splits a free
        chunk only when it is at least twice the request, so outputs of more than half of
        it take all of it; else they leave it less by what they take. (A [3000, 3000]
        float64 output, 68.7 MiB, after an earlier call had grown a 126 MiB region under
        128 MiB: the output took the region whole and the 2.3 MiB block found nothing.)

        Example:
            >>> budget = Budget(1000, "config")
            >>> budget.block_room(900, 800), budget.block_room(600, 500, Held(in_use=100, peak=900))
            (750.0, 350.0)
            >>> budget.block_room(400, 50, Held(peak=900), other_bytes=100)   # the outputs leave 350
            350.0
            >>> budget.block_room(400, 50, Held(peak=900), other_bytes=300)   # they take the region whole
            0.0
        """
        limit = self.xla_bytes if limit is None else limit
        region = held.peak / REGION_SLACK  # regions double: the last is at least half of all
        if other_bytes and region < 2 * other_bytes:  # BFC's split rule: under twice the request, all of it
            largest_region = 0.0
        else:
            largest_region = region - held.in_use - other_bytes
        return max(largest_region, limit - self._grown_before(total_bytes, largest_bytes, held, other_bytes))

    @staticmethod
    def _grown_before(total_bytes: int, largest_bytes: int, held: Held, other_bytes: int) -> float:
        """The regions held once what comes before the block has allocated (`block_room`)."""
        return max(REGION_SLACK * max(held.peak + other_bytes, total_bytes - largest_bytes), held.regions)

    def xla_overshoot(self, total_bytes: int, largest_bytes: int, held: Held = NOTHING_HELD, *,
                      other_bytes: int = 0, limit: int | None = None) -> float:
        """How far XLA's plan is over `limit` (default: XLA's share of this budget, what
        planning aims for): ≤ 1 fits, 1.3 means 30% over.

        The plan must fit whole beside what the allocator holds (`held.in_use`, as far as
        the budget must hold it: `beside`): the call allocates its block of temporaries
        and `other_bytes` (its outputs) on top of that, and its parameters are among it.
        And its largest block (the temporaries) must find room in one piece
        (`block_room`). `other_bytes`, what the call allocates itself beside that block
        (a big output), grows regions of its own on top of `held.peak`: a block that needs
        a new region under twice its size takes all of it, so what comes after it must
        find room elsewhere (SGPR `predict_f(full_cov=True)` at 3,000 points: a 68.7 MiB
        output and a 14.8 MiB block, 83.6 MiB planned, ran out of memory under 128 MiB).
        A Gram-matrix loss with gradients over two [20000, 64] float64 inputs under 62.5 MiB:
        XLA planned 53.7 MiB with them, but the allocator held 32 MiB for the two 9.8 MiB
        inputs, and 32 + 19.5 (outputs) + 14.6 (block) MiB ran out of memory.

        Example:
            >>> budget = Budget(1000, "config")                   # XLA may plan 950
            >>> budget.xla_overshoot(total_bytes=900, largest_bytes=800)  # room: 950 - 2 × 100
            1.066...
            >>> budget.xla_overshoot(total_bytes=900, largest_bytes=800, held=Held(peak=300))  # room: 350
            2.285...
            >>> budget.xla_overshoot(total_bytes=900, largest_bytes=600, held=Held(peak=100), other_bytes=200)
            1.714...
            >>> budget.xla_overshoot(total_bytes=500, largest_bytes=200, held=Held(in_use=400), other_bytes=200)
            0.842...
            >>> budget.xla_overshoot(total_bytes=500, largest_bytes=200, held=Held(in_use=600), other_bytes=200)
            1.052...
        """
        limit = self.xla_bytes if limit is None else limit
        whole = max(total_bytes, self.beside(held) + largest_bytes + other_bytes)
        room = self.block_room(total_bytes, largest_bytes, held, other_bytes=other_bytes, limit=limit)
        return max(whole / limit, largest_bytes / max(room, 1))

    @staticmethod
    def describe_overshoot(overshoot: float) -> str:
        """`xla_overshoot` for a message: the ratio, or that the block finds no room at all
        (the ratio is then the block's size over one byte of room, a meaningless number).

        Example:
            >>> Budget.describe_overshoot(1.0734), Budget.describe_overshoot(2.2e8)
            ('overshoot 1.073', 'overshoot: no room for its block of temporaries')
        """
        if overshoot > _NO_ROOM_OVERSHOOT:
            return "overshoot: no room for its block of temporaries"
        return f"overshoot {overshoot:.3f}"

    def fits_xla_plan(self, total_bytes: int, largest_bytes: int, held: Held = NOTHING_HELD, *,
                      other_bytes: int = 0) -> bool:
        """The verdict on a program XLA planned: the plan fits the budget itself, beside
        what the allocator holds, its block of temporaries in one piece (`xla_overshoot`
        against `nbytes`).

        Planning aims for XLA's share (`xla_bytes`), a margin; the verdict does not
        count the margin as used. XLA allocates every buffer the call needs in its plan
        (parameters and outputs included) and TensorFlow adds little beside it (SGPR
        Matern32 + mean, N=20,000, D=8, M=2000 under a 512 MiB limit: XLA plans 491.0
        MiB, over its 486.4 MiB share, and the call runs at a real peak of 498.4 MiB).

        Example:
            >>> budget = Budget(1000, "config")
            >>> budget.fits_xla_plan(960, 950), budget.xla_overshoot(960, 950) > 1
            (True, True)
            >>> budget.fits_xla_plan(1010, 950), budget.fits_xla_plan(960, 950, Held(peak=200))
            (False, False)
        """
        return self.xla_overshoot(total_bytes, largest_bytes, held, other_bytes=other_bytes,
                                  limit=self.nbytes) <= 1

    def plan_overshoot(self, plan: XlaPlan, held: Held = NOTHING_HELD) -> float:
        """`xla_overshoot` of a plan XLA made: its block of temporaries, allocated after its
        outputs, must find room beside them. A plan in several heaps whose heaps do not all
        find room under the budget (`heaps_replay`: it replays the regions the allocator
        holds, which XLA's share would not leave it) is over by at least the heap that
        found none, over the budget.

        For planning, the largest heap is judged as a block after all the call's other
        buffers, its other heaps among them, as if each grew a region: stricter than the
        verdict (`fits_plan`), it keeps the passes splitting the way they do for one block.
        (Judged as the verdict judges it, the overshoot of a plan whose heap found no room
        is only that heap over the budget, and the passes stopped early at plans that ran
        out of memory: a Cholesky and solves at n=2000 in 31 MiB heaps under 160 MiB.)"""
        overshoot = self.xla_overshoot(plan.total_bytes, plan.block_bytes, held, other_bytes=plan.output_bytes)
        heaps = self.heaps_replay(plan, held)
        if heaps is not None and not heaps.fits:
            overshoot = max(overshoot, 1 + heaps.failed_bytes / self.nbytes)
        return overshoot

    def fits_plan(self, plan: XlaPlan, held: Held = NOTHING_HELD) -> bool:
        """`fits_xla_plan` of a plan XLA made (its block after its outputs). For a plan in
        several heaps: the whole plan within the budget, every heap finding room
        (`heaps_replay`), and the largest judged as a block beside the call's other
        buffers but not its other heaps, which the replay places (`_without_other_heaps`)."""
        heaps = self.heaps_replay(plan, held)
        if heaps is None:
            return self.fits_xla_plan(plan.total_bytes, plan.block_bytes, held, other_bytes=plan.output_bytes)
        return (plan.total_bytes <= self.nbytes and heaps.fits
                and self.fits_xla_plan(_without_other_heaps(plan), plan.block_bytes, held, other_bytes=plan.output_bytes))

    def heaps_replay(self, plan: XlaPlan, held: Held = NOTHING_HELD, *, limit: int | None = None) -> Replay | None:
        """Where XLA's temporaries land when it packed them in several heaps (under the
        process's heap limit, `tfmem.xla_heaps`); None for one block, which `block_room`
        judges alone.

        Each heap is an allocation of its own, and all must find room, not only the
        largest: the allocator (`tfmem.allocator`) is replayed with regions grown as far as
        its peak (`BfcAllocator.grow_to`), under `limit` (default: the budget), over what it
        holds in use, then the call's outputs, then the heaps in the order the call
        allocates them.

        What it holds is placed by best fit: mostly inputs and variables, allocated while
        the regions were small. (Held at the start of the largest regions instead, VGP's
        15.4 MiB variable left its 31 MiB heaps no room, yet they ran: the verdict said
        "does NOT fit", and planning moved to a plan in heaps that did run out of memory.)
        The order matters too: GPflow's VGP (N=2000) in heaps of 15.3, 30.6, 32.0, 32.0
        and 32.0 MiB, in that order, after a 15.3 MiB output, fits the regions a 192 MiB
        limit left it (and runs); largest first, the 30.6 MiB one would find none.

        Example:
            >>> from tfmem.memory import XlaPlan
            >>> mib = 1 << 20
            >>> grown = Held(in_use=16 * mib, peak=183 * mib)   # regions 2 + 4 + ... + 64 + 66 MiB
            >>> four = XlaPlan(170 * mib, 32 * mib, temp_bytes=32 * mib, output_bytes=16 * mib, heap_bytes=(32 * mib,) * 4)
            >>> Budget(192 * mib, "config").heaps_replay(four, grown).fits
            True
            >>> five = dataclasses.replace(four, heap_bytes=(32 * mib,) * 5)
            >>> print(Budget(192 * mib, "config").heaps_replay(five, grown).why())
            the allocator finds no room for XLA's heap 5 of 5 (32.0 MiB): its regions of 2.0 + 4.0 + 8.0 + 16.0 + 32.0 + 64.0 + 66.0 MiB are in use or split too small, and 0 B is left to grow
        """
        if len(plan.heap_bytes) < 2:
            return None
        events = [Allocate("what the allocator holds", self.beside(held)), Allocate("the call's outputs", plan.output_bytes)]
        events += [Allocate(f"XLA's heap {i + 1} of {len(plan.heap_bytes)}", size) for i, size in enumerate(plan.heap_bytes)]
        return replay(events, self.nbytes if limit is None else limit, grown_to=max(held.peak, held.regions))

    def replan_target(self, plan: XlaPlan, estimate_bytes: int, held: Held = NOTHING_HELD) -> int | None:
        """The target the passes plan to next when XLA's plan (`plan`) of a program the
        static estimate put at `estimate_bytes` is over XLA's share; None when no plan can
        reach the share.

        Splitting further and taking smaller chunks lower XLA's block of temporaries; the
        call's inputs and outputs and what the allocator holds stay. So what must come off
        is counted in bytes: the plan's excess over the share, or its block's over the
        room it finds in one piece (`block_room`), whichever is more. The estimate comes
        down by the same share of itself as that is of XLA's plan (XLA can plan 1.8 times
        the estimate), and `REPLAN_MARGIN` below that. Dividing the target by the
        overshoot instead over-shrinks it where the block finds little room (GPR
        `predict_f(full_cov=True)`, n=1500, 2000 test points: planned lower under 152.6
        MiB than under 61 MiB), and where the block finds none at all the overshoot is the
        block over one byte (a target of 1 B). None when what must come off is the whole
        block or more: however small its temporaries, the rest leaves them no room
        (`why_not` says why).

        Example:
            >>> from tfmem.memory import XlaPlan
            >>> budget = Budget(1000, "config")                  # XLA's share 950
            >>> budget.replan_target(XlaPlan(900, 800), 900)     # the block finds 750: 50 of 900 to shed
            807
            >>> budget.replan_target(XlaPlan(900, 800), 450)     # the estimate's share of that: 25
            403
            >>> budget.replan_target(XlaPlan(900, 800), 900, Held(in_use=200, peak=200))  # it finds 550
            641
            >>> budget.replan_target(XlaPlan(900, 300, temp_bytes=300, output_bytes=500), 900) is None
            True
        """
        limit = self.xla_bytes
        whole = max(plan.total_bytes, self.beside(held) + plan.block_bytes + plan.output_bytes)
        room = self.block_room(plan.total_bytes, plan.block_bytes, held, other_bytes=plan.output_bytes, limit=limit)
        shed = max(whole - limit, plan.block_bytes - room)
        next_target = int(estimate_bytes * (1 - shed / max(whole, 1)) * REPLAN_MARGIN)
        return next_target if shed < plan.block_bytes and next_target > 0 else None

    def why_not(self, plan: XlaPlan, held: Held = NOTHING_HELD, *, limit: int | None = None) -> str:
        """Why XLA's plan does not fit `limit` (default: the budget itself), in words: the
        bytes over it, beside what the allocator holds; else the room its block of
        temporaries does not find in one piece (`block_room`).

        Example:
            >>> from tfmem.memory import XlaPlan
            >>> print(Budget(1000, "config").why_not(XlaPlan(900, 300, temp_bytes=300, output_bytes=500)))
            its block of temporaries (300 B) finds no room in one piece: regions of up to 2× XLA's other buffers (parameters, outputs, constants), 600 B, leave none of 1000 B
            >>> print(Budget(1000, "config").why_not(XlaPlan(700, 600, temp_bytes=600, output_bytes=100), Held(in_use=400)))
            the call allocates 700 B (its outputs and its block of temporaries) beside the 400 B the allocator holds already (its inputs among it): 1.1 KiB, over 1000 B
        """
        limit = self.nbytes if limit is None else limit
        total, block, outputs = plan.total_bytes, plan.block_bytes, plan.output_bytes
        beside, reasons = self.beside(held), []
        if beside + block + outputs > max(total, limit):
            reasons.append(f"the call allocates {format_size(block + outputs)} (its outputs and its block of "
                           f"temporaries) beside the {format_size(beside)} the allocator holds already (its inputs "
                           f"among it): {format_size(beside + block + outputs)}, over {format_size(limit)}")
        elif total > limit:
            reasons.append(f"XLA plans {format_size(total)}, over {format_size(limit)}")
        one_block = _without_other_heaps(plan)  # the other heaps are the replay's, below
        room = self.block_room(one_block, block, held, other_bytes=outputs, limit=limit)
        if block > room:
            grown = max(held.peak + outputs, one_block - block)
            which = ("the call's outputs and the allocator's peak" if held.peak + outputs >= one_block - block
                     else "XLA's other buffers (parameters, outputs, constants)")
            left = limit - self._grown_before(one_block, block, held, outputs)
            where = (f"regions of up to {REGION_SLACK:g}× {which}, {format_size(grown)}"
                     + (f" (at least the allocator's first, {format_size(held.regions)})"
                        if REGION_SLACK * grown < held.regions else "")
                     + ", leave " + (format_size(int(left)) if left >= 1 else "none") + f" of {format_size(limit)}")
            if held.peak and held.in_use:
                where += f", and those it grew hold {format_size(held.in_use)} in use"
            found = f"only {format_size(int(room))}" if room >= 1 else "no room"
            reasons.append(f"its block of temporaries ({format_size(block)}) finds {found} in one piece: {where}"
                           + self._heaps_hint(plan))
        heaps = self.heaps_replay(plan, held, limit=limit)
        if heaps is not None and not heaps.fits:
            reasons.append(heaps.why())
        return "; ".join(reasons) or f"XLA's plan fits {format_size(limit)}"

    @staticmethod
    def _heaps_hint(plan: XlaPlan) -> str:
        """For a block that finds no room in one piece: the process-wide heap limit that
        lets XLA allocate it in pieces (`tfmem.xla_heaps.suggested_heap_bytes`)."""
        size = suggested_heap_bytes(plan)
        if size is None:
            return ""
        return (f" (XLA packs its temporaries in one block; tfmem.limit_xla_heaps('{size >> 20}MiB'), called "
                f"before anything compiles, lets it allocate them in heaps of at most that size)")

    @property
    def origin(self) -> str:
        """Where the bound came from, in a few words: "memory_budget" (the config), or the
        device's limit it was derived from (e.g. "90% of TF_CPU_BFC_MEM_LIMIT_IN_MB=1024")."""
        return "memory_budget" if self.source == "config" else self.source.split(",")[0]

    def __str__(self) -> str:
        return f"{format_size(self.nbytes)} ({self.source})"


def _without_other_heaps(plan: XlaPlan) -> int:
    """The plan's bytes as the one-block rule (`Budget.xla_overshoot`) judges its largest
    heap: all its buffers but its other heaps, which `Budget.heaps_replay` places (counted
    as buffers allocated before the block, each heap would grow regions of twice its size
    in that rule, and a plan in 31 MiB heaps that ran was refused)."""
    return plan.total_bytes - (sum(plan.heap_bytes) - plan.block_bytes if len(plan.heap_bytes) > 1 else 0)


@dataclasses.dataclass(frozen=True)
class PlanVerdict:
    """Whether the static estimate of a rewritten program reaches its target
    (`PassContext.target_bytes`): the split pass's verdict, in its `PassResult`.

    Attributes:
        fits: the estimated peak is at most the target.
        peak_bytes: the estimated peak after the pass.
        target_bytes: what it had to reach.
        node: the node at the peak.
        reason: when it does not fit, why: the tensor, op and bytes that keep the peak.
        threshold_dropped: when splitting by `tensor_size_threshold` could not meet the
            target and the plan by the budget alone came out lower, why (naming both
            numbers): the threshold was not honoured, the bound was.
        split_size_dropped: when a loop holds more than `tensor_split_size` (one slice of
            its tensor is over it), which: the split size was not honoured, the bound was.
    """

    fits: bool
    peak_bytes: int
    target_bytes: int
    node: str = ""
    reason: str = ""
    threshold_dropped: str = ""
    split_size_dropped: str = ""


def resolve_budget(config: Config, device: str | None = None, *, sharing: int = 1,
                   environ: Mapping[str, str] | None = None,
                   gpu_limits: Callable[[], Mapping[str, int]] | None = None,
                   in_use: Callable[[str], tuple[int, int]] | None = None) -> Budget | None:
    """The budget a function rewritten under `config` on `device` works to, or None.

    `sharing`: how many replicas (of a `tf.distribute` strategy) share the device's
    allocator; the config's budget is per replica already.
    """
    if config.budget_off:
        return None
    if config.memory_budget is not None:
        return Budget(config.memory_budget, "config")
    if "split" not in config.passes:
        return None
    return device_budget(device, sharing=sharing, environ=environ, gpu_limits=gpu_limits, in_use=in_use)


def device_budget(device: str | None = None, *, sharing: int = 1, environ: Mapping[str, str] | None = None,
                  gpu_limits: Callable[[], Mapping[str, int]] | None = None,
                  in_use: Callable[[str], tuple[int, int]] | None = None) -> Budget | None:
    """The budget the device offers: see the module docstring.

    What the device's allocator already holds (other programs' tensors, variables, data)
    is not on offer: the budget is the limit less that, split evenly between `sharing`
    replicas.

    Args:
        device: e.g. "GPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"; None = the
            first GPU if there is one, else the CPU.
        sharing: replicas that share this device's allocator (logical CPUs share one).
        environ: the environment (default `os.environ`).
        gpu_limits: returns GPU name ("GPU:0") → allocator limit in bytes (default: asks
            TensorFlow); tests pass a stub.
        in_use: device name ("CPU:0") → (bytes its allocator holds now, its peak so
            far) (default: asks TensorFlow); tests pass a stub.
    """
    environ = os.environ if environ is None else environ
    limits = _gpu_limits if gpu_limits is None else gpu_limits
    kind, index = _resolve_device(device, lambda: limits().keys())
    if kind == "GPU":
        limit = limits().get(f"GPU:{index}")
        if not limit:
            return None
        total, source = int(limit * GPU_SAFETY_FRACTION), f"{GPU_SAFETY_FRACTION:.0%} of GPU:{index}'s {format_size(limit)}"
    elif kind == "CPU" and environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() in ("1", "true"):
        text = environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "").strip()
        if not text.isdigit() or int(text) <= 0:
            return None
        total, source = int(text) * 2**20, f"TF_CPU_BFC_MEM_LIMIT_IN_MB={text}"  # TF reads MiB
    else:
        return None
    held, peak = (_memory_info if in_use is None else in_use)(f"{kind}:{index}")
    free = max(0, total - held)
    if held:
        source += f", less {format_size(held)} in use"
    if kind == "CPU":
        # TensorFlow's CPU BFC allocator grows in regions (doubling: 2, 4, 8 MiB, ...) and,
        # unlike the GPU's, never gives one back; XLA asks for a program's temporaries as
        # one block. A block must fit in the regions earlier programs grew (at least their
        # peak) or in what is left to grow (the limit less that): the larger of the two.
        room = min(free, max(peak, total - peak))
        if room < free:
            source += f", of which one block may take {format_size(room)} (peak so far {format_size(peak)})"
        free, source = int(room * CPU_SAFETY_FRACTION), f"{CPU_SAFETY_FRACTION:.0%} of {source}"
    if sharing > 1:
        source += f", shared by {sharing} replicas"
    return Budget(free // max(1, sharing), source, in_use_excluded=held)


def allocator_held(device: str | None = None) -> Held:
    """What the allocator a program on `device` uses holds now, and its peak where it matters.

    Nothing on the CPU without `TF_CPU_ALLOCATOR_USE_BFC`: no limit is enforced there, and
    a budget bounds the program alone (the test suite's process holds whatever earlier
    tests left). The peak is 0 where the allocator does not grow in regions (a GPU without
    memory growth: one preallocated region): see `Budget.xla_overshoot`. Zeros where unknown.

    `device`: as for `device_budget`; None = the first GPU if there is one, else the CPU.
    """
    kind, index = _resolve_device(device, _gpu_names)
    grows = _grows_in_regions(kind, index)
    if kind == "CPU" and not grows:
        return NOTHING_HELD
    in_use, peak = _memory_info(f"{kind}:{index}")
    if not grows:
        return Held(in_use, 0)
    return Held(in_use, peak, regions=BFC_FIRST_REGION if peak > 0 else 0)


def _grows_in_regions(kind: str, index: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the device's allocator is a BFC allocator that grows region by region."""
    environ = os.environ if environ is None else environ
    if kind == "CPU":
        return environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() in ("1", "true")
    if environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").strip().lower() == "true":
        return True
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return index < len(gpus) and bool(tf.config.experimental.get_memory_growth(gpus[index]))


def _memory_info(device: str) -> tuple[int, int]:
    """Bytes the device's allocator holds now, and its peak so far ((0, 0) where unknown)."""
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, tf.errors.OpError):
        return 0, 0
    return int(info["current"]), int(info["peak"])


def _parse_device(device: str | None) -> tuple[str | None, int]:
    if not device:
        return None, 0
    match = _DEVICE_RE.search(device.strip())
    if match is None:
        return None, 0
    return match.group("kind").upper(), int(match.group("index"))


def _resolve_device(device: str | None, gpu_names: Callable[[], Iterable[str]]) -> tuple[str, int]:
    """("GPU", 0) for "GPU:0" and the like; for None, the first of `gpu_names` or else the CPU."""
    kind, index = _parse_device(device)
    if kind is None:
        gpus = list(gpu_names())
        kind, index = ("GPU", min(_parse_device(name)[1] for name in gpus)) if gpus else ("CPU", 0)
    return kind, index


def _gpu_names() -> list[str]:
    """"GPU:0", ... for each visible GPU (without asking device_lib for their limits)."""
    import tensorflow as tf

    return [f"GPU:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]


def _gpu_limits() -> dict[str, int]:
    """Allocator limit of each visible GPU, from TensorFlow's local device list."""
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        return {}  # without GPUs, skip device_lib: it would initialise every device
    from tensorflow.python.client import device_lib

    devices: Sequence[Any] = device_lib.list_local_devices()
    return {f"GPU:{d.name.rsplit(':', 1)[1]}": int(d.memory_limit) for d in devices
            if d.device_type == "GPU"}
