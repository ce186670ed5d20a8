"""Band parts as selects by broadcast iota compares, so that XLA never stores their mask.

    band_part(X, lower, upper)   →   where(i − j ≤ lower  and  j − i ≤ upper, X, 0)
                                      (i a [rows, 1] iota, j a [1, cols] one)

TensorFlow lowers `MatrixBandPart` to XLA with a mask made of two `[rows, cols]` iotas.
XLA's common-subexpression pass merges the masks of all band parts of one shape into one,
and with more than one reader XLA stores it: a `pred[rows, cols]` buffer, alive from the
first band part to the last. GPflow's SGPR gradient has three lower bands of `[M, M]`
(two triangular solves' gradients and a Cholesky gradient's), the first before the split
loop over the data and the last after it: at M=3,600 the mask was 12.4 MiB of XLA's peak.
Made from `[n]` iotas broadcast in the compare, the mask is fused into each select and
not stored (measured on two band parts either side of a loop: a `pred[2000, 2000]` buffer
with `band_part`, none with the selects).

It runs last, after splitting: the split stage lowers the bands it can cut by rows itself
(`rewrites.split.diagonals.lower_band_parts`); what is left here are band parts of whole
matrices, read whole (by a factorization's gradient, a solve).

Conditions (rejections carry these reasons):
    * compiled by XLA (`jit_compile`): without XLA the select's mask is a tensor of its own;
    * constant limits and a static shape of at least `MIN_BYTES` (smaller masks cost little).

Example:
    >>> f = tfmem.TfmemFunction(lambda x: tf.linalg.band_part(x @ tf.transpose(x), -1, 0) @ x,
    ...                         passes=[BandsAsSelects()], config={"jit_compile": True})
    >>> Graph(f.report(tf.ones([1000, 8])).rewritten_graph_def).op_counts().get("MatrixBandPart", 0)
    0
"""
from __future__ import annotations

from tfmem.context import PassContext
from tfmem.graph import Graph, TensorRef
from tfmem.memory import AS_SELECT_SCOPE_SUFFIX
from tfmem.passes import GraphPass, PassResult, RewriteRecord

from rewrites.split.diagonals import band_part_as_select

RULE = "BandAsSelect"
# Band parts of smaller matrices stay: their mask, stored or not, is under 128 KiB.
MIN_BYTES = 1 << 20


class BandsAsSelects(GraphPass):
    """`band_part(X, lower, upper)` of a large matrix → `where(iota compares, X, 0)`, under XLA."""

    name = "bands_as_selects"
    stage = "split"
    reads = frozenset({"jit_compile"})

    def run(self, graph: Graph, context: PassContext) -> PassResult:
        bands = [node for node in graph.nodes if node.op == "MatrixBandPart"
                 and (graph.nbytes(TensorRef(node.name)) or 0) >= MIN_BYTES]
        if not bands:
            return PassResult(graph, False, [])
        if not context.config.jit_compile:
            return PassResult(graph, False, [RewriteRecord(
                self.name, RULE, "rejected", (bands[0].name,),
                "not compiled by XLA: TensorFlow's kernel stores no mask, a select would")])
        records = []
        for node in bands:
            matrix = graph.inputs(node.name)[0]
            if band_part_as_select(graph, node.name, scope=f"{node.name}{AS_SELECT_SCOPE_SUFFIX}") is None:
                records.append(RewriteRecord(self.name, RULE, "rejected", (node.name,),
                                             f"limits not constants, or shape {graph.spec(matrix).shape} not static"))
                continue
            records.append(RewriteRecord(self.name, RULE, "fired", (node.name,),
                                         details={"matrix_bytes": graph.nbytes(matrix) or 0}))
        graph.prune()
        return PassResult(graph, any(r.status == "fired" for r in records), records)


__all__ = ["BandsAsSelects", "MIN_BYTES"]
