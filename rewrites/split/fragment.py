"""Cut a region's nodes out of a `Graph` as a GraphDef of their own, to import per chunk.

The split loops import a region's fragment once per chunk (`rewrites.split.loops`).
Inputs from outside the fragment become named feeds (`Fragment.import_into`); control
edges are dropped (callers only cut nodes without them), as are the attrs that tie nodes
to the graph they came from (stale `_output_shapes`, `_class` colocation).

Example:
    >>> frag = fragment(graph, ["exp", "sum"])
    >>> [out] = frag.import_into({TensorRef("x"): chunk}, [TensorRef("sum")])
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfmem.graph import Graph, TensorRef, const_node, copy_node, set_node_inputs

_FRAGMENT_INPUT = "tfmem_fragment_input_"


@dataclasses.dataclass(frozen=True)
class Fragment:
    """Nodes cut out of a Graph (`fragment`), ready to import into another graph.

    Attributes:
        graph_def: the nodes, reading their outside inputs by feed name.
        feeds: feed key → its feed name, for the feeds the nodes read.
    """

    graph_def: graph_pb2.GraphDef
    feeds: Mapping[Hashable, str]

    def import_into(self, values: Mapping[Hashable, tf.Tensor], returns: Sequence[TensorRef], *,
                    name: str = "fragment") -> list[tf.Tensor]:
        """Imports the fragment into the current (default) graph, feeding `values`.

        `values` must hold a tensor for every feed key (extra ones are ignored); returns
        the tensors named by `returns` (refs into the fragment's nodes).
        """
        input_map = {f"{feed}:0": values[key] for key, feed in self.feeds.items()}
        return tf.graph_util.import_graph_def(self.graph_def, input_map=input_map,
                                              return_elements=[r.name for r in returns], name=name)


def fragment(graph: Graph, nodes: Sequence[str], *,
             feed: Callable[[str, int, TensorRef], Hashable] | None = None,
             constants: Mapping[tuple[str, int], Any] | None = None,
             inline: Iterable[Hashable] = ()) -> Fragment:
    """Cuts `nodes` of `graph` out as a GraphDef of their own (see the module docstring).

    Args:
        nodes: the nodes to copy, in topological order.
        feed: `(node, input position, tensor) → key` of the feed an outside input
            comes from; positions with equal keys share a feed. Default: the tensor
            (so a tensor read twice is fed once); a loop feeding one tensor both
            sliced and whole gives the two different keys.
        constants: `(node, input position) → value`: that input becomes a new `Const`
            (e.g. a reshape's target shape, rewritten for a chunk).
        inline: feed keys of small `Const`s to copy in rather than feed, so that shape
            arguments stay constant and shape inference keeps every dimension.
    """
    inside = set(nodes)
    constants = dict(constants or {})
    inline = set(inline)
    key_of = feed or (lambda name, position, ref: ref)
    feed_names: dict[Hashable, str] = {}
    graph_def = graph_pb2.GraphDef()
    graph_def.versions.CopyFrom(graph.versions)
    for name in nodes:
        inputs: list[TensorRef] = []
        for position, ref in enumerate(graph.inputs(name)):
            if (name, position) in constants:
                const = const_node(f"{name}/tfmem_chunk_{position}", constants[(name, position)])
                graph_def.node.append(const)
                inputs.append(TensorRef(const.name))
                continue
            if ref.node in inside:
                inputs.append(ref)
                continue
            key = key_of(name, position, ref)
            if key not in feed_names:
                feed_names[key] = f"{_FRAGMENT_INPUT}{len(feed_names)}"
                if key in inline:  # the constant itself, under the feed's name
                    graph_def.node.append(set_node_inputs(copy_node(graph.node(ref.node), feed_names[key]), []))
            inputs.append(TensorRef(feed_names[key]))  # a feed, or the inlined constant
        graph_def.node.append(set_node_inputs(copy_node(graph.node(name), name), inputs))
    return Fragment(graph_def, {key: name for key, name in feed_names.items() if key not in inline})
