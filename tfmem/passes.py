"""Graph passes and the PassManager that runs them.

A pass takes a Graph and returns a `PassResult(graph, modified, records)`. Records say
what fired, what was rejected and why, so the Report and `explain` need no other source.
The PassManager runs the passes in order, repeatedly, until none changes the graph
(first those before the budget-reading split stage, which every budget shares, then all);
with `lint=True` it checks the graph after every pass and names the pass that broke it.

Example:
    >>> class DropIdentities(GraphPass):
    ...     name, stage = "drop_identities", "cleanup"
    ...     def run(self, graph, config):
    ...         records = []
    ...         for node in list(graph.find("Identity")):
    ...             if not graph.is_output(TensorRef(node.name)):
    ...                 graph.replace_all_uses(TensorRef(node.name), graph.inputs(node.name)[0])
    ...                 records.append(RewriteRecord(self.name, "identity", "fired", (node.name,)))
    ...         graph.prune()
    ...         return PassResult(graph, bool(records), records)
    >>> result = PassManager([DropIdentities()], lint=True).run(graph, Config())
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal

from tfmem.config import Config, format_size
from tfmem.graph import Graph, GraphError

logger = logging.getLogger(__name__)

RecordStatus = Literal["fired", "rejected", "info"]
# What a record is about: a pattern or region rewrite, a split into a loop, the memory
# budget, or housekeeping. Reports group by it; the status alone says what happened.
RecordKind = Literal["rewrite", "split", "budget", "cleanup"]


@dataclasses.dataclass(frozen=True)
class RewriteRecord:
    """One thing a pass did or declined to do.

    Attributes:
        pass_name: the pass that wrote it.
        rule: the rule or transformation (e.g. "ExpandSquaredDistance").
        status: "fired" (the graph changed), "rejected" (with `reason`) or "info".
        nodes: the nodes concerned (the match's root first).
        reason: why a match was rejected or a tensor left unsplit.
        details: anything else worth reporting (chunk counts, byte sizes, ...).
        kind: "rewrite", "split", "budget" or "cleanup".
    """

    pass_name: str
    rule: str
    status: RecordStatus
    nodes: tuple[str, ...] = ()
    reason: str = ""
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    kind: RecordKind = "rewrite"

    def __str__(self) -> str:
        where = f" at {self.nodes[0]}" if self.nodes else ""
        why = f": {self.reason}" if self.reason else ""
        extra = "".join(f" {k}={format_size(v) if k.endswith('bytes') and isinstance(v, int) else v}"
                        for k, v in self.details.items())
        return f"[{self.pass_name}] {self.rule} {self.status}{where}{why}{extra}"


@dataclasses.dataclass
class PassResult:
    """What a pass returns: the (possibly edited) graph, whether it changed, and records."""

    graph: Graph
    modified: bool
    records: list[RewriteRecord] = dataclasses.field(default_factory=list)


class GraphPass(abc.ABC):
    """A graph-to-graph transformation. Subclasses set `name` and `stage` and implement `run`.

    `run` may edit the graph it is given in place (the PassManager hands it a private
    copy) and returns it inside a PassResult.
    """

    name: ClassVar[str]
    stage: ClassVar[str]
    # Runs in the first round only. For a pass whose output later rounds only tidy (the
    # split stage's loops): running it again would split what it already split.
    once: ClassVar[bool] = False
    # Its result depends on the memory budget or the split sizes. The PassManager runs the
    # passes before the first such pass once per graph (`run_prefix`), whatever the budget.
    reads_budget: ClassVar[bool] = False

    @abc.abstractmethod
    def run(self, graph: Graph, config: Config) -> PassResult:
        raise NotImplementedError


class PassError(RuntimeError):
    """A pass raised, or left the graph malformed. `pass_name` says which."""

    def __init__(self, pass_name: str, cause: BaseException | str) -> None:
        self.pass_name = pass_name
        super().__init__(f"pass {pass_name!r} failed: {cause}")


@dataclasses.dataclass
class PipelineResult:
    """The PassManager's output: final graph, all records, seconds per pass, rounds run,
    and the budget-free prefix it started from."""

    graph: Graph
    records: list[RewriteRecord]
    seconds: dict[str, float]
    iterations: int
    # The budget-free part it started from (`PassManager.run_prefix`), for reuse.
    prefix: PipelineResult | None = None

    @property
    def modified(self) -> bool:
        return any(r.status == "fired" for r in self.records)


class PassManager:
    """Runs passes in order to a fixed point.

    Args:
        passes: the passes, in run order.
        max_iterations: rounds over all passes before giving up on a fixed point.
        lint: check the graph after each pass (tests turn this on).
    """

    def __init__(self, passes: Sequence[GraphPass], *, max_iterations: int = 4,
                 lint: bool = False) -> None:
        self.passes = list(passes)
        self.max_iterations = max_iterations
        self.lint = lint

    def run(self, graph: Graph, config: Config, *, prefix: PipelineResult | None = None) -> PipelineResult:
        """Runs the passes on a copy of `graph`, in two phases: those before the first pass
        that reads the budget to a fixed point (`run_prefix`), then, from that pass on,
        all of them to a fixed point.

        Args:
            prefix: `run_prefix(graph, config)` computed earlier. It is the same whatever
                the budget, so planning again for another budget (`compile_within_budget`)
                reuses it instead of cleaning the graph up again.

        Raises:
            PassError: naming the pass that raised or (with lint) broke the graph.
        """
        with collector_paused():
            reused = prefix is not None
            if prefix is None:
                prefix = self.run_prefix(graph, config)
            first = self._first_budget_pass()
            if first == len(self.passes):
                rest = PipelineResult(prefix.graph.copy(), [], {}, 0)  # the prefix is shared: a copy
            else:
                rest = self._fixed_point(prefix.graph.copy(), config, self.passes, skip_first_round=first)
            # Time is what this run spent: a reused prefix cost nothing here.
            seconds = {p.name: rest.seconds.get(p.name, 0.0) + (0.0 if reused else prefix.seconds.get(p.name, 0.0))
                       for p in self.passes}
            return PipelineResult(rest.graph, _unique(prefix.records + rest.records), seconds,
                                  prefix.iterations + rest.iterations, prefix=prefix)

    def run_prefix(self, graph: Graph, config: Config) -> PipelineResult:
        """The passes before the first that reads the budget (`GraphPass.reads_budget`), run
        to a fixed point on a copy of `graph`: the part of the pipeline every budget shares."""
        with collector_paused():
            return self._fixed_point(graph.copy(), config, self.passes[:self._first_budget_pass()])

    def _first_budget_pass(self) -> int:
        return next((i for i, p in enumerate(self.passes) if p.reads_budget), len(self.passes))

    def _fixed_point(self, graph: Graph, config: Config, passes: Sequence[GraphPass], *,
                     skip_first_round: int = 0) -> PipelineResult:
        """Runs `passes` in rounds until none changes the graph (the first round from
        `passes[skip_first_round]` on: those before it are at their fixed point already)."""
        records: list[RewriteRecord] = []
        seconds = {p.name: 0.0 for p in passes}
        iterations = 0
        for iterations in range(1, self.max_iterations + 1):
            changed = False
            for graph_pass in passes[skip_first_round if iterations == 1 else 0:]:
                if graph_pass.once and iterations > 1:
                    continue
                start = time.perf_counter()
                try:
                    result = graph_pass.run(graph, config)
                except Exception as err:  # name the culprit; the wrapper decides what to do
                    raise PassError(graph_pass.name, f"{type(err).__name__}: {err}") from err
                finally:
                    seconds[graph_pass.name] += time.perf_counter() - start
                if self.lint:
                    problems = result.graph.lint()
                    if problems:
                        raise PassError(graph_pass.name, GraphError("; ".join(problems[:5])))
                graph = result.graph
                records.extend(result.records)
                changed |= result.modified
            if not changed:
                break
        else:
            logger.info("passes did not reach a fixed point in %d rounds", self.max_iterations)
        return PipelineResult(graph, _unique(records), seconds, iterations)


def _unique(records: list[RewriteRecord]) -> list[RewriteRecord]:
    """Each rejection once (one is re-recorded on every round); what fired every time (each
    firing changed the graph)."""
    unique: dict[tuple[object, ...], RewriteRecord] = {}
    for index, r in enumerate(records):
        changed = r.status == "fired"
        unique[(r.pass_name, r.rule, r.status, r.nodes, r.reason, index if changed else -1)] = r
    return list(unique.values())


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector for the block (reentrant).

    Passes allocate many short-lived objects, and each full collection walks every object
    TensorFlow keeps alive: on GPflow's SGPR graph the collector took a third of the
    pipeline's time. Reference counting still frees what is not in a cycle; the rest is
    collected when the block ends and the collector runs again.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --- the registered pipeline --------------------------------------------------------

PipelineFactory = Callable[[Config], Sequence[GraphPass]]
_PIPELINE: list[PipelineFactory] = []
ENTRY_POINT_GROUP = "tfmem.pipelines"


def register_pipeline(factory: PipelineFactory) -> None:
    """Makes `factory(config) -> passes` the pipeline every `tfmem.function` runs by default.

    The engine does not import its passes: the `rewrites` package registers itself
    through the `tfmem.pipelines` entry point (see setup.py); a program may register
    its own pipeline instead.

    Example:
        >>> register_pipeline(lambda config: [MyCleanup(), *rewrites.passes_for(config)])
    """
    _PIPELINE[:] = [factory]


def default_pipeline(config: Config) -> list[GraphPass]:
    """The registered pipeline's passes for `config`.

    Raises:
        PassError: when no pipeline is registered (tfmem installed without its passes).
    """
    if not _PIPELINE:
        from importlib.metadata import entry_points

        found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name != "default")
        if not found:
            raise PassError("pipeline", f"no rewrite pipeline is registered (entry point group "
                                        f"{ENTRY_POINT_GROUP!r}): install tfmem with pip, or call "
                                        "tfmem.register_pipeline")
        _PIPELINE[:] = [found[0].load()]
    return list(_PIPELINE[0](config))
