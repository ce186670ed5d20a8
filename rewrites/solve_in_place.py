"""Triangular solves that overwrite their right-hand side, one block of rows at a time.

    X = triangular_solve(L, B)   →   X = B
                                     for each block i of b rows, in substitution order:
                                         X[i] = solve(L[i, i], X[i] − Σ_j op(L)[i, j] X[j])   (j: blocks done)

XLA lowers a triangular solve (`TriangularSolveExpander`) to one product per block of
rows, each kept as its own buffer, and a result that grows by concatenation: at its
peak it holds the right-hand side, the result so far and the blocks still to join it,
two output-sized buffers beside the factor. In the Cholesky gradient (two solves
against `[n, n]` right-hand sides, after `SolveInsteadOfInverse`) that is XLA's peak of
GPflow's GPR loss and gradients: at n=4,300, 4.0 whole `[n, n]` matrices, 564 MiB of the
512 it was given. Substitution in a loop needs none of it: a block's rows of the result
depend only on the same rows of the right-hand side and on the blocks already solved,
so the loop carries the right-hand side and writes each solved block over its rows
(`tensor_scatter_nd_update`, which XLA does in place). The right-hand side, when nothing
else reads it, becomes the result: one output-sized buffer, not two. Each block sums
its products with the solved blocks in an inner loop (`b × b` times `b × m` each), so
the flops are the solve's own, `n²m`; measured on 2 cores the step time equals XLA's.

It runs after splitting: a solve the splitter cuts into column chunks (a wide
right-hand side) is already small, and the split loops are not touched (nor the chunk
a loop computes before it, at the top level); the solves left whole are the ones
rewritten here. Whether the loops pay off only
XLA's buffer assignment tells (it schedules around them differently: GPflow's SGPR
gradient plans more with them), so the pass is `xla_checked`: under a budget it runs only
once a plan without it does not fit, and stays where XLA then plans less
(`tfmem.stages._with_xla_checked_passes`).

Conditions (rejections carry these reasons):
    * compiled by XLA (`jit_compile`): TensorFlow's own kernel writes its result once;
    * float32 or float64, static shapes, the factor's batch dimensions equal the
      right-hand side's;
    * at least a block's width of columns (blocks of `BLOCK_ROWS` rows, or
      n/`_row_panels.MIN_BLOCKS` when that is fewer): a narrow right-hand side saves too
      little to pay for a loop.
      Solves of fewer than `MIN_ROWS` rows are no candidates at all (no record each).

Example:
    >>> def solve(l, b):                                  # l [1024, 1024] lower, b [1024, 1024]
    ...     return tf.linalg.triangular_solve(l, b * 2.0)
    >>> traced = tfmem.TfmemFunction(solve).trace(l, b)
    >>> str(traced.rewrite(tfmem.Config(), passes=[SolveInPlace()]).records[0])
    '[solve_in_place] SolveInPlace fired at triangular_solve/MatrixTriangularSolve: blocks=8 block_rows=128 rhs_bytes=8.0 MiB'
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import tensorflow as tf

from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Emitted, RegionRule

from rewrites._row_panels import RowPanels, panel_rows
from rewrites.split.loops import in_split_loop

SOLVE_DTYPES = frozenset({tf.float32, tf.float64})
# Rows per block, at most. A loop step holds about 2.3 blocks of the right-hand side's
# rows beside it (the residual, the product being subtracted, the slice it reads); at n/8
# rows that is 0.28 of the right-hand side, against the one XLA's solve holds more.
# Measured on 2 cores (the Cholesky gradient's two solves, m=n, f64): 256 rows run as
# fast as XLA's own solve at n=2,048 and 4,096, 128 rows 1.2× slower; at n=1,000, n/8
# (125) rows run 1.08× XLA's time.
BLOCK_ROWS = 256
# Smaller solves stay as they are: the one buffer saved is small, the loop costs a compile.
MIN_ROWS = 512


@dataclasses.dataclass
class SolveRegion:
    """One `MatrixTriangularSolve` node; `block`, the rows per block `check` chose for it
    (0 until then)."""

    solve: str
    block: int = 0

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.solve,)


def substitute_in_place(factor: tf.Tensor, rhs: tf.Tensor, *, lower: bool, adjoint: bool,
                        block: int = BLOCK_ROWS) -> tf.Tensor:
    """`triangular_solve(factor, rhs, lower=lower, adjoint=adjoint)` as a loop over row blocks.

    The loop state is `rhs`, solved blocks written over its rows. Forward substitution
    (lower and not adjoint, or upper and adjoint) goes from the first rows with the
    remainder rows last; back substitution from the last rows, the remainder first.

    Example:
        >>> x = substitute_in_place(l, b, lower=True, adjoint=False, block=2)   # l [5, 5]
        >>> np.allclose(x, tf.linalg.triangular_solve(l, b))
        True
    """
    n, m = int(rhs.shape[-2]), int(rhs.shape[-1])
    forward = lower != adjoint
    full_blocks, remainder = divmod(n, block)
    panels = RowPanels(rhs.shape[:-2].as_list(), m)

    def block_start(j: tf.Tensor | int) -> tf.Tensor | int:
        return j * block if forward else n - (j + 1) * block

    def op_factor(rows: tf.Tensor | int, size: int, cols: tf.Tensor | int, width: int) -> tf.Tensor:
        """op(factor)[rows:rows+size, cols:cols+width], without forming op(factor)."""
        if not adjoint:
            return panels.block(factor, rows, cols, size, width)
        return tf.linalg.matrix_transpose(panels.block(factor, cols, rows, width, size))

    def solve_rows(x: tf.Tensor, start: tf.Tensor | int, size: int, done: tf.Tensor | int) -> tf.Tensor:
        """`x` with rows [start, start+size) solved, given the first `done` blocks are."""
        def subtract_block(j: tf.Tensor, residual: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            cols = block_start(j)
            return j + 1, residual - tf.linalg.matmul(op_factor(start, size, cols, block), panels.rows(x, cols, block))

        _, residual = tf.while_loop(lambda j, _: j < done, subtract_block,
                                    (tf.constant(0), panels.rows(x, start, size)))
        diagonal = panels.block(factor, start, start, size, size)
        solved = tf.linalg.triangular_solve(diagonal, residual, lower=lower, adjoint=adjoint)
        return panels.put(x, start, solved)

    _, x = tf.while_loop(lambda i, _: i < full_blocks,
                         lambda i, x: (i + 1, solve_rows(x, block_start(i), block, i)),
                         (tf.constant(0), rhs))
    if remainder:
        x = solve_rows(x, full_blocks * block if forward else 0, remainder, full_blocks)
    return x


class SolveInPlace(RegionRule[SolveRegion]):
    """Solves a large triangular system in a loop that overwrites the right-hand side.

    Example:
        >>> traced = tfmem.TfmemFunction(lambda l, b: tf.linalg.triangular_solve(l, b)).trace(l, b)
        >>> traced.rewrite(tfmem.Config(), passes=[SolveInPlace()]).graph.op_counts().get("MatrixTriangularSolve", 0)
        0
    """

    name = "solve_in_place"
    rule = "SolveInPlace"
    stage = "split"
    # The in-place loop is XLA's (TF's kernel has no second buffer); blocks honour the split size.
    reads = frozenset({"jit_compile", "tensor_split_size", "tensor_size_threshold"})
    # XLA schedules the loops differently from its own solves: in GPflow's SGPR gradient at
    # M=4,000 (N=20,000) a split loop then overlaps the Cholesky gradient, and XLA plans
    # 722.0 MiB against 559.7 without (measured), while GPR's n=4,300 drops from 564.8 to 441.5.
    xla_checked = True

    def __init__(self, block_rows: int = BLOCK_ROWS, min_rows: int = MIN_ROWS) -> None:
        if not 0 < block_rows < min_rows:
            # The loop's last, partial block is a solve of its own: it must not qualify again.
            raise ValueError(f"SolveInPlace: block_rows={block_rows} must be positive and below min_rows={min_rows}")
        self.block_rows = block_rows
        self.min_rows = min_rows

    def block_for(self, rows: int, row_bytes: int = 0, split_size: int | None = None) -> int:
        """Rows per block for a solve of `rows` rows (`panel_rows`, at most `block_rows`: the
        block temporaries stay small beside the result), a block of rows (`row_bytes`
        each) within the user's `split_size`."""
        return panel_rows(rows, self.block_rows, row_bytes, split_size)

    def find(self, graph: Graph) -> Iterator[SolveRegion]:
        for node in list(graph.find("MatrixTriangularSolve")):
            if node.name not in graph:
                continue
            rows = graph.spec(graph.inputs(node.name)[1]).shape[-2:-1]
            # Small solves are no candidates (no record each): the loop's own last block is one.
            # Nor are a split loop's (the chunk it solves before the loop is at the top level):
            # a chunk is small already, and the solves in the loop's body stay XLA's too.
            # (GPflow's SGPR gradient, N=20,000, M=4,000: XLA planned 722.0 MiB with that
            # chunk's solves in place, 568.7 MiB without.)
            if not (rows.is_fully_defined() and rows[0] < self.min_rows) and not in_split_loop(node.name):
                yield SolveRegion(node.name)

    def check(self, graph: Graph, region: SolveRegion, config: Config) -> str | None:
        if not config.jit_compile:
            return "not compiled by XLA: TensorFlow's kernel holds no second copy of the result"
        factor, rhs = (graph.spec(t) for t in graph.inputs(region.solve)[:2])
        if rhs.dtype not in SOLVE_DTYPES:
            return f"dtype {rhs.dtype.name} is not float32 or float64"
        if not factor.shape.is_fully_defined() or not rhs.shape.is_fully_defined():
            return f"shapes {factor.shape} and {rhs.shape} are not static"
        if factor.shape[:-2] != rhs.shape[:-2]:
            return f"the factor's batch dims {factor.shape[:-2]} differ from the right-hand side's {rhs.shape[:-2]}"
        n, m = rhs.shape[-2], rhs.shape[-1]
        if m < self.block_for(n):
            return (f"the right-hand side has {m} columns, fewer than a block's {self.block_for(n)} rows: "
                    "too little to save")
        region.block = self.block_for(n, m * rhs.dtype.size, config.split_size)
        return None

    def emit(self, graph: Graph, region: SolveRegion) -> Emitted | str:
        node = graph.node(region.solve)
        lower, adjoint = bool(node.attr["lower"].b), bool(node.attr["adjoint"].b)
        factor, rhs = graph.inputs(region.solve)[:2]
        block = region.block or self.block_for(graph.spec(rhs).shape[-2])
        (result,) = graph.splice(
            lambda l, b: substitute_in_place(l, b, lower=lower, adjoint=adjoint, block=block), [factor, rhs],
            scope=self.name)
        if graph.spec(result).shape != graph.spec(TensorRef(region.solve)).shape:
            return f"internal: the loop's result has shape {graph.spec(result).shape}"
        graph.replace_all_uses(TensorRef(region.solve), result)
        n = graph.spec(rhs).shape[-2]
        details = {"blocks": -(-n // block), "block_rows": block,
                   "chunk_bytes": block * graph.spec(rhs).shape[-1] * graph.spec(rhs).dtype.size,
                   "rhs_bytes": graph.nbytes(rhs) or 0}
        return Emitted(details, (result.node,))


__all__ = ["BLOCK_ROWS", "SolveInPlace", "SolveRegion", "substitute_in_place"]
