"""The stages of one signature, each a value you can hold and inspect (as JAX's are).

    Traced      the user's function traced for these arguments and taken apart
      │ .rewrite(config)
    Rewritten   the graph after the pass pipeline, its records and memory estimate
      │ .compile()
    Compiled    the rewritten graph imported into a `tf.function` (XLA by default)

`tfmem.function(f)(*args)` is the composition of the three, cached per signature,
with a fallback to the original where a stage fails. Each stage raises instead:

Example:
    >>> import tfmem
    >>> from tfmem.examples import kernel_matmul, kernel_matmul_inputs
    >>> x, v = kernel_matmul_inputs(n=1000)
    >>> wrapped = tfmem.function(kernel_matmul, config={"memory_budget": "8MiB"})
    >>> traced = wrapped.trace(x, v)                  # Traced: .graph, .captured, .memory
    >>> print(traced.memory)
    peak ... MiB at Square (largest live: Square:0 float64[1000, 1000, 3] 22.9 MiB, ...)
    >>> rewritten = traced.rewrite(wrapped.config)   # Rewritten: .graph, .records, .memory, .verdict
    >>> print(rewritten.report.summary())
    fits 8.0 MiB (memory_budget): estimated peak ... MiB, was ... MiB; 1 loop in ... chunks
    >>> compiled = rewritten.compile()
    >>> compiled(x, v).shape, compiled.xla_planned_bytes(x, v) <= 8 * 2**20
    (TensorShape([1000, 16]), True)
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

from tfmem.budget import ESTIMATE_ERROR, NOTHING_HELD, Budget, Held, PlanVerdict, allocator_held, resolve_budget
from tfmem.capture import CapturedFunction, import_as_function
from tfmem.config import Config, format_size
from tfmem.context import PassContext
from tfmem.graph import Graph
from tfmem.memory import (TENSOR_LIST_OPS, MemoryEstimate, XlaPlan, estimate_memory, ops_in, xla_expanded_ops,
                          xla_plan_or_refusal)
from tfmem.passes import GraphPass, PassManager, PipelineResult, RewriteRecord, collector_paused, default_pipeline
from tfmem.report import (NEVER_WORSE_RULE, XLA_CHECKED_RULE, XLA_EARLIER_RULE, XLA_HELD_RULE, XLA_PEAK_RULE,
                          XLA_PEAK_RULES, XLA_SHRINK_RULE, XLA_SPLIT_RULE, XLA_WHOLE_RULE, Report)


@dataclasses.dataclass(frozen=True)
class Traced:
    """A traced signature, taken apart for rewriting.

    Attributes:
        function_name: the user's function.
        signature: its input signature, as text.
        captured: the ConcreteFunction taken apart (arguments, captures, outputs, effects).
        seconds: how long tracing and capturing took.
    """

    function_name: str
    signature: str
    captured: CapturedFunction
    seconds: float = 0.0
    # The prefixes of the pipelines run on this trace (`PassManager.run`'s cache), by the
    # passes that ran: reused when the same passes run again under another target or budget.
    _prefixes: dict[Any, dict[Any, PipelineResult]] = dataclasses.field(default_factory=dict, compare=False,
                                                                        repr=False)
    # What passes computed on this trace that the next pipeline run reuses (`PassContext.memo`).
    _memo: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def graph(self) -> Graph:
        """The traced graph (a fresh view: passes work on their own copy)."""
        return self.captured.to_graph()

    @functools.cached_property
    def memory(self) -> MemoryEstimate:
        """The static peak estimate of the traced graph."""
        return estimate_memory(self.graph)

    def rewrite(self, config: Config | None = None, *, passes: Sequence[GraphPass] | None = None,
                lint: bool = False, device: str | None = None, budget: Budget | None = None,
                target_bytes: int | None = None, xla_peaks: Sequence[MemoryEstimate] = (),
                xla_checked: bool = True, peak_rules: Sequence[frozenset[str] | None] = ()) -> Rewritten:
        """Runs the pass pipeline under `config` (default: `Config()`) for `device`.

        Args:
            passes: the passes to run; None = the registered pipeline for `config`.
            lint: check the graph after every pass (tests turn this on).
            device: where the function will run, for a budget from the device.
            budget: the budget, when the caller resolved it (a replica's share of its
                device); None = `resolve_budget(config, device)`.
            target_bytes: what the static estimate must reach; None = the budget's
                `plan_bytes` (`compile_within_budget` asks for less when XLA needs more).
            xla_peaks: XLA's live sets at its peaks in earlier compiles that did not fit,
                oldest first (`PassContext.xla_peaks`).
            xla_checked: run the passes XLA decides on (`GraphPass.xla_checked`) too;
                `compile_within_budget` holds them back until a plan does not fit.
            peak_rules: the passes that may act on each of `xla_peaks`, by position
                (`PassContext.peak_rules`); missing or None = all.

        Raises:
            PassError: naming the pass that failed.
        """
        config = config or Config()
        start = time.perf_counter()
        if budget is None:
            budget = resolve_budget(config, device)
        context = PassContext.for_budget(config, budget)
        if target_bytes is not None:
            context = context.tightened(target_bytes)
        if xla_peaks:
            context = context.seeing(*xla_peaks)
        if peak_rules:
            context = dataclasses.replace(context, peak_rules=tuple(peak_rules))
        context = dataclasses.replace(context, memo=self._memo)
        # The registered pipeline is made anew from the config; given passes are the same objects.
        # Plans with and without the passes XLA decides on share a cached prefix only as far as
        # their passes agree: `PassManager.prefix_key` names the passes each prefix ran.
        cache = self._prefixes.setdefault((tuple(passes) if passes is not None else "registered", lint), {})
        passes = [p for p in (passes if passes is not None else default_pipeline(config))
                  if xla_checked or not p.xla_checked]
        result = PassManager(passes, lint=lint).run(self.graph, context, cache=cache)
        with collector_paused():
            memory = estimate_memory(result.graph)
        return Rewritten(traced=self, context=context, graph=result.graph, records=tuple(result.records),
                         pass_seconds=dict(result.seconds), memory=memory, verdict=result.verdict(PlanVerdict),
                         seconds=time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class Rewritten:
    """A signature after the pass pipeline.

    Attributes:
        traced: the stage it came from.
        context: what the passes were handed: the config as given, the budget, the target.
        graph: the rewritten graph.
        records: what every pass did or declined to do, with reasons.
        pass_seconds: time in each pass.
        memory: the static peak estimate of the rewritten graph.
        verdict: the split planner's verdict on the target (None: no budget, or no split stage).
        seconds: how long rewriting took.
        cached: the plan cache file it was read from ("" when the passes made it here).
    """

    traced: Traced
    context: PassContext
    graph: Graph
    records: tuple[RewriteRecord, ...]
    pass_seconds: Mapping[str, float]
    memory: MemoryEstimate
    verdict: PlanVerdict | None
    seconds: float
    cached: str = ""

    @property
    def config(self) -> Config:
        """The config the passes ran under, as the user gave it."""
        return self.context.config

    @property
    def budget(self) -> Budget | None:
        """The budget and where it came from (None: no budget)."""
        return self.context.budget

    @property
    def modified(self) -> bool:
        return any(r.status == "fired" for r in self.records)

    @property
    def report(self) -> Report:
        """The report of this stage (no XLA bytes: `TfmemFunction.explain` compiles both
        programs to add them)."""
        return Report.of(self.traced, self)

    def compile(self, *, input_signature: Any = None, name: str = "tfmem", with_xla: bool | None = None) -> Compiled:
        """Imports the rewritten graph into a `tf.function`, with XLA when `with_xla` says so
        (None: when the config does).

        Tracing happens on the first call: errors XLA raises for a graph it cannot take
        surface there.
        """
        start = time.perf_counter()
        with_xla = self.config.jit_compile if with_xla is None else with_xla
        function = import_as_function(self.traced.captured, self.graph, jit_compile=with_xla,
                                      input_signature=input_signature, name=name)
        return Compiled(self, function, time.perf_counter() - start, with_xla=with_xla)

    def for_trace(self, traced: Traced) -> Rewritten:
        """This rewrite, for another trace of the same program (a replica's: same graph,
        its own captured variables); `compile` then imports it with that trace's."""
        return dataclasses.replace(self, traced=traced)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """The rewritten graph as a callable `tf.function` with the user's signature.

    Attributes:
        checked_plan: XLA's plan for it, when `compile_within_budget` checked one.
        xla_overshoot: `Budget.xla_overshoot` of that plan against XLA's share (≤ 1: within
            the share planning aims for), given what the allocator held before.
        held: what the allocator held when the plan was checked, and its peak
            (`Budget.fits_xla_plan` judges the plan beside them).
        check_seconds: how long asking XLA took (it compiles the program).
        with_xla: whether the function runs under XLA (as the config says, unless XLA
            could not compile the rewrite: `TfmemFunction._run_without_xla`).
        xla_refusal: why XLA could not compile the rewrite, where `compile_within_budget`
            found it so when it asked for XLA's plan and planned for graph mode instead.
    """

    rewritten: Rewritten
    function: Callable[..., Any]
    seconds: float = 0.0
    checked_plan: XlaPlan | None = None
    xla_overshoot: float | None = None
    check_seconds: float = 0.0
    held: Held = NOTHING_HELD
    with_xla: bool = True
    xla_refusal: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def xla_plan_or_refusal(self, *args: Any, **kwargs: Any) -> tuple[XlaPlan | None, str]:
        """XLA's buffer assignment for one call, or else why XLA cannot compile the program
        (`memory.xla_plan_or_refusal`); (None, "") when not compiled with XLA."""
        if not self.with_xla:
            return None, ""
        return xla_plan_or_refusal(self.function, *args, **kwargs)

    def xla_plan(self, *args: Any, **kwargs: Any) -> XlaPlan | None:
        """XLA's buffer assignment for one call (None when not compiled with XLA, or XLA
        cannot compile it)."""
        return self.xla_plan_or_refusal(*args, **kwargs)[0]

    def xla_planned_bytes(self, *args: Any, **kwargs: Any) -> int | None:
        """XLA's planned bytes for one call (None when not compiled with XLA)."""
        plan = self.xla_plan(*args, **kwargs)
        return plan.total_bytes if plan is not None else None


def compile_within_budget(traced: Traced, config: Config, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                          passes: Sequence[GraphPass] | None = None, lint: bool = False,
                          budget: Budget | None = None, input_signature: Any = None,
                          name: str = "tfmem", ask_xla: bool = False) -> Compiled:
    """Rewrites and compiles `traced`; with a budget and XLA, makes sure XLA's plan fits it.

    The static estimate counts live tensors; XLA's buffer assignment is what the
    allocator will see (one block of temporaries, plus constants and parameters), and it
    can be larger: copies in loops, fusion choices, its own schedule. Asking XLA for it
    is a full compilation, as long as the one that runs the program, so it is asked only
    when the estimate cannot settle the question:

    1. The passes plan to `Budget.plan_bytes`. A plan whose estimate fits even when XLA
       plans the estimate's largest measured error more (`Budget.fits_unchecked`) is
       compiled once, to run; not when it has an op XLA expands far beyond its output
       (`memory.XLA_EXPANDED_OPS`: igamma, lgamma, polygamma, betainc), nor when the
       program keeps values in TensorLists (`memory.TENSOR_LIST_OPS`: a gradient through a
       loop, `map_fn` or `scan`), for which no margin holds.
       (Planning lower on purpose to get there would take smaller chunks, and every later
       step would pay for the compile saved once.)
    2. Otherwise XLA's plan is checked. When it is over `Budget.xla_bytes`, or has a
       block too large to find room beside the rest (`Budget.xla_overshoot`), the passes
       XLA decides on (held back so far) are tried, and kept when XLA fits their plan
       better (`_with_xla_checked_passes`, one compile more); then the passes run again to
       a target lowered by what XLA's plan must shed (`Budget.replan_target`), up to
       `_REPLANS` times; not when the static plan already missed its own target (a tighter
       one meets the same wall), nor when no plan can fit (the call's inputs, outputs and
       what the allocator holds leave its temporaries no room, however small).
    3. A rewritten program that XLA still plans over its share (`Budget.xla_bytes`: one
       within the budget but over the share fits, with less margin than planned for) is
       planned once more with XLA's live set at its peak in view: what XLA holds there for
       later readers is made again for them, a loop XLA peaks in takes smaller chunks
       (`_plan_around_xla_peaks`); kept when XLA's plan then fits better (one more
       compile), and again at XLA's new peak. When
       the passes XLA decides on were compiled both ways in rule 2, the variant not kept
       is planned around its peaks too, and kept instead if XLA then fits it better
       (`_better_around_xla_peaks`).
    4. A rewritten program that still does not fit is compared with the program as
       written (one more XLA compile): where XLA plans less for that, the rewrite is
       dropped and the program runs as written (`_never_worse_than_written`).

    Where XLA cannot compile the rewrite when its plan is asked for (the gradient of a loop
    with no bound on its trips, an op XLA has no kernel for), the program is planned for
    graph mode instead, where it will run (`Compiled.xla_refusal` says why).

    `ask_xla`: skip the first rule (the wrapper asks again so when an unchecked plan ran
    out of memory).
    """
    budget = budget if budget is not None else resolve_budget(config)
    # Passes XLA decides on run only once a plan without them does not fit (rule 2).
    checked = False
    other: Compiled | None = None  # the plan `_with_xla_checked_passes` did not keep
    if budget is not None and not config.jit_compile:  # no XLA plan to check: a margin, and small chunks
        split = min(config.tensor_split_size or budget.graph_mode_split_bytes, budget.graph_mode_split_bytes)
        return traced.rewrite(dataclasses.replace(config, tensor_split_size=split), passes=passes, lint=lint,
                              budget=budget, target_bytes=budget.graph_mode_plan_bytes).compile(
            input_signature=input_signature, name=name)
    rewritten = traced.rewrite(config, passes=passes, lint=lint, budget=budget, xla_checked=checked)
    if budget is None:
        return rewritten.compile(input_signature=input_signature, name=name)
    # The allocator's peak is read after each rewrite and check, not before: rewriting
    # (Grappler's constant folding) and XLA's compilation allocate too, and the regions
    # they grow stay (SGPR Matern52 N=40,000 under 192 MiB: 11.4 MiB before the rewrite,
    # 30.3 MiB after it, and XLA's 137.4 MiB block then found no room).
    # XLA's plan for these can be ten times the estimate (igamma over [1000, 1300] f64:
    # estimated 60.8 MiB, XLA plans 708 MiB), so no error margin makes the estimate safe.
    expanded = xla_expanded_ops(rewritten.graph)
    # The program's own TensorLists (not the split loops', whose stacks the estimate counts).
    lists = ops_in(traced.graph, TENSOR_LIST_OPS)
    # The outputs are allocated before the block of temporaries, in regions of their own.
    outputs = sum(rewritten.graph.nbytes(ref) or 0 for ref in rewritten.graph.outputs)
    if not (ask_xla or expanded or lists) and budget.fits_unchecked(rewritten.memory.peak_bytes, allocator_held(),
                                                                    outputs):
        note = RewriteRecord("compile_within_budget", "XlaPlan", "info", kind="plan", reason=(
            f"not asked: the estimated peak {format_size(rewritten.memory.peak_bytes)} fits even if XLA plans "
            f"{ESTIMATE_ERROR}× it (the estimate's largest error measured on the corpus) in one block"))
        rewritten = dataclasses.replace(rewritten, records=(*rewritten.records, note))
        return rewritten.compile(input_signature=input_signature, name=name)
    compiled = rewritten.compile(input_signature=input_signature, name=name)
    check_seconds = 0.0
    best: Compiled | None = None  # a re-plan can come out worse (more loops, more held): keep the best
    stopped: RewriteRecord | None = None
    for attempt in range(_REPLANS + 1):
        start = time.perf_counter()
        planned, refusal = compiled.xla_plan_or_refusal(*args, **kwargs)
        check_seconds += time.perf_counter() - start
        held = allocator_held()
        if planned is None:
            # Inside another function's trace the arguments are symbolic: no refusal of XLA's.
            if refusal and attempt == 0 and tf.executing_eagerly():  # planned for where it will run: graph mode
                plain = compile_within_budget(traced, dataclasses.replace(config, jit_compile=False), args, kwargs,
                                              passes=passes, lint=lint, budget=budget,
                                              input_signature=input_signature, name=name)
                return dataclasses.replace(plain, xla_refusal=refusal, check_seconds=check_seconds)
            return dataclasses.replace(compiled, check_seconds=check_seconds)
        overshoot = budget.plan_overshoot(planned, held)
        compiled = dataclasses.replace(compiled, checked_plan=planned, xla_overshoot=overshoot,
                                       check_seconds=check_seconds, held=held)
        if attempt == 0 and overshoot > 1:
            compiled, checked, other = _with_xla_checked_passes(traced, config, compiled, budget, args, kwargs,
                                                                passes=passes, lint=lint,
                                                                input_signature=input_signature, name=name)
            check_seconds, rewritten = compiled.check_seconds, compiled.rewritten
            if checked:  # plan on with them
                planned, overshoot, held = compiled.checked_plan, compiled.xla_overshoot, compiled.held
                assert planned is not None and overshoot is not None
        if best is None or overshoot < best.xla_overshoot:
            best = compiled
        if overshoot <= 1 or attempt == _REPLANS:
            break
        if rewritten.verdict is not None and not rewritten.verdict.fits:
            # The static plan already missed its own target with nothing left to split or
            # shrink: a tighter target meets the same wall, after another XLA compile
            # (SGPR M=20,000 at 32 GiB: 5 min of compile for a plan that came out worse).
            stopped = RewriteRecord(
                "compile_within_budget", "XlaPlan", "info", kind="plan",
                reason=f"XLA plans {format_size(planned.total_bytes)} against its share {format_size(budget.xla_bytes)} "
                       f"({budget.describe_overshoot(overshoot)}); not planning again: the static plan is over its "
                       "target already, with nothing left that splitting or smaller chunks would lower")
            break
        target = budget.replan_target(planned, rewritten.memory.peak_bytes, held)
        if target is None:
            # However small its temporaries, the rest leaves them no room: planning again
            # would only take smaller chunks, each trip slower, for no verdict it can change.
            stopped = RewriteRecord(
                "compile_within_budget", "XlaPlan", "info", kind="plan",
                reason=f"XLA plans {format_size(planned.total_bytes)} against its share {format_size(budget.xla_bytes)} "
                       f"({budget.describe_overshoot(overshoot)}); not planning again: no plan can fit, "
                       f"{budget.why_not(planned, held, limit=budget.xla_bytes)}")
            break
        note = RewriteRecord("compile_within_budget", "XlaPlan", "info", kind="plan", details={
            "xla_planned_bytes": planned.total_bytes, "xla_share_bytes": budget.xla_bytes,
            "xla_largest_allocation_bytes": planned.largest_bytes, "overshoot": round(overshoot, 3),
            "next_target_bytes": target})
        again = traced.rewrite(config, passes=passes, lint=lint, budget=budget, target_bytes=target,
                               xla_checked=checked)
        rewritten = dataclasses.replace(again, records=(note, *again.records),
                                        seconds=rewritten.seconds + again.seconds)
        compiled = rewritten.compile(input_signature=input_signature, name=name)
    assert best is not None and best.xla_overshoot is not None
    records = best.rewritten.records + ((stopped,) if stopped is not None else ())
    if best is not compiled:
        records = (*records, RewriteRecord(
            "compile_within_budget", "XlaPlan", "info", kind="plan",
            reason=f"planning again came out worse under XLA ({budget.describe_overshoot(compiled.xla_overshoot)}): "
                   f"kept the plan with {budget.describe_overshoot(best.xla_overshoot)}"))
    # The time of every attempt counts, whichever plan is kept.
    best = dataclasses.replace(best, check_seconds=check_seconds, rewritten=dataclasses.replace(
        best.rewritten, records=records, seconds=rewritten.seconds))
    best = _plan_around_xla_peaks(traced, config, best, budget, args, kwargs, passes=passes, lint=lint,
                                  input_signature=input_signature, name=name, xla_checked=checked)
    if other is not None:
        best = _better_around_xla_peaks(traced, config, best, other, budget, args, kwargs, passes=passes, lint=lint,
                                        input_signature=input_signature, name=name, xla_checked=not checked)
    best = _never_worse_than_written(traced, config, best, budget, args, kwargs, input_signature=input_signature,
                                     name=name)
    # Said last: the plans above each carry the records of their own rewrite.
    why_asked = []
    if expanded:
        why_asked.append(f"the program has {', '.join(expanded)}, which XLA lowers to loops whose temporaries can "
                         "be many times the estimate")
    if lists:
        why_asked.append(f"the program keeps values in TensorLists ({', '.join(lists)}), whose elements the "
                         "estimate does not count: how many there are is set when its loops run")
    if why_asked:
        best = dataclasses.replace(best, rewritten=dataclasses.replace(best.rewritten, records=(
            *best.rewritten.records, RewriteRecord("compile_within_budget", "XlaPlan", "info", kind="plan",
                                                   reason="asked: " + "; ".join(why_asked)))))
    return judged_as_the_allocator_is(best)


def judged_as_the_allocator_is(compiled: Compiled) -> Compiled:
    """`compiled`'s plan judged beside what the allocator holds now, before its call.

    The checks made after the plan was judged compile too, and the regions they grow stay:
    a variant XLA was asked about and not kept, the program as written. (A CG solve's
    gradient under 76 MiB: 0.2 MiB held when its plan was judged to fit, 15.3 MiB after
    XLA compiled a variant of it, and the call's 74.2 MiB block found no room.) A plan
    another process made, or another replica, was judged beside that allocator, not this.
    """
    budget = compiled.rewritten.budget
    if compiled.checked_plan is None or budget is None:
        return compiled
    held = allocator_held()
    if held == compiled.held:
        return compiled
    return dataclasses.replace(compiled, held=held, xla_overshoot=budget.plan_overshoot(compiled.checked_plan, held))


def _plan_around_xla_peaks(traced: Traced, config: Config, compiled: Compiled, budget: Budget,
                           args: Sequence[Any], kwargs: Mapping[str, Any], *,
                           passes: Sequence[GraphPass] | None, lint: bool, input_signature: Any,
                           name: str, xla_checked: bool) -> Compiled:
    """`compiled`, or its plan made again with XLA's peaks in view while XLA's plan of that fits better.

    The passes plan to the static estimate, whose schedule and loop bodies are not XLA's:
    a tensor the estimate sees read at its peak can be one XLA holds across its own, and
    XLA keeps more chunk-sized temporaries in a loop body than the estimate counts. XLA's
    live set at its peak (`XlaPlan.peak`) says which; the pipeline runs once more with it
    (`PassContext.xla_peaks`): what XLA held there for later readers is made again for
    them (`rewrites.split.recompute`), and a loop XLA peaked in takes smaller chunks
    (`Planner.shrink_at_xla_peaks`). Each round costs one more compile and is kept only if
    XLA's plan of it fits better (`Budget.plan_overshoot`); the next round sees the new
    peak beside the old ones, up to `_XLA_PEAK_ROUNDS`, while XLA's plan is over its share
    of the budget (`Budget.xla_bytes`, what planning aims for; `Compiled.xla_overshoot`).

    For example GPflow's SGPR loss and gradients, N=20,000, M=3,600 under 512 MiB: XLA
    peaks in the Cholesky gradient of the second factor at 523 MiB, holding the first
    factor L for the gradient after it; with L made again there it plans 445.7 MiB.
    """
    peaks: tuple[MemoryEstimate, ...] = ()
    kept_rules: tuple[frozenset[str] | None, ...] = ()  # for each older peak, the rules its plan was kept with
    acted_before = 0
    for _ in range(_XLA_PEAK_ROUNDS):
        plan = compiled.checked_plan
        if plan is None or plan.peak is None or (compiled.xla_overshoot or 0) <= 1:
            return compiled
        peaks = (*peaks, plan.peak_with_others)
        start = time.perf_counter()

        def rewrite(rules: frozenset[str] | None) -> Rewritten:
            return traced.rewrite(config, passes=passes, lint=lint, budget=budget,
                                  target_bytes=compiled.rewritten.context.target_bytes, xla_peaks=peaks,
                                  xla_checked=xla_checked, peak_rules=(*kept_rules, rules))

        def acted_in(rewritten: Rewritten) -> list[RewriteRecord]:
            return [r for r in rewritten.records if r.rule in XLA_PEAK_RULES and r.status == "fired"]

        again = rewrite(None)
        acted = acted_in(again)
        if len(acted) <= acted_before:  # nothing new: say why not, from what each rule found
            why = tuple(r for r in again.records if r.rule in XLA_PEAK_RULES and r.status != "fired")
            return _noted(compiled, why, check_seconds=compiled.check_seconds + time.perf_counter() - start)
        tried = [_xla_peak_round(again, acted, None, budget, args, kwargs, input_signature=input_signature,
                                 name=name)]
        # Rules that each lower XLA's peak can raise it together (a tensor made again after the
        # peak that another rule made XLA compute before it): when the round does not fit
        # better, each rule that acted is tried alone on the newest peak. The rule kept acts
        # alone on that peak in later rounds too.
        rules = list(dict.fromkeys(r.pass_name for r in acted))
        if not tried[0].better_than(compiled) and len(rules) > 1:
            for rule in rules:
                alone = rewrite(frozenset({rule}))
                acted_alone = acted_in(alone)
                if len(acted_alone) > acted_before:
                    tried.append(_xla_peak_round(alone, acted_alone, frozenset({rule}), budget, args, kwargs,
                                                 input_signature=input_signature, name=name))
        best = min(tried, key=lambda t: t.overshoot if t.overshoot is not None else float("inf"))
        check_seconds = compiled.check_seconds + time.perf_counter() - start
        # Kept for what decides the verdict: XLA's plan must fit better, not only be smaller.
        if not best.better_than(compiled):
            notes = tuple(RewriteRecord("compile_within_budget", XLA_PEAK_RULE, "rejected", kind="plan", reason=(
                f"not kept: with {t.changes}, XLA plans "
                + (f"{format_size(t.planned.total_bytes)} ({budget.describe_overshoot(t.overshoot)})"
                   if t.planned is not None and t.overshoot is not None else "nothing it can compile")
                + f", {format_size(plan.total_bytes)} ({budget.describe_overshoot(compiled.xla_overshoot or 0)}) "
                  "without")) for t in tried)
            return _noted(compiled, notes, check_seconds=check_seconds)
        acted_before = len(best.acted)
        kept_rules = (*kept_rules, best.rules)
        notes = tuple(r for r in compiled.rewritten.records if r.pass_name == "compile_within_budget")
        kept = RewriteRecord("compile_within_budget", XLA_PEAK_RULE, "info", kind="plan", reason=(
            f"kept: with {best.changes}, XLA plans {format_size(best.planned.total_bytes)} "
            f"({budget.describe_overshoot(best.overshoot)}), "
            f"{format_size(plan.total_bytes)} ({budget.describe_overshoot(compiled.xla_overshoot)}) without"),
            details={"xla_with_bytes": best.planned.total_bytes, "xla_without_bytes": plan.total_bytes})
        rewritten = dataclasses.replace(best.rewritten, records=(*notes, *best.rewritten.records, kept),
                                        seconds=compiled.rewritten.seconds + best.rewritten.seconds)
        compiled = dataclasses.replace(best.candidate, rewritten=rewritten, checked_plan=best.planned,
                                       xla_overshoot=best.overshoot, check_seconds=check_seconds, held=best.held)
    return compiled


@dataclasses.dataclass(frozen=True)
class _XlaPeakRound:
    """One plan of `_plan_around_xla_peaks`, compiled and checked."""

    rewritten: Rewritten
    acted: list[RewriteRecord]
    rules: frozenset[str] | None  # the rules that acted on the newest peak (None: all)
    candidate: Compiled
    planned: XlaPlan | None
    overshoot: float | None
    held: Held
    changes: str

    def better_than(self, compiled: Compiled) -> bool:
        """Whether XLA's plan of it fits better than `compiled`'s."""
        return (self.overshoot is not None and compiled.xla_overshoot is not None
                and self.overshoot < compiled.xla_overshoot)


def _xla_peak_round(rewritten: Rewritten, acted: list[RewriteRecord], rules: frozenset[str] | None, budget: Budget,
                    args: Sequence[Any], kwargs: Mapping[str, Any], *, input_signature: Any,
                    name: str) -> _XlaPeakRound:
    candidate = rewritten.compile(input_signature=input_signature, name=name)
    planned = candidate.xla_plan(*args, **kwargs)
    held = allocator_held()
    overshoot = budget.plan_overshoot(planned, held) if planned is not None else None
    changes = "; ".join(dict.fromkeys(_xla_peak_change(r) for r in acted))
    return _XlaPeakRound(rewritten, acted, rules, candidate, planned, overshoot, held, changes)


def _xla_peak_change(record: RewriteRecord) -> str:
    """What a rule acting on XLA's peak changed, in a few words."""
    if record.rule == XLA_SHRINK_RULE:
        return f"loop {record.details.get('loop')} in chunks of {record.details.get('chunk')}"
    if record.rule == XLA_EARLIER_RULE:
        return f"{record.details.get('tensor')} reduced before {record.details.get('before')}"
    if record.rule == XLA_HELD_RULE:
        return f"{record.details.get('tensor')} folded before {record.details.get('before')}"
    if record.rule == XLA_WHOLE_RULE:
        return f"{record.details.get('tensor')} made whole before {record.details.get('before')}"
    if record.rule == XLA_SPLIT_RULE:
        return f"{record.details.get('tensor')} split at XLA's peak in {record.details.get('chunks')} chunks"
    return f"{record.details.get('tensor')} made again after XLA's peak"


def _noted(compiled: Compiled, records: Sequence[RewriteRecord], *, check_seconds: float) -> Compiled:
    """`compiled` as it is, with `records` added to its report and the time its checks took."""
    return dataclasses.replace(compiled, check_seconds=check_seconds, rewritten=dataclasses.replace(
        compiled.rewritten, records=(*compiled.rewritten.records, *records)))


def _with_xla_checked_passes(traced: Traced, config: Config, compiled: Compiled, budget: Budget,
                             args: Sequence[Any], kwargs: Mapping[str, Any], *,
                             passes: Sequence[GraphPass] | None, lint: bool, input_signature: Any,
                             name: str) -> tuple[Compiled, bool, Compiled | None]:
    """`compiled` (planned without the passes XLA decides on), or the plan with them when XLA
    fits that better; whether it was; and the plan not kept, when both were compiled.

    A pass marked `GraphPass.xla_checked` lowers what XLA plans in some programs and raises
    it in others (XLA schedules around it differently), which only a compile tells. It is
    held back until a plan without it does not fit; then the pipeline runs again with it,
    to the same target, at the cost of one more compile, and the plan XLA fits better is
    kept (`Budget.plan_overshoot`); planning goes on with the kept plan's passes, and the
    report says which and why.

    For example, with its triangular solves in place (`SolveInPlace`), GPflow's GPR loss and
    gradients at n=4,300 under 512 MiB: XLA plans 441.5 MiB with them, 564.8 MiB without;
    SGPR's (N=20,000, M=4,000): 722.0 MiB with them, 559.7 MiB without.
    """
    plan = compiled.checked_plan
    held_back = sorted({p.name for p in (passes if passes is not None else default_pipeline(config)) if p.xla_checked})
    if plan is None or not held_back or compiled.xla_overshoot is None:
        return compiled, False, None
    start = time.perf_counter()
    again = traced.rewrite(config, passes=passes, lint=lint, budget=budget,
                           target_bytes=compiled.rewritten.context.target_bytes, xla_checked=True)
    fired = sorted({r.pass_name for r in again.records if r.pass_name in held_back and r.status == "fired"})
    if not fired:  # nothing for them to do here: no compile
        return compiled, False, None
    candidate = again.compile(input_signature=input_signature, name=name)
    planned = candidate.xla_plan(*args, **kwargs)
    check_seconds = compiled.check_seconds + time.perf_counter() - start
    held = allocator_held()
    overshoot = budget.plan_overshoot(planned, held) if planned is not None else None
    named = ", ".join(fired)
    without = f"{format_size(plan.total_bytes)} ({budget.describe_overshoot(compiled.xla_overshoot)}) without"
    if overshoot is None or planned is None or overshoot >= compiled.xla_overshoot:
        note = RewriteRecord("compile_within_budget", XLA_CHECKED_RULE, "rejected", kind="plan", reason=(
            f"{named} not kept: XLA plans "
            + (f"{format_size(planned.total_bytes)} ({budget.describe_overshoot(overshoot)}) with {named}"
               if planned is not None and overshoot is not None else f"nothing it can compile with {named}")
            + f", {without}"), details={"xla_without_bytes": plan.total_bytes,
                                         "xla_with_bytes": planned.total_bytes if planned is not None else None})
        other = None if planned is None or overshoot is None else dataclasses.replace(
            candidate, checked_plan=planned, xla_overshoot=overshoot, held=held, check_seconds=0.0)
        return _noted(compiled, (note,), check_seconds=check_seconds), False, other
    kept = RewriteRecord("compile_within_budget", XLA_CHECKED_RULE, "info", kind="plan", reason=(
        f"{named} kept: XLA plans {format_size(planned.total_bytes)} ({budget.describe_overshoot(overshoot)}) "
        f"with {named}, {without}"), details={"xla_without_bytes": plan.total_bytes,
                                               "xla_with_bytes": planned.total_bytes})
    notes = tuple(r for r in compiled.rewritten.records if r.pass_name == "compile_within_budget")
    rewritten = dataclasses.replace(again, records=(*notes, *again.records, kept),
                                    seconds=compiled.rewritten.seconds + again.seconds)
    return dataclasses.replace(candidate, rewritten=rewritten, checked_plan=planned, xla_overshoot=overshoot,
                               check_seconds=check_seconds, held=held), True, dataclasses.replace(compiled,
                                                                                                  check_seconds=0.0)


# How much more than the plan kept the variant not kept may overshoot and still be planned
# around its peaks: their rounds lowered XLA's plan by up to 23% (VGP, N=1,200: 72.9 MiB
# to 56.4 MiB, against 62.0 MiB for the plan kept); a variant planned far above is not worth
# their compiles.
_OTHER_VARIANT_RANGE = 1.3


def _better_around_xla_peaks(traced: Traced, config: Config, best: Compiled, other: Compiled, budget: Budget,
                             args: Sequence[Any], kwargs: Mapping[str, Any], *,
                             passes: Sequence[GraphPass] | None, lint: bool, input_signature: Any,
                             name: str, xla_checked: bool) -> Compiled:
    """`best`, or `other` planned around XLA's peaks when XLA fits that better.

    `_with_xla_checked_passes` keeps the variant XLA fits better before the rounds of
    `_plan_around_xla_peaks`; those rounds can then do more for the other one. (GPflow's
    VGP, N=2,000 under 192 MiB: with `LeanCholeskyGradient`, XLA plans 172.0 MiB and peaks
    where no rule acts; without it 202.3 MiB, and its rounds take that lower.) Asked only
    when `best` does not fit after its own rounds, and `other` overshot by less than
    `_OTHER_VARIANT_RANGE` times as much: each round is one more compile.
    """
    assert best.checked_plan is not None and best.xla_overshoot is not None
    if budget.fits_plan(best.checked_plan, best.held) or other.xla_overshoot is None \
            or other.xla_overshoot >= _OTHER_VARIANT_RANGE * best.xla_overshoot:
        return best
    start = time.perf_counter()
    around = _plan_around_xla_peaks(traced, config, other, budget, args, kwargs, passes=passes, lint=lint,
                                    input_signature=input_signature, name=name, xla_checked=xla_checked)
    seconds = best.check_seconds + time.perf_counter() - start
    if around.xla_overshoot is None or around.checked_plan is None or around.xla_overshoot >= best.xla_overshoot:
        note = RewriteRecord("compile_within_budget", XLA_CHECKED_RULE, "info", kind="plan", reason=(
            "the variant not kept, planned around XLA's peaks too, came out no better: XLA plans "
            + (f"{format_size(around.checked_plan.total_bytes)} ({budget.describe_overshoot(around.xla_overshoot)})"
               if around.checked_plan is not None and around.xla_overshoot is not None else "nothing")
            + f" for it, {format_size(best.checked_plan.total_bytes)} for the plan kept"))
        return _noted(best, (note,), check_seconds=seconds)
    note = RewriteRecord("compile_within_budget", XLA_CHECKED_RULE, "info", kind="plan", reason=(
        f"the variant not kept at first, planned around XLA's peaks, fits better: XLA plans "
        f"{format_size(around.checked_plan.total_bytes)} ({budget.describe_overshoot(around.xla_overshoot)}), "
        f"{format_size(best.checked_plan.total_bytes)} ({budget.describe_overshoot(best.xla_overshoot)}) "
        "for the other"), details={"xla_with_bytes": around.checked_plan.total_bytes,
                                   "xla_without_bytes": best.checked_plan.total_bytes})
    return _noted(around, (note,), check_seconds=seconds)


def _never_worse_than_written(traced: Traced, config: Config, compiled: Compiled, budget: Budget,
                              args: Sequence[Any], kwargs: Mapping[str, Any], *, input_signature: Any,
                              name: str) -> Compiled:
    """`compiled`, or the program as written when XLA plans less for it.

    A rewrite is kept for what it does to XLA's plan, not to the static estimate: where
    the rewritten program does not fit and XLA plans more for it than for the program as
    written, the rewrite is dropped and the program runs as written, with XLA's plan of
    it deciding the verdict. Asking costs one more XLA compile, so it is asked only when
    the rewritten program does not fit (a program that fits is not worth a compile more).

    For example, GPflow's SGPR `predict_f(full_cov=True)` at 3,000 test points under 128 MiB,
    with an experimental rewrite that split its output 88 times: XLA planned 5.4 GiB for the
    rewritten program and 280.7 MiB for the program as written, which then ran instead; the
    report's first line ends with `the rewrite is dropped: XLA plans 5.4 GiB for the
    rewritten program (183 rewrites) and 280.7 MiB for the program as written, which runs
    instead`.
    """
    plan = compiled.checked_plan
    if plan is None or not compiled.rewritten.modified or budget.fits_plan(plan, compiled.held):
        return compiled
    start = time.perf_counter()
    as_written = traced.rewrite(config, passes=[], budget=budget).compile(input_signature=input_signature, name=name)
    written_plan = as_written.xla_plan(*args, **kwargs)
    check_seconds = compiled.check_seconds + time.perf_counter() - start
    held = allocator_held()
    if written_plan is None or written_plan.total_bytes >= plan.total_bytes:
        note = RewriteRecord("compile_within_budget", NEVER_WORSE_RULE, "info", kind="plan", reason=(
            f"kept: XLA plans {format_size(plan.total_bytes)} for the rewritten program"
            + (f", {format_size(written_plan.total_bytes)} for the program as written" if written_plan else
               ", and cannot compile the program as written")))
        return _noted(compiled, (note,), check_seconds=check_seconds)
    fired = sum(1 for r in compiled.rewritten.records if r.status == "fired")
    dropped = RewriteRecord("compile_within_budget", NEVER_WORSE_RULE, "rejected", kind="plan", reason=(
        f"the rewrite is dropped: XLA plans {format_size(plan.total_bytes)} for the rewritten program "
        f"({fired} rewrites) and {format_size(written_plan.total_bytes)} for the program as written, "
        "which runs instead"), details={"xla_rewritten_bytes": plan.total_bytes,
                                        "xla_as_written_bytes": written_plan.total_bytes})
    # Why the rewrite could not do better (what each region it tried to split is blocked by)
    # stays in the report: the program as written runs, but the user reads what keeps it whole.
    blocked = tuple(r for r in compiled.rewritten.records if r.status == "rejected" and r.kind == "split")
    rewritten = dataclasses.replace(as_written.rewritten, records=(dropped, *blocked),
                                    seconds=compiled.rewritten.seconds + as_written.rewritten.seconds)
    return dataclasses.replace(as_written, rewritten=rewritten, checked_plan=written_plan,
                               xla_overshoot=budget.plan_overshoot(written_plan, held),
                               check_seconds=check_seconds, held=held)


_REPLANS = 2
# Rounds of rule 3 (`_plan_around_xla_peaks`), each one more compile of a plan over XLA's share.
# Four: GPflow VGP's Matérn-5/2 gradient peaks in four places in turn (the variance term,
# the `q_sqrt` gradient's products, the Cholesky, the kernel's gradient),
# 244.4 → 240.4 → 192.7 → 183.4 → 161.2 MiB.
_XLA_PEAK_ROUNDS = 4
