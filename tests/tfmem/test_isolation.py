"""`run_isolated` time limits: scaled by the child's measured start-up, reported as "timeout"."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tfmem.isolation import REFERENCE_STARTUP_SECONDS, _wait, run_isolated


def test_a_trial_past_its_limit_is_a_timeout_not_an_error_or_oom() -> None:
    result = run_isolated("time:sleep", 3600, timeout=1.0)
    assert result.status == "timeout" and not result.ok and not result.oom
    assert result.error.startswith("no result within")
    # The limit after start-up is the timeout stretched by how slow start-up was.
    assert result.startup_seconds > 0
    assert result.time_limit_seconds == pytest.approx(max(1.0, result.startup_seconds / REFERENCE_STARTUP_SECONDS))


def test_a_start_up_past_its_limit_is_a_timeout_too(tmp_path: Path) -> None:
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    startup, limit, why = _wait(stuck, tmp_path / "never-written", timeout=600.0, startup_limit=1.0)
    assert stuck.returncode is not None  # killed
    assert (startup, limit, why) == (None, None, "TensorFlow did not start within 1 s")


def test_results_carry_the_start_up_and_the_limit_applied() -> None:
    limited = run_isolated("time:sleep", 0, timeout=600.0)
    assert limited.status == "ok" and limited.startup_seconds > 0
    assert limited.time_limit_seconds >= 600.0
    unlimited = run_isolated("time:sleep", 0, timeout=None)
    assert unlimited.status == "ok" and unlimited.time_limit_seconds is None


def test_on_a_gpu_machine_a_trial_runs_on_a_memory_limited_logical_gpu() -> None:
    # No GPU here: TensorFlow's device calls are stubbed to check what a trial would do.
    import types

    from tfmem.isolation import _limit_gpu

    calls = []
    config = types.SimpleNamespace(
        list_physical_devices=lambda kind: ["gpu0", "gpu1"] if kind == "GPU" else [],
        set_logical_device_configuration=lambda device, logical: calls.append((device, logical)),
        LogicalDeviceConfiguration=lambda memory_limit: ("logical", memory_limit))
    stub = types.SimpleNamespace(config=config)
    assert _limit_gpu(stub, 512) == "GPU:0"
    assert calls == [("gpu0", [("logical", 512)])]
    assert _limit_gpu(stub, None) == "GPU:0" and len(calls) == 1  # no limit: the GPU as it is
    cpu_only = types.SimpleNamespace(config=types.SimpleNamespace(list_physical_devices=lambda kind: []))
    assert _limit_gpu(cpu_only, 512) == "CPU:0"
