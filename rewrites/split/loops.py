"""Loops: a region computed chunk by chunk in a `tf.while_loop`.

The region's nodes become a GraphDef *fragment* whose inputs are placeholders shaped
for one chunk. The loop imports that fragment once per chunk — the same
`import_graph_def` the wrapper uses — with the chunk's slices of the split inputs:

    accumulators           → the identity of each sink's merge (0, -inf, ...)
    while i < full_chunks  → slice inputs at i·c, import the fragment, combine, write
    remainder (static)     → one more import with the last, shorter chunk

Sinks combine by their op's combiner (add partial sums and products, max/min, a running
top-k merge, arg-max/arg-min with values); written-out tensors go into a TensorArray
and are concatenated. Everything is static-shaped, so the loop compiles under XLA.

A large matrix product summed over the chunks (`acc += a_c b_c`, GPflow SGPR's
`A Aᵀ` and its gradient's products, [M, M]) is not formed whole in the body: the
accumulator is kept as row blocks and each block's product is added in place, each
after the previous block's update (`order.computed_after`), so the body holds one
block of the product beside the accumulator, not a whole second [M, M]:

    acc[j] += a_c[rows j] · b_c      for j = 1 … k     (tensor_scatter_nd_add)
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tfmem.graph import Graph, TensorRef

from rewrites.split.fragment import Fragment, fragment
from rewrites.split.regions import Feed, SliceRegion
from rewrites.split.op_rules import chunk_patches
from rewrites.split.order import computed_after

_SMALL_CONSTANT_BYTES = 1 << 16
# The name scope of a split loop's nodes (made unique per loop: `tfmem_split_1`, ...).
SPLIT_SCOPE = "tfmem_split"
# A summed product at least this large is accumulated in row blocks (see the module
# docstring): below it, a whole product per chunk costs less than the blocks' extra ops.
BLOCKED_PRODUCT_BYTES = 8 << 20
# How many row blocks, in order of preference: the first that divides the rows.
_ROW_BLOCKS = (4, 5, 6, 3, 8, 2)


def _fragment(graph: Graph, region: SliceRegion, feeds: Sequence[Feed], chunk: int,
              exclude: frozenset[str] = frozenset()) -> Fragment:
    """The region's nodes (but `exclude`) as a fragment for one chunk of length `chunk`."""
    constants: dict[tuple[str, int], np.ndarray] = {}
    nodes = [name for name in region.nodes if name not in exclude]
    for name in nodes:
        in_axes = {}
        for position, ref in enumerate(graph.inputs(name)):
            feed = region.feed_of(name, position, ref)
            axis = region.axes.get(ref) if feed is None else feed.axis
            if axis is not None:
                in_axes[position] = axis
        patches = chunk_patches(graph, name, region.axes.get(TensorRef(name)), chunk, in_axes)
        constants.update(((name, position), value) for position, value in patches.items())
    # Shape arguments must stay constants, or shape inference loses dimensions.
    inline = [feed for feed in feeds if feed.axis is None and is_small_constant(graph, feed.ref)]
    return fragment(graph, nodes, feed=region.feed_of, constants=constants, inline=inline)


def row_blocks(graph: Graph, region: SliceRegion, name: str) -> int:
    """Into how many row blocks the sum of sink `name`'s chunk products is accumulated:
    more than 1 for a 2-D `MatMul` summed over the chunks whose product is at least
    `BLOCKED_PRODUCT_BYTES`, read by nothing else in the region, with rows that divide
    evenly; else 1 (a whole product per chunk)."""
    node = graph.node(name)
    if region.sinks.get(name) != "sum" or node.op != "MatMul":
        return 1
    out = TensorRef(name)
    shape = graph.spec(out).shape
    if shape.rank != 2 or not shape.is_fully_defined() or (graph.nbytes(out) or 0) < BLOCKED_PRODUCT_BYTES:
        return 1
    if any(ref.node == name for reader in region.nodes for ref in graph.inputs(reader)):
        return 1
    return next((k for k in _ROW_BLOCKS if shape[0] % k == 0), 1)


def is_small_constant(graph: Graph, ref: TensorRef) -> bool:
    """A `Const` small enough to copy into a loop body rather than feed it (shape
    arguments stay constants there, and shape inference keeps every dimension)."""
    return graph.node(ref.node).op == "Const" and (graph.nbytes(ref) or 0) <= _SMALL_CONSTANT_BYTES


def _slice_along(tensor: tf.Tensor, axis: int, start: Any, length: int) -> tf.Tensor:
    shape = tensor.shape.as_list()
    if isinstance(start, int):  # a static start (the remainder): a constant a later region can patch
        begin = tf.constant([start if j == axis else 0 for j in range(len(shape))], tf.int32)
    else:
        begin = tf.stack([tf.cast(start, tf.int32) if j == axis else tf.constant(0) for j in range(len(shape))])
    size = [length if j == axis else s for j, s in enumerate(shape)]
    return tf.slice(tensor, begin, size)


def _to_front(tensor: tf.Tensor, axis: int) -> tf.Tensor:
    if axis == 0:
        return tensor
    rank = tensor.shape.rank
    return tf.transpose(tensor, [axis] + [j for j in range(rank) if j != axis])


def _to_front_shape(shape: list[int], axis: int, length: int) -> list[int]:
    """The shape `_to_front` gives a chunk of length `length` of a tensor of `shape`."""
    return [length] + [s for j, s in enumerate(shape) if j != axis]


def _from_front(tensor: tf.Tensor, axis: int) -> tf.Tensor:
    if axis == 0:
        return tensor
    rank = tensor.shape.rank
    order = [axis] + [j for j in range(rank) if j != axis]
    return tf.transpose(tensor, np.argsort(order).tolist())


def _lowest(dtype: tf.DType) -> Any:
    return -np.inf if dtype.is_floating else dtype.min


def _highest(dtype: tf.DType) -> Any:
    return np.inf if dtype.is_floating else dtype.max


# Merges that keep the earliest chunk's candidate on ties: their chunks must run in order.
ORDERED_MERGES = frozenset({"argmax", "argmin", "topk"})


class _Combiner:
    """Starts and merges the accumulators of one sink across chunks."""

    def __init__(self, graph: Graph, region: SliceRegion, name: str) -> None:
        self.kind = region.sinks[name]
        self.outputs = len(graph.output_specs(name))
        node = graph.node(name)
        self.source = graph.inputs(name)[0]  # the reduced tensor (for arg-max values)
        self.axis = region.axes.get(self.source)
        self.k = None
        if self.kind == "topk":
            k = graph.constant_value(graph.inputs(name)[1])
            self.k = int(k)
        self.size = region.size
        self.sorted = node.attr["sorted"].b if "sorted" in node.attr else True
        self.specs = graph.output_specs(name)
        self.source_dtype = graph.spec(self.source).dtype
        # A product summed in row blocks: the fragment returns its operands, not the product.
        self.blocks = row_blocks(graph, region, name)
        self.transposes = (node.attr["transpose_a"].b, node.attr["transpose_b"].b) if self.blocks > 1 else (False, False)
        # What each chunk hands `partial`: the sink's outputs from the fragment, or for a
        # blocked sum its operands, each a fragment tensor or a feed of the loop.
        self.reads: list[TensorRef | Feed] = (
            [region.feed_of(name, position, ref) or ref for position, ref in enumerate(graph.inputs(name)[:2])]
            if self.blocks > 1 else [TensorRef(name, i) for i in range(self.outputs)])

    def _blocked_shape(self) -> list[int]:
        rows, cols = self.specs[0].shape.as_list()
        return [self.blocks, rows // self.blocks, cols]

    def initial(self) -> list[tf.Tensor]:
        """The accumulators before the first chunk: the identity of the merge (for the
        ordered merges; the others start from a chunk computed before the loop)."""
        def filled(spec: tf.TensorSpec, value: Any) -> tf.Tensor:
            return tf.fill(spec.shape.as_list(), tf.constant(value, spec.dtype))

        kind, (out, *_) = self.kind, self.specs
        if self.blocks > 1:
            return [tf.zeros(self._blocked_shape(), out.dtype)]
        if kind in ("sum", "mean"):
            return [filled(out, 0)]
        if kind in ("max", "min"):
            return [filled(out, _lowest(out.dtype) if kind == "max" else _highest(out.dtype))]
        if kind in ("prod", "all", "any"):  # (a bool has no lowest value: only max/min ask for one)
            return [filled(out, {"prod": 1, "all": True, "any": False}[kind])]
        if kind in ("argmax", "argmin"):
            extreme = _lowest if kind == "argmax" else _highest
            values = tf.TensorSpec(out.shape, self.source_dtype)
            return [filled(values, extreme(self.source_dtype)), filled(out, 0)]
        if kind == "topk":
            values, indices = self.specs
            return [filled(values, _lowest(values.dtype)), filled(indices, 0)]
        raise AssertionError(f"unknown combine {kind}")

    def partial(self, outputs: list[tf.Tensor], source: tf.Tensor | None, start: Any, chunk: int) -> list[tf.Tensor]:
        """This chunk's contribution, in global terms (indices offset, means weighted)."""
        if self.kind == "mean":
            return [outputs[0] * tf.constant(chunk / self.size, outputs[0].dtype)]  # not via float32
        if self.kind == "topk":
            values, indices = outputs
            return [values, indices + tf.cast(start, indices.dtype)]
        if self.kind in ("argmax", "argmin"):
            reduce = tf.reduce_max if self.kind == "argmax" else tf.reduce_min
            (indices,) = outputs
            return [reduce(source, axis=self.axis), indices + tf.cast(start, indices.dtype)]
        return list(outputs)

    def start(self, partial: list[tf.Tensor]) -> list[tf.Tensor]:
        """The accumulators from the first chunk's partial results (a peeled chunk)."""
        if self.blocks > 1:
            a, b = partial
            ta, tb = self.transposes
            return [tf.reshape(tf.matmul(a, b, transpose_a=ta, transpose_b=tb), self._blocked_shape())]
        return partial

    def merge(self, acc: list[tf.Tensor], new: list[tf.Tensor]) -> list[tf.Tensor]:
        kind = self.kind
        if self.blocks > 1:
            return [self._add_by_rows(acc[0], *new)]
        if kind in ("sum", "mean"):
            return [acc[0] + new[0]]
        if kind in ("max", "min", "prod"):
            return [{"max": tf.maximum, "min": tf.minimum, "prod": tf.multiply}[kind](acc[0], new[0])]
        if kind in ("all", "any"):
            return [(tf.logical_and if kind == "all" else tf.logical_or)(acc[0], new[0])]
        if kind in ("argmax", "argmin"):
            better = new[0] > acc[0] if kind == "argmax" else new[0] < acc[0]  # ties keep the first
            return [tf.where(better, new[0], acc[0]), tf.where(better, new[1], acc[1])]
        if kind == "topk":
            values = tf.concat([acc[0], new[0]], axis=-1)  # earlier chunks first: ties keep lower indices
            indices = tf.concat([acc[1], new[1]], axis=-1)
            best = tf.math.top_k(values, k=self.k, sorted=self.sorted)
            return [best.values, tf.gather(indices, best.indices, batch_dims=indices.shape.rank - 1)]
        raise AssertionError(f"unknown combine {kind}")

    def _add_by_rows(self, acc: tf.Tensor, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        """`acc + a·b` (with the sink's transposes), one block of rows at a time, each
        block's product made after the previous block was added (so XLA holds one)."""
        ta, tb = self.transposes
        rows = acc.shape[1]
        for j in range(self.blocks):
            block = a[:, j * rows:(j + 1) * rows] if ta else a[j * rows:(j + 1) * rows]
            if j:
                [block] = computed_after(acc, block)
            product = tf.matmul(block, b, transpose_a=ta, transpose_b=tb)
            acc = tf.tensor_scatter_nd_add(acc, [[j]], product[None])
        return acc

    def finish(self, acc: list[tf.Tensor]) -> list[tf.Tensor]:
        if self.blocks > 1:
            return [tf.reshape(acc[0], self.specs[0].shape)]
        return acc[1:] if self.kind in ("argmax", "argmin") else acc


def written_out(graph: Graph, region: SliceRegion, max_write_out: int, *,
                assemble_returned: bool = True) -> list[TensorRef]:
    """The split tensors a loop of `region` assembles whole for readers outside it: those
    of at most `max_write_out` bytes, and (with `assemble_returned`) what the program
    returns, which is held whole anyway."""
    whole = set(region.left_whole(graph, max_write_out, assemble_returned=assemble_returned))
    return [ref for ref in region.write_outs(graph) if ref not in whole]


def even_chunk(size: int, chunk: int, *, down_to: float = 0.75) -> int:
    """`chunk`, or the largest divisor of `size` no smaller than `down_to × chunk`.

    A loop whose chunks do not divide its length computes a remainder chunk after the
    others, and joins what it writes out to theirs with a copy of the whole tensor.

    Example:
        >>> even_chunk(3000, 314), even_chunk(3001, 314), even_chunk(20000, 395, down_to=0.5)
        (300, 314, 250)
    """
    if chunk >= size:
        return chunk  # one trip: no remainder
    for candidate in range(chunk, max(1, math.ceil(down_to * chunk)) - 1, -1):
        if size % candidate == 0:
            return candidate
    return chunk


def in_split_loop(node: str) -> bool:
    """Whether `node` is one of a split loop's nodes (its scope `SPLIT_SCOPE`, `SPLIT_SCOPE_1`, ...),
    the chunk it computes before the loop included.

    Example:
        >>> in_split_loop("tfmem_split_1/chunk/MatMul"), in_split_loop("tfmem_splitter/MatMul")
        (True, False)
    """
    scope = node.split("/", 1)[0]
    return scope == SPLIT_SCOPE or (scope.startswith(f"{SPLIT_SCOPE}_") and scope[len(SPLIT_SCOPE) + 1:].isdigit())


def emit_loop(graph: Graph, region: SliceRegion, chunk: int, *, max_write_out: int,
              assemble_returned: bool = True, scope: str = SPLIT_SCOPE) -> dict[TensorRef, TensorRef]:
    """Adds a loop computing `region` in chunks of `chunk`; returns original → new tensors.

    Split tensors read outside the region are assembled whole only up to `max_write_out`
    bytes, or when the program returns them (`written_out`); larger ones are left to their
    original ops (and so to a later loop that can recompute them chunk by chunk), never
    materialised here. The caller rewires readers with `Graph.replace_all_uses` and prunes
    the originals.
    """
    feeds = region.feeds(graph)
    write_outs = written_out(graph, region, max_write_out, assemble_returned=assemble_returned)
    out_axes = [region.axes[ref] for ref in write_outs]
    sink_names = list(region.sinks)
    combiners = {name: _Combiner(graph, region, name) for name in sink_names}
    blocked = frozenset(n for n in sink_names if combiners[n].blocks > 1)
    sink_reads = [read for n in sink_names for read in combiners[n].reads]
    sources = [combiners[n].source for n in sink_names if combiners[n].kind in ("argmax", "argmin")]
    returns = write_outs + [read for read in sink_reads if isinstance(read, TensorRef)] + sources
    full, remainder = divmod(region.size, chunk)
    fragments = {length: _fragment(graph, region, feeds, length, exclude=blocked)
                 for length in {chunk, remainder} if length}

    def run_chunk(tensors: Sequence[tf.Tensor], start: Any, length: int) -> tuple[list, list[list]]:
        fragment = fragments[length]
        # tf.identity captures a whole input into the loop body (import needs local tensors).
        # Only inputs the fragment (or a blocked sum) reads are fed (a patched shape
        # constant is no longer read).
        wanted = set(fragment.feeds) | {read for read in sink_reads if isinstance(read, Feed)}
        values = {feed: tf.identity(t) if feed.axis is None else _slice_along(t, feed.axis, start, length)
                  for feed, t in zip(feeds, tensors) if feed in wanted}
        results = fragment.import_into(values, returns, name="chunk")
        written = results[:len(write_outs)]
        rest = iter(results[len(write_outs):])
        sink_outputs = {n: [values[read] if isinstance(read, Feed) else next(rest) for read in combiners[n].reads]
                        for n in sink_names}
        source_values = dict(zip([n for n in sink_names if combiners[n].kind in ("argmax", "argmin")], rest))
        partials = [combiners[n].partial(sink_outputs[n], source_values.get(n), start, length)
                    for n in sink_names]
        return list(written), partials

    # Merges that do not depend on the order of the chunks start from a chunk computed
    # before the loop, whose partial results are the accumulators' first values: no
    # identity-filled accumulator is materialised. (XLA merges the identical fills of
    # several loops into one buffer, alive from the first loop to the last: a whole
    # [M, M] at GPflow SGPR's gradient peak.) That chunk is the remainder, else the first.
    # Top-k and arg-max keep the earliest chunk on ties, so their chunks run in order.
    peel = bool(sink_names) and not any(combiners[n].kind in ORDERED_MERGES for n in sink_names)

    def build(*tensors: tf.Tensor) -> list[tf.Tensor]:
        chunk_shapes = [_to_front_shape(graph.spec(ref).shape.as_list(), axis, chunk)
                        for ref, axis in zip(write_outs, out_axes)]
        arrays = [tf.TensorArray(graph.spec(ref).dtype, size=full, element_shape=shape)
                  for ref, shape in zip(write_outs, chunk_shapes)]
        first = 0  # the first full chunk the loop computes
        last_written: list[tf.Tensor] = []
        if peel and remainder:
            last_written, partials = run_chunk(tensors, full * chunk, remainder)
            acc = [combiners[n].start(p) for n, p in zip(sink_names, partials)]
        elif peel:
            written, partials = run_chunk(tensors, 0, chunk)
            acc = [combiners[n].start(p) for n, p in zip(sink_names, partials)]
            arrays = [ta.write(0, _to_front(w, a)) for ta, w, a in zip(arrays, written, out_axes)]
            first = 1
        else:
            acc = [combiners[n].initial() for n in sink_names]

        def body(i: tf.Tensor, acc: list, arrays: list) -> tuple:
            written, partials = run_chunk(tensors, i * chunk, chunk)
            acc = [combiners[n].merge(a, p) for n, a, p in zip(sink_names, acc, partials)]
            arrays = [ta.write(i, _to_front(w, a)) for ta, w, a in zip(arrays, written, out_axes)]
            return i + 1, acc, arrays

        # One trip at a time: TensorFlow's executor (jit_compile off) otherwise starts up to
        # 10 trips at once, each holding its chunk, and the loop holds 10 chunks where the
        # plan counts one (a [4000, 4000] kernel under 64 MiB ran out of memory). XLA runs
        # trips one by one anyway.
        _, acc, arrays = tf.while_loop(lambda i, *_: i < full, body, (tf.constant(first), acc, arrays),
                                       maximum_iterations=full - first, parallel_iterations=1)
        if remainder and not peel:
            last_written, partials = run_chunk(tensors, full * chunk, remainder)
            acc = [combiners[n].merge(a, p) for n, a, p in zip(sink_names, acc, partials)]
        outputs = []
        for k, (ta, axis) in enumerate(zip(arrays, out_axes)):
            stacked = ta.stack()  # [full, chunk, ...]
            front = tf.reshape(stacked, [full * chunk, *chunk_shapes[k][1:]])
            if remainder:
                front = tf.concat([front, _to_front(last_written[k], axis)], axis=0)
            outputs.append(_from_front(front, axis))
        for name, a in zip(sink_names, acc):
            outputs.extend(combiners[name].finish(a))
        return outputs

    new_refs = graph.splice(build, [feed.ref for feed in feeds], scope=scope)
    old_refs = write_outs + [TensorRef(n, i) for n in sink_names for i in range(combiners[n].outputs)]
    return dict(zip(old_refs, new_refs))
