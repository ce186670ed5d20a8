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
from tfmem.passes import GraphPass, PassResult, RewriteRecord

from rewrites.split.loops import emit_loop
from rewrites.split.regions import Region, grow_region
from rewrites.split.rules import SUPPORTED_OPS

__all__ = ["SplitOversizedRegions", "SUPPORTED_OPS"]

_MAX_LOOPS = 64


class SplitOversizedRegions(GraphPass):
    """Splits every region it can around tensors over the threshold into chunked loops."""

    name = "split_oversized_regions"
    stage = "split"

    def run(self, graph: Graph, config: Config) -> PassResult:
        threshold = config.tensor_size_threshold
        if threshold is None:
            return PassResult(graph, False, [])
        split_size = config.split_size
        records: list[RewriteRecord] = []
        given_up: set[TensorRef] = set()
        seen_regions: set[tuple[str, ...]] = set()
        loops = 0
        while loops < _MAX_LOOPS:
            seed = _largest_oversized(graph, threshold, given_up)
            if seed is None:
                break
            region, reason = _best_region(graph, seed, threshold, split_size)
            if region is None:
                given_up.add(seed)
                records.append(RewriteRecord(self.name, "SplitOversizedRegions", "unsplit", (seed.node,),
                                             reason, {"tensor": seed.name,
                                                      "bytes": graph.nbytes(seed)}))
                continue
            if tuple(region.nodes) in seen_regions:  # it came back: its readers need it whole
                given_up.add(seed)
                continue
            seen_regions.add(tuple(region.nodes))
            chunk = _chunk_length(graph, region, split_size)
            chunk_bytes = region.per_unit_bytes(graph) * chunk
            replaced = emit_loop(graph, region, chunk, max_write_out=threshold, scope=f"tfmem_split_{loops}")
            for old, new in replaced.items():
                graph.replace_all_uses(old, new)
            graph.prune()
            loops += 1
            n_chunks = -(-region.size // chunk)
            records.append(RewriteRecord(
                self.name, "SplitOversizedRegions", "split", (seed.node,), details={
                    "tensor": seed.name, "dim": region.axes[seed], "size": region.size, "chunks": n_chunks,
                    "chunk": chunk, "chunk_bytes": chunk_bytes,
                    "loop": f"tfmem_split_{loops - 1}", "nodes": len(region.nodes),
                    "sinks": ",".join(sorted(set(region.sinks.values()))) or "-"}))
        return PassResult(graph, loops > 0, records)


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
        if seed not in region.axes or TensorRef(seed.node) not in region.axes and seed.node not in region.nodes:
            reasons.append(f"axis {axis}: the seed could not stay in its region")
            continue
        oversized_out = [r for r in region.write_outs(graph) if (graph.nbytes(r) or 0) > threshold]
        if seed in oversized_out:
            why = region.boundaries.get(seed, "a reader needs it whole")
            reasons.append(f"axis {axis}: {why}")
            continue
        eliminated = sum(1 for r in region.axes if r.node in region.nodes and r not in oversized_out
                         and (graph.nbytes(r) or 0) > threshold)
        score = (-len(oversized_out), eliminated, -len(region.nodes))
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
