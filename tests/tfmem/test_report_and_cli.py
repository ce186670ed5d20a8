"""Report rendering and export, explain, and the `tfmem` command line."""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

import tfmem
from tfmem import cli
from tfmem.config import Config
from tfmem.examples import kernel_matmul, kernel_matmul_inputs

REPO = Path(__file__).resolve().parents[2]


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


def test_cli_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("TFMEM_")]:
        monkeypatch.delenv(name)
    code = cli.main(["tfmem", "explain", "tfmem.examples:kernel_matmul", "--noxla",
                     f"--pbtxt={tmp_path / 'g.pbtxt'}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tfmem report for kernel_matmul" in out and (tmp_path / "g.pbtxt").exists()
    # The default config splits nothing, and the output says why.
    assert "Note: no tensor_size_threshold or memory_budget is set, so no tensor was split" in out
    code = cli.main(["tfmem", "explain", "tfmem.examples:kernel_matmul", "--noxla",
                     f"--config={REPO / 'configs' / 'low-memory.yaml'}"])
    out = capsys.readouterr().out
    assert code == 0 and "Note:" not in out


@pytest.mark.parametrize("argv, message", [
    (["explain", "no_such_module:f"], "cannot import module"),
    (["explain", "tfmem.examples:nothing"], "has no 'nothing'"),
    (["explain", "tfmem.examples"], "MODULE:NAME"),
    (["explain", "tfmem.examples:allocate"], "pass --inputs"),
    (["config", "--config=/no/such/file.yaml"], "cannot be read"),
    (["explain", "tfmem.examples:kernel_matmul", "--bogus"], "bogus"),
    (["explain", "tfmem.examples:kernel_matmul", "--xla_heaps=3GiB"], "--xla_heaps: heap size: expected 1 B"),
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


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_cli_config_reads_every_bundled_file(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tfmem", "config", f"--config={REPO / 'configs' / name}"]) == 0
    expected = Config.from_yaml(REPO / "configs" / name)
    assert f"tensor_size_threshold: {expected.tensor_size_threshold}\n" in capsys.readouterr().out


def test_cli_config_error_is_one_line_with_did_you_mean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tfmem:\n  tensor_size_threshold: -64MB\n  jit_compil: true\n")
    assert cli.main(["tfmem", "config", f"--config={path}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"tfmem config: config file '{path}', section 'tfmem': unknown key 'jit_compil' "
                   "(did you mean 'jit_compile'?); known keys: " + ", ".join(Config.keys()) + "\n")
    path.write_text("tfmem:\n  tensor_size_threshold: -64MB\n")
    assert cli.main(["tfmem", "config", f"--config={path}"]) == 2
    assert "tensor_size_threshold: a size must not be negative, got '-64MB'" in capsys.readouterr().err


def test_help_lists_every_command_in_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tfmem", "--help"]) == 0
    out = capsys.readouterr().out
    commands = re.findall(r"^  (\S+)  +(\S.*)$", out, flags=re.M)
    assert [name for name, _ in commands] == ["explain", "config", *sorted(cli.plugin_commands())]
    assert "compare" in cli.plugin_commands()  # declared in setup.py, found through the metadata
    assert dict(commands)["compare"].startswith("GPflow SGPR under a memory budget")


def test_plugin_commands_come_from_entry_points(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    group = cli.ENTRY_POINT_GROUP
    fake = [importlib.metadata.EntryPoint("dumps", "json:dumps", group),
            importlib.metadata.EntryPoint("broken", "no_such_module_for_tfmem:main", group),
            importlib.metadata.EntryPoint("config", "json:loads", group)]  # cannot shadow a built-in
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [ep for ep in fake if ep.group == group])
    assert sorted(cli.plugin_commands()) == ["broken", "dumps"]
    assert cli.main(["tfmem", "--help"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  dumps +Serialize ``obj`` to a JSON formatted ``str``", out, flags=re.M)
    assert re.search(r"^  broken +unavailable: ModuleNotFoundError", out, flags=re.M)
    assert cli.main(["tfmem", "nothing"]) == 2
    assert "unknown command 'nothing'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["explain", "config", "compare"])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_every_subcommand_has_help(command: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tfmem", command, flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tfmem {command}") and "--config" in out


def test_engine_does_not_import_gpflow_integration() -> None:
    offenders = []
    for path in sorted((REPO / "tfmem").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] == "gpflow_integration"]
    assert not offenders


def test_console_script_from_the_users_directory(tmp_path: Path) -> None:
    """What a user runs: the installed `tfmem` script, a module in the current directory, and no
    TensorFlow start-up noise (`cuInit`, `absl::InitializeLog`, oneDNN) on the terminal."""
    script = Path(sys.executable).parent / "tfmem"
    assert script.exists(), "install the package first: pip install -e '.[test]'"
    (tmp_path / "mymodule_for_tfmem.py").write_text(
        "import tensorflow as tf\n\n"
        "def f(x):\n    return tf.reduce_sum(tf.exp(x[:, None] - x[None, :]), 1)\n\n"
        "def f_inputs():\n    return (tf.ones([300], tf.float64),)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")}
    proc = subprocess.run([str(script), "explain", "mymodule_for_tfmem:f"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "tfmem report for f(float64[300])" in proc.stdout
    assert proc.stderr == "", proc.stderr
    usage = subprocess.run([str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: tfmem COMMAND")


def test_a_threshold_that_split_nothing_says_why() -> None:
    # A kernel matrix the Cholesky factor reads whole: a loop over its rows would keep none of
    # what it computes, so nothing is split. The summary said only "no memory_budget set and
    # none from the device", as if nothing had asked for a split.
    import numpy as np

    x = tf.constant(np.random.default_rng(0).uniform(-3, 3, (800, 2)))

    def factor(x):
        k = tf.exp(-0.5 * tf.reduce_sum((x[:, None, :] - x[None, :, :]) ** 2, -1))
        return tf.linalg.cholesky(k + 0.05 * tf.eye(800, dtype=tf.float64))

    for config in ({"tensor_size_threshold": "100KB"}, {"tensor_size_threshold": "100KB", "memory_budget": "off"}):
        report = tfmem.function(factor, config=config).report(x)
        summary = report.summary()
        assert not report.splits, summary
        refused = next(r for r in report.rejected if r.rule == "SplitOversizedRegions")
        assert f"nothing split (tensor_size_threshold 97.7 KiB: {refused.reason})" in summary, summary
        assert "no memory_budget set" not in summary, summary
