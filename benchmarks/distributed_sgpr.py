"""Data-parallel SGPR under a per-device memory budget: one device runs out, two fit.

GPflow SGPR (SE kernel, float64), loss and gradients of all N points, through
`gpflow_integration.DataParallelSGPR`: each replica sums its half of the data inside
tfmem's split loops, under tfmem's per-replica budget, and the strategy all-reduces.

What is measured (every trial in a fresh process, `tfmem.run_isolated`):

1. **Out of memory on one device, fits on two** at `--n-big` points with a per-device
   budget of `--budget-mb` MiB (tfmem's per-replica `memory_budget` is the same number):
   - one device: MirroredStrategy over /cpu:0, process limit = budget → expected "oom";
   - two logical CPU devices in one process. They share one BFC allocator (TensorFlow's
     `get_memory_info` reports the same numbers for CPU:0 and CPU:1, and CPU logical
     devices take no `memory_limit`), so the process limit is 2 × budget: the sum of the
     per-device budgets, not a limit on each;
   - two workers (MultiWorkerMirroredStrategy on localhost, `TF_CONFIG`), one CPU device
     and one process each, each process limited to the budget: a real per-device limit.
2. **Equality**: the two-device and two-worker results against stock GPflow (`model.
   training_loss()` and its gradients, one device, no tfmem, no limit) at `--n-big`,
   and one and two replicas against stock GPflow at `--n-small`.
3. **Speed**: one process with two logical CPU devices times loss-and-gradient calls of
   one replica and of two replicas interleaved, at `--n-small`; the ratio is two/one. The
   logical devices share this machine's cores, so this measures overlap, not more compute.

The model itself is built on its first M points only: `DataParallelSGPR(data=...)`
shards the full data, and a model built on all N would hold them on every device.

Why one device runs out: tfmem splits the [M, N] tensors of the SGPR statistics and of
their gradient into chunks of at most the threshold, but today's split pass leaves the
*gradient's* [M, N] tensors whole once the device's [N] vectors (noise variance, kernel
diagonal, residuals: 8·N bytes each) are themselves over the threshold — they come from
ops it cannot split (Fill, Tile, StridedSliceGrad, ops with control inputs), and the
regions around them fail. With the 16 MiB threshold that happens above 2.1M points on
a device: one device with N = 3.2M needs several GiB, each of two devices with 1.6M
points stays in a few hundred MiB. The per-device memory of the split program is not
proportional to the data (the chunk buffers are a large fixed part), so the data-
parallel saving is this: each device's program stays in the regime tfmem can split.

Run:
    python -m benchmarks.distributed_sgpr          # ≈ 10 min on 2 cores → benchmarks/distributed_sgpr.json, DISTRIBUTED_SGPR.md
    python -m benchmarks.distributed_sgpr --quick  # smaller sizes and budget (a smoke test), to a temp dir
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfmem.isolation import IsolatedResult, run_isolated  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DIMENSIONS = 3
TARGET = "benchmarks.distributed_sgpr"


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """N points of a smooth function of 3 inputs with noise: X [n, 3], Y [n, 1]."""
    rng = np.random.default_rng(seed)
    X = rng.uniform(-3.0, 3.0, size=(n, DIMENSIONS))  # noqa: N806
    Y = np.sin(X[:, :1]) * np.cos(X[:, 1:2]) + 0.2 * X[:, 2:] + 0.1 * rng.normal(size=(n, 1))  # noqa: N806
    return X, Y


def make_model(X: np.ndarray, Y: np.ndarray, inducing: int) -> Any:  # noqa: N803
    """SGPR with an ARD SE kernel on inducing points from a fixed grid-free draw."""
    import gpflow

    Z = np.random.default_rng(1).uniform(-3.0, 3.0, size=(inducing, DIMENSIONS))  # noqa: N806
    return gpflow.models.SGPR((X, Y), gpflow.kernels.SquaredExponential(lengthscales=[1.0] * DIMENSIONS),
                              inducing_variable=Z, noise_variance=0.1)


def _strategy(replicas: int, multi_worker: bool) -> Any:
    import tensorflow as tf

    from tfmem.distribute import split_cpu

    if multi_worker:
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.MirroredStrategy(split_cpu(replicas) if replicas > 1 else ["/cpu:0"])


def _loss_and_gradients(sgpr: Any) -> tuple[float, list[np.ndarray]]:
    loss, grads = sgpr.loss_and_gradients()
    return float(loss), [g.numpy() for g in grads]


def sgpr_trial(n: int, replicas: int, inducing: int, budget_mb: int, threshold: str, steps: int,
               multi_worker: bool = False) -> dict[str, Any]:
    """Data-parallel loss and gradients: the first call, then `steps` timed calls (run in a fresh process)."""
    import tensorflow as tf

    from gpflow_integration import DataParallelSGPR

    strategy = _strategy(replicas, multi_worker)
    X, Y = make_data(n)  # noqa: N806 - host memory; only the shards go to the devices
    with strategy.scope():
        model = make_model(X[:inducing], Y[:inducing], inducing)
    sgpr = DataParallelSGPR(model, strategy, data=(X, Y),
                            config={"tensor_size_threshold": threshold, "memory_budget": f"{budget_mb}MiB"})
    start = time.perf_counter()
    loss, grads = _loss_and_gradients(sgpr)
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _loss_and_gradients(sgpr)
        times.append(time.perf_counter() - start)
    return {"loss": loss, "grads": grads, "first_call_s": first, "step_s": statistics.median(times),
            "replicas": strategy.num_replicas_in_sync,
            "static_peaks": [(r.function_name, r.replica.replica_id if r.replica else None,
                              r.memory_after.peak_bytes if r.memory_after else None) for r in sgpr.reports()],
            "bfc_peak": int(tf.config.experimental.get_memory_info("CPU:0")["peak"])}


def stock_trial(n: int, inducing: int) -> dict[str, Any]:
    """Stock GPflow on one device: `model.training_loss()` and its gradients under `tf.function`."""
    import tensorflow as tf

    model = make_model(*make_data(n), inducing)

    @tf.function
    def loss_and_gradients() -> tuple[tf.Tensor, list[tf.Tensor]]:
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return loss, tape.gradient(loss, model.trainable_variables)

    loss, grads = loss_and_gradients()
    return {"loss": float(loss), "grads": [g.numpy() for g in grads]}


def speed_trial(n: int, inducing: int, budget_mb: int, threshold: str, rounds: int) -> dict[str, Any]:
    """One and two replicas in one process (two logical CPUs), calls interleaved; median times."""
    import tensorflow as tf

    from gpflow_integration import DataParallelSGPR
    from tfmem.distribute import split_cpu

    devices = split_cpu(2)
    X, Y = make_data(n)  # noqa: N806
    config = {"tensor_size_threshold": threshold, "memory_budget": f"{budget_mb}MiB"}
    runs: dict[str, Any] = {}
    for name, strategy in (("one", tf.distribute.MirroredStrategy(devices[:1])),
                           ("two", tf.distribute.MirroredStrategy(devices))):
        with strategy.scope():
            model = make_model(X[:inducing], Y[:inducing], inducing)
        runs[name] = DataParallelSGPR(model, strategy, data=(X, Y), config=config)
    results = {name: _loss_and_gradients(sgpr) for name, sgpr in runs.items()}  # compiles
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(rounds):
        for name in (list(runs) if i % 2 == 0 else list(reversed(runs))):  # alternate who goes first
            start = time.perf_counter()
            _loss_and_gradients(runs[name])
            times[name].append(time.perf_counter() - start)
    return {name: {"loss": results[name][0], "grads": results[name][1], "step_s": statistics.median(times[name])}
            for name in runs}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def two_workers(n: int, inducing: int, budget_mb: int, threshold: str, steps: int) -> list[IsolatedResult]:
    """MultiWorkerMirroredStrategy: two processes on localhost, each limited to `budget_mb`."""
    cluster = {"worker": [f"localhost:{_free_port()}" for _ in range(2)]}
    results: list[IsolatedResult | None] = [None, None]

    def worker(index: int) -> None:
        env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        results[index] = run_isolated(f"{TARGET}:sgpr_trial", n, 1, inducing, budget_mb, threshold, steps,
                                      multi_worker=True, memory_limit_mb=budget_mb, env=env, timeout=3600)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None]


def rel_err(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Relative error of the loss and the largest over the gradients (each by its max |entry|)."""
    def err(a: Any, b: Any) -> float:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))

    return {"loss": err(got["loss"], want["loss"]),
            "grads": max(err(g, w) for g, w in zip(got["grads"], want["grads"]))}


def _short_error(error: str | None) -> str | None:
    """The allocator's "Out of memory while trying to allocate …" line, else the first line."""
    if not error:
        return None
    oom = re.search(r"(Out of memory[^\n]*|OOM when allocating[^\n]*)", error)
    return oom.group(1) if oom else error.strip().splitlines()[0][:300]


def _summary(result: IsolatedResult) -> dict[str, Any]:
    value = result.value if result.ok else {}
    return {"status": result.status, "error": _short_error(result.error),
            "bfc_peak": value.get("bfc_peak", result.peak_bytes), "step_s": value.get("step_s"),
            "first_call_s": value.get("first_call_s"), "static_peaks": value.get("static_peaks"),
            "seconds": result.seconds}


def _git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD")
    return commit + (" (with uncommitted changes)" if git("status", "--porcelain", "--", ".") else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    common = {"inducing": args.inducing, "budget_mb": args.budget_mb, "threshold": args.threshold}
    out: dict[str, Any] = {"commit": _git_commit(), "settings": vars(args) | {"dimensions": DIMENSIONS}}

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    log(f"one device, N={args.n_big}, limit {args.budget_mb} MiB")
    one = run_isolated(f"{TARGET}:sgpr_trial", args.n_big, 1, steps=1, memory_limit_mb=args.budget_mb,
                       timeout=3600, **common)
    log(f"two logical devices, N={args.n_big}, limit {2 * args.budget_mb} MiB for the process")
    two = run_isolated(f"{TARGET}:sgpr_trial", args.n_big, 2, steps=args.steps,
                       memory_limit_mb=2 * args.budget_mb, timeout=3600, **common)
    log(f"two workers, N={args.n_big}, limit {args.budget_mb} MiB each")
    workers = two_workers(args.n_big, args.inducing, args.budget_mb, args.threshold, args.steps)
    log(f"stock GPflow, N={args.n_big}, no limit")
    stock_big = run_isolated(f"{TARGET}:stock_trial", args.n_big, args.inducing, timeout=3600)
    out["oom_demo"] = {"n": args.n_big, "one_device": _summary(one), "two_devices": _summary(two),
                       "two_workers": [_summary(w) for w in workers], "stock": {"status": stock_big.status,
                                                                                "bfc_peak": stock_big.peak_bytes}}
    if stock_big.ok:
        if two.ok:
            out["oom_demo"]["two_devices"]["vs_stock"] = rel_err(two.value, stock_big.value)
        for summary, worker in zip(out["oom_demo"]["two_workers"], workers):
            if worker.ok:
                summary["vs_stock"] = rel_err(worker.value, stock_big.value)

    log(f"speed: one vs two replicas in one process, N={args.n_small}")
    speed = run_isolated(f"{TARGET}:speed_trial", args.n_small, args.inducing, args.budget_mb, args.threshold,
                         args.rounds, memory_limit_mb=2 * args.budget_mb, timeout=3600)
    stock_small = run_isolated(f"{TARGET}:stock_trial", args.n_small, args.inducing, timeout=3600)
    out["speed"] = {"n": args.n_small, "status": speed.status, "error": _short_error(speed.error)}
    if speed.ok:
        one_s, two_s = speed.value["one"]["step_s"], speed.value["two"]["step_s"]
        out["speed"] |= {"one_replica_step_s": one_s, "two_replicas_step_s": two_s, "ratio_two_over_one": two_s / one_s,
                         "two_vs_one": rel_err(speed.value["two"], speed.value["one"])}
        if stock_small.ok:
            out["speed"] |= {"one_vs_stock": rel_err(speed.value["one"], stock_small.value),
                             "two_vs_stock": rel_err(speed.value["two"], stock_small.value)}
    log("done")
    return out


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def render(out: dict[str, Any]) -> str:
    """DISTRIBUTED_SGPR.md from the JSON."""
    s, demo, speed = out["settings"], out["oom_demo"], out["speed"]
    lines = [
        "# Data-parallel SGPR under a per-device budget",
        "",
        f"Commit `{out['commit']}`; `python -m benchmarks.distributed_sgpr` "
        f"(N big {s['n_big']}, N small {s['n_small']}, M = {s['inducing']}, D = {s['dimensions']}, float64, "
        f"SE kernel; tfmem threshold {s['threshold']}, per-replica budget {s['budget_mb']} MiB).",
        "",
        f"## N = {demo['n']}: one device runs out, two fit",
        "",
        "| run | process limit | status | BFC peak (process) | static peak per replica (statistics, vjp) "
        "| first call | loss + gradients |",
        "|---|---|---|---|---|---|---|",
    ]

    def row(name: str, limit: str, summary: dict[str, Any]) -> str:
        peaks = summary.get("static_peaks") or []
        static = ", ".join(f"{fn.split('_')[-1]} r{rid}: {_mib(b)}" for fn, rid, b in peaks) or "-"
        status = summary["status"] + (f" ({summary['error']})" if summary["status"] != "ok" and
                                      summary.get("error") else "")
        first = "-" if summary.get("first_call_s") is None else f"{summary['first_call_s']:.1f} s"
        step = "-" if summary.get("step_s") is None else f"{summary['step_s']:.2f} s"
        return f"| {name} | {limit} | {status} | {_mib(summary.get('bfc_peak'))} | {static} | {first} | {step} |"

    budget = s["budget_mb"]
    lines.append(row("one device", f"{budget} MiB", demo["one_device"]))
    lines.append(row("two logical CPU devices, one process", f"{2 * budget} MiB (shared)", demo["two_devices"]))
    for i, worker in enumerate(demo["two_workers"]):
        lines.append(row(f"two workers (MultiWorkerMirroredStrategy), worker {i}", f"{budget} MiB", worker))
    lines += ["", "One device fails allocating its gradient program's buffers: with all N points its [N] "
              "vectors are over the threshold and tfmem's split pass leaves the gradient's [M, N] tensors "
              "whole (module docstring); with half the points each device's program is split.",
              "", f"Stock GPflow at this N (one device, no tfmem, no limit): {demo['stock']['status']}, "
              f"BFC peak {_mib(demo['stock']['bfc_peak'])}."]
    for name, summary in [("two logical devices", demo["two_devices"])] + [
            (f"worker {i}", w) for i, w in enumerate(demo["two_workers"])]:
        if "vs_stock" in summary:
            lines.append(f"- {name} vs stock GPflow: loss rel. err {summary['vs_stock']['loss']:.1e}, "
                         f"gradients {summary['vs_stock']['grads']:.1e}")
    lines += ["", f"## N = {speed['n']}: one vs two replicas (both fit)", ""]
    if speed["status"] == "ok":
        lines += [f"- loss + gradients: one replica {speed['one_replica_step_s']:.3f} s, two replicas "
                  f"{speed['two_replicas_step_s']:.3f} s; ratio two/one = {speed['ratio_two_over_one']:.2f} "
                  "(two logical devices on the same 2 cores)",
                  f"- two vs one replica: loss rel. err {speed['two_vs_one']['loss']:.1e}, gradients "
                  f"{speed['two_vs_one']['grads']:.1e}"]
        for key in ("one_vs_stock", "two_vs_stock"):
            if key in speed:
                lines.append(f"- {key.replace('_', ' ')} GPflow: loss rel. err {speed[key]['loss']:.1e}, "
                             f"gradients {speed[key]['grads']:.1e}")
    else:
        lines.append(f"- {speed['status']}: {speed['error']}")
    lines += ["", "On CPU the per-device budget is enforced three ways: tfmem rewrites each replica's program "
              "to the per-replica budget (static peaks above); two logical devices share one process limit of "
              "twice the budget (TensorFlow's CPU allocator is per process); the two-worker run gives each "
              "device its own process limited to the budget.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-big", type=int, default=3_200_000, help="points for the out-of-memory demonstration")
    parser.add_argument("--n-small", type=int, default=400_000, help="points for the speed and equality runs")
    parser.add_argument("--inducing", type=int, default=20, help="inducing points M")
    parser.add_argument("--budget-mb", type=int, default=512, help="per-device budget, MiB")
    # Today's split pass leaves the SGPR gradient's [M, N] tensors whole once a device's
    # [N] vectors exceed the threshold (8·N bytes > threshold): 16 MiB holds for 1.6M points
    # (a half of N big), not for 3.2M (all of it). See the module docstring.
    parser.add_argument("--threshold", default="16MiB", help="tfmem tensor_size_threshold")
    parser.add_argument("--steps", type=int, default=2, help="timed calls after the first, per big run")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls of each in the speed run")
    parser.add_argument("--quick", action="store_true", help="small sizes and a 112 MiB budget, to a temp dir")
    parser.add_argument("--out", default=HERE, help="directory for distributed_sgpr.json and DISTRIBUTED_SGPR.md")
    args = parser.parse_args()
    if args.quick:
        args.n_big, args.n_small, args.budget_mb, args.threshold = 800_000, 100_000, 112, "4MiB"
        args.steps, args.rounds, args.out = 1, 3, tempfile.mkdtemp(prefix="distributed-sgpr-")
    out = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "distributed_sgpr.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    report = render(out)
    with open(os.path.join(args.out, "DISTRIBUTED_SGPR.md"), "w") as f:
        f.write(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
