"""Splitting: compute oversized tensors in `tf.while_loop` chunks.

    T = f(X) with bytes(T) > tensor_size_threshold, reduced by g
      →  acc = g(f(X[0:c])); for i in 1..n/c: acc = combine(acc, g(f(X[i·c:(i+1)·c])))

For each tensor over `tensor_size_threshold` (largest first) the pass grows a region
along each of its axes (`regions`), keeps the one that leaves fewest oversized tensors
behind, sizes chunks so that the *largest* tensor in the loop body stays within
`tensor_split_size`, and emits the loop (`loops`). Tensors it cannot split are left as
they are and reported with the reason.

Conditions: static shapes; ops on the path must have a split rule (`rules`); a region's
results must be sinks (reductions, contractions, top-k, arg-max/min) or tensors small
enough to hold whole.
"""
from __future__ import annotations

from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.memory import estimate_memory
from tfmem.passes import GraphPass, PassResult, RewriteRecord

from rewrites.split.loops import emit_loop
from rewrites.split.regions import GRAPH_INPUT_OPS, Region, grow_region
from rewrites.split.rules import SUPPORTED_OPS

__all__ = ["SplitOversizedRegions", "SUPPORTED_OPS"]

_MAX_LOOPS = 64


class SplitOversizedRegions(GraphPass):
    """Splits every region it can around tensors over the threshold into chunked loops.

    With `memory_budget` set, it then keeps splitting the largest tensor live at the
    static peak (below the threshold now) while the estimate is over the budget.
    """

    name = "split_oversized_regions"
    stage = "split"

    def run(self, graph: Graph, config: Config) -> PassResult:
        threshold = config.tensor_size_threshold
        if threshold is None:
            return PassResult(graph, False, [])
        splitter = _Splitter(self.name, graph)
        splitter.split_all(threshold, config.split_size)
        if config.memory_budget is not None:
            splitter.fit_budget(config.memory_budget, config.split_size)
        return PassResult(graph, splitter.loops > 0, splitter.records)


class _Splitter:
    """The state of one run of the pass: records, and seeds already tried."""

    def __init__(self, pass_name: str, graph: Graph) -> None:
        self.pass_name = pass_name
        self.graph = graph
        self.records: list[RewriteRecord] = []
        self.given_up: set[TensorRef] = set()
        self.seen_regions: set[tuple[str, ...]] = set()
        self.loops = 0

    def split_all(self, threshold: int, split_size: int) -> None:
        """Splits around every tensor over `threshold`, largest first."""
        graph = self.graph
        while self.loops < _MAX_LOOPS:
            seed = _largest_oversized(graph, threshold, self.given_up)
            if seed is None:
                return
            region, reason = _best_region(graph, seed, threshold, split_size)
            if region is None:
                self.given_up.add(seed)
                self.records.append(RewriteRecord(self.pass_name, "SplitOversizedRegions", "unsplit",
                                                  (seed.node,), reason,
                                                  {"tensor": seed.name, "bytes": graph.nbytes(seed)}))
                continue
            if tuple(region.nodes) in self.seen_regions:  # it came back: its readers need it whole
                self.given_up.add(seed)
                continue
            self.seen_regions.add(tuple(region.nodes))
            self._emit(region, seed, threshold, split_size)

    def _emit(self, region: Region, seed: TensorRef, threshold: int, split_size: int) -> None:
        graph = self.graph
        chunk = _chunk_length(graph, region, split_size)
        chunk_bytes = region.per_unit_bytes(graph) * chunk
        loop = f"tfmem_split_{self.loops}"
        replaced = emit_loop(graph, region, chunk, max_write_out=threshold, scope=loop)
        for old, new in replaced.items():
            graph.replace_all_uses(old, new)
        graph.prune()
        self.loops += 1
        self.records.append(RewriteRecord(
            self.pass_name, "SplitOversizedRegions", "split", (seed.node,), details={
                "tensor": seed.name, "dim": region.axes[seed], "size": region.size,
                "chunks": -(-region.size // chunk), "chunk": chunk, "chunk_bytes": chunk_bytes,
                "loop": loop, "nodes": len(region.nodes),
                "sinks": ",".join(sorted(set(region.sinks.values()))) or "-"}))

    def fit_budget(self, budget: int, split_size: int) -> None:
        """Splits the largest tensor live at the static peak while the peak is over `budget`."""
        estimate = estimate_memory(self.graph)
        for _ in range(_MAX_LOOPS):
            if estimate.peak_bytes <= budget:
                self.records.append(RewriteRecord(self.pass_name, "MemoryBudget", "info",
                                                  details={"peak_bytes": estimate.peak_bytes,
                                                           "budget_bytes": budget}))
                return
            # A loop body holds a handful of chunk-sized tensors at once: chunks of an
            # eighth of the budget keep it well inside.
            chunk_budget = min(split_size, budget // 8)
            candidates = [TensorRef.parse(t.name) for t in estimate.live_at_peak
                          if self.graph.node(TensorRef.parse(t.name).node).op not in GRAPH_INPUT_OPS
                          and TensorRef.parse(t.name) not in self.given_up and t.nbytes > chunk_budget]
            if not candidates:
                break
            target = self.graph.nbytes(candidates[0]) or 0
            loops = self.loops
            self.split_all(target - 1, chunk_budget)
            if self.loops == loops:  # nothing split, so the graph and its estimate are unchanged
                self.given_up.add(candidates[0])
            else:
                estimate = estimate_memory(self.graph)
        self.records.append(RewriteRecord(
            self.pass_name, "MemoryBudget", "unsplit", (estimate.peak_node or "",),
            "the static peak stays over the budget: nothing left there can be split",
            {"peak_bytes": estimate.peak_bytes, "budget_bytes": budget}))


def _largest_oversized(graph: Graph, threshold: int, skip: set[TensorRef]) -> TensorRef | None:
    best, best_bytes = None, threshold
    for node in graph.nodes:
        for index in range(len(graph.output_specs(node.name))):
            ref = TensorRef(node.name, index)
            nbytes = graph.nbytes(ref) or 0
            if nbytes > best_bytes and ref not in skip:
                best, best_bytes = ref, nbytes
    return best


def _best_region(graph: Graph, seed: TensorRef, threshold: int, split_size: int) -> tuple[Region | None, str]:
    """The region around `seed` that leaves fewest oversized tensors whole, or why none works."""
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
        if region.per_unit_bytes(graph) > split_size:
            reasons.append(f"axis {axis}: a single slice is {region.per_unit_bytes(graph)} bytes, over the "
                           f"split size {split_size} (splitting two axes at once is not supported)")
            continue
        oversized_out = [r for r in region.write_outs(graph) if (graph.nbytes(r) or 0) > threshold]
        if seed in oversized_out:
            why = region.boundaries.get(seed, "a reader needs it whole")
            reasons.append(f"axis {axis}: {why}")
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


def _chunk_length(graph: Graph, region: Region, split_size: int) -> int:
    per_unit = max(region.per_unit_bytes(graph), 1)
    chunk = max(1, split_size // per_unit)
    k_min = max((int(graph.constant_value(graph.inputs(n)[1])) for n, kind in region.sinks.items()
                 if kind == "topk"), default=1)
    return int(min(region.size, max(chunk, k_min)))
