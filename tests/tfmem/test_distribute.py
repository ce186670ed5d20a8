"""tfmem.function under tf.distribute: per-replica rewrites, budgets, variables, fallbacks.

Tests that need two devices run `two_cpu_scenarios` once, in a fresh process whose CPU
is split into two logical devices (TensorFlow fixes its devices on first use, so this
process cannot), and check its results. The rest run here: OneDeviceStrategy gives a
replica context on the one CPU.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem import Config, Graph, GraphPass, PassResult
from tfmem.budget import CPU_SAFETY_FRACTION
from tfmem.distribute import Replica, current_replica, replica_budget, split_cpu
from tfmem.testing import run_scenarios, scenario_outcome

SPLIT = Config(tensor_size_threshold="1MB", memory_budget="4MB")
MiB = 2**20


def kernel_times(x: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
    """exp(−½‖xᵢ − xⱼ‖²) @ v: an [n, n] kernel matrix that tfmem splits."""
    sqdist = tf.reduce_sum((x[:, None, :] - x[None, :, :]) ** 2, -1)  # [n, n]
    return tf.exp(-0.5 * sqdist) @ v  # [n, k]


class CountRuns(GraphPass):
    """Counts how often the pass pipeline runs (the PassManager calls it once per round)."""

    name, stage = "count_runs", "cleanup"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, graph: Graph, config: Config) -> PassResult:
        self.calls += 1
        return PassResult(graph, False, [])


def _counted(fn: Callable[..., Any], config: Config) -> tuple[tfmem.TfmemFunction, CountRuns]:
    from rewrites import passes_for

    counter = CountRuns()
    return tfmem.TfmemFunction(fn, config=config, passes=[counter, *passes_for(config)]), counter


def _max_rel_err(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


# --- in this process ----------------------------------------------------------------


def test_no_replica_outside_strategy_run() -> None:
    assert current_replica() is None
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert current_replica() is None  # cross-replica context


def test_one_device_strategy_rewrites_per_replica_and_equals_stock(rng: np.random.Generator) -> None:
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    x, v = tf.constant(rng.normal(size=(600, 3))), tf.constant(rng.normal(size=(600, 2)))
    wrapped = tfmem.function(kernel_times, config=SPLIT)
    got = tf.function(lambda x, v: strategy.run(wrapped, (x, v)))(x, v)
    assert _max_rel_err(got, kernel_times(x, v)) < 1e-12
    [report] = wrapped.reports()
    assert report.status == "rewritten" and report.splits
    assert report.replica is not None and report.replica.strategy == "OneDeviceStrategy"
    assert report.replica.replica_id == 0 and report.replica.num_replicas == 1
    assert report.config.memory_budget == SPLIT.memory_budget
    assert "OneDeviceStrategy replica 0 of 1" in str(report) and "per-replica budget 3.8 MiB (config)" in str(report)


def test_replica_budget_prefers_the_configs_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "1")
    monkeypatch.setenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", "1024")
    monkeypatch.setattr("tfmem.budget._memory_info", lambda device: (0, 0))
    replica = Replica("MirroredStrategy", 1, 2, "/job:localhost/replica:0/task:0/device:CPU:1",
                      ("/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"))
    # Logical CPU devices share the process's allocator: each gets its share of the limit.
    budget = replica_budget(Config(), replica)
    assert budget is not None and budget.nbytes == int(1024 * MiB * CPU_SAFETY_FRACTION) // 2
    assert "shared by 2 replicas" in budget.source
    assert replica_budget(SPLIT, replica).nbytes == SPLIT.memory_budget  # per replica already
    # A threshold adds splits and keeps the replica's share as its bound; `off` opts out.
    assert replica_budget(Config(tensor_size_threshold="1MB"), replica) == budget
    assert replica_budget(Config(tensor_size_threshold="1MB", memory_budget="off"), replica) is None
    monkeypatch.delenv("TF_CPU_BFC_MEM_LIMIT_IN_MB")
    assert replica_budget(Config(), replica) is None


def test_function_spanning_devices_falls_back(caplog: pytest.LogCaptureFixture, rng: np.random.Generator) -> None:
    def two_devices(x: tf.Tensor) -> tf.Tensor:
        with tf.device("/cpu:0"):
            a = x * 2.0
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:1"):  # placed only when run
            b = x + 1.0
        return a, b

    wrapped = tfmem.function(two_devices)
    x = tf.constant(rng.normal(size=(4,)))
    report = wrapped.report(x)
    assert report.status == "fallback"
    assert "places ops on 2 devices" in report.reason and "strategy.run" in report.reason


def test_gradients_only_for_watched_arguments_stay_fresh(rng: np.random.Generator) -> None:
    """An outer tape watching w only: the data's gradient is never computed, and new data
    on the next call (a captured tensor would be stale) gives the new gradient."""
    w = tf.constant(rng.normal(size=(3,)))
    wrapped = tfmem.function(lambda x, w: tf.reduce_sum(kernel_times(x * w, x)), config=SPLIT)
    for step in range(2):
        x = tf.constant(rng.normal(size=(500, 3)))
        grads = []
        for fn in (wrapped, tf.function(wrapped.python_function)):
            with tf.GradientTape() as tape:
                tape.watch(w)
                loss = fn(x, w)
            grads.append(tape.gradient(loss, w))
        assert _max_rel_err(grads[0], grads[1]) < 1e-10, step
    [forward] = wrapped._signatures.values()
    [backward] = forward.backward.values()
    [vjp] = backward._signatures.values()
    assert vjp.report.status == "rewritten"
    assert len(vjp.traced.captured.outputs) == 1  # the vector-Jacobian product returns w's gradient only


# --- on two logical CPU devices, in a fresh process ------------------------------------


def two_cpu_scenarios() -> dict[str, Any]:
    """Every two-replica scenario's results (or traceback); run in a fresh process."""
    return run_scenarios(SCENARIOS, tf.distribute.MirroredStrategy(split_cpu(2)))


def _shards(strategy: tf.distribute.Strategy, n: int = 600) -> tuple[Any, Any, list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 3)) for _ in range(2)]
    vs = [rng.normal(size=(n, 2)) for _ in range(2)]
    x = strategy.experimental_distribute_values_from_function(lambda c: tf.constant(xs[c.replica_id_in_sync_group]))
    v = strategy.experimental_distribute_values_from_function(lambda c: tf.constant(vs[c.replica_id_in_sync_group]))
    return x, v, xs, vs


def _describe(report: tfmem.Report) -> dict[str, Any]:
    return {"function": report.function_name, "status": report.status, "reason": report.reason,
            "replica": str(report.replica),
            "replica_id": report.replica.replica_id if report.replica else None,
            "device": report.replica.device if report.replica else None,
            "budget": report.budget.nbytes if report.budget else None, "budget_note": str(report.budget),
            "splits": len(report.splits),
            "peak_after": report.memory_after.peak_bytes if report.memory_after else None,
            "text": str(report)}


def _kernel_in_tf_function(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    x, v, xs, vs = _shards(strategy)
    single, single_count = _counted(kernel_times, SPLIT)
    single(tf.constant(xs[0]), tf.constant(vs[0]))
    # The same allocator peak for both: a higher one can ask for a plan with more room
    # (`Budget.fits_unchecked`), and with it another run of the passes.
    tf.config.experimental.reset_memory_stats("CPU:0")
    wrapped, count = _counted(kernel_times, SPLIT)
    run = tf.function(lambda x, v: strategy.run(wrapped, (x, v)))
    got = strategy.experimental_local_results(run(x, v))
    # Where the step places each replica's call of the rewritten function.
    calls = [op for op in run.get_concrete_function(x, v).graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall") and "tfmem_" in op.get_attr("f").name]
    return {"errors": [_max_rel_err(g, kernel_times(tf.constant(a), tf.constant(b))) for g, a, b in zip(got, xs, vs)],
            "devices": [op.device for op in calls], "reports": [_describe(r) for r in wrapped.reports()],
            "pipeline_runs": count.calls, "single_device_pipeline_runs": single_count.calls}


def _kernel_eager(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    x, v, xs, vs = _shards(strategy)
    wrapped = tfmem.function(kernel_times, config=SPLIT)
    got = strategy.experimental_local_results(strategy.run(wrapped, (x, v)))
    return {"errors": [_max_rel_err(g, kernel_times(tf.constant(a), tf.constant(b))) for g, a, b in zip(got, xs, vs)],
            "reports": [_describe(r) for r in wrapped.reports()]}


def _device_budget(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    x, v, _, _ = _shards(strategy)
    wrapped = tfmem.function(kernel_times, config={})  # no budget: each replica's share of the device
    tf.function(lambda x, v: strategy.run(wrapped, (x, v)))(x, v)
    return {"reports": [_describe(r) for r in wrapped.reports()]}


def _explain(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    x, v, _, _ = _shards(strategy)
    wrapped = tfmem.function(kernel_times, config=SPLIT)
    reports = strategy.experimental_local_results(strategy.run(wrapped.explain, (x, v)))
    return {"reports": [_describe(r) | {"xla_before": r.xla_bytes_before, "xla_after": r.xla_bytes_after}
                        for r in reports]}


def _training(strategy: tf.distribute.Strategy, use_tfmem: bool, sync_inside: bool) -> dict[str, Any]:
    """Three SGD steps on a mirrored lengthscale; the loss reads it through a (tfmem) kernel.

    Each replica differentiates its loss; `apply_gradients` all-reduces (sums) the
    gradients, and the loss is all-reduced for reporting. With `sync_inside`, the whole
    step, `apply_gradients` included, is the wrapped function.
    """
    x, v, _, _ = _shards(strategy, n=400)
    with strategy.scope():
        lengthscale = tf.Variable([1.0, 0.7, 1.3], dtype=tf.float64)
        optimizer = tf.keras.optimizers.SGD(1e-4)
        optimizer.build([lengthscale])

    def loss_fn(x: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(kernel_times(x / lengthscale, v) ** 2)

    loss_in_step = tfmem.function(loss_fn, config=SPLIT) if use_tfmem and not sync_inside else loss_fn

    def step(x: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_in_step(x, v)
        optimizer.apply_gradients([(tape.gradient(loss, lengthscale), lengthscale)])
        return tf.distribute.get_replica_context().all_reduce("SUM", loss)

    replica_fn = tfmem.function(step, config=SPLIT) if use_tfmem and sync_inside else step
    run = tf.function(lambda x, v: strategy.reduce("MEAN", strategy.run(replica_fn, (x, v)), axis=None))
    losses = [float(run(x, v)) for _ in range(3)]
    wrapped = [f for f in (loss_in_step, replica_fn) if isinstance(f, tfmem.TfmemFunction)]
    return {"losses": losses, "lengthscale": lengthscale.numpy().tolist(),
            "reports": [_describe(r) for f in wrapped for r in f.reports()]}


def _training_compared(strategy: tf.distribute.Strategy, sync_inside: bool) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _training(strategy, use_tfmem=True, sync_inside=sync_inside)
    want = _training(strategy, use_tfmem=False, sync_inside=sync_inside)
    return {"got": got, "want": want,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, tfmem.TfmemWarning)]}


def _sync_on_read_update(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    x, v, _, _ = _shards(strategy)
    with strategy.scope():
        total = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                            synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM)

    def accumulate(x: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
        out = kernel_times(x, v)
        total.assign_add(tf.reduce_sum(out))  # each replica adds to its own copy
        return out

    wrapped = tfmem.function(accumulate, config=SPLIT)
    run = tf.function(lambda x, v: strategy.run(wrapped, (x, v)))
    outs = [strategy.experimental_local_results(run(x, v)) for _ in range(2)]
    expected = sum(float(tf.reduce_sum(o)) for out in outs for o in out)
    return {"total": float(total.read_value()), "expected": expected,
            "reports": [_describe(r) for r in wrapped.reports()]}


def _around_strategy_run(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    x, v, _, _ = _shards(strategy)

    def summed(x: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
        return tf.distribute.get_replica_context().all_reduce("SUM", kernel_times(x, v))

    def everything(x: Any, v: Any) -> Any:
        return strategy.run(summed, (x, v))

    wrapped = tfmem.function(everything, config=SPLIT)
    got = strategy.experimental_local_results(wrapped(x, v))
    want = strategy.experimental_local_results(tf.function(everything)(x, v))
    return {"errors": [_max_rel_err(g, w) for g, w in zip(got, want)],
            "reports": [_describe(r) for r in wrapped.reports()]}


SCENARIOS: dict[str, Callable[[tf.distribute.Strategy], dict[str, Any]]] = {
    "kernel_in_tf_function": _kernel_in_tf_function,
    "kernel_eager": _kernel_eager,
    "device_budget": _device_budget,
    "explain": _explain,
    "training_tfmem_loss": lambda s: _training_compared(s, sync_inside=False),
    "training_sync_inside": lambda s: _training_compared(s, sync_inside=True),
    "sync_on_read_update": _sync_on_read_update,
    "around_strategy_run": _around_strategy_run,
}


@pytest.fixture(scope="module")
def two_cpus() -> dict[str, Any]:
    # A 1024 MiB process limit: each of the two logical CPU devices' share is 512 MiB.
    result = tfmem.run_isolated("tests.tfmem.test_distribute:two_cpu_scenarios", memory_limit_mb=1024,
                                timeout=1800)
    assert result.ok, result.error
    return result.value


def test_kernel_inside_strategy_run_splits_per_replica_and_equals_stock(two_cpus: dict[str, Any]) -> None:
    outcome = scenario_outcome(two_cpus, "kernel_in_tf_function")
    assert max(outcome["errors"]) < 1e-12
    assert [d.endswith(f"CPU:{i}") for i, d in enumerate(outcome["devices"])] == [True, True]
    reports = outcome["reports"]
    assert [r["replica_id"] for r in reports] == [0, 1]
    assert [r["device"].endswith(f"CPU:{i}") for i, r in enumerate(reports)] == [True, True]
    for report in reports:
        assert report["status"] == "rewritten" and report["splits"] >= 1
        assert report["budget"] == SPLIT.memory_budget and report["peak_after"] <= SPLIT.memory_budget
        assert "per-replica budget 3.8 MiB (config)" in report["text"]
    # The two replicas' traces are identical: the passes ran once, as for one device.
    assert outcome["pipeline_runs"] == outcome["single_device_pipeline_runs"] > 0


def test_eager_strategy_run(two_cpus: dict[str, Any]) -> None:
    outcome = scenario_outcome(two_cpus, "kernel_eager")
    assert max(outcome["errors"]) < 1e-12
    assert [(r["status"], r["replica_id"]) for r in outcome["reports"]] == [("rewritten", 0), ("rewritten", 1)]


def test_device_budget_is_the_replicas_share_of_the_process_limit(two_cpus: dict[str, Any]) -> None:
    reports = scenario_outcome(two_cpus, "device_budget")["reports"]
    # 90% of the 1024 MiB limit less what the process holds, halved between the replicas.
    assert all(0.8 * 512 * MiB < r["budget"] <= CPU_SAFETY_FRACTION * 512 * MiB for r in reports), reports
    assert all("per-replica budget" in r["text"] and "shared by 2 replicas" in r["text"] for r in reports)


def test_explain_inside_strategy_run_reports_each_replica(two_cpus: dict[str, Any]) -> None:
    reports = scenario_outcome(two_cpus, "explain")["reports"]
    assert [r["replica_id"] for r in reports] == [0, 1]
    for report in reports:
        assert report["xla_after"] < report["xla_before"]
        assert "MirroredStrategy replica" in report["text"] and "XLA planned" in report["text"]


@pytest.mark.parametrize("name", ["training_tfmem_loss", "training_sync_inside"])
def test_training_with_mirrored_variables_equals_stock(two_cpus: dict[str, Any], name: str) -> None:
    outcome = scenario_outcome(two_cpus, name)
    got, want = outcome["got"], outcome["want"]
    assert _max_rel_err(got["losses"], want["losses"]) < 1e-10
    assert _max_rel_err(got["lengthscale"], want["lengthscale"]) < 1e-12
    assert got["lengthscale"] != [1.0, 0.7, 1.3]  # the steps moved it
    if name == "training_sync_inside":
        # apply_gradients and all_reduce are merge_calls: TF cannot trace them in a nested
        # function, so the step runs inline, unchanged, and says so naming the strategy.
        assert [r["status"] for r in got["reports"]] == ["fallback"]
        assert "cannot be traced as a nested function inside MirroredStrategy.run" in got["reports"][0]["reason"]
        assert "merge_call" in got["reports"][0]["reason"]
        assert any("under MirroredStrategy replica" in w and "merge_call" in w for w in outcome["warnings"])
    else:
        # Each replica's loss and, for the outer tape, its vector-Jacobian product.
        assert [(r["function"], r["status"], r["replica_id"]) for r in got["reports"]] == [
            ("loss_fn", "rewritten", 0), ("loss_fn_vjp", "rewritten", 0),
            ("loss_fn", "rewritten", 1), ("loss_fn_vjp", "rewritten", 1)]
        assert outcome["warnings"] == []


def test_sync_on_read_variable_updated_per_replica(two_cpus: dict[str, Any]) -> None:
    outcome = scenario_outcome(two_cpus, "sync_on_read_update")
    assert abs(outcome["total"] - outcome["expected"]) <= 1e-10 * abs(outcome["expected"])
    assert [r["status"] for r in outcome["reports"]] == ["rewritten", "rewritten"]


def test_function_calling_strategy_run_falls_back_and_equals_stock(two_cpus: dict[str, Any]) -> None:
    outcome = scenario_outcome(two_cpus, "around_strategy_run")
    assert max(outcome["errors"]) < 1e-12
    [report] = outcome["reports"]
    assert report["status"] == "fallback" and report["replica"] == "None"
    assert "places ops on 2 devices" in report["reason"] and "strategy.run" in report["reason"]
