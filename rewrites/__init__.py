"""The passes tfmem runs, one module per rewrite, grouped by pipeline stage.

`passes_for(config)` returns the passes of the stages `config.passes` enables, in
pipeline order (cleanup → match_and_replace → reorder → split). A new rewrite adds
its class to `PASSES_BY_STAGE`.
"""
from __future__ import annotations

from rewrites.add_diagonal import AddDiagonal
from rewrites.bands_as_selects import BandsAsSelects
from rewrites.cholesky_gradient import LeanCholeskyGradient
from rewrites.cleanup import ForwardIdentities
from rewrites.compose_band_parts import ComposeBandParts
from rewrites.compose_transposes import ComposeTransposes
from rewrites.detach_constants import DetachConstants
from rewrites.grappler_cleanup import GrapplerCleanup
from rewrites.merge_duplicates import MergeDuplicates
from rewrites.order_only_edges import DropOrderOnlyControlEdges
from rewrites.solve_in_place import SolveInPlace
from rewrites.solve_not_invert import SolveInsteadOfInverse
from rewrites.splat_operands import ScalarForSplatOperand
from rewrites.splats import CanonicalizeSplats
from rewrites.segment_ids import UnflattenSegmentIds
from rewrites.squared_distance import ExpandSquaredDistance
from rewrites.sum_of_products import SumOfProductsAsContraction
from rewrites.diag_of_elementwise import DiagOfElementwise
from rewrites.diag_of_product import ContractDiagOfProduct
from rewrites.einsum_diagonal import EinsumAsDiagonal
from rewrites.einsum_matmul import EinsumAsMatMul
from rewrites.matmul_chain import ReorderMatMulChain
from rewrites.scale_by_diagonal import ScaleByDiagonal
from rewrites.split import (RecomputeAcrossXlaPeak, ReduceBeforeXlaPeak, ReduceHeldBeforeXlaPeak, SplitAtXlaPeak,
                            SplitOversizedRegions, WholeInputBeforeXlaPeak)
from tfmem.config import PASS_STAGES, Config
from tfmem.passes import GraphPass

PASSES_BY_STAGE: dict[str, tuple[type[GraphPass], ...]] = {
    "cleanup": (ForwardIdentities, DetachConstants, CanonicalizeSplats, ScalarForSplatOperand, UnflattenSegmentIds,
                MergeDuplicates, GrapplerCleanup, DropOrderOnlyControlEdges),
    "match_and_replace": (EinsumAsMatMul, EinsumAsDiagonal, ExpandSquaredDistance, AddDiagonal,
                          LeanCholeskyGradient, SolveInsteadOfInverse, ComposeTransposes, ComposeBandParts,
                          SumOfProductsAsContraction),
    "reorder": (DiagOfElementwise, ContractDiagOfProduct, ScaleByDiagonal, ReorderMatMulChain),
    # SolveInPlace after splitting: solves the splitter cut into column chunks are small already.
    # BandsAsSelects last: the bands left are read whole; their masks are XLA's concern only.
    "split": (SplitOversizedRegions, RecomputeAcrossXlaPeak, ReduceBeforeXlaPeak, ReduceHeldBeforeXlaPeak,
              WholeInputBeforeXlaPeak, SplitAtXlaPeak, SolveInPlace, BandsAsSelects),
}
assert set(PASSES_BY_STAGE) == set(PASS_STAGES)


def passes_for(config: Config) -> list[GraphPass]:
    """Instances of every pass in the enabled stages, in run order."""
    return [cls() for stage in config.passes for cls in PASSES_BY_STAGE[stage]]


__all__ = ["PASSES_BY_STAGE", "passes_for", "ForwardIdentities"]
