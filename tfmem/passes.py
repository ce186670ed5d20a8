"""Graph passes and the PassManager that runs them.

A pass takes a Graph and returns a `PassResult(graph, modified, records)`. Records say
what fired, what was rejected and why, so the Report and `explain` need no other source.
Every pass is handed the graph and a `PassContext` (the user's config, and what was
resolved from it), and declares in `reads` which config keys its result depends on.
The PassManager runs the passes in order, repeatedly, until none changes the graph:
first those before the first pass that runs once (their fixed point is the *prefix*,
which a caller may cache: its key derives from the keys those passes read), then all.
With `lint=True` it checks the graph after every pass and names the pass that broke it.
A pass may hand its caller a typed value beside the graph (`PassResult.verdict`); the
PassManager passes it on without reading it.

Example:
    >>> import tensorflow as tf
    >>> from tfmem.capture import capture
    >>> from tfmem.graph import TensorRef
    >>> f = tf.function(lambda x: tf.exp(tf.identity(tf.identity(x))))
    >>> graph = capture(f.get_concrete_function(tf.TensorSpec([3]))).to_graph()
    >>> class DropIdentities(GraphPass):
    ...     name, stage, reads = "drop_identities", "cleanup", frozenset()
    ...     def run(self, graph, context):
    ...         records = []
    ...         for node in list(graph.find("Identity")):
    ...             if not graph.is_output(TensorRef(node.name)):
    ...                 graph.replace_all_uses(TensorRef(node.name), graph.inputs(node.name)[0])
    ...                 records.append(RewriteRecord(self.name, "identity", "fired", (node.name,)))
    ...         graph.prune()
    ...         return PassResult(graph, bool(records), records)
    >>> result = PassManager([DropIdentities()], lint=True).run(graph, PassContext(Config()))
    >>> [str(r) for r in result.records]
    ['[drop_identities] identity fired at Identity', '[drop_identities] identity fired at Identity_1']
    >>> graph.op_counts()["Identity"], result.graph.op_counts()["Identity"]  # the output's stays
    (3, 1)
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar

from tfmem.config import Config, format_size
from tfmem.context import PassContext
from tfmem.graph import Graph, GraphError

logger = logging.getLogger(__name__)

RecordStatus = Literal["fired", "rejected", "info"]
# What a record is about: a pattern or region rewrite, a split into a loop, the memory
# plan, or housekeeping. Reports group by it; the status alone says what happened.
RecordKind = Literal["rewrite", "split", "plan", "cleanup"]
VerdictT = TypeVar("VerdictT")


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
        kind: "rewrite", "split", "plan" (the memory plan) or "cleanup".
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
    """What a pass returns: the (possibly edited) graph, whether it changed, and records.

    `verdict`: a typed value for the pass's caller (the split pass's plan verdict, say);
    the PassManager hands on the last one of each pass (`PipelineResult.verdict`).
    """

    graph: Graph
    modified: bool
    records: list[RewriteRecord] = dataclasses.field(default_factory=list)
    verdict: object | None = None


class GraphPass(abc.ABC):
    """A graph-to-graph transformation. Subclasses set `name` and `stage` and implement `run`.

    `run` may edit the graph it is given in place (the PassManager hands it a private
    copy) and returns it inside a PassResult.
    """

    name: ClassVar[str]
    stage: ClassVar[str]
    # Runs in the first round only: a pass whose output later rounds only tidy, and which
    # would redo its own work if run again. The passes before it form the prefix.
    runs_once: ClassVar[bool] = False
    # The config keys its result depends on, beside the graph; None: possibly any of them.
    # A cached prefix is reused for another config that agrees on the keys its passes read.
    reads: ClassVar[frozenset[str] | None] = None
    # Its payoff shows only in XLA's buffer assignment, and can turn into a loss there
    # (it moves what XLA keeps alive when): `compile_within_budget` holds it back until a
    # plan without it does not fit, then compiles the plan with it once and keeps the one
    # XLA fits better (`stages._with_xla_checked_passes`).
    xla_checked: ClassVar[bool] = False

    @abc.abstractmethod
    def run(self, graph: Graph, context: PassContext) -> PassResult:
        raise NotImplementedError


class PassError(RuntimeError):
    """A pass raised, or left the graph malformed. `pass_name` says which."""

    def __init__(self, pass_name: str, cause: BaseException | str) -> None:
        self.pass_name = pass_name
        super().__init__(f"pass {pass_name!r} failed: {cause}")


@dataclasses.dataclass
class PipelineResult:
    """The PassManager's output: final graph, all records, seconds per pass, rounds run,
    the last verdict of each pass that gave one, and the prefix it started from."""

    graph: Graph
    records: list[RewriteRecord]
    seconds: dict[str, float]
    iterations: int
    verdicts: dict[str, object] = dataclasses.field(default_factory=dict)
    # The fixed point of the passes before the first that runs once, for reuse.
    prefix: PipelineResult | None = None

    @property
    def modified(self) -> bool:
        return any(r.status == "fired" for r in self.records)

    def verdict(self, kind: type[VerdictT]) -> VerdictT | None:
        """The last verdict of type `kind` a pass gave, if any."""
        found = [v for v in self.verdicts.values() if isinstance(v, kind)]
        return found[-1] if found else None


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

    def run(self, graph: Graph, context: PassContext, *,
            cache: MutableMapping[Hashable, PipelineResult] | None = None) -> PipelineResult:
        """Runs the passes on a copy of `graph`, in two phases: the prefix (the passes
        before the first that runs once) to a fixed point, then all of them.

        Args:
            cache: prefixes computed earlier, by `prefix_key`. A prefix depends only on
                the graph and the config keys its passes read, so running again under
                another context (a tighter memory target, say) reuses it.

        Raises:
            PassError: naming the pass that raised or (with lint) broke the graph.
        """
        with collector_paused():
            first = self._prefix_length()
            key = self.prefix_key(context)
            prefix = cache.get(key) if cache is not None else None
            reused = prefix is not None
            if prefix is None:
                prefix = self._fixed_point(graph.copy(), context, self.passes[:first])
                if cache is not None:
                    cache[key] = prefix
            if first == len(self.passes):
                rest = PipelineResult(prefix.graph.copy(), [], {}, 0)  # the prefix is shared: a copy
            else:
                rest = self._fixed_point(prefix.graph.copy(), context, self.passes, skip_first_round=first)
            # Time is what this run spent: a reused prefix cost nothing here.
            seconds = {p.name: rest.seconds.get(p.name, 0.0) + (0.0 if reused else prefix.seconds.get(p.name, 0.0))
                       for p in self.passes}
            return PipelineResult(rest.graph, _unique(prefix.records + rest.records), seconds,
                                  prefix.iterations + rest.iterations, {**prefix.verdicts, **rest.verdicts},
                                  prefix=prefix)

    def prefix_key(self, context: PassContext) -> Hashable:
        """What the prefix's result depends on beside the graph: its passes, and the values
        of the config keys they read (the whole config if one of them does not say)."""
        prefix = self.passes[:self._prefix_length()]
        names = tuple(f"{type(p).__module__}.{type(p).__qualname__}:{p.name}" for p in prefix)
        if any(p.reads is None for p in prefix):
            return names, context.config
        keys = sorted(set().union(*(p.reads for p in prefix if p.reads is not None)))
        return names, tuple((k, getattr(context.config, k)) for k in keys)

    def _prefix_length(self) -> int:
        return next((i for i, p in enumerate(self.passes) if p.runs_once), len(self.passes))

    def _fixed_point(self, graph: Graph, context: PassContext, passes: Sequence[GraphPass], *,
                     skip_first_round: int = 0) -> PipelineResult:
        """Runs `passes` in rounds until none changes the graph (the first round from
        `passes[skip_first_round]` on: those before it are at their fixed point already)."""
        records: list[RewriteRecord] = []
        verdicts: dict[str, object] = {}
        seconds = {p.name: 0.0 for p in passes}
        iterations = 0
        for iterations in range(1, self.max_iterations + 1):
            changed = False
            for graph_pass in passes[skip_first_round if iterations == 1 else 0:]:
                if graph_pass.runs_once and iterations > 1:
                    continue
                start = time.perf_counter()
                try:
                    result = graph_pass.run(graph, context)
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
                if result.verdict is not None:
                    verdicts[graph_pass.name] = result.verdict
                changed |= result.modified
            if not changed:
                break
        else:
            logger.info("passes did not reach a fixed point in %d rounds", self.max_iterations)
        return PipelineResult(graph, _unique(records), seconds, iterations, verdicts)


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

    Example (the bundled passes; `lambda config: [MyPass(), *passes_for(config)]` puts
    your own in front of them):
        >>> from rewrites import passes_for
        >>> register_pipeline(passes_for)
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
