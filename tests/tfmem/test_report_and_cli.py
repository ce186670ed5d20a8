"""Report rendering and export, explain, and the `tfmem` command line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

import tfmem
from tfmem import cli
from tfmem.examples import kernel_matmul, kernel_matmul_inputs


def test_explain_reports_memory_and_xla_bytes(tmp_path: Path) -> None:
    x, v = kernel_matmul_inputs(n=300)
    report = tfmem.explain(kernel_matmul, x, v)
    assert report.status in ("rewritten", "unchanged")
    assert report.memory_before.peak_bytes >= 300 * 300 * 3 * 8  # the naive [n, n, d] difference
    assert report.xla_bytes_before > 0 and report.xla_bytes_after > 0
    assert report.nodes_before > 0 and report.pipeline_seconds > 0
    text = str(report)
    assert "kernel_matmul(float64[300, 3], float64[300, 16])" in text
    assert "static peak" in text and "XLA planned" in text
    path = report.write_pbtxt(tmp_path / "rewritten.pbtxt")
    assert "node {" in Path(path).read_text()
    report.write_tensorboard(tmp_path / "logs")
    assert any(name.startswith("events.out") for name in os.listdir(tmp_path / "logs"))


def test_fallback_report_says_why() -> None:
    wrapped = tfmem.function(tf.exp, input_signature=[tf.TensorSpec([None], tf.float32)])
    report = wrapped.report(tf.ones([2]))
    assert report.status == "fallback" and "dynamic shape" in report.reason
    assert "fallback" in str(report)
    with pytest.raises(ValueError, match="no rewritten graph"):
        report.write_pbtxt("unused.pbtxt")


def test_cli_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["tfmem", "explain", "tfmem.examples:kernel_matmul", "--noxla",
                     f"--pbtxt={tmp_path / 'g.pbtxt'}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tfmem report for kernel_matmul" in out and (tmp_path / "g.pbtxt").exists()


@pytest.mark.parametrize("argv, message", [
    (["explain", "no_such_module:f"], "cannot import module"),
    (["explain", "tfmem.examples:nothing"], "has no 'nothing'"),
    (["explain", "tfmem.examples"], "MODULE:NAME"),
    (["explain", "tfmem.examples:allocate"], "pass --inputs"),
    (["config", "--config=/no/such/file.yaml"], "cannot be read"),
    (["explain", "tfmem.examples:kernel_matmul", "--bogus"], "bogus"),
])
def test_cli_bad_input_is_one_clear_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tfmem", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_config_prints_effective_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tensor_size_threshold: 1GiB\n")
    assert cli.main(["tfmem", "config", f"--config={path}"]) == 0
    assert "tensor_size_threshold: 1073741824" in capsys.readouterr().out


def test_console_script_usage() -> None:
    proc = subprocess.run([sys.executable, "-m", "tfmem.cli"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "tfmem explain MODULE:FUNCTION" in proc.stderr
