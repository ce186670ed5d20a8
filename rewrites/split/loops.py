"""Loops: a region computed chunk by chunk in a `tf.while_loop`.

The region's nodes become a GraphDef *fragment* whose inputs are placeholders shaped
for one chunk. The loop imports that fragment once per chunk — the same
`import_graph_def` the wrapper uses — with the chunk's slices of the split inputs:

    first chunk            → initial accumulators and the first written-out chunk
    while i < full_chunks  → slice inputs at i·c, import the fragment, combine, write
    remainder (static)     → one more import with the last, shorter chunk

Sinks combine by their op's combiner (add partial sums and products, max/min, a running
top-k merge, arg-max/arg-min with values); written-out tensors go into a TensorArray
and are concatenated. Everything is static-shaped, so the loop compiles under XLA.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from tfmem.graph import Graph, TensorRef

from rewrites.split.regions import Region
from rewrites.split.rules import chunk_patches

_INPUT = "tfmem_chunk_input_{}"
_STRIP_ATTRS = ("_output_shapes", "_class")
_SMALL_CONSTANT_BYTES = 1 << 16


def _fragment(graph: Graph, region: Region, inputs: Sequence[TensorRef], chunk: int) -> graph_pb2.GraphDef:
    """The region's nodes as a GraphDef for one chunk of length `chunk`."""
    fragment = graph_pb2.GraphDef()
    fragment.versions.CopyFrom(graph.versions)
    # Inputs are named but not defined: import_graph_def binds them through input_map. (A
    # placeholder node would be imported even when mapped, and XLA has no kernel for it.)
    index = {ref: k for k, ref in enumerate(inputs)}
    copied: set[str] = set()
    for name in region.nodes:
        node = _copy_for_fragment(graph.node(name), name)
        data_inputs = graph.inputs(name)
        in_axes = {i: region.axes[ref] for i, ref in enumerate(data_inputs) if ref in region.axes}
        out_axis = region.axes.get(TensorRef(name))
        patches = chunk_patches(graph, name, out_axis, chunk, in_axes)
        del node.input[:]  # data inputs are re-added below; regions hold no control edges
        for position, ref in enumerate(data_inputs):
            if position in patches:
                const = _const_node(f"{name}/tfmem_chunk_{position}", patches[position])
                fragment.node.append(const)
                node.input.append(const.name)
            elif ref in index and ref not in region.axes and _is_small_constant(graph, ref):
                # Shape arguments must stay constants, or shape inference loses dimensions.
                name_in_fragment = _INPUT.format(index[ref]) + "_const"
                if name_in_fragment not in copied:
                    const = _copy_for_fragment(graph.node(ref.node), name_in_fragment)
                    del const.input[:]
                    fragment.node.append(const)
                    copied.add(name_in_fragment)
                node.input.append(name_in_fragment)
            elif ref in index:
                node.input.append(TensorRef(_INPUT.format(index[ref]), 0).as_input())
            else:
                node.input.append(ref.as_input())
        fragment.node.append(node)
    return fragment


def _copy_for_fragment(original: node_def_pb2.NodeDef, name: str) -> node_def_pb2.NodeDef:
    """A copy named `name`, without the attrs that tie it to the big graph (stale shapes,
    colocation with nodes the fragment does not have)."""
    node = node_def_pb2.NodeDef()
    node.CopyFrom(original)
    node.name = name
    for attr in _STRIP_ATTRS:
        if attr in node.attr:
            del node.attr[attr]
    return node


def _is_small_constant(graph: Graph, ref: TensorRef) -> bool:
    return graph.node(ref.node).op == "Const" and (graph.nbytes(ref) or 0) <= _SMALL_CONSTANT_BYTES


def _const_node(name: str, value: np.ndarray) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return node


def _slice_along(tensor: tf.Tensor, axis: int, start: Any, length: int) -> tf.Tensor:
    shape = tensor.shape.as_list()
    begin = tf.stack([tf.cast(start, tf.int32) if j == axis else tf.constant(0) for j in range(len(shape))])
    size = [length if j == axis else s for j, s in enumerate(shape)]
    return tf.slice(tensor, begin, size)


def _to_front(tensor: tf.Tensor, axis: int) -> tf.Tensor:
    if axis == 0:
        return tensor
    rank = tensor.shape.rank
    return tf.transpose(tensor, [axis] + [j for j in range(rank) if j != axis])


def _from_front(tensor: tf.Tensor, axis: int) -> tf.Tensor:
    if axis == 0:
        return tensor
    rank = tensor.shape.rank
    order = [axis] + [j for j in range(rank) if j != axis]
    return tf.transpose(tensor, np.argsort(order).tolist())


class _Combiner:
    """Starts and merges the accumulators of one sink across chunks."""

    def __init__(self, graph: Graph, region: Region, name: str) -> None:
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

    def merge(self, acc: list[tf.Tensor], new: list[tf.Tensor]) -> list[tf.Tensor]:
        kind = self.kind
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

    def finish(self, acc: list[tf.Tensor]) -> list[tf.Tensor]:
        return acc[1:] if self.kind in ("argmax", "argmin") else acc


def emit_loop(graph: Graph, region: Region, chunk: int, *, max_write_out: int,
              scope: str = "tfmem_split") -> dict[TensorRef, TensorRef]:
    """Adds a loop computing `region` in chunks of `chunk`; returns original → new tensors.

    Split tensors read outside the region are assembled whole only up to `max_write_out`
    bytes; larger ones are left to their original ops (and so to a later loop that can
    recompute them chunk by chunk), never materialised here. The caller rewires readers
    with `Graph.replace_all_uses` and prunes the originals.
    """
    inputs = region.inputs(graph)
    in_axes = [region.axes.get(ref) for ref in inputs]
    write_outs = [ref for ref in region.write_outs(graph) if (graph.nbytes(ref) or 0) <= max_write_out]
    out_axes = [region.axes[ref] for ref in write_outs]
    sink_names = list(region.sinks)
    combiners = {name: _Combiner(graph, region, name) for name in sink_names}
    sources = [combiners[n].source for n in sink_names if combiners[n].kind in ("argmax", "argmin")]
    returns = [ref.name for ref in write_outs] + [TensorRef(n, i).name for n in sink_names
                                                  for i in range(combiners[n].outputs)]
    returns += [ref.name for ref in sources]
    full, remainder = divmod(region.size, chunk)
    fragments = {length: _fragment(graph, region, inputs, length) for length in {chunk, remainder} if length}

    def run_chunk(tensors: Sequence[tf.Tensor], start: Any, length: int) -> tuple[list, list[list]]:
        # tf.identity captures a whole input into the loop body (import needs local tensors).
        feeds = {f"{_INPUT.format(k)}:0": tf.identity(t) if axis is None else _slice_along(t, axis, start, length)
                 for k, (t, axis) in enumerate(zip(tensors, in_axes))}
        # Feed only inputs the fragment reads (a patched shape constant is no longer read).
        read = {TensorRef.parse(i).node for n in fragments[length].node for i in n.input}
        feeds = {k: v for k, v in feeds.items() if TensorRef.parse(k).node in read}
        results = tf.graph_util.import_graph_def(fragments[length], input_map=feeds, return_elements=returns,
                                                 name="chunk")
        written = results[:len(write_outs)]
        rest = iter(results[len(write_outs):])
        sink_outputs = {n: [next(rest) for _ in range(combiners[n].outputs)] for n in sink_names}
        source_values = dict(zip([n for n in sink_names if combiners[n].kind in ("argmax", "argmin")], rest))
        partials = [combiners[n].partial(sink_outputs[n], source_values.get(n), start, length)
                    for n in sink_names]
        return list(written), partials

    def build(*tensors: tf.Tensor) -> list[tf.Tensor]:
        written, acc = run_chunk(tensors, 0, chunk)
        chunk_shapes = [_to_front(w, a).shape.as_list() for w, a in zip(written, out_axes)]
        arrays = [tf.TensorArray(w.dtype, size=full, element_shape=_to_front(w, a).shape).write(0, _to_front(w, a))
                  for w, a in zip(written, out_axes)]
        if full > 1:
            def body(i: tf.Tensor, acc: list, arrays: list) -> tuple:
                start = i * chunk
                new_written, partials = run_chunk(tensors, start, chunk)
                acc = [combiners[n].merge(a, p) for n, a, p in zip(sink_names, acc, partials)]
                arrays = [ta.write(i, _to_front(w, a)) for ta, w, a in zip(arrays, new_written, out_axes)]
                return i + 1, acc, arrays

            _, acc, arrays = tf.while_loop(lambda i, *_: i < full, body, (tf.constant(1), acc, arrays),
                                           maximum_iterations=full - 1)
        if remainder:
            last_written, partials = run_chunk(tensors, full * chunk, remainder)
            acc = [combiners[n].merge(a, p) for n, a, p in zip(sink_names, acc, partials)]
        else:
            last_written = []
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

    new_refs = graph.splice(build, inputs, scope=scope)
    old_refs = write_outs + [TensorRef(n, i) for n in sink_names for i in range(combiners[n].outputs)]
    return dict(zip(old_refs, new_refs))
