"""Row panels of a batch of matrices, read and written back in place under XLA.

The in-place loops (`SolveInPlace`, `LeanCholeskyGradient`) carry one whole matrix and
rewrite it a panel of rows at a time. A panel is read with a slice and written back with
`tensor_scatter_nd_update` on its row indices, which XLA performs in place on a loop's
state, so the loop holds the matrix once and a few panel-sized temporaries beside it.
Offsets may be tensors (a loop counter); sizes are static, as XLA needs them.

Example:
    >>> panels = RowPanels(batch=[], columns=4)
    >>> x = tf.zeros([6, 4])
    >>> y = panels.put(x, 2, tf.ones([2, 4]))             # rows 2 and 3 become ones
    >>> panels.rows(y, 2, 2).numpy().sum(), panels.block(y, 1, 0, 2, 2).numpy().sum()
    (8.0, 2.0)
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

Offset = "tf.Tensor | int"
# At least this many panels per matrix: a loop step holds a few panels beside the matrix.
MIN_BLOCKS = 8


def panel_rows(rows: int, most: int, row_bytes: int = 0, split_size: int | None = None) -> int:
    """Rows per panel of a matrix of `rows` rows: at most `most`, few enough for
    `MIN_BLOCKS` panels, and, with the user's `split_size` (`tensor_split_size`), a panel
    of rows of `row_bytes` each within it; at least one row.

    Example:
        >>> panel_rows(2000, 256), panel_rows(2000, 256, row_bytes=2000 * 8, split_size=2 * 2**20)
        (250, 131)
    """
    block = min(most, -(-rows // MIN_BLOCKS))
    if split_size is not None and row_bytes:
        block = min(block, split_size // row_bytes)
    return max(1, block)


@dataclasses.dataclass(frozen=True)
class RowPanels:
    """Slices and row writes of `[*batch, n, columns]` matrices (one static batch shape).

    Attributes:
        batch: the static batch dimensions, shared by every matrix handled.
        columns: the width of the matrices whose rows are read and written.
    """

    batch: list[int]
    columns: int

    @property
    def _zeros(self) -> list[int]:
        return [0] * len(self.batch)

    @property
    def _whole(self) -> list[int]:
        return [-1] * len(self.batch)

    def rows(self, x: tf.Tensor, start: tf.Tensor | int, size: int) -> tf.Tensor:
        """Rows [start, start+size) of `x`, every column: [*batch, size, columns]."""
        return tf.slice(x, [*self._zeros, start, 0], [*self._whole, size, self.columns])

    def block(self, x: tf.Tensor, row: tf.Tensor | int, col: tf.Tensor | int, height: int, width: int) -> tf.Tensor:
        """`x[..., row:row+height, col:col+width]` (any matrix with these batch dims)."""
        return tf.slice(x, [*self._zeros, row, col], [*self._whole, height, width])

    def row_indices(self, start: tf.Tensor | int, size: int) -> tf.Tensor:
        """Scatter indices of rows [start, start+size) in every batch member: [*batch, size, rank-1]."""
        axes = [tf.range(d) for d in self.batch] + [start + tf.range(size)]
        return tf.stack(tf.meshgrid(*axes, indexing="ij"), axis=-1)

    def put(self, x: tf.Tensor, start: tf.Tensor | int, panel: tf.Tensor) -> tf.Tensor:
        """`x` with rows [start, start+len(panel)) replaced by `panel` (in place under XLA)."""
        return tf.tensor_scatter_nd_update(x, self.row_indices(start, int(panel.shape[-2])), panel)


__all__ = ["RowPanels"]
