"""Expand naive pairwise squared distances, forward and backward.

    Σ_d (x[..., :, None, :] − y[..., None, :, :])²   →   max(‖x‖² + ‖y‖²ᵀ − 2·x·yᵀ, 0)
    Σ_j G_ij·(x_i − y_j)    (the gradient wrt x)       →   rowsum(G)·x − G·y
    Σ_i G_ij·(x_i − y_j)    (minus the gradient wrt y) →   colsum(G)·y − Gᵀ·x

The naive form materialises an [..., n, m, d] difference tensor; so does its gradient
(TF's gradient of `Sum` tiles the upstream [n, m] gradient to [n, m, d], multiplies it
with the difference and reduces over m or n). The expanded form needs only [n, m].

How: the rule's pattern finds a pairwise difference `rows − cols` (or
`SquaredDifference(rows, cols)`) whose operands are shaped [..., n, 1, d] and
[..., 1, m, d] — however they were made: `tf.expand_dims`, `[:, None]`/`tf.newaxis`
slicing, `tf.reshape`, GPflow's `difference_matrix`, or plain broadcasting against
[m, d]. The check then follows every [..., n, m, d] tensor computed from it and
represents each symbolically as

    T[i, j, k] = a_ij·x_ik + b_ij·y_jk + c_ij          (linear in the difference; c_ij only
                                                        where a and b are 0: see below), or
    T[i, j, k] = s_ij·P[i, j, k]·Q[i, j, k]            (a product of two linear ones),

where the coefficients a, b, c, s are [..., n, m] tensors or scalars. Negation,
addition, subtraction, scaling by [n, m]- or scalar-shaped tensors, `Square`,
`Pow(·, 1|2)`, `x*x`, no-op `Reshape`/`Identity`, and `Tile`/`BroadcastTo` of an
[n, m, 1] tensor (the backward of `Sum`) stay in this form. Every reduction out of the
region (`Sum`/`Mean` over the feature axis, over m or over n, then any other axes) is
replaced by its closed form built from x, y, x·yᵀ and the coefficients, so no
[..., n, m, d] tensor is left, forward or backward.

Conditions (each failure is a recorded rejection with its reason):
- static shapes; floating dtypes;
- every tensor derived from the difference is representable as above (e.g. not `Sqrt`
  or `Exp` of the difference, not multiplied by a per-feature [d] tensor);
- the difference is not shifted (x − y + c with c constant along the features): such a
  shift guards against zero distances (`tf.norm(x[:, None] − y[None] + 1e-9, axis=-1)`,
  whose gradient is finite where points coincide), and the expansion's cancellation
  error, about ε·(‖x‖² + ‖y‖²), swamps the d·c² it leaves there (0 again, and a NaN
  gradient through the square root; found by a program nobody here wrote);
- every way out of the region is a `Sum`/`Mean` that reduces the feature axis, m or n
  (or a `Shape`);
- self-contained: no tensor of the region is a graph output or read by anything
  outside it (only `Const`s waiting on it by a control edge, which are detached).
- not a forward-only distance with few features under XLA. When the only way out is one
  reduction over the feature axis and d ≤ `KEEP_NAIVE_UP_TO_D`, the naive form stays:
  XLA fuses it into that reduction, never materialising [n, m, d], and the expansion
  (a k=d GEMM, which is inefficient, plus a pass over [n, m]) took 1.03–1.3× its time
  on CPU for d = 1–4 (`benchmarks/sqdist_fusion.py`, n = 3000 and 8000). At d = 5 the
  two were even, from d = 6 the expansion was faster (0.9×, 0.5× at d = 32), and from
  about d = 40 XLA materialises [n, m, d] (20.5 GiB planned at n = 8000, d = 40), so the
  rule fires there. It always fires without `jit_compile` and whenever a gradient reads
  the difference.

The squared form is clamped at 0 before anything reads it, so a `tf.sqrt` on top
(a Euclidean distance) stays real where cancellation makes the expansion slightly
negative. Cancellation is kept to the points' spread: where every form is a difference
(b = −a), x and y are taken about y's mean (exact: x − y = (x − μ) − (y − μ)), so points far
from the origin keep their small distances; and distances of a set to itself leave the
diagonal out of every closed form (there xᵢ − xᵢ is exactly 0, as the program computes it,
where the expansion would cancel to rounding under weights as large as 1/√(d² + ε)).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import tensorflow as tf

from tfmem.config import Config
from tfmem.graph import Graph, TensorRef
from tfmem.pattern import (Emitted, Match, OpBuilder, Pattern, PatternNode, RegionRule, outside_readers,
                           self_containment_reason)

from rewrites.split.diagonals import diagonal_mask

_Env = Mapping[TensorRef, tf.Tensor]

# Ops that can only reshape a tensor when they keep its number of elements.
_RESHAPING_OPS = frozenset({"ExpandDims", "Reshape", "StridedSlice", "Identity", "Squeeze"})

# Up to this many features, XLA's fused naive forward distance is faster than the
# expansion and no larger (see the module docstring for the measurements).
KEEP_NAIVE_UP_TO_D = 4


# --- coefficients: [..., n, m]-broadcastable scalars or tensors, built lazily ------------


@dataclasses.dataclass(frozen=True)
class _Coef:
    """A coefficient: a Python scalar, or a tensor expression over graph tensors `refs`."""

    refs: tuple[TensorRef, ...]
    build: Callable[[_Env], Any]
    scalar: float | None = None

    @classmethod
    def of(cls, value: float) -> _Coef:
        return cls((), lambda env: value, float(value))

    @classmethod
    def tensor(cls, ref: TensorRef, shape: Sequence[int]) -> _Coef:
        shape = list(shape)
        return cls((ref,), lambda env: tf.reshape(env[ref], shape))


Coef = Union[_Coef, None]  # None is zero: most coefficients vanish, and skipping them keeps graphs small


def _mul(a: Coef, b: Coef) -> Coef:
    if a is None or b is None:
        return None
    if a.scalar is not None and b.scalar is not None:
        return _Coef.of(a.scalar * b.scalar)
    if a.scalar == 1.0:
        return b
    if b.scalar == 1.0:
        return a
    return _Coef(a.refs + b.refs, lambda env: a.build(env) * b.build(env))


def _add(a: Coef, b: Coef) -> Coef:
    if a is None:
        return b
    if b is None:
        return a
    if a.scalar is not None and b.scalar is not None:
        return _Coef.of(a.scalar + b.scalar)
    return _Coef(a.refs + b.refs, lambda env: a.build(env) + b.build(env))


def _inv(a: Coef) -> Coef:
    if a is None:
        raise ZeroDivisionError
    if a.scalar is not None:
        return _Coef.of(1.0 / a.scalar)
    return _Coef(a.refs, lambda env: 1.0 / a.build(env))


@dataclasses.dataclass(frozen=True)
class _Linear:
    """T[i, j, k] = a_ij·x_ik + b_ij·y_jk + c_ij."""

    a: Coef = None
    b: Coef = None
    c: Coef = None
    # A difference: b = −a and c = 0, so shifting x and y by the same vector leaves it as it is.
    difference: bool = False

    def scaled(self, s: Coef) -> _Linear:
        return _Linear(_mul(self.a, s), _mul(self.b, s), _mul(self.c, s), self.difference)

    def plus(self, other: _Linear) -> _Linear:
        a, b, c = _add(self.a, other.a), _add(self.b, other.b), _add(self.c, other.c)
        opposite = a is not None and b is not None and a.scalar is not None and b.scalar is not None \
            and a.scalar + b.scalar == 0.0
        return _Linear(a, b, c, c is None and ((self.difference and other.difference) or opposite))

    @property
    def is_broadcast(self) -> bool:
        """Constant along the feature axis: an [n, m] tensor tiled d times."""
        return self.a is None and self.b is None


@dataclasses.dataclass(frozen=True)
class _Product:
    """T[i, j, k] = s_ij·P[i, j, k]·Q[i, j, k]; `square` when P is Q (so Σ_k T/s ≥ 0)."""

    p: _Linear
    q: _Linear
    s: Coef
    square: bool

    def scaled(self, s: Coef) -> _Product:
        return _Product(self.p, self.q, _mul(self.s, s), self.square)

    @property
    def difference(self) -> bool:
        return self.p.difference and self.q.difference


_Form = Union[_Linear, _Product]


@dataclasses.dataclass(frozen=True)
class _Exit:
    """A reduction out of the region, replaced by its closed form."""

    node: str
    form: _Form
    axes: tuple[int, ...]
    mean: bool
    out_shape: tuple[int, ...]
    shape_only: tf.DType | None = None  # a `Shape` op: its out_type


# --- the rule ----------------------------------------------------------------------------


def _rows_spec(spec: tf.TensorSpec) -> bool:
    shape = spec.shape
    return (spec.dtype.is_floating and shape.rank is not None and shape.rank >= 3
            and shape.is_fully_defined() and shape[-2] == 1 and shape[-3] > 1)


def _cols_spec(spec: tf.TensorSpec) -> bool:
    shape = spec.shape
    if not (spec.dtype.is_floating and shape.rank is not None and shape.rank >= 2
            and shape.is_fully_defined()):
        return False
    padded = [1] * (3 - shape.rank) + shape.as_list()
    return padded[-3] == 1 and padded[-2] > 1


def pairwise_difference(op: OpBuilder, rows: PatternNode, cols: PatternNode) -> PatternNode:
    """`rows − cols`, `cols − rows` or `SquaredDifference(rows, cols)`: the seed of a distance."""
    return op.any_of(op.Sub(rows, cols), op.Sub(cols, rows), op.SquaredDifference(rows, cols))


class ExpandSquaredDistance(RegionRule["_DistanceRegion"]):
    """Rewrites naive pairwise squared distances (and their gradients) to the expanded form.

    Example:
        >>> @tf.function
        ... def f(x, y):
        ...     with tf.GradientTape() as tape:
        ...         tape.watch(x)
        ...         d2 = tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1)  # [n, m]
        ...         loss = tf.reduce_sum(tf.exp(-d2))
        ...     return loss, tape.gradient(loss, x)
        >>> cf = f.get_concrete_function(tf.TensorSpec([300, 16]), tf.TensorSpec([200, 16]))
        >>> graph = capture(cf).to_graph()
        >>> result = ExpandSquaredDistance().run(graph, PassContext(Config()))
        >>> [(r.status, r.details["exits"]) for r in result.records]   # Σ_d forward, Σ_j for dx
        [('fired', 2)]
        >>> "MatMul" in result.graph.op_counts()
        True
    """

    name = "ExpandSquaredDistance"
    rule = "ExpandSquaredDistance"
    stage = "match_and_replace"
    reads = frozenset({"jit_compile"})  # XLA fuses the naive form itself

    def __init__(self) -> None:
        self.pattern = Pattern(pairwise_difference, where={"rows": _rows_spec, "cols": _cols_spec})

    def find(self, graph: Graph) -> list[_DistanceRegion]:
        # The pattern is only the seed: each region grows from one pairwise difference.
        # Seeds are all taken before anything is rewritten.
        return [_DistanceRegion(graph, match) for match in self.pattern.matches(graph)]

    def check(self, graph: Graph, region: _DistanceRegion, config: Config) -> str | None:
        return region.analyse() or (region.fused_by_xla() if config.jit_compile else None)

    def emit(self, graph: Graph, region: _DistanceRegion) -> Emitted:
        for old, new in region.replace().items():
            graph.replace_all_uses(old, new)
        return Emitted({"pairwise_shape": list(region.shape), "removed_nodes": len(region.inner),
                        "exits": len(region.exits)})


class _DistanceRegion:
    """The [..., n, m, d] tensors computed from one pairwise difference, in closed form."""

    # op type → transfer function name; the table, not an if-chain, says what is supported
    _TRANSFER = {
        "Sub": "_sub", "Add": "_add", "AddV2": "_add", "AddN": "_add", "Neg": "_negate",
        "Mul": "_multiply", "RealDiv": "_divide", "Square": "_square", "Pow": "_power",
        "SquaredDifference": "_squared_difference", "Identity": "_same", "Snapshot": "_same",
        "StopGradient": "_same", "EnsureShape": "_same", "Reshape": "_reshape",
        "Tile": "_broadcast", "BroadcastTo": "_broadcast",
    }
    _EXITS = frozenset({"Sum", "Mean", "Shape"})
    # ops whose later inputs are shapes or exponents, not tensors of the region
    _DATA_INPUTS = {"Reshape": 1, "Tile": 1, "BroadcastTo": 1, "Pow": 1}

    def __init__(self, graph: Graph, match: Match) -> None:
        self.graph = graph
        self.nodes = match.nodes  # the seed's: records name them
        self.root = match.root
        self.rows, self.cols = match["rows"], match["cols"]
        self.shape: tuple[int, ...] = ()
        self.forms: dict[TensorRef, _Form] = {}
        self.inner: dict[str, None] = {}  # nodes whose outputs vanish with the rewrite
        self.exits: list[_Exit] = []
        self.detach: list[tuple[str, str]] = []  # (consumer, producer) control edges to drop

    # --- analysis ---------------------------------------------------------------

    def analyse(self) -> str | None:
        graph, root = self.graph, self.root
        shape = graph.spec(root).shape
        if not shape.is_fully_defined():
            return f"the pairwise tensor {root} has a dynamic shape {shape}"
        self.shape = tuple(shape.as_list())
        rows, cols = self._padded(self.rows), self._padded(self.cols)
        n, m, d = self.shape[-3:]
        if rows[-3:] != [n, 1, d] or cols[-3:] != [1, m, d]:
            return f"{self.rows} and {self.cols} do not span {root}'s [n, m, d] = {[n, m, d]}"
        order = {name: i for i, name in enumerate(graph.topological_order())}
        region, exits = self._collect()
        for name in sorted(region, key=order.__getitem__):
            form = self._form(TensorRef(name))
            if isinstance(form, str):
                return form
        for name in sorted(exits, key=order.__getitem__):
            found = self._exit(name)
            if isinstance(found, str):
                return found
            self.exits.append(found)
        if not self.exits:
            return f"nothing reduces {root}: the [n, m, d] tensor is needed as is"
        return self._self_contained(set(exits))

    def fused_by_xla(self) -> str | None:
        """A reason to keep the naive form under XLA: a forward-only distance with few features."""
        d = self.shape[-1]
        reductions = [e for e in self.exits if e.shape_only is None]
        if len(reductions) != 1 or len(self.shape) - 1 not in reductions[0].axes:
            return None  # a gradient (or a second reader) needs the difference: expand
        if d > KEEP_NAIVE_UP_TO_D:
            return None
        return (f"kept naive under jit_compile: {self.root} has d={d} ≤ {KEEP_NAIVE_UP_TO_D} "
                f"features and one reduction over them, which XLA fuses without materialising "
                f"{list(self.shape)}; the expansion would only add a GEMM and a pass over [n, m]")

    def _source(self, ref: TensorRef) -> TensorRef:
        """The tensor `ref` only reshapes (`x[:, None]`, `tf.expand_dims(x, 0)`, `tf.reshape`):
        its elements in the same order (a strided slice only with unit strides, so `x[::-1]`
        is not `x`)."""
        size = self.graph.spec(ref).shape.num_elements()
        while self.graph.node(ref.node).op in _RESHAPING_OPS and ref.index == 0:
            if self.graph.node(ref.node).op == "StridedSlice":
                strides = self.graph.constant_value(self.graph.inputs(ref.node)[3])
                if strides is None or not np.all(np.asarray(strides) == 1):
                    break
            source = self.graph.inputs(ref.node)[0]
            if self.graph.spec(source).shape.num_elements() != size:
                break
            ref = source
        return ref

    def _self_pairs(self) -> bool:
        """Whether the pairs are of a set x [..., n, d] with itself, aligned: rows are
        `x[..., :, None, :]` and columns `x[..., None, :, :]`, so (i, i) is xᵢ − xᵢ."""
        shape = self.shape
        source = self._source(self.rows)
        if shape[-3] != shape[-2] or source != self._source(self.cols):
            return False
        dims = self.graph.spec(source).shape.as_list()
        if len(dims) < 2 or None in dims:
            return False

        def padded(template: list[int]) -> list[int]:
            return [1] * (len(shape) - len(template)) + template

        return (self._padded(self.rows) == padded(dims[:-1] + [1] + dims[-1:])
                and self._padded(self.cols) == padded(dims[:-2] + [1] + dims[-2:]))

    def _padded(self, ref: TensorRef) -> list[int]:
        """The static shape of `ref`, left-padded with 1s to the pairwise tensor's rank."""
        shape = self.graph.spec(ref).shape.as_list()
        return [1] * (len(self.shape) - len(shape)) + shape

    def _big(self, ref: TensorRef) -> bool:
        shape = self.graph.spec(ref).shape
        return shape.rank is None or (shape.rank >= 3 and tuple(shape.as_list()[-3:]) == self.shape[-3:])

    def _collect(self) -> tuple[set[str], set[str]]:
        """Nodes with an [n, m, d] output reachable from the root, and the nodes leaving them.

        Only data edges count; control edges are judged by `_self_contained`.
        """
        region, exits = {self.root.node}, set()
        stack = [self.root.node]
        while stack:
            name = stack.pop()
            for index in range(len(self.graph.output_specs(name))):
                for consumer, _ in self.graph.consumers(TensorRef(name, index)):
                    if consumer in region or consumer in exits:
                        continue
                    outputs = range(len(self.graph.output_specs(consumer)))
                    if any(self._big(TensorRef(consumer, i)) for i in outputs):
                        region.add(consumer)
                        stack.append(consumer)
                    else:
                        exits.add(consumer)
        return region, exits

    def _form(self, ref: TensorRef) -> _Form | str:
        """The symbolic form of an [n, m, d] tensor (computed on demand, memoised)."""
        if ref in self.forms:
            return self.forms[ref]
        node = self.graph.node(ref.node)
        method = self._TRANSFER.get(node.op)
        if method is None or ref.index != 0:
            return (f"{ref} ({node.op}) is computed from the pairwise difference {self.root} but "
                    f"has no closed form without the [n, m, d] tensor")
        inputs = self.graph.inputs(ref.node)
        operands = [self._operand(r) for r in inputs[:self._DATA_INPUTS.get(node.op, len(inputs))]]
        for operand in operands:
            if isinstance(operand, str):
                return operand
        form = getattr(self, method)(ref, operands)
        if isinstance(form, str):
            return form
        self.forms[ref] = form
        self.inner[ref.node] = None
        return form

    def _operand(self, ref: TensorRef) -> _Form | str:
        """An input of a region op: an [n, m, d] tensor's form, or a small tensor as c_ij."""
        if ref == self.rows:
            return _Linear(a=_Coef.of(1.0))
        if ref == self.cols:
            return _Linear(b=_Coef.of(1.0))
        if self._big(ref):
            return self._form(ref)
        coef = self._coefficient(ref)
        return coef if isinstance(coef, str) else _Linear(c=coef)

    def _coefficient(self, ref: TensorRef) -> Coef | str:
        """A small tensor as a coefficient broadcastable to [..., n, m] (constant along d)."""
        value = self.graph.constant_value(ref)
        if value is not None and value.size == 1:
            return _Coef.of(float(value.reshape(())))
        shape = self.graph.spec(ref).shape
        rank = len(self.shape)
        if not shape.is_fully_defined() or shape.rank > rank:
            return f"{ref} with shape {shape} does not broadcast against {list(self.shape)}"
        padded = [1] * (rank - shape.rank) + shape.as_list()
        if padded[-1] != 1:
            return (f"{ref} {shape} varies along the feature axis of {self.root}; "
                    f"the distance has no closed form")
        if any(p not in (1, full) for p, full in zip(padded, self.shape)):
            return f"{ref} with shape {shape} does not broadcast against {list(self.shape)}"
        return _Coef.tensor(ref, padded[:-1])

    # --- transfer functions: operands' forms → the op's form, or a reason ----------

    def _same(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        return operands[0]

    def _reshape(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        before, after = self.graph.spec(self.graph.inputs(ref.node)[0]).shape, self.graph.spec(ref).shape
        if before != after:
            return f"{ref} reshapes the pairwise tensor from {before} to {after}"
        return operands[0]

    def _negate(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        return operands[0].scaled(_Coef.of(-1.0))

    def _add(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        if not all(isinstance(o, _Linear) for o in operands):
            return f"{ref} adds a squared difference to something: no closed form for the sum"
        total = operands[0]
        for other in operands[1:]:
            total = total.plus(other)  # type: ignore[union-attr]
        if not total.is_broadcast and total.c is not None:  # type: ignore[union-attr]
            # x − y + c: the shift is a guard against zero distances (`‖xᵢ − xⱼ + 1e-9‖`, whose
            # gradient is finite where xᵢ = xⱼ). The expansion's cancellation error, about
            # ε·(‖x‖² + ‖y‖²), swamps d·c²: the distance came out 0 again, and the gradient of
            # its square root NaN (float32, 300 points: 6,528 NaN where stock XLA had none).
            return (f"{ref} shifts the pairwise difference by a term constant along the features (x − y + c, "
                    "a guard against zero distances): the expanded form would lose it to cancellation")
        return total

    def _sub(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        return self._add(ref, [operands[0], operands[1].scaled(_Coef.of(-1.0))])

    def _multiply(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        left, right = operands
        if isinstance(right, _Linear) and right.is_broadcast:
            return left.scaled(right.c)
        if isinstance(left, _Linear) and left.is_broadcast:
            return right.scaled(left.c)
        if isinstance(left, _Linear) and isinstance(right, _Linear):
            return _Product(left, right, _Coef.of(1.0), square=left == right)
        return f"{ref} multiplies a squared difference by the difference (a cubic term)"

    def _divide(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        left, right = operands
        if isinstance(right, _Linear) and right.is_broadcast and right.c is not None:
            return left.scaled(_inv(right.c))
        return f"{ref} divides by a tensor that depends on the pairwise difference"

    def _square(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        (p,) = operands
        if not isinstance(p, _Linear):
            return f"{ref} squares a squared difference (a quartic term)"
        return _Product(p, p, _Coef.of(1.0), square=True)

    def _power(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        exponent = self.graph.constant_value(self.graph.inputs(ref.node)[1])
        if exponent is None or exponent.size != 1 or float(exponent.reshape(())) not in (1.0, 2.0):
            return f"{ref} raises the pairwise difference to a power other than a constant 1 or 2"
        return operands[0] if float(exponent.reshape(())) == 1.0 else self._square(ref, operands[:1])

    def _squared_difference(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        difference = self._sub(ref, operands)
        return difference if isinstance(difference, str) else self._square(ref, [difference])

    def _broadcast(self, ref: TensorRef, operands: list[_Form]) -> _Form | str:
        source = operands[0]
        if isinstance(source, _Linear) and source.is_broadcast:
            return source  # an [n, m, 1] tensor tiled along d: c_ij itself
        return f"{ref} tiles a tensor that varies along the feature axis"

    # --- exits ----------------------------------------------------------------------

    def _exit(self, name: str) -> _Exit | str:
        node = self.graph.node(name)
        inputs = self.graph.inputs(name)
        out_shape = self.graph.spec(TensorRef(name)).shape
        if node.op not in self._EXITS or not out_shape.is_fully_defined():
            return (f"{name} ({node.op}) reads the pairwise tensor {self.root} and is not a reduction "
                    f"over its feature, row or column axis")
        if node.op == "Shape":
            return _Exit(name, _Linear(), (), False, tuple(out_shape.as_list()),
                         shape_only=self.graph.spec(TensorRef(name)).dtype)
        form = self._form(inputs[0])
        if isinstance(form, str):
            return form
        axes_value = self.graph.constant_value(inputs[1])
        if axes_value is None:
            return f"{name} reduces over axes that are not a constant"
        rank = len(self.shape)
        axes = tuple(sorted({int(a) % rank for a in np.atleast_1d(axes_value)}))
        primary = {rank - 1, rank - 2, rank - 3} & set(axes)
        if not primary:
            return f"{name} reduces only batch axes {list(axes)}: the [n, m, d] tensor would remain"
        if isinstance(form, _Product) and rank - 1 not in axes:
            return f"{name} reduces a squared difference over {list(axes)} but not over the feature axis"
        return _Exit(name, form, axes, node.op == "Mean", tuple(out_shape.as_list()))

    def _self_contained(self, exits: set[str]) -> str | None:
        readers = outside_readers(self.graph, [TensorRef(n) for n in self.inner], set(self.inner) | exits)
        # A constant waiting on the region by a control edge only orders, reads nothing: detach it.
        self.detach = [(r.reader, r.tensor.node) for r in readers if r.waiting_constant]
        return self_containment_reason(self.graph, readers, allow_waiting_constants=True)

    # --- replacement ------------------------------------------------------------------

    def replace(self) -> dict[TensorRef, TensorRef]:
        refs: list[TensorRef] = [self.rows, self.cols]
        for exit_ in self.exits:
            for coef in _coefs(exit_.form):
                refs.extend(r for r in coef.refs if r not in refs)
        shape, exits = self.shape, self.exits
        rows_padded, cols_padded = self._padded(self.rows), self._padded(self.cols)
        centred = all(e.form.difference for e in exits if e.shape_only is None)
        # Distances of a set to itself: xᵢ − xᵢ is exactly 0, as the program computes it, so the
        # diagonal of every closed form is left out instead of cancelling to rounding there (with
        # a weight as large as 1/√(d² + 1e-8) on the diagonal, float32 gradients were 2e-3 off).
        self_pairs = centred and self._self_pairs()

        def build(*tensors: tf.Tensor) -> list[tf.Tensor]:
            env = dict(zip(refs, tensors))
            x = tf.reshape(env[self.rows], rows_padded[:-2] + rows_padded[-1:])  # [..., n, d]
            y = tf.reshape(env[self.cols], cols_padded[:-3] + cols_padded[-2:])  # [..., m, d]
            if centred:
                # x − y = (x − μ) − (y − μ) for any μ: about y's mean, ‖x‖² + ‖y‖² − 2·x·yᵀ cancels
                # digits of the spread, not of the offset (float64 points 5e6 from the origin: kNN
                # distances 6.4e-7 off, now to rounding).
                mean = tf.reduce_mean(tf.reshape(y, [-1, y.shape[-1]]), 0)
                x, y = x - mean, y - mean
            terms = _Terms(x, y, shape, env, self_pairs=self_pairs)
            return [terms.exit(e) for e in exits]

        new = self.graph.splice(build, refs, scope="ExpandSquaredDistance")
        for consumer, producer in self.detach:
            self.graph.remove_control_input(consumer, producer)
        return {TensorRef(e.node): r for e, r in zip(exits, new)}


def _coefs(form: _Form) -> list[_Coef]:
    linears = [form] if isinstance(form, _Linear) else [form.p, form.q]
    found = [c for lin in linears for c in (lin.a, lin.b, lin.c) if c is not None]
    if isinstance(form, _Product) and form.s is not None:
        found.append(form.s)
    return found


class _Terms:
    """Builds closed forms from x [..., n, d], y [..., m, d]; shared pieces are built once."""

    def __init__(self, x: tf.Tensor, y: tf.Tensor, shape: tuple[int, ...], env: _Env, *,
                 self_pairs: bool = False) -> None:
        self.x, self.y, self.shape, self.env = x, y, shape, env
        # x is y, and every form a difference: each form is 0 where i = j (see `replace`).
        self.self_pairs = self_pairs
        self.rank = len(shape)
        self._cache: dict[str, tf.Tensor] = {}

    def _piece(self, key: str, make: Callable[[], tf.Tensor]) -> tf.Tensor:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def value(self, coef: Coef) -> tf.Tensor | None:
        """A coefficient as a scalar or a tensor broadcastable to [..., n, m] (None for zero)."""
        if coef is None:
            return None
        if coef.scalar is not None:
            return tf.constant(coef.scalar, self.x.dtype)
        return tf.cast(coef.build(self.env), self.x.dtype)

    def full(self, coef: Coef) -> tf.Tensor:
        """A non-scalar coefficient broadcast to [..., n, m], for matmuls and row/column sums;
        0 on the diagonal for self pairs (what it multiplies there, xᵢ − xᵢ, is 0)."""
        full = tf.broadcast_to(self.value(coef), self.shape[:-1])
        return _off_diagonal(full) if self.self_pairs else full

    @property
    def x_sum(self) -> tf.Tensor:  # [..., n, 1]
        return self._piece("x_sum", lambda: tf.reduce_sum(self.x, -1, keepdims=True))

    @property
    def y_sum(self) -> tf.Tensor:  # [..., 1, m]
        return self._piece("y_sum", lambda: tf.linalg.matrix_transpose(
            tf.reduce_sum(self.y, -1, keepdims=True)))

    @property
    def x_sq(self) -> tf.Tensor:  # [..., n, 1]
        return self._piece("x_sq", lambda: tf.reduce_sum(tf.square(self.x), -1, keepdims=True))

    @property
    def y_sq(self) -> tf.Tensor:  # [..., 1, m]
        return self._piece("y_sq", lambda: tf.linalg.matrix_transpose(
            tf.reduce_sum(tf.square(self.y), -1, keepdims=True)))

    @property
    def xy(self) -> tf.Tensor:  # [..., n, m]
        return self._piece("xy", lambda: tf.linalg.matmul(self.x, self.y, transpose_b=True))

    def exit(self, exit_: _Exit) -> tf.Tensor:
        if exit_.shape_only is not None:
            return tf.constant(self.shape, dtype=exit_.shape_only)
        rank, shape = self.rank, list(self.shape)
        axes = set(exit_.axes)
        kept = list(shape)
        if rank - 1 in axes:
            dense = self._feature_sum(exit_.form)[..., None]  # [..., n, m, 1]
            primary = rank - 1
        elif rank - 2 in axes:
            dense = tf.expand_dims(self._column_sum(exit_.form), -2)  # [..., n, 1, d]
            primary = rank - 2
        else:
            dense = tf.expand_dims(self._row_sum(exit_.form), -3)  # [..., 1, m, d]
            primary = rank - 3
        kept[primary] = 1
        dense = tf.broadcast_to(dense, kept)
        rest = sorted(axes - {primary})
        if rest:
            dense = tf.reduce_sum(dense, rest, keepdims=True)
        if exit_.mean:
            dense = dense / float(np.prod([shape[a] for a in axes]))
        return tf.reshape(dense, exit_.out_shape)

    def _feature_sum(self, form: _Form) -> tf.Tensor:
        """Σ_k T[..., i, j, k] → [..., n, m]."""
        d = float(self.shape[-1])
        if isinstance(form, _Linear):
            a, b, c = (self.value(v) for v in (form.a, form.b, form.c))
            total = _sum_terms([(a, self.x_sum), (b, self.y_sum), (c, d)], self.shape[:-1], self.x.dtype)
            return _off_diagonal(total) if self.self_pairs else total
        p, q = form.p, form.q
        pa, pb, pc = (self.value(v) for v in (p.a, p.b, p.c))
        qa, qb, qc = (self.value(v) for v in (q.a, q.b, q.c))
        inner = _sum_terms([
            (_prod(pa, qa), self.x_sq), (_prod(pb, qb), self.y_sq),
            (_plus(_prod(pa, qb), _prod(pb, qa)), self.xy), (_prod(pc, qc), d),
            (_plus(_prod(pa, qc), _prod(pc, qa)), self.x_sum),
            (_plus(_prod(pb, qc), _prod(pc, qb)), self.y_sum)], self.shape[:-1], self.x.dtype)
        if form.square:  # a sum of squares: cancellation must not make it negative
            inner = tf.maximum(inner, tf.zeros([], inner.dtype))
        if self.self_pairs:
            inner = _off_diagonal(inner)
        s = self.value(form.s)
        return inner if s is None else s * inner

    def _column_sum(self, form: _Form) -> tf.Tensor:
        """Σ_j a_ij·x_i + b_ij·y_j + c_ij → [..., n, d]."""
        assert isinstance(form, _Linear)
        m = float(self.shape[-2])
        parts = []
        if form.a is not None:  # Σ_j a_ij · x_i
            parts.append((self.value(form.a) * m if form.a.scalar is not None
                          else tf.reduce_sum(self.full(form.a), -1, keepdims=True)) * self.x)
        if form.b is not None:  # Σ_j b_ij · y_j
            parts.append(self.value(form.b) * tf.reduce_sum(self.y, -2, keepdims=True)
                         if form.b.scalar is not None else tf.linalg.matmul(self.full(form.b), self.y))
        if form.c is not None:
            parts.append(self.value(form.c) * m if form.c.scalar is not None
                         else tf.reduce_sum(self.full(form.c), -1, keepdims=True))
        return _total(parts, self.shape[:-3] + (self.shape[-3], self.shape[-1]), self.x.dtype)

    def _row_sum(self, form: _Form) -> tf.Tensor:
        """Σ_i a_ij·x_i + b_ij·y_j + c_ij → [..., m, d]."""
        assert isinstance(form, _Linear)
        n = float(self.shape[-3])
        parts = []
        if form.a is not None:  # Σ_i a_ij · x_i
            parts.append(self.value(form.a) * tf.reduce_sum(self.x, -2, keepdims=True)
                         if form.a.scalar is not None
                         else tf.linalg.matmul(self.full(form.a), self.x, transpose_a=True))
        if form.b is not None:  # Σ_i b_ij · y_j
            parts.append((self.value(form.b) * n if form.b.scalar is not None else
                          tf.linalg.matrix_transpose(tf.reduce_sum(self.full(form.b), -2, keepdims=True)))
                         * self.y)
        if form.c is not None:
            parts.append(self.value(form.c) * n if form.c.scalar is not None else
                         tf.linalg.matrix_transpose(tf.reduce_sum(self.full(form.c), -2, keepdims=True)))
        return _total(parts, self.shape[:-3] + self.shape[-2:], self.x.dtype)


def _off_diagonal(matrix: tf.Tensor) -> tf.Tensor:
    """`matrix` [..., n, n] with 0 on its diagonal: a select by the identity mask, which the
    split stage cuts by rows (a `set_diag` has no split rule and kept a kernel matrix's
    backward whole)."""
    return tf.where(diagonal_mask(int(matrix.shape[-1])), tf.zeros([], matrix.dtype), matrix)


def _prod(a: tf.Tensor | None, b: tf.Tensor | None) -> tf.Tensor | None:
    return None if a is None or b is None else a * b


def _plus(a: tf.Tensor | None, b: tf.Tensor | None) -> tf.Tensor | None:
    return b if a is None else a if b is None else a + b


def _sum_terms(terms: list[tuple[tf.Tensor | None, Any]], shape: Sequence[int], dtype: tf.DType) -> tf.Tensor:
    return _total([coef * basis for coef, basis in terms if coef is not None], shape, dtype)


def _total(parts: list[tf.Tensor], shape: Sequence[int], dtype: tf.DType) -> tf.Tensor:
    if not parts:
        return tf.zeros(list(shape), dtype)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return tf.broadcast_to(total, list(shape))


__all__ = ["ExpandSquaredDistance", "pairwise_difference"]
