"""`tfmem compare`: the quick sweep end to end, and bad input as one clear line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpflow_integration.compare import main


def test_quick_sweep_end_to_end(tmp_path, capsys):
    status = main(["tfmem compare", "--quick", "--output_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    for heading in ("M", "method", "status", "peak memory", "step time", "test RMSE", "test NLPD"):
        assert heading in out
    assert "Largest M within" in out

    document = json.loads((tmp_path / "compare.json").read_text())
    trials = document["trials"]
    methods = {"tf_function", "tf_function_jit", "tfmem"}
    assert {t["method"] for t in trials} == methods
    assert all(t["status"] in ("ok", "oom", "skipped") for t in trials), trials
    smallest = [t for t in trials if t["num_inducing"] == min(t["num_inducing"] for t in trials)]
    assert all(t["status"] == "ok" and t["peak_bytes"] > 0 for t in smallest)
    # The same model and data give the same fit, whichever way it is compiled.
    rmses = [t["value"]["rmse"] for t in smallest]
    assert max(rmses) - min(rmses) < 1e-6 * max(rmses)
    assert set(document["oom_points"]) == methods
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_main(capsys, *args: str) -> tuple[int, str]:
    status = main(["tfmem compare", *args])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--model", "gpr"], "model not supported"),
    (["--quick", "--memory_budget", "1kB"], "smaller than the data itself"),
    (["--quick", "--inducing_points", "20,10"], "increasing"),
    (["--quick", "--methods", "tf_function,pytorch"], "methods"),
    (["--quick", "--dataset", "mnist"], "unknown data set"),
    (["--no_such_flag"], "no_such_flag"),
    (["stray"], "unexpected argument"),
])
def test_bad_flags(capsys, tmp_path, args, message):
    status, err = run_main(capsys, *args, "--output_dir", str(tmp_path))
    assert status == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unreadable_and_invalid_configs(capsys, tmp_path):
    status, err = run_main(capsys, "--config", str(tmp_path / "missing.yaml"))
    assert status == 2 and "cannot be read" in err and len(err.strip().splitlines()) == 1

    bad = tmp_path / "bad.yaml"
    bad.write_text("compare:\n  memory_budget: [\n")
    status, err = run_main(capsys, "--config", str(bad))
    assert status == 2 and "not valid YAML" in err and len(err.strip().splitlines()) == 1

    bad.write_text("tfmem:\n  tensor_size_threshold: 1GB\n  tensor_split_size: 2GB\n")
    status, err = run_main(capsys, "--config", str(bad))
    assert status == 2 and "tensor_split_size" in err


def test_help(capsys):
    assert main(["tfmem compare", "--help"]) == 0
    assert "--memory_budget" in capsys.readouterr().out


def test_runs_as_a_module_and_fails_cleanly():
    proc = subprocess.run([sys.executable, "-m", "gpflow_integration.compare", "--model", "svgp"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "model not supported" in proc.stderr and "Traceback" not in proc.stderr
