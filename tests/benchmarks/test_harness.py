"""End-to-end check of the benchmark harness: `--quick` into a temporary directory.

The quick mode runs kernel_matmul under a 64 MiB allocator limit, where an n=4000
float64 kernel matrix (128 MB) must run out of memory under stock TensorFlow and XLA
while tfmem (threshold 8MB) runs it; then it times XLA and tfmem and writes the report.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests import background

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@background.job("harness_quick")
def harness_quick() -> tuple[dict, str]:
    """`python -m benchmarks.harness --quick` into a fresh directory (runs beside the other tests).

    No time limit but the hang guard's: the harness's own time caps scale with the machine's load.
    """
    out_dir = background.scratch_directory("tfmem-harness-quick-")
    out = os.path.join(out_dir, "results.json")
    background.run_command([sys.executable, "-m", "benchmarks.harness", "--quick", f"--out={out}"], cwd=REPO)
    with open(out) as f:
        return json.load(f), out_dir


@pytest.fixture(scope="module")
def quick_run() -> tuple[dict, str]:
    return background.result("harness_quick")


@pytest.mark.background("harness_quick")
def test_quick_run_detects_oom_and_ok(quick_run: tuple[dict, str]) -> None:
    data, _ = quick_run
    statuses = {(t["method"], t["size"]): t["status"] for t in data["trials"]}
    assert statuses[("tf", 4000)] == "oom"
    assert statuses[("xla", 4000)] == "oom"
    assert statuses[("tfmem", 4000)] == "ok"
    assert all(t["status"] in ("ok", "oom") for t in data["trials"]), data["trials"]
    tfmem_trial = next(t for t in data["trials"] if (t["method"], t["size"]) == ("tfmem", 4000))
    assert tfmem_trial["peak_bytes"] < 64 * 2**20
    assert tfmem_trial["splits"] >= 1


@pytest.mark.background("harness_quick")
def test_quick_run_oom_points_and_ratios(quick_run: tuple[dict, str]) -> None:
    data, _ = quick_run
    points = {p["method"]: p for p in data["oom_points"]}
    assert points["xla"]["stop"] == "oom" and points["xla"]["largest_ok"] == 2000
    assert points["tfmem"]["label"] == "≥ 4000 (size cap)" and points["tfmem"]["lower_bound"]
    assert points["tf"]["largest_ok"] is None and points["tf"]["stop"] == "none_ok"
    (ratio,) = data["ratios"]
    assert ratio["size_ratio"] == pytest.approx(2.0)
    assert ratio["memory_units_ratio"] == pytest.approx(4.0)  # n² growth
    (speed,) = data["speed"]
    assert speed["ratios"]["tfmem/xla"] > 0


@pytest.mark.background("harness_quick")
def test_quick_run_writes_report(quick_run: tuple[dict, str]) -> None:
    _, out_dir = quick_run
    with open(os.path.join(out_dir, "RESULTS.md")) as f:
        text = f.read()
    assert "## kernel_matmul" in text and "≥ 4000 (size cap)" in text and "tfmem/xla" in text
    png = os.path.join(out_dir, "plots", "kernel_matmul.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_step_timing_keeps_calling_until_min_seconds() -> None:
    from benchmarks.cases import _time_steps

    calls = []
    start = time.perf_counter()
    timed = _time_steps(lambda: (calls.append(1), time.sleep(0.01)), repeats=3, min_seconds=0.1)
    # It went on past the 3 repeats until the calls had lasted 0.1 s, however slow the machine.
    assert timed["steps_timed"] == len(calls) >= 3
    assert time.perf_counter() - start >= 0.1
    assert timed["step_s"] > 0.009  # each call sleeps 10 ms (no upper bound: the machine may be busy)
    calls.clear()
    quick = _time_steps(lambda: calls.append(1), repeats=3, min_seconds=0.05)  # microseconds a call
    assert quick["steps_timed"] == len(calls) > 3
    assert _time_steps(lambda: calls.append(1), repeats=0, min_seconds=5.0) == {"step_s": None, "steps_timed": 0}


def test_speed_interleaves_methods_in_one_process() -> None:
    from benchmarks.cases import run_speed

    timed = run_speed("kernel_matmul", 300, ["xla", "tfmem", "no_such_method"], threshold="100kB",
                      repeats=2, min_seconds=0.0)
    assert timed["no_such_method"]["status"] == "error" and "no_such_method" in timed["no_such_method"]["error"]
    xla, tfmem_ = timed["xla"], timed["tfmem"]
    assert xla["status"] == tfmem_["status"] == "ok"
    assert xla["steps_timed"] == tfmem_["steps_timed"] == 2  # one call of each per round
    assert xla["step_s"] > 0 and tfmem_["step_s"] > 0
    assert tfmem_["digest"] == pytest.approx(xla["digest"], rel=1e-9)
