"""TensorFlow's Cholesky gradient, computed in place in one matrix (Murray's blocked algorithm).

    Ā = ½ · sym(L⁻ᴴ Φ(Lᴴ Ḡ) L⁻¹)            (`linalg_grad._CholeskyGrad`: L⁻¹ = solve(L, eye),
                                              three products, a set_diag, a band part, a transpose)
      →  A = tril(Ḡ); for each block of columns J, last to first (Murray 2016, "Differentiation
         of the Cholesky decomposition", algorithm `chol_blocked_rev`):
             C̄ ← C̄ D⁻¹,   B̄ ← B̄ − C̄ R,   D̄ ← Φ(D⁻ᵀ (P + Pᵀ) D⁻¹) with P = Φ(Dᵀ (D̄ − tril(C̄ᵀ C))),
             R̄ ← R̄ − C̄ᵀ B − (D̄ + D̄ᵀ) R
         (D the diagonal block of L at J, R the rows of J left of it, C the rows below J in
         J's columns, B the rows below left of J; barred: the same blocks of A); then
         Ā = sym(A), written over A a panel of rows at a time.

TensorFlow's rule forms the identity, the inverse `L⁻¹`, the product `Lᴴ Ḡ`, its masked
copy, two products with the inverse and a transpose: five `[n, n]` matrices beside L and Ḡ,
and XLA's peak of GPflow's GPR, VGP and SGPR gradients sits among them. The blocked
algorithm reads L and rewrites one matrix, `A`, a panel of `b` rows at a time in a
`tf.while_loop` (XLA updates a loop's state in place: `rewrites._row_panels`): the whole
gradient needs L, A and a few `[b, n]` panels, the floor of what any form of it needs.
It also costs fewer flops (about 2n³ against TensorFlow's 4n³ and more), so the step is
no slower (n=2,000, float64, 2 cores: 0.7 s against 0.8 s and more for XLA's own).

The result equals TensorFlow's gradient to rounding: both compute the same symmetric
matrix, Φ(Lᴴ Ḡ) depending only on the lower triangle of Ḡ (property-tested against
TensorFlow's own gradient, float32 and float64, with batch dimensions).

Conditions (rejections carry these reasons):
    * compiled by XLA (`jit_compile`): the loop works in place only under XLA;
    * the factor is a `Cholesky` output; the match is TensorFlow's rule exactly (the solve
      against an identity, the flags of the products, ½ on the diagonal and on the sum, the
      lower band, the transpose of the last two axes), and nothing else reads its inner tensors;
    * float32 or float64, static shapes, at least `MIN_ROWS` rows (smaller ones are no
      candidates: the matrices saved are small, the loop costs a compile);
    * one factor, not a batch: XLA does not update a batch in place in the loop (the
      function itself takes batches, `cholesky_gradient_in_place`).

Example:
    >>> def cholesky_grad(a, w):                     # a [600, 600] SPD, w [600, 600]
    ...     with tf.GradientTape() as tape:
    ...         tape.watch(a)
    ...         loss = tf.reduce_sum(tf.linalg.cholesky(a) * w)
    ...     return tape.gradient(loss, a)
    >>> traced = tfmem.TfmemFunction(cholesky_grad).trace(a, w)
    >>> str(traced.rewrite(tfmem.Config(), passes=[LeanCholeskyGradient()]).records[0])
    '[LeanCholeskyGradient] LeanCholeskyGradient fired at gradient_tape/mul_1 blocks=8 block_rows=75 matrix_bytes=2.7 MiB'
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrites._chain_algebra import PRODUCT_FLAGS
from rewrites._row_panels import RowPanels, panel_rows
from rewrites.solve_not_invert import SOLVE_DTYPES, identity_reason
from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import Match, OpBuilder, PatternNode, RewriteRule

# Rows per block, at most (as `SolveInPlace`), and at least `_row_panels.MIN_BLOCKS` blocks.
BLOCK_ROWS = 256
# Smaller gradients stay TensorFlow's: the matrices saved are small, the loops cost a compile.
MIN_ROWS = 512


def _tr(x: tf.Tensor) -> tf.Tensor:
    return tf.linalg.matrix_transpose(x)


def _phi(x: tf.Tensor) -> tf.Tensor:
    """The lower triangle of x with its diagonal halved."""
    return tf.linalg.band_part(x, -1, 0) - 0.5 * tf.linalg.diag(tf.linalg.diag_part(x))


def _diagonal_block_gradient(d: tf.Tensor, dbar: tf.Tensor) -> tf.Tensor:
    """Φ(D⁻ᵀ (P + Pᵀ) D⁻¹), P = Φ(Dᵀ D̄): one diagonal block's gradient, lower convention."""
    p = _phi(tf.linalg.matmul(d, dbar, adjoint_a=True))
    x = tf.linalg.triangular_solve(d, p + _tr(p), lower=True, adjoint=True)
    return _phi(_tr(tf.linalg.triangular_solve(d, _tr(x), lower=True, adjoint=True)))


def block_for(rows: int, split_size: int | None = None, itemsize: int = 8) -> int:
    """Rows per block for an `[rows, rows]` factor (`panel_rows`, at most `BLOCK_ROWS`): a
    `[block, rows]` panel stays within the user's `split_size` (`tensor_split_size`).

    Example:
        >>> block_for(2000), block_for(2000, split_size=2 * 2**20)
        (250, 131)
    """
    return panel_rows(rows, BLOCK_ROWS, rows * itemsize, split_size)


def cholesky_gradient_in_place(factor: tf.Tensor, grad: tf.Tensor, *, block: int | None = None) -> tf.Tensor:
    """The gradient TensorFlow's Cholesky rule returns, computed in one `[n, n]` matrix.

    Args:
        factor: L, the lower Cholesky factor, `[*batch, n, n]`.
        grad: Ḡ, the gradient with respect to L (only its lower triangle matters).
        block: rows per block (default `block_for(n)`).

    Returns:
        The symmetric gradient with respect to the factorised matrix, as `tf.GradientTape`
        gives it.

    Example:
        >>> a = tf.constant(np.eye(5) * 2.0 + 0.1)
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(a)
        ...     l = tf.linalg.cholesky(a)
        >>> want = tape.gradient(l, a, output_gradients=tf.ones_like(l))
        >>> got = cholesky_gradient_in_place(l, tf.ones_like(l), block=2)
        >>> bool(np.allclose(got, want))
        True
    """
    n = int(factor.shape[-1])
    block = block or block_for(n)
    panels = RowPanels(factor.shape[:-2].as_list(), n)
    full_blocks, remainder = divmod(n, block)
    columns = tf.range(n)

    def left_of(panel: tf.Tensor, start: tf.Tensor | int) -> tf.Tensor:
        return tf.where(columns < start, panel, tf.constant(0, panel.dtype))  # a scalar: no [b, n] constant

    def with_columns(panel: tf.Tensor | None, start: tf.Tensor | int, value: tf.Tensor) -> tf.Tensor:
        """`panel` [.., h, n] (None: zeros) with columns [start, start+w) set to `value` [.., h, w]."""
        width = int(value.shape[-1])
        inside = (columns >= start) & (columns < start + width)
        # A gather, not a pad: XLA needs the paddings of a pad to be constants.
        spread = tf.gather(tf.concat([value, tf.zeros_like(value[..., :1])], -1),
                           tf.where(inside, columns - start, width), axis=-1)
        return tf.where(inside, spread, tf.constant(0, value.dtype) if panel is None else panel)

    def reverse_step(a: tf.Tensor, start: tf.Tensor | int, size: int) -> tf.Tensor:
        """Murray's step for the diagonal block at [start, start+size); the rows below it
        are whole blocks (the remainder block is the first)."""
        d = panels.block(factor, start, start, size, size)
        # R, zero-padded to n columns; None for the first block (a Python 0), which has
        # nothing left of it: `left_of` there is a select whose predicate is all false, and
        # Grappler folds it into an [h, n] constant of zeros (6.3 MiB at n = 3,800), built
        # on the host and handed to XLA as a literal.
        r = None if isinstance(start, int) and start == 0 else left_of(panels.rows(factor, start, size), start)

        def below(i: tf.Tensor, a: tf.Tensor, cbar_c: tf.Tensor):
            row = start + size + i * block
            panel = panels.rows(a, row, block)
            # C̄ ← C̄ D⁻¹ (solving X D = C̄), then B̄ ← B̄ − C̄ R, with C̄ kept in J's columns.
            cbar = _tr(tf.linalg.triangular_solve(d, _tr(panels.block(panel, 0, start, block, size)),
                                                  lower=True, adjoint=True))
            a = panels.put(a, row, with_columns(panel if r is None else panel - tf.linalg.matmul(cbar, r),
                                                start, cbar))
            # R̄ ← R̄ − C̄ᵀ B, a block of rows at a time (no [b, n] accumulator: XLA's compile
            # would hold its zeros as a constant); D̄'s share, C̄ᵀ C, is summed.
            if r is not None:
                cbar_b = tf.linalg.matmul(cbar, left_of(panels.rows(factor, row, block), start), adjoint_a=True)
                a = panels.put(a, start, panels.rows(a, start, size) - cbar_b)
            cbar_c += tf.linalg.matmul(cbar, panels.block(factor, row, start, block, size), adjoint_a=True)
            return i + 1, a, cbar_c

        trips = (n - start - size) // block
        _, a, cbar_c = tf.while_loop(lambda i, *_: i < trips, below,
                                     (tf.constant(0), a, tf.zeros([*panels.batch, size, size], a.dtype)))
        panel = panels.rows(a, start, size)
        dbar = tf.linalg.band_part(panels.block(panel, 0, start, size, size) - cbar_c, -1, 0)
        dbar = _diagonal_block_gradient(d, dbar)
        panel = None if r is None else left_of(panel - tf.linalg.matmul(dbar + _tr(dbar), r), start)
        return panels.put(a, start, with_columns(panel, start, dbar))

    def symmetrised_rows(a: tf.Tensor, start: tf.Tensor | int, size: int) -> tf.Tensor:
        """Rows [start, start+size) of sym(A): ½A left of the diagonal block, ½ of the
        column below it on the right (rows below are not yet rewritten)."""
        panel = panels.rows(a, start, size)
        column = _tr(tf.slice(a, [*[0] * len(panels.batch), 0, start], [*[-1] * len(panels.batch), n, size]))
        diagonal = panels.block(panel, 0, start, size, size)
        mirrored = tf.where(columns < start, 0.5 * panel, 0.5 * column)
        return panels.put(a, start, with_columns(mirrored, start, 0.5 * (diagonal + _tr(diagonal))))

    a = tf.linalg.band_part(grad, -1, 0)
    _, a = tf.while_loop(lambda j, _: j < full_blocks,
                         lambda j, a: (j + 1, reverse_step(a, remainder + (full_blocks - 1 - j) * block, block)),
                         (tf.constant(0), a))
    if remainder:
        a = reverse_step(a, 0, remainder)
        a = symmetrised_rows(a, 0, remainder)
    _, a = tf.while_loop(lambda j, _: j < full_blocks,
                         lambda j, a: (j + 1, symmetrised_rows(a, remainder + j * block, block)),
                         (tf.constant(0), a))
    return a


def _product(op: OpBuilder, a: PatternNode, b: PatternNode) -> PatternNode:
    return (op.MatMul | op.BatchMatMulV2)(a, b)


def tf_cholesky_gradient(op: OpBuilder, factor: PatternNode, grad: PatternNode, eye: PatternNode) -> PatternNode:
    """`linalg_grad._CholeskyGrad` as TensorFlow 2.16–2.21 builds it."""
    inverse = op.MatrixTriangularSolve(factor, eye).named("inverse")
    middle = _product(op, factor, grad).named("middle")
    halved = op.Mul(op.const(name="diagonal_scale"), op.MatrixDiagPartV3(middle, op.const(name="diag_k"), op.any()))
    banded = op.MatrixBandPart(op.MatrixSetDiagV3(middle, halved, op.const(name="set_k")),
                               op.const(name="band_lower"), op.const(name="band_upper"))
    left = _product(op, inverse, banded).named("left")
    both = _product(op, left, inverse).named("both")
    return op.Mul(op.AddV2(both, op.Transpose(both, op.const(name="perm"))), op.const(name="sum_scale"))


# The products' adjoint flags TensorFlow's rule sets: Lᴴ Ḡ, L⁻ᴴ M, (L⁻ᴴ M) L⁻¹.
_FLAGS = {"middle": (True, False), "left": (True, False), "both": (False, False)}


def _flags(graph: Graph, product: TensorRef) -> tuple[bool, bool]:
    node = graph.node(product.node)
    names = PRODUCT_FLAGS[node.op]
    return tuple(bool(node.attr[name].b) if name in node.attr else False for name in names)  # type: ignore[return-value]


class LeanCholeskyGradient(RewriteRule):
    """TensorFlow's Cholesky gradient → Murray's blocked algorithm, in place in one matrix.

    Example (`cholesky_grad` as in the module's example):
        >>> traced = tfmem.TfmemFunction(cholesky_grad).trace(a, w)
        >>> graph = traced.rewrite(tfmem.Config(), passes=[LeanCholeskyGradient()]).graph
        >>> graph.op_counts().get("MatrixTriangularSolve", 0)    # no inverse: the solves are the loop's
        0
    """

    reads = frozenset({"jit_compile", "tensor_split_size", "tensor_size_threshold"})  # XLA; panel sizes
    # XLA schedules around the loops differently: GPflow's GPR gradient at n=4,700 under 512 MiB
    # plans 401.5 MiB with them against 527.1 MiB without, but VGP (Linear kernel, N=2,000)
    # 187.2 MiB against 179.3 MiB. Only XLA's plan tells, so under a budget the rule is tried
    # once a plan without it does not fit, and kept where XLA plans less
    # (`tfmem.stages._with_xla_checked_passes`).
    xla_checked = True

    def __init__(self, min_rows: int = MIN_ROWS) -> None:
        super().__init__("LeanCholeskyGradient", tf_cholesky_gradient)
        self.min_rows = min_rows

    def check(self, graph: Graph, match: Match, config: Config) -> str | None:
        if not config.jit_compile:
            return "not compiled by XLA: the loop works in place only under XLA"
        factor = match["factor"]
        if graph.node(factor.node).op != "Cholesky":
            return f"the factor {factor} is {graph.node(factor.node).op}, not a Cholesky factor"
        reason = identity_reason(graph, match["eye"])
        if reason is not None:
            return reason
        solve = graph.node(match["inverse"].node)
        if not solve.attr["lower"].b or solve.attr["adjoint"].b:
            return f"{solve.name} is not a lower, non-adjoint solve"
        for name, want in _FLAGS.items():
            if _flags(graph, match[name]) != want:
                return f"{match[name].node} has adjoint flags {_flags(graph, match[name])}, not {want}"
        values = {name: np.asarray(graph.constant_value(match[name])) for name in match.value_captures}
        spec = graph.spec(factor)
        rank = spec.shape.rank
        expected = {"diagonal_scale": 0.5, "sum_scale": 0.5, "diag_k": 0, "set_k": 0, "band_lower": -1,
                    "band_upper": 0}
        for name, value in expected.items():
            if values[name].size != 1 or float(values[name].reshape(())) != value:
                return f"{name} is {values[name].tolist()}, not {value}: not TensorFlow's Cholesky gradient"
        if rank is None or values["perm"].tolist() != [*range(rank - 2), rank - 1, rank - 2]:
            return f"the transpose's perm {values['perm'].tolist()} does not swap the last two axes"
        if spec.dtype not in SOLVE_DTYPES:
            return f"dtype {spec.dtype.name} is not float32 or float64"
        grad = graph.spec(match["grad"])
        if not spec.shape.is_fully_defined() or grad.shape != spec.shape:
            return f"shapes {spec.shape} (factor) and {grad.shape} (gradient) are not static and equal"
        if rank > 2:
            # The loop's updates are not in place for a batch (even of one): measured at n=520,
            # float64, XLA plans 40.8 MiB for [1, n, n] against 16.0 MiB for TensorFlow's rule,
            # and 121.4 against 54.1 MiB for [3, n, n] (10.3 against 14.0 MiB for [n, n]).
            return f"a batch of factors {spec.shape}: XLA does not update the loop's batch in place"
        if spec.shape[-1] < self.min_rows:
            return f"{spec.shape[-1]} rows, fewer than {self.min_rows}: too little to save"
        n = int(spec.shape[-1])
        block = block_for(n, config.split_size, spec.dtype.size)
        match.state["block"] = block
        match.state["details"] = {"blocks": -(-n // block), "block_rows": block, "chunk_bytes": block * n * spec.dtype.size,
                                  "matrix_bytes": graph.nbytes(factor) or 0}
        return None

    def apply(self, graph: Graph, match: Match) -> dict[TensorRef, TensorRef]:
        def lean(factor: tf.Tensor, grad: tf.Tensor) -> tf.Tensor:
            return cholesky_gradient_in_place(factor, grad, block=match.state.get("block"))

        (result,) = graph.splice(lean, [match["factor"], match["grad"]], scope=self.name)
        return {match.root: result}


__all__ = ["LeanCholeskyGradient", "block_for", "cholesky_gradient_in_place", "tf_cholesky_gradient"]
