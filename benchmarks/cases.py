"""Benchmark cases and the methods that run them, one trial per call.

A *case* builds a function and its inputs for a problem size; a *method* runs it:

    tf       stock `tf.function`
    xla      stock `tf.function(jit_compile=True)`
    tfmem    `tfmem.function` with the given threshold
    chunked  a hand-written chunked TensorFlow version (the practical limit)

`run_trial(case, method, size, ...)` is what `tfmem.run_isolated` calls in a fresh
process under a memory limit; it returns timings and a small digest of the result so
that methods can be checked against each other. `run_speed(case, size, methods, ...)`
times several methods in one process, interleaved, for speed ratios.

Example:
    >>> from tfmem import run_isolated
    >>> result = run_isolated("benchmarks.cases:run_trial", "kernel_matmul", "tfmem", 4000,
    ...                       threshold="8MB", memory_limit_mb=64)  # a 128 MB kernel matrix, in chunks
    >>> result.status, result.value["status"], result.value["splits"] > 0
    ('ok', 'rewritten', True)
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.isolation import classify_error

METHODS = ("tf", "xla", "tfmem", "chunked")
# Peers outside TensorFlow, for the kNN cases; they allocate with numpy, so the allocator
# limit does not bind them and the harness compares their resident memory with the budget.
PEERS = ("sklearn", "faiss")


@dataclasses.dataclass(frozen=True)
class Case:
    """A problem family: `build(size)` → (function, args, hand-chunked function or None)."""

    name: str
    description: str
    size_name: str
    build: Callable[[int], tuple[Callable[..., Any], tuple[Any, ...], Callable[..., Any] | None]]
    # Memory grows like size**growth: the OOM-point ratio is reported in these units too.
    growth: float = 2.0


# --- kernel matrix products ----------------------------------------------------------


def kernel_matrix(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """exp(-½‖xᵢ − yⱼ‖²) written the naive way: an [n, m, d] difference, then [n, m]."""
    return tf.exp(-0.5 * tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), axis=-1))


def _kernel_matmul(n: int, k: int = 16):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(n, 3)))
    v = tf.constant(rng.normal(size=(n, k)))

    def fn(x, v):
        return kernel_matrix(x, x) @ v  # [n, k]

    def chunked(x, v, rows: int = 1024):
        pieces = [kernel_matrix(x[i:i + rows], x) @ v for i in range(0, n, rows)]
        return tf.concat(pieces, axis=0)

    return fn, (x, v), tf.function(chunked, jit_compile=True)


def _kernel_matvec(n: int):
    return _kernel_matmul(n, k=1)


# --- nearest neighbours --------------------------------------------------------------


def knn_indices(queries: tf.Tensor, data: tf.Tensor, k: int = 10) -> tf.Tensor:
    """Indices of the k nearest data points of each query (squared Euclidean)."""
    distances = (tf.reduce_sum(queries ** 2, -1)[:, None] + tf.reduce_sum(data ** 2, -1)[None, :]
                 - 2.0 * queries @ tf.transpose(data))  # [q, n]
    return tf.math.top_k(-distances, k=k).indices


def _knn(dtype: tf.DType) -> Callable[[int], Any]:
    def build(n: int):
        rng = np.random.default_rng(0)
        queries = tf.constant(rng.normal(size=(max(n // 10, 16), 8)), dtype)
        data = tf.constant(rng.normal(size=(n, 8)), dtype)

        def chunked(queries, data, cols: int = 8192, k: int = 10):
            best_values, best_indices = None, None
            for start in range(0, n, cols):
                block = data[start:start + cols]
                d = (tf.reduce_sum(queries ** 2, -1)[:, None] + tf.reduce_sum(block ** 2, -1)[None, :]
                     - 2.0 * queries @ tf.transpose(block))
                values, indices = tf.math.top_k(-d, k=min(k, block.shape[0]))
                indices += start
                if best_values is not None:
                    values = tf.concat([best_values, values], -1)
                    indices = tf.concat([best_indices, indices], -1)
                    top = tf.math.top_k(values, k=k)
                    values, indices = top.values, tf.gather(indices, top.indices, batch_dims=1)
                best_values, best_indices = values, indices
            return best_indices

        return knn_indices, (queries, data), tf.function(chunked, jit_compile=True)

    return build


# --- distances with gradients --------------------------------------------------------


def _distance_gradient(n: int):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(n, 64)), tf.float32)
    y = tf.constant(rng.normal(size=(n, 64)), tf.float32)

    def fn(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            total = tf.reduce_sum(tf.sqrt(tf.reduce_sum((x[:, None] - y[None]) ** 2, -1) + 1e-6))
        return total, tape.gradient(total, x)

    return fn, (x, y), None


# --- GPflow SGPR ---------------------------------------------------------------------


def sgpr_model(n: int, m: int, seed: int = 0) -> Any:
    """An SGPR model on synthetic 3-d data with n points and m inducing points."""
    import gpflow

    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, size=(n, 3))
    y = np.sin(x).sum(-1, keepdims=True) + 0.1 * rng.normal(size=(n, 1))
    return gpflow.models.SGPR((x, y), gpflow.kernels.SquaredExponential(lengthscales=[1.0] * 3),
                              inducing_variable=x[rng.choice(n, m, replace=False)].copy())


def sgpr_loss_and_gradients(n: int, m: int) -> Callable[[], Any]:
    """A fresh SGPR model's loss-and-gradient step (the tape inside the function)."""
    model = sgpr_model(n, m)

    def step():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)

    return step


def vgp_loss_and_gradients(n: int, dim: int, seed: int = 6) -> Callable[[], Any]:
    """A fresh GPflow VGP's (Linear kernel, Gaussian likelihood) loss-and-gradient step on n
    synthetic dim-d points: its `q_sqrt` is a triangular [n, n]."""
    import gpflow

    x = np.random.default_rng(seed).uniform(-3, 3, (n, dim))
    model = gpflow.models.VGP((x, np.sin(x).sum(-1, keepdims=True)), gpflow.kernels.Linear(),
                              gpflow.likelihoods.Gaussian(variance=0.1))

    def step():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)

    return step


def _sgpr(n: int) -> Callable[[int], Any]:
    return lambda m: (sgpr_loss_and_gradients(n, m), (), None)


def _sgpr_predict(n_test: int):
    model = sgpr_model(2000, 100)
    x_test = tf.constant(np.random.default_rng(1).uniform(-3, 3, size=(n_test, 3)))

    def fn(x_test):
        return model.predict_f(x_test)

    return fn, (x_test,), None


CASES: dict[str, Case] = {c.name: c for c in [
    Case("kernel_matmul", "exp(-½ sqdist(X, X)) @ V, X: n×3, V: n×16, float64", "n", _kernel_matmul),
    Case("kernel_matvec", "exp(-½ sqdist(X, X)) @ v, X: n×3, v: n×1, float64", "n", _kernel_matvec),
    Case("knn_f32", "k=10 nearest of n/10 queries among n points, d=8, float32", "n", _knn(tf.float32)),
    Case("knn_f64", "k=10 nearest of n/10 queries among n points, d=8, float64", "n", _knn(tf.float64)),
    Case("distance_gradient", "Σ naive pairwise distance of n×64 and its gradient, float32", "n",
         _distance_gradient),
    Case("sgpr", "GPflow SGPR loss and gradients, N=100000, D=3, float64", "M", _sgpr(100_000), growth=1.0),
    Case("sgpr_small", "GPflow SGPR loss and gradients, N=10000, D=3, float64", "M", _sgpr(10_000), growth=1.0),
    Case("sgpr_predict", "GPflow SGPR predict_f (full cov off) on n test points, M=100", "n", _sgpr_predict,
         growth=1.0),
]}


def _knn_peer(method: str, queries: tf.Tensor, data: tf.Tensor, k: int = 10) -> Callable[[], Any]:
    """A kNN peer on the same inputs: scikit-learn's chunked distances, or faiss's exact search."""
    q, x = np.ascontiguousarray(queries.numpy()), np.ascontiguousarray(data.numpy())
    if method == "sklearn":
        from sklearn.metrics import pairwise_distances_chunked

        def reduce(chunk: np.ndarray, start: int) -> np.ndarray:
            del start
            top = np.argpartition(chunk, k, axis=1)[:, :k]
            order = np.argsort(np.take_along_axis(chunk, top, 1), axis=1)
            return np.take_along_axis(top, order, 1)

        # working_memory (MiB) bounds each chunk of the [q, n] distance matrix.
        return lambda: np.concatenate(list(pairwise_distances_chunked(
            q, x, reduce_func=reduce, metric="sqeuclidean", working_memory=64)))
    import faiss

    if q.dtype != np.float32:  # faiss only searches float32
        q, x = q.astype(np.float32), x.astype(np.float32)
    index = faiss.IndexFlatL2(x.shape[1])
    index.add(x)
    return lambda: index.search(q, k)[1]


def _time_steps(step: Callable[[], Any], repeats: int, min_seconds: float = 0.0) -> dict[str, Any]:
    """Median time of `step` over at least `repeats` calls and `min_seconds` of calls.

    `repeats=0` times nothing (OOM searches only need the first call). `run_speed` calls
    it with a step that is one interleaved round of every method.
    """
    times: list[float] = []
    while len(times) < repeats or (repeats and sum(times) < min_seconds and len(times) < 1000):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times) if times else None, "steps_timed": len(times)}


def _digest(value: Any) -> list[float]:
    """A small fingerprint of a result: the float64 sum and the first entries of each output."""
    digest = []
    for leaf in tf.nest.flatten(value):
        array = np.asarray(leaf, dtype=np.float64)
        digest.append(float(array.sum()))
        digest.extend(array.ravel()[:3].tolist())
    return digest


def _method_step(case: str, method: str, size: int, threshold: str | int | None,
                 outer_gradient: bool = False) -> tuple[Callable[[], Any], Any, tuple[Any, ...]]:
    """One call of `case` at `size` by `method`: (call, the method's function, its inputs).

    With `outer_gradient`, the call also differentiates Σ output² w.r.t. the first input
    with a tape *outside* the method's function (tfmem's backward is then its own rewrite).
    """
    if method in PEERS:
        if not case.startswith("knn"):
            raise NotImplementedError(f"no {method} peer for {case}")
        _, (queries, data), _ = CASES[case].build(size)
        peer = _knn_peer(method, queries, data)
        return peer, peer, (queries, data)
    fn, args, chunked = CASES[case].build(size)
    if method == "tf":
        runner = tf.function(fn)
    elif method == "xla":
        runner = tf.function(fn, jit_compile=True)
    elif method == "tfmem":
        runner = tfmem.function(fn, config=tfmem.Config(tensor_size_threshold=threshold))
    elif method == "chunked":
        if chunked is None:
            raise NotImplementedError(f"no hand-chunked version of {case}")
        runner = chunked
    else:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS + PEERS)}")

    def call() -> Any:
        if not outer_gradient:
            return runner(*args)
        with tf.GradientTape() as tape:
            tape.watch(args[0])
            out = runner(*args)
            loss = tf.reduce_sum(out ** 2)
        return out, tape.gradient(loss, args[0])

    return call, runner, args


def _first_call(call: Callable[[], Any]) -> tuple[Any, list[float], float]:
    """The first call's result, its digest (computing it waits for the result) and seconds."""
    start = time.perf_counter()
    value = call()
    digest = _digest(value)
    return value, digest, time.perf_counter() - start


def run_trial(case: str, method: str, size: int, *, threshold: str | int | None = "64MB",
              repeats: int = 3, planned: bool = True, outer_gradient: bool = False,
              keep_value: bool = False) -> dict[str, Any]:
    """Runs one case at one size with one method; returns timings, XLA plan and a digest.

    Args:
        repeats: warm calls to time after the first (the step time is their median).
        outer_gradient: also differentiate Σ output² w.r.t. the first argument, with a
            tape *outside* the method's function (tfmem's backward is then its own rewrite).
        keep_value: return the result itself (as numpy) under "value", for exact checks.

    Raises whatever the method raises (an out-of-memory is a ResourceExhaustedError,
    which `run_isolated` reports as status "oom").
    """
    call, runner, args = _method_step(case, method, size, threshold, outer_gradient)
    value, digest, first_call = _first_call(call)
    result: dict[str, Any] = {"first_call_s": first_call,
                              **_time_steps(lambda: _digest(call()), repeats), "digest": digest}
    if method in PEERS:
        result["rss_only"] = True  # numpy allocates outside TensorFlow's allocator
        return result
    if keep_value:
        result["value"] = tf.nest.map_structure(lambda t: np.asarray(t), value)
    if planned and method in ("xla", "tfmem", "chunked"):
        result["xla_planned_bytes"] = tfmem.xla_planned_bytes(runner, *args)
    if method == "tfmem":
        report = runner.report(*args)
        result["status"] = report.status
        result["splits"] = len(report.splits)
    return result


def run_speed(case: str, size: int, methods: Sequence[str], *, threshold: str | int | None = "64MB",
              repeats: int = 3, min_seconds: float = 2.0) -> dict[str, dict[str, Any]]:
    """Times several methods of one case in *one* process, interleaved call by call.

    Each method is built and called once (its first call includes tracing, rewriting and
    compiling); then rounds call every method once, in an order that rotates each round,
    until every method has `repeats` timed calls and the rounds have lasted
    `min_seconds` per method. Interleaving puts the machine's slow spells on every
    method alike, which separate processes timed one after another do not.

    Returns method → {"status": "ok" | "oom" | "error", "error", "first_call_s",
    "step_s" (median), "steps_timed", "digest"}.

    Example:
        >>> from tfmem import run_isolated
        >>> timed = run_isolated("benchmarks.cases:run_speed", "kernel_matmul", 1000, ["xla", "tfmem"],
        ...                      threshold="4MB", repeats=3, min_seconds=0, memory_limit_mb=256).value
        >>> [timed[m]["status"] for m in ("xla", "tfmem")], timed["tfmem"]["steps_timed"]
        (['ok', 'ok'], 3)
    """
    results: dict[str, dict[str, Any]] = {}
    calls: dict[str, Callable[[], Any]] = {}
    for method in methods:
        try:
            call, _, _ = _method_step(case, method, size, threshold)
            _, digest, first_call = _first_call(call)
        except Exception as error:  # noqa: BLE001 — one method failing must not lose the others
            results[method] = {"status": classify_error(error), "error": f"{type(error).__name__}: {error}"[:500]}
            continue
        calls[method] = call
        results[method] = {"status": "ok", "error": None, "first_call_s": first_call, "digest": digest}
    times: dict[str, list[float]] = {m: [] for m in calls}
    order = list(calls)

    def one_round() -> None:  # every method once, then rotate who goes first
        for method in order:
            start = time.perf_counter()
            _digest(calls[method]())
            times[method].append(time.perf_counter() - start)
        order.append(order.pop(0))

    if order:
        _time_steps(one_round, repeats, min_seconds * len(order))
    for method, samples in times.items():
        results[method].update(step_s=statistics.median(samples) if samples else None,
                               steps_timed=len(samples))
    return results
