"""Memory accounting: a static liveness estimate over a Graph, and XLA's planned bytes.

The static estimate walks the graph in topological order. Each node allocates its
outputs when it runs; a buffer is freed after its last reader has run. Graph inputs
(placeholders, constants, variable handles) are resident for the whole run, as they
are in TensorFlow. Ops that only reinterpret a buffer (`Identity`, `Reshape`, ...)
allocate nothing and extend their input's life. A node that calls library functions
(`While`, `If`, `PartitionedCall`) adds the peak of its bodies beyond their arguments.
The walk's allocations and frees, in its order, are kept too (`MemoryEstimate.allocations`):
without XLA, `tfmem.allocator` replays TensorFlow's allocator over them.

Example:
    >>> est = estimate_memory(graph)
    >>> est.peak_bytes, est.peak_node, [t.name for t in est.live_at_peak][:3]
    (3200000000, 'MatMul', ['MatMul:0', 'x:0', 'y:0'])
"""
from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2

from tfmem.allocator import Allocate, AllocatorEvent, Free
from tfmem.config import format_size
from tfmem.errors import first_line
from tfmem.graph import Graph, TensorRef, called_functions, function_tensor_node, keep_functions_alive
from tfmem.host_folding import LARGE_TENSOR_BYTES, computable_nodes

logger = logging.getLogger(__name__)

# Inputs of the program: resident before the first op runs and until the last.
RESIDENT_OPS = frozenset({"Placeholder", "Const", "VarHandleOp", "_Arg", "HostConst"})
# What a program is given: a tensor made from none of these (or a stateful op) is a constant.
ARG_OPS = frozenset({"Placeholder", "_Arg"})
WHILE_LOOP_OPS = frozenset({"While", "StatelessWhile"})
# Ops that write their result into their first input's buffer when nothing reads that
# input after them, as XLA does (a scatter-add into an accumulator's row block).
IN_PLACE_UPDATE_OPS = frozenset({"TensorScatterAdd", "TensorScatterSub", "TensorScatterUpdate",
                                 "TensorScatterMax", "TensorScatterMin"})
# Ops XLA lowers to loops that keep several temporaries of their output's size, so its
# plan can be many times the static estimate (a [1000, 1300] f64 map plus its gradient,
# XLA's plan over the estimate: Igamma 10.8×, Igammac 10.5×, Lgamma 2.75×, Polygamma
# 2.25×; Digamma, Zeta, Erfinv, Ndtri, the Bessel functions, erf, exp ≤ 1.4×; Betainc 1.4×
# there, but 2.35× for fuzz 14's Student-t CDFs over [1500, 1400] float32).
# A program with one of them is never judged by its estimate alone.
XLA_EXPANDED_OPS = frozenset({"Igamma", "Igammac", "IgammaGradA", "Lgamma", "Polygamma", "Betainc"})
# The scopes in which late passes replace a node by ops of their own, named after it:
# `bands_as_selects` (`B_as_select/...`) and the split stage's diagonal lowering
# (`D_lowered/...`). XLA's names for those ops stand for the node before the pass ran.
AS_SELECT_SCOPE_SUFFIX = "_as_select"
LOWERED_SCOPE_SUFFIX = "_lowered"
_LOWERED_SCOPE = re.compile(rf"(.+)(?:{AS_SELECT_SCOPE_SUFFIX}|{LOWERED_SCOPE_SUFFIX})/[^/]+$")
# Ops that make a TensorList: a loop's store of a value from every iteration (what a
# gradient through a `while_loop`, `map_fn` or `scan` keeps for the backward pass). How
# many elements it holds is set when the loop runs, so the estimate counts none of them
# (fuzz 14: a `map_fn` gradient estimated at 0.5 MiB, XLA planned 110 MiB; a Kalman
# filter's, 0.3 MiB against 138 MiB). A program with one is never judged by its estimate alone.
TENSOR_LIST_OPS = frozenset({"EmptyTensorList", "TensorListReserve", "TensorListFromTensor"})
# attr name → which node inputs are that function's arguments.
_FUNCTION_ATTRS = {"body": 0, "cond": 0, "then_branch": 1, "else_branch": 1, "f": 0,
                   "branches": 1}


@dataclasses.dataclass(frozen=True)
class LiveTensor:
    """A tensor alive at the peak: its name, size in bytes, shape and dtype, the op that
    made it and why it is still alive there: `held_for`, the last node that reads it
    ("" when it is an output of the program, or a constant or variable held throughout)."""

    name: str
    nbytes: int
    shape: tuple[int | None, ...]
    dtype: str
    op: str = ""
    held_for: str = ""

    def __str__(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)} {format_size(self.nbytes)}"

    def why(self, peak_node: str | None = None) -> str:
        """One line: what it is, and what keeps it alive at the peak (`peak_node`: the node
        running there, which may be the reader itself)."""
        made = f" ({self.op})" if self.op else ""
        if not self.held_for:
            kept = ", held to the end"
        elif self.held_for == peak_node:
            kept = f", read by {self.held_for}, running at the peak"
        else:
            kept = f", read later by {self.held_for}"
        return f"{self}{made}{kept}"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The static peak of a graph.

    Attributes:
        peak_bytes: the largest sum of live buffers at any step.
        peak_node: the node running at the peak.
        live_at_peak: the buffers alive there, largest first.
        unknown: tensors whose size is not static (counted as 0 bytes).
        nested_peak_bytes: at the peak node, the extra bytes its function bodies need.
        steps: each node's `(live, nested)` bytes (`at`), in the order the schedule runs them.
        allocations: the buffers' allocations and frees in that order, with one run of each
            function a node calls inside its step (what `tfmem.allocator.replay` replays).
    """

    peak_bytes: int
    peak_node: str | None
    live_at_peak: tuple[LiveTensor, ...]
    unknown: tuple[str, ...] = ()
    nested_peak_bytes: int = 0
    steps: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    allocations: tuple[AllocatorEvent, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def at(self, node: str) -> tuple[int, int]:
        """`(live, nested)` bytes while `node` runs: its graph's live buffers, and what the
        functions it calls (a loop's body) need beyond them."""
        return self.steps.get(node, (0, 0))

    def __str__(self) -> str:
        top = ", ".join(str(t) for t in self.live_at_peak[:3])
        return f"peak {format_size(self.peak_bytes)} at {self.peak_node} (largest live: {top})"

    def in_words(self) -> str:
        """The peak as a GP user reads it: whole tensors by shape, then the loop body's chunks.

        Example:
            >>> estimate = MemoryEstimate(
            ...     peak_bytes=3 * 800 + 100 + 50, peak_node="while", nested_peak_bytes=100,
            ...     live_at_peak=(LiveTensor("K", 800, (10, 10), "float64"), LiveTensor("L", 800, (10, 10), "float64"),
            ...                   LiveTensor("dK", 800, (10, 10), "float64"), LiveTensor("y", 50, (10,), "float64")))
            >>> estimate.in_words()
            'peak 2.5 KiB = 3 whole float64[10, 10] (2.3 KiB) + a loop body at while (100 B) + 1 other (50 B)'
        """
        groups: dict[tuple[str, tuple[int | None, ...]], list[LiveTensor]] = {}
        for tensor in self.live_at_peak:
            groups.setdefault((tensor.dtype, tensor.shape), []).append(tensor)
        ranked = sorted(groups.items(), key=lambda kv: -sum(t.nbytes for t in kv[1]))
        # Name the shapes that make up the peak; the rest counted as "others".
        named, others = [], []
        for (dtype, shape), tensors in ranked:
            total = sum(t.nbytes for t in tensors)
            if len(named) < 3 and total >= 0.1 * self.peak_bytes:
                named.append(f"{len(tensors)} whole {dtype}{list(shape)} ({format_size(total)})")
            else:
                others.extend(tensors)
        if self.nested_peak_bytes:
            named.append(f"a loop body at {self.peak_node} ({format_size(self.nested_peak_bytes)})")
        if others:
            named.append(f"{len(others)} other{'s' * (len(others) != 1)} ({format_size(sum(t.nbytes for t in others))})")
        return f"peak {format_size(self.peak_bytes)} = " + " + ".join(named)


def estimate_memory(graph: Graph | graph_pb2.GraphDef, *, outputs: Any = ()) -> MemoryEstimate:
    """Estimates the peak memory of running `graph` once.

    Args:
        graph: a Graph, or a GraphDef (then `outputs` names the fetched tensors, which
            stay alive to the end).
    """
    if not isinstance(graph, Graph):
        graph = Graph(graph, outputs=outputs)
    return _Estimator(graph).run()


def _returned_source(body: Any, producers: Mapping[str, Any], index: int, through: frozenset[str]) -> str:
    """Where a function's output `index` comes from, followed back through ops in
    `through` (their first input): a FunctionDef tensor ("node:output_arg:index") or,
    when the chain reaches one, an argument's name."""
    args = {arg.name for arg in body.signature.input_arg}
    source = body.ret[body.signature.output_arg[index].name]
    while source not in args:
        producer = producers.get(function_tensor_node(source))
        if producer is None or producer.op not in through:
            break
        source = producer.input[0]
    return source


def while_passthrough(graph: Graph, name: str) -> dict[int, int]:
    """Outputs of a `While` node that are its inputs handed through unchanged: index → index.

    A loop's invariants (e.g. captured tensors) are loop variables its body returns as
    they came; the loop's outputs then share their buffers and allocate nothing.
    """
    node = graph.node(name)
    if node.op not in WHILE_LOOP_OPS or graph.function(node.attr["body"].func.name) is None:
        return {}
    body = graph.function(node.attr["body"].func.name)
    producers = {n.name: n for n in body.node_def}
    passed = {}
    for index, arg in enumerate(body.signature.input_arg[:len(body.signature.output_arg)]):
        if _returned_source(body, producers, index, frozenset({"Identity"})) == arg.name:
            passed[index] = index
    return passed


# (function name, argument shapes) → (peak bytes beyond its arguments, unknown tensors, the
# allocations of one run but its arguments').
# Library function names are unique in a process, and estimating a body means importing
# it into a scratch graph: every estimate of a graph with loops would pay that again.
_FUNCTION_BYTES: dict[tuple[str, tuple[Any, ...], bool], tuple[int, tuple[str, ...], tuple[AllocatorEvent, ...]]] = {}


class _Estimator:
    def __init__(self, graph: Graph, *, loop_body: bool = False) -> None:
        self.graph = graph
        # A while loop's body: XLA updates its state in place, so an argument may be
        # written over by an update (`IN_PLACE_UPDATE_OPS`) as any dead buffer may.
        self.loop_body = loop_body
        self.unknown: list[str] = []
        self._function_cache = _FUNCTION_BYTES
        self._sizes: dict[TensorRef, int] = {}  # the schedule and the sweep both ask

    def _bytes(self, ref: TensorRef) -> int:
        if ref not in self._sizes:
            self._sizes[ref] = self._measure(ref)
        return self._sizes[ref]

    def _measure(self, ref: TensorRef) -> int:
        try:
            size = self.graph.nbytes(ref)
        except Exception:  # an op TF cannot type statically: count nothing, say so
            size = None
        if size is None:
            dtype = self.graph.spec(ref).dtype if ref.node in self.graph else None
            if dtype not in (tf.resource, tf.variant):
                self.unknown.append(ref.name)
            return 0
        return size

    def run(self) -> MemoryEstimate:
        graph = self.graph
        order = self._schedule()
        end = len(order)
        step = {name: i for i, name in enumerate(order)}
        buffer_of: dict[TensorRef, TensorRef] = {}
        size: dict[TensorRef, int] = {}
        alloc: dict[TensorRef, int] = {}
        last_use: dict[TensorRef, int] = {}
        last_read: dict[TensorRef, int] = {}  # tensor → its last reader's step (asked by updates in place)
        if any(graph.node(name).op in IN_PLACE_UPDATE_OPS | WHILE_LOOP_OPS for name in order):
            for name in order:
                last_read.update((ref, step[name]) for ref in graph.inputs(name))

        def overwrites(name: str, target: TensorRef) -> bool:
            """Whether update `name` may write into `target`'s buffer: the buffer is the
            program's own (or, in a loop body, its state) and nothing reads it after."""
            buffer = buffer_of[target]
            owned = alloc.get(buffer, 0) > 0 or self.loop_body and graph.node(buffer.node).op in ARG_OPS
            return owned and all(last_read.get(ref, -1) <= step[name] for ref, b in buffer_of.items() if b == buffer)

        for name in order:
            node = graph.node(name)
            inputs = graph.inputs(name)
            passed = while_passthrough(graph, name)
            if node.op in IN_PLACE_UPDATE_OPS and inputs and overwrites(name, inputs[0]):
                buffer_of[TensorRef(name)] = buffer_of[inputs[0]]  # nothing reads the old value after
                for ref in inputs:
                    last_use[buffer_of[ref]] = max(last_use[buffer_of[ref]], step[name])
                continue
            for index in range(len(graph.output_specs(name))):
                ref = TensorRef(name, index)
                if graph.aliases_input(name) and inputs or index in passed:
                    source = inputs[passed.get(index, index if node.op == "IdentityN" else 0)]
                    buffer_of[ref] = buffer_of[source]
                    continue
                if node.op in WHILE_LOOP_OPS and index < len(inputs) and overwrites(name, inputs[index]) \
                        and self._bytes(ref) == size.get(buffer_of[inputs[index]], -1):
                    # XLA's loop state lives in its initial value's buffer when nothing
                    # reads that value after the loop (an in-place loop holds its matrix once).
                    buffer_of[ref] = buffer_of[inputs[index]]
                    continue
                buffer_of[ref] = ref
                size[ref] = self._bytes(ref)
                resident = node.op in RESIDENT_OPS
                alloc[ref] = 0 if resident else step[name]
                last_use[ref] = end if resident else step[name]
            for ref in inputs:
                buffer = buffer_of[ref]
                last_use[buffer] = max(last_use[buffer], step[name])
        for output in graph.outputs:
            last_use[buffer_of[output]] = end

        # Sweep: +size at allocation, -size after the last use.
        delta = [0] * (end + 2)
        for buffer, nbytes in size.items():
            delta[alloc[buffer]] += nbytes
            delta[last_use[buffer] + 1] -= nbytes
        nested_runs = [self._nested(name) for name in order]
        nested = [nbytes for nbytes, _ in nested_runs]
        live, peak, peak_step = 0, -1, 0
        steps: dict[str, tuple[int, int]] = {}
        for i in range(end):
            live += delta[i]
            steps[order[i]] = (live, nested[i])
            if live + nested[i] > peak:
                peak, peak_step = live + nested[i], i
        if not order:
            return MemoryEstimate(0, None, ())
        live_at_peak = sorted(
            (self._live_tensor(b, n, order[last_use[b]] if last_use[b] < end and alloc[b] > 0 else "")
             for b, n in size.items() if alloc[b] <= peak_step <= last_use[b] and n > 0),
            key=lambda t: (-t.nbytes, t.name))
        return MemoryEstimate(peak_bytes=max(peak, 0), peak_node=order[peak_step],
                              live_at_peak=tuple(live_at_peak),
                              unknown=tuple(dict.fromkeys(self.unknown)),
                              nested_peak_bytes=nested[peak_step], steps=steps,
                              allocations=self._allocations(order, size, alloc, last_use, nested_runs))

    @staticmethod
    def _allocations(order: list[str], size: Mapping[TensorRef, int], alloc: Mapping[TensorRef, int],
                     last_use: Mapping[TensorRef, int],
                     nested_runs: list[tuple[int, tuple[AllocatorEvent, ...]]]) -> tuple[AllocatorEvent, ...]:
        """Each step allocates its node's outputs, runs the function it calls once (its
        buffers all freed by the step's end), then frees the buffers it read last."""
        made: dict[int, list[TensorRef]] = {}
        freed: dict[int, list[TensorRef]] = {}
        for buffer, nbytes in size.items():
            if nbytes > 0:
                made.setdefault(alloc[buffer], []).append(buffer)
                if last_use[buffer] < len(order):
                    freed.setdefault(last_use[buffer], []).append(buffer)
        events: list[AllocatorEvent] = []
        for i, name in enumerate(order):
            events += [Allocate(b.name, size[b]) for b in made.get(i, ())]
            inner = [dataclasses.replace(e, name=f"{name}/{e.name}") for e in nested_runs[i][1]]
            events += inner
            left = dict.fromkeys(e.name for e in inner if isinstance(e, Allocate))  # the body's outputs
            for e in inner:
                if isinstance(e, Free):
                    left.pop(e.name, None)
            events += [Free(n) for n in left]
            events += [Free(b.name) for b in freed.get(i, ())]
        return tuple(events)

    def _schedule(self) -> list[str]:
        """A topological order that, like XLA's scheduler, runs whatever frees most first.

        The GraphDef's own order is arbitrary (rewrites append new nodes at the end); a
        greedy list schedule — among ready nodes, least new bytes minus bytes freed, ties
        in graph order — is close to how the program really runs.

        A large tensor made from constants alone (a diagonal mask, an `eye`) frees nothing
        when it runs, so run early it is only held longer (a [3000, 3000] mask held across
        a conjugate-gradient loop it is not read in). It waits until one of its readers
        has every other producer done, and runs just before that reader: where XLA makes
        it too (fused into the reader, when XLA is given it unfolded: `tfmem.host_folding`).
        """
        graph = self.graph
        base = graph.topological_order()
        readers = {n: len(graph.node_consumers(n)) for n in base}
        out_bytes = {n: 0 if graph.node(n).op in RESIDENT_OPS or graph.aliases_input(n) else
                     sum(self._bytes(TensorRef(n, i)) for i in range(len(graph.output_specs(n))))
                     for n in base}
        deferred = {n for n in computable_nodes(graph) if out_bytes[n] > LARGE_TENSOR_BYTES}
        unscheduled = set(base)

        def reader_waits_only_for_deferred(reader: str) -> bool:
            return all(p not in unscheduled or p in deferred for p in graph.producers(reader))

        def priority(n: str) -> tuple[int, int]:  # new bytes minus bytes it frees as the last reader
            waits = n in deferred and not any(reader_waits_only_for_deferred(c) for c in graph.node_consumers(n))
            return int(waits), out_bytes[n] - sum(out_bytes[p] for p in graph.producers(n) if readers[p] == 1)

        def reprioritize(name: str) -> list[str]:
            unscheduled.discard(name)
            changed = []
            for p in graph.producers(name):
                readers[p] -= 1
                if readers[p] == 1:  # its last reader now frees it
                    changed += [c for c in graph.node_consumers(p) if c in unscheduled]
            for reader in graph.node_consumers(name):  # a deferred producer of it may be due now
                changed += [p for p in graph.producers(reader) if p in deferred and p in unscheduled]
            return changed

        return graph.topological_order(priority, reprioritize=reprioritize)

    def _live_tensor(self, ref: TensorRef, nbytes: int, held_for: str) -> LiveTensor:
        spec = self.graph.spec(ref)
        shape = tuple(spec.shape.as_list()) if spec.shape.rank is not None else ()
        return LiveTensor(ref.name, nbytes, shape, spec.dtype.name, self.graph.node(ref.node).op, held_for)

    def _nested(self, name: str) -> tuple[int, tuple[AllocatorEvent, ...]]:
        """Peak bytes of the functions a node calls, beyond the arguments it passes them,
        and the allocations of one run of the function that needs most."""
        return max((self._function_run(call.function, call.args, loop_body=call.loop_body)
                    for call in function_calls(self.graph, name)), default=(0, ()), key=lambda run: run[0])

    def _function_run(self, function_name: str, args: list[TensorRef], *,
                        loop_body: bool = False) -> tuple[int, tuple[AllocatorEvent, ...]]:
        shapes = tuple(tuple(self.graph.spec(a).shape.as_list()) if self.graph.spec(a).shape.rank
                       is not None else None for a in args)
        key = (function_name, shapes, loop_body)
        if key not in self._function_cache:
            self._function_cache[key] = (0, (), ())  # guards against recursion
            try:
                body = FunctionCall(function_name, args).graph(self.graph)
                inner = _Estimator(body, loop_body=loop_body)
                estimate = inner.run()
                arguments = [TensorRef(n.name) for n in body.find("Placeholder")]
                arg_bytes = sum(inner._bytes(ref) for ref in arguments)
                given = {ref.name for ref in arguments}  # the caller holds them already
                self._function_cache[key] = (max(0, estimate.peak_bytes - arg_bytes),
                                             tuple(f"{function_name}/{u}" for u in inner.unknown),
                                             tuple(e for e in estimate.allocations if e.name not in given))
            except Exception as err:  # the estimate must never break the pipeline
                logger.debug("cannot estimate function %s: %s", function_name, err)
        nbytes, unknown, allocations = self._function_cache[key]
        self.unknown.extend(unknown)
        return nbytes, allocations


@dataclasses.dataclass(frozen=True)
class FunctionCall:
    """A library function a node calls: its name, the node's inputs passed as its arguments,
    and whether it is a `While` loop's body."""

    function: str
    args: list[TensorRef]
    loop_body: bool = False

    def graph(self, caller: Graph) -> Graph:
        """The function as a Graph of its own, shaped by this call's arguments (`function_graph`)."""
        return function_graph(caller, self.function, [caller.spec(a).shape for a in self.args],
                              list_element_shapes(caller, self.args))


def function_calls(graph: Graph, name: str) -> list[FunctionCall]:
    """The library functions node `name` calls: a function called as an op, and those named
    by its function attrs (a loop's body and cond, a branch, a `PartitionedCall`'s `f`)."""
    node, inputs = graph.node(name), graph.inputs(name)
    calls = [FunctionCall(node.op, inputs)] if graph.function(node.op) is not None else []
    for attr, first_arg in _FUNCTION_ATTRS.items():
        if attr not in node.attr:
            continue
        value = node.attr[attr]
        if value.HasField("func"):
            calls.append(FunctionCall(value.func.name, inputs[first_arg:], attr == "body" and node.op in WHILE_LOOP_OPS))
        calls.extend(FunctionCall(f.name, inputs[first_arg:]) for f in value.list.func)
    return calls


def xla_expanded_ops(graph: Graph) -> list[str]:
    """The ops of `graph` (and of the functions it calls: loop bodies, branches) that XLA
    expands far beyond their output's size (`XLA_EXPANDED_OPS`), sorted.

    >>> import tensorflow as tf
    >>> from tfmem.graph import Graph
    >>> @tf.function
    ... def f(a, x):
    ...     return tf.reduce_sum(tf.math.igamma(a, x))
    >>> spec = tf.TensorSpec([3], tf.float64)
    >>> xla_expanded_ops(Graph(f.get_concrete_function(spec, spec).graph.as_graph_def()))
    ['Igamma']
    """
    return ops_in(graph, XLA_EXPANDED_OPS)


def ops_in(graph: Graph, ops: frozenset[str]) -> list[str]:
    """Which of `ops` `graph` runs, in its own nodes or in the functions it calls, sorted."""
    found = {op for op in graph.op_counts() if op in ops}  # no topological order needed
    found.update(node.op for function in graph.library.function for node in function.node_def if node.op in ops)
    return sorted(found)


def loop_function_graph(graph: Graph, loop: str, attr: str) -> Graph:
    """The `body` or `cond` (`attr`) of a `While` node as a Graph, its arguments shaped
    by the loop's inputs (TensorLists by their element shapes, `list_element_shapes`)."""
    return FunctionCall(graph.node(loop).attr[attr].func.name, graph.inputs(loop)).graph(graph)


# TensorList reads and where their `element_shape` input is: a read that passes -1
# (unknown) gets its list's shape from `list_element_shapes`.
_LIST_READS = {"TensorListPopBack": 1, "TensorListGetItem": 2, "TensorListStack": 1, "TensorListGather": 2}
# The output shapes of a list read, from its list's element shape.
_LIST_READ_SHAPES = {"TensorListPopBack": lambda shape: [tf.TensorShape([]), shape],
                     "TensorListGetItem": lambda shape: [shape]}
# Ops that hand on the list they read (input 0 → output 0) with its element shape.
_LIST_UPDATES = frozenset({"TensorListPushBack", "TensorListPopBack", "TensorListSetItem", "Identity"})


def list_element_shapes(graph: Graph, args: list[TensorRef]) -> dict[int, tf.TensorShape]:
    """The element shapes of the TensorLists among `args` (a function's arguments), where
    the list's creator (`EmptyTensorList`, `TensorListReserve`) fixed them, by position.

    A loop's gradient pops the forward loop's per-trip values from lists with an unknown
    `element_shape`; the lists themselves were made with the values' static shapes.

    Example:
        >>> list_element_shapes(graph, graph.inputs("gradients/while_grad"))[8]
        TensorShape([200, 1])
    """
    shapes = {}
    for position, ref in enumerate(args):
        if graph.spec(ref).dtype == tf.variant:
            shape = _list_element_shape(graph, ref, depth=0)
            if shape is not None:
                shapes[position] = shape
    return shapes


def _list_element_shape(graph: Graph, ref: TensorRef, depth: int) -> tf.TensorShape | None:
    node = graph.node(ref.node)
    if depth > 8:
        return None
    if node.op == "Identity":
        return _list_element_shape(graph, graph.inputs(ref.node)[0], depth + 1)
    if node.op in ("EmptyTensorList", "TensorListReserve"):
        value = graph.constant_value(graph.inputs(ref.node)[0])
        if value is None or value.ndim != 1 or (value < 0).any():
            return None
        return tf.TensorShape([int(v) for v in value])
    if node.op in WHILE_LOOP_OPS and _body_updates_list(graph, ref.node, ref.index):
        return _list_element_shape(graph, graph.inputs(ref.node)[ref.index], depth + 1)
    return None


def _body_updates_list(graph: Graph, loop: str, slot: int) -> bool:
    """Whether `loop`'s body returns at `slot` the list it took there, pushed or popped."""
    body = graph.function(graph.node(loop).attr["body"].func.name)
    if body is None or slot >= len(body.signature.output_arg):
        return False
    producers = {n.name: n for n in body.node_def}
    return _returned_source(body, producers, slot, _LIST_UPDATES) == body.signature.input_arg[slot].name


def _with_list_shapes(fdef: Any, element_shapes: Mapping[int, tf.TensorShape]) -> Any:
    """A copy of `fdef` whose list reads of those arguments pass their element shapes."""
    patched = function_pb2.FunctionDef()
    patched.CopyFrom(fdef)
    by_arg = {fdef.signature.input_arg[i].name: shape for i, shape in element_shapes.items()}
    taken = {node.name for node in fdef.node_def}
    for node in list(patched.node_def):
        position = _LIST_READS.get(node.op)
        if position is None or len(node.input) <= position or node.input[0] not in by_arg:
            continue
        name, counter = f"{node.name}/tfmem_element_shape", 0
        while name in taken:  # a body patched before, and rebuilt from its graph
            counter += 1
            name = f"{node.name}/tfmem_element_shape_{counter}"
        taken.add(name)
        const = patched.node_def.add(name=name, op="Const")
        const.attr["dtype"].type = tf.int32.as_datatype_enum
        const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(by_arg[node.input[0]].as_list(), tf.int32))
        node.input[position] = f"{const.name}:output:0"
        # The importer keeps the shapes a node declares (TensorFlow's gradient declares the
        # popped value's shape; a body rebuilt by tfmem does not): declare them here too.
        declared = _LIST_READ_SHAPES.get(node.op)
        if declared is not None:
            node.attr["_output_shapes"].list.ClearField("shape")
            node.attr["_output_shapes"].list.shape.extend(
                s.as_proto() for s in declared(by_arg[node.input[0]]))
    return patched


def function_graph(graph: Graph, function_name: str,
                   input_shapes: list[tf.TensorShape] | None = None,
                   list_shapes: Mapping[int, tf.TensorShape] | None = None) -> Graph:
    """A library function of `graph` as a Graph of its own, with static shapes.

    Arguments become placeholders (shaped by `input_shapes` where given); the function's
    return values are the outputs. `list_shapes` gives the element shapes of TensorList
    arguments (`list_element_shapes`), so that what the body reads from them is shaped.
    """
    fdef = graph.function(function_name)
    if fdef is None:
        raise KeyError(f"no library function {function_name!r}")
    # Only the functions the body calls, directly or not: the whole library of a program
    # the splitter made 64 loops in is 128 functions, imported for each of them in each
    # estimate (5.1 s of a 10.6 s pipeline for TFP's MultivariateNormalTriL under 2.5 MiB).
    try:
        return _function_graph(graph, fdef, _library_closure(graph.library, fdef), input_shapes, list_shapes)
    except (ValueError, TypeError, KeyError, tf.errors.OpError):
        # Something called by a name the closure does not see: the whole library, as before.
        return _function_graph(graph, fdef, graph.library, input_shapes, list_shapes)


def _library_closure(library: function_pb2.FunctionDefLibrary,
                     fdef: function_pb2.FunctionDef) -> function_pb2.FunctionDefLibrary:
    """The functions of `library` that `fdef` calls, directly or through them (by op type
    or by a function attr), with their registered gradients and what those call."""
    by_name = {f.signature.name: f for f in library.function}
    gradient_of = {g.function_name: g.gradient_func for g in library.gradient}
    wanted: dict[str, function_pb2.FunctionDef] = {}
    stack = [fdef]
    while stack:
        for node in stack.pop().node_def:
            for name in [node.op, *called_functions(node)]:
                for called in (name, gradient_of.get(name)):
                    if called in by_name and called not in wanted:
                        wanted[called] = by_name[called]
                        stack.append(by_name[called])
    closure = function_pb2.FunctionDefLibrary()
    closure.function.extend(wanted.values())
    closure.gradient.extend(g for g in library.gradient if g.function_name in wanted)
    return closure


def _function_graph(graph: Graph, fdef: function_pb2.FunctionDef, library: function_pb2.FunctionDefLibrary,
                    input_shapes: list[tf.TensorShape] | None,
                    list_shapes: Mapping[int, tf.TensorShape] | None) -> Graph:
    """`function_graph` of `fdef`, its calls resolved in `library`."""
    from tensorflow.python.framework import function_def_to_graph

    if list_shapes:
        fdef = _with_list_shapes(fdef, list_shapes)
    shapes = None
    if input_shapes is not None and len(input_shapes) == len(fdef.signature.input_arg):
        shapes = list(input_shapes)
    with tf.Graph().as_default() as scratch:
        # Register the library so nested calls in the body resolve.
        tf.graph_util.import_graph_def(graph_pb2.GraphDef(library=library), name="")
        body_def, flat_names = function_def_to_graph.function_def_to_graph_def(fdef, input_shapes=shapes)
        tf.graph_util.import_graph_def(body_def, name="body")
        for node in body_def.node:
            op = scratch.get_operation_by_name(f"body/{node.name}")
            shapes = node.attr["_output_shapes"].list.shape
            del shapes[:]  # FunctionDefs may carry stale or partial ones
            shapes.extend(t.shape.as_proto() for t in op.outputs)
        keep_functions_alive(scratch)
    outputs = [flat_names[fdef.ret[arg.name]] for arg in fdef.signature.output_arg]
    body_def.library.CopyFrom(library)
    body_def.versions.CopyFrom(graph.versions)
    return Graph(body_def, outputs=outputs)


@dataclasses.dataclass(frozen=True)
class XlaPlan:
    """XLA's buffer assignment for one compiled program, in bytes.

    Attributes:
        total_bytes: XLA's "Total bytes used": every buffer allocation summed.
        largest_bytes: the largest allocation the call makes itself (parameters and
            constants excluded). XLA packs its temporaries into one block, and a growing
            allocator (TensorFlow's BFC with growth, as on the CPU) needs that block in one
            piece beside the regions it already holds: see `Budget.xla_overshoot`.
        peak: what XLA itself keeps alive at its peak, from its heap simulator's trace
            (`xla_live_at_peak`); None when the proto has no trace. Its `peak_bytes` is at
            most the block's: the rest of the block is gaps XLA's packing left.
        temp_bytes: the block of temporaries (the largest allocation that is not an output);
            None: not recorded (a plan file of an older format), then `largest_bytes`.
        output_bytes: the allocations of the call's outputs. XLA asks for them before its
            block of temporaries (a program whose output is a big matrix allocates it apart).
        heap_bytes: the sizes of the allocations XLA packed its temporaries into, in the
            order the call allocates them (XLA's allocation index; its outputs come first):
            one block, or several heaps under the process-wide heap limit (`tfmem.xla_heaps`);
            () when not recorded.
    """

    total_bytes: int
    largest_bytes: int
    peak: MemoryEstimate | None = dataclasses.field(default=None, compare=False)
    temp_bytes: int | None = None
    output_bytes: int = 0
    heap_bytes: tuple[int, ...] = ()

    @property
    def block_bytes(self) -> int:
        """The block the call allocates last, which must find room in one piece."""
        return self.largest_bytes if self.temp_bytes is None else self.temp_bytes

    @property
    def peak_with_others(self) -> MemoryEstimate | None:
        """`peak` with what the call holds then counted: the call's other allocations (its
        outputs, parameters and constants, alive beside the block all call long) and the
        whole block, which is allocated in one piece: what its packing leaves unused at the
        peak is held too. That is the plan's total; None without a trace.

        SGPR `predict_f(full_cov=True)` at 3,000 points: XLA peaks at 62.5 MiB in its block,
        beside the 68.7 MiB output: 131.4 MiB in all, the whole of its plan. SGPR's loss and
        gradients, N=20,000, M=3,800: XLA peaks at 484.1 MiB in a 494.4 MiB block, and a
        shrink by the peak alone found nothing over XLA's 486.4 MiB share to take off.
        """
        if self.peak is None:
            return None
        others = max(0, self.total_bytes - self.block_bytes)
        return dataclasses.replace(self.peak, peak_bytes=max(self.peak.peak_bytes + others, self.total_bytes))


# XLA's PrimitiveType names → TensorFlow's dtype names, for the live set in words.
_XLA_DTYPES = {"PRED": "bool", "S8": "int8", "S16": "int16", "S32": "int32", "S64": "int64", "U8": "uint8",
               "U32": "uint32", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
               "F64": "float64", "C64": "complex64", "C128": "complex128"}


def xla_live_at_peak(proto: Any) -> MemoryEstimate | None:
    """XLA's own live set at its peak, from the heap simulator trace of its buffer assignment.

    The trace lists every buffer's allocation and release in XLA's schedule. A buffer is
    counted by the bytes XLA placed it in (its allocation and offset): buffers that share
    them — a loop's state and the value its body writes back, an in-place update, a
    bitcast — are one piece of memory, counted once and named by the latest of them. So
    the peak is what the packed block must hold at once (never more than the block), and
    where it is. Each live buffer is named by the TensorFlow op it came from (XLA keeps
    it as `op_name` metadata: `function/node`), or by its HLO instruction where XLA made
    it up itself (the blocks of a triangular solve). The result reads like tfmem's own
    estimate (`MemoryEstimate.in_words`): it is what tfmem's estimate is trying to predict.
    Its `steps` are the program's ops (`function/node`; a loop's body counts as its loop)
    in the order XLA first runs them, with the bytes live then.

    Example:
        >>> plan = xla_plan(tf.function(lambda x: tf.linalg.cholesky(x @ tf.transpose(x)), jit_compile=True),
        ...                 tf.ones([500, 500]))
        >>> plan.peak.in_words()
        'peak ... = ... whole float32[500, 500] ...'
    """
    from tensorflow.compiler.xla import xla_data_pb2

    assignment = proto.buffer_assignment
    traces = [t for t in assignment.heap_simulator_traces if t.events]
    if not traces:
        return None
    buffers = {b.id: b for b in assignment.logical_buffers}
    # Where each buffer lives: (allocation, offset) and its size there.
    placed = {assigned.logical_buffer_id: ((allocation.index, assigned.offset), assigned.size)
              for allocation in assignment.buffer_allocations for assigned in allocation.assigned}
    instructions = {i.id: i for c in proto.hlo_module.computations for i in c.instructions}
    by_name = {i.name: (i, c.id) for c in proto.hlo_module.computations for i in c.instructions}
    op_names, entry_ops = _op_names(proto), _calling_ops(proto, outermost=True)
    best: tuple[int, str, list[tuple[int, int]]] | None = None
    steps: dict[str, tuple[int, int]] = {}  # the program's ops in XLA's order: the bytes live when each starts
    for trace in traces:
        at: dict[Any, list[int]] = {}  # a place in memory → the live buffers in it, oldest first
        size: dict[Any, int] = {}
        current = 0
        for event in trace.events:
            buffer = event.buffer_id
            place, nbytes = placed.get(buffer, (("unplaced", buffer), buffers[buffer].size))
            members = at.get(place)
            if event.kind in (event.ALLOC, event.SHARE_WITH):
                if members is None:
                    at[place], size[place] = [buffer], nbytes
                    current += nbytes
                elif buffer not in members:
                    members.append(buffer)
                    if nbytes > size[place]:
                        current += nbytes - size[place]
                        size[place] = nbytes
            elif event.kind == event.FREE and members is not None and buffer in members:
                members.remove(buffer)
                if not members:
                    del at[place]
                    current -= size.pop(place)
            if event.instruction_name in by_name:
                instruction, computation = by_name[event.instruction_name]
                op = (entry_ops.get(computation) or op_names.get(instruction.id, "")).split(" (", 1)[0]
                if op and op not in steps:
                    steps[op] = (current, 0)
            if best is None or current > best[0]:
                best = (current, event.instruction_name, [(members[-1], size[place]) for place, members in at.items()])
    assert best is not None
    peak_bytes, peak_instruction, live_ids = best

    def described(buffer_id: int, nbytes: int) -> LiveTensor:
        buffer = buffers[buffer_id]
        instruction = instructions.get(buffer.defined_at.instruction_id)
        if instruction is None:
            return LiveTensor(f"buffer {buffer_id}", nbytes, (), "")
        shape = instruction.shape
        for index in buffer.defined_at.shape_index:
            shape = shape.tuple_shapes[index]
        dtype = _XLA_DTYPES.get(xla_data_pb2.PrimitiveType.Name(shape.element_type), "")
        return LiveTensor(op_names.get(instruction.id, f"XLA's {instruction.name}"), nbytes,
                          tuple(shape.dimensions), dtype, instruction.opcode)

    live_at_peak = sorted((described(b, nbytes) for b, nbytes in live_ids), key=lambda t: (-t.nbytes, t.name))
    peak_node = (_peak_node(*by_name[peak_instruction], op_names, entry_ops) if peak_instruction in by_name
                 else peak_instruction)
    return MemoryEstimate(peak_bytes, peak_node, tuple(live_at_peak), steps=steps)


def _peak_node(instruction: Any, computation: int, op_names: Mapping[int, str],
               entry_ops: Mapping[int, str]) -> str:
    """The op running at XLA's peak: the TensorFlow op of the instruction, and where it
    runs inside a called computation (a loop's body), the op of the program that calls
    it, as `tfmem_step/tfmem_split/while (chunk/MatMul_1)`."""
    own = op_names.get(instruction.id, instruction.name)
    outer = entry_ops.get(computation)
    return own if outer is None or own.startswith(outer) else f"{outer} ({own})"


def _calling_ops(proto: Any, *, outermost: bool) -> dict[int, str]:
    """The op calling each computation XLA called from another, by computation id: the
    nearest calling instruction with an `op_name`, or with `outermost` the instruction
    of the entry computation the calls start from (a loop's body → the loop)."""
    entry = proto.hlo_module.entry_computation_id
    calling: dict[int, str] = {}
    computations = list(proto.hlo_module.computations)
    for _ in range(8):  # computations call computations: a few rounds reach the nested ones
        changed = False
        for computation in computations:
            for instruction in computation.instructions:
                if outermost:
                    name = instruction.metadata.op_name if computation.id == entry else calling.get(computation.id)
                else:
                    name = instruction.metadata.op_name or calling.get(computation.id)
                for called in instruction.called_computation_ids:
                    if name and called not in calling:
                        calling[called], changed = name, True
        if not changed:
            break
    return calling


def _op_names(proto: Any) -> dict[int, str]:
    """The TensorFlow op each HLO instruction came from, by instruction id: its own
    `op_name` metadata, or for what XLA made up inside a computation it expanded an op
    into (a triangular solve's blocks), that of the instruction calling the computation,
    as `op (XLA's instruction)`."""
    caller = _calling_ops(proto, outermost=False)
    names: dict[int, str] = {}
    for computation in proto.hlo_module.computations:
        for instruction in computation.instructions:
            if instruction.metadata.op_name:
                names[instruction.id] = instruction.metadata.op_name
            elif computation.id in caller:
                names[instruction.id] = f"{caller[computation.id]} (XLA's {instruction.name})"
    return names


def graph_node_for(graph: Graph, xla_name: str) -> str | None:
    """The node of `graph` an XLA name from `xla_live_at_peak` stands for, or None.

    XLA names an op `function/node` (the function the graph was imported as), and what it
    made up inside one `function/node (XLA's instruction)`; ops inside a loop's body are
    named by their own graph's nodes, and match nothing here.

    Example:
        >>> graph_node_for(graph, "tfmem_step/Cholesky")    # a graph with a node "Cholesky"
        'Cholesky'
    """
    name = xla_name.split(" (", 1)[0]
    candidates = (name, name.split("/", 1)[-1])
    for candidate in candidates:
        if candidate in graph:
            return candidate
    # An op a late pass made in place of a node, in a scope named after it
    # (`bands_as_selects`: `B_as_select/SelectV2` for `B`), stands for that node in the
    # graph before the pass ran: the XLA-peak passes see the graph before it.
    for candidate in candidates:
        lowered = _LOWERED_SCOPE.match(candidate)
        if lowered is not None and lowered.group(1) in graph:
            return lowered.group(1)
    return None


def held_at_xla_peak(graph: Graph, xla_peak: MemoryEstimate, *, worth: int) -> list[tuple[LiveTensor, TensorRef]]:
    """The tensors of `graph` XLA holds at its peak (`xla_peak`, from `XlaPlan.peak`), each
    at least 1/`worth` of the peak, largest first, each once: what XLA's live set names
    that is a graph node's output of that size (not inside a loop's body, not made up by
    XLA inside an op).

    Example:
        >>> [(live.name, tensor.name) for live, tensor in held_at_xla_peak(graph, plan.peak, worth=16)]
        [('tfmem_step/Exp', 'Exp:0'), ('tfmem_step/MatMul', 'MatMul:0')]
    """
    found: list[tuple[LiveTensor, TensorRef]] = []
    seen: set[TensorRef] = set()
    for live in xla_peak.live_at_peak:
        if live.nbytes * worth < xla_peak.peak_bytes:
            break  # largest first: the rest are small
        node = graph_node_for(graph, live.name)
        if node is None or " (" in live.name:  # in a loop's body, or made up by XLA inside an op
            continue
        tensor = next((TensorRef(node, i) for i in range(len(graph.output_specs(node)))
                       if graph.nbytes(TensorRef(node, i)) == live.nbytes), None)
        if tensor is not None and tensor not in seen:
            seen.add(tensor)
            found.append((live, tensor))
    return found


def xla_schedule(graph: Graph, xla_estimate: MemoryEstimate) -> dict[str, int]:
    """The nodes of `graph` by their first step in XLA's schedule (`xla_estimate.steps`,
    from `XlaPlan.peak`); an op XLA fused into another has no step of its own."""
    order: dict[str, int] = {}
    for op in xla_estimate.steps:
        node = graph_node_for(graph, op)
        if node is not None and node not in order:
            order[node] = len(order)
    return order


def xla_plan_from_hlo_proto(serialized: bytes) -> XlaPlan:
    """The `XlaPlan` of a serialized HloProto (its `buffer_assignment`)."""
    from tensorflow.compiler.xla.service import hlo_pb2

    proto = hlo_pb2.HloProto()
    proto.ParseFromString(serialized)
    allocations = proto.buffer_assignment.buffer_allocations
    own = [a for a in allocations if not (a.is_entry_computation_parameter or a.is_constant)]
    try:
        peak = xla_live_at_peak(proto)
    except Exception as err:  # a proto layout we do not know: the sizes still stand
        logger.debug("XLA's live set at its peak unavailable: %s", first_line(err))
        peak = None
    heaps = [a.size for a in own if not (a.maybe_live_out or a.is_thread_local or a.is_tuple) and a.size]
    return XlaPlan(sum(a.size for a in allocations), max((a.size for a in own), default=0), peak,
                   temp_bytes=max((a.size for a in own if not a.maybe_live_out), default=0),
                   output_bytes=sum(a.size for a in own if a.maybe_live_out), heap_bytes=tuple(heaps))


def xla_plan(function: Any, *args: Any, **kwargs: Any) -> XlaPlan | None:
    """XLA's buffer assignment for one call of a jit-compiled function, or None.

    Works for a `tf.function(jit_compile=True)` and for a `tfmem.function` (which it
    asks for its compiled function). Returns None where XLA cannot compile it.

    Example:
        >>> f = tf.function(lambda x: x @ tf.transpose(x), jit_compile=True)
        >>> xla_plan(f, tf.ones([1000, 10])).largest_bytes  # the 1000×1000 result
        4000000
    """
    if hasattr(function, "python_function") and callable(getattr(function, "compiled", None)):
        function = function.compiled(*args, **kwargs)  # a tfmem.function: its Compiled stage
        if function is None:
            return None  # it fell back to the original
    if hasattr(function, "xla_plan"):  # a Compiled stage
        return function.xla_plan(*args, **kwargs)
    return xla_plan_or_refusal(function, *args, **kwargs)[0]


def xla_plan_or_refusal(function: Any, *args: Any, **kwargs: Any) -> tuple[XlaPlan | None, str]:
    """XLA's buffer assignment for one call of a jit-compiled `tf.function`, or else why XLA
    cannot compile it: its error's first line. One compilation answers both.

    Running out of memory while compiling is no refusal: then neither is known (None, "").

    Example:
        >>> def unbounded(x):
        ...     return tf.while_loop(lambda v: tf.reduce_sum(v) < 10.0, lambda v: v * 2.0, [x])[0]
        >>> plan, refusal = xla_plan_or_refusal(tf.function(unbounded, jit_compile=True), tf.ones([3]))
        >>> plan.total_bytes > 0, refusal
        (True, '')
        >>> xla_plan_or_refusal(tf.function(lambda x: tf.numpy_function(lambda v: v, [x], tf.float32),
        ...                                 jit_compile=True), tf.ones([3]))
        (None, 'ValueError: Failed getting HLO text: ...')
    """
    try:
        serialized = function.experimental_get_compiler_ir(*args, **kwargs)(
            stage="optimized_hlo_proto_serialized")
    except (tf.errors.ResourceExhaustedError, MemoryError) as err:
        logger.info("XLA planned bytes unavailable: %s", first_line(err))
        return None, ""
    except Exception as err:  # noqa: BLE001 - not jit-compiled, or XLA refuses it (as several types)
        logger.info("XLA planned bytes unavailable: %s", first_line(err))
        return None, f"{type(err).__name__}: {first_line(err)}"
    return xla_plan_from_hlo_proto(serialized), ""


def xla_planned_bytes(function: Any, *args: Any, **kwargs: Any) -> int | None:
    """XLA's planned allocation ("Total bytes used") for one call, or None: see `xla_plan`.

    Example:
        >>> f = tf.function(lambda x: x @ tf.transpose(x), jit_compile=True)
        >>> xla_planned_bytes(f, tf.ones([1000, 10]))  # at least the 1000×1000 result
        4040...
    """
    plan = xla_plan(function, *args, **kwargs)
    return plan.total_bytes if plan is not None else None
