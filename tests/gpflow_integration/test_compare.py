"""`tfmem compare`: the quick sweep's headline, its output, and bad input as one clear line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpflow_integration import compare
from gpflow_integration.compare import main, render
from tests import background

REPO = Path(__file__).resolve().parents[2]


@background.job("compare_quick")
def compare_quick() -> tuple[int, str, str, Path]:
    """One `tfmem compare --quick` in its own process (beside the other tests), shared by
    the tests below: its exit status, output and directory.

    No time limit but the hang guard's: on a busy machine the sweep takes longer, it does not fail.
    """
    out = Path(background.scratch_directory("tfmem-compare-quick-"))
    proc = background.run_command([sys.executable, "-m", "gpflow_integration.compare", "--quick",
                                   "--timeout_seconds", "none", "--output_dir", str(out)], cwd=str(REPO))
    return proc.returncode, proc.stdout, proc.stderr, out


@pytest.fixture(scope="module")
def quick_run() -> tuple[int, str, str, Path]:
    return background.result("compare_quick")


def _trials(document: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(t["num_inducing"], t["method"]): t for t in document["trials"]}


@pytest.mark.background("compare_quick")
def test_quick_headline_tfmem_fits_where_stock_xla_runs_out_of_memory(quick_run) -> None:
    status, out, _, directory = quick_run
    assert status == 0, out
    document = json.loads((directory / "compare.json").read_text())
    budget = document["memory_budget_bytes"]
    trials = _trials(document)
    sizes = sorted({m for m, _ in trials})
    headline = [m for m in sizes
                if trials[(m, "tf_function_jit")]["status"] == "oom" and trials[(m, "tfmem")]["status"] == "ok"]
    assert headline, f"no M where stock XLA runs out of memory and tfmem fits: {document['oom_points']}"
    for m in headline:
        fitted = trials[(m, "tfmem")]
        assert 0 < fitted["peak_bytes"] < budget  # the allocator's real peak, under its enforced limit
        assert fitted["value"]["tfmem_status"] == "rewritten" and fitted["value"]["tfmem_splits"] >= 1
        assert fitted["value"]["rmse"] < 1.0  # standardised targets: better than predicting the mean
        assert "ResourceExhaustedError" in trials[(m, "tf_function_jit")]["error"]
    assert document["oom_points"]["tfmem"]["largest_ok"] > document["oom_points"]["tf_function_jit"]["largest_ok"]


@pytest.mark.background("compare_quick")
def test_quick_smallest_m_fits_everywhere_with_the_same_fit(quick_run) -> None:
    _, _, _, directory = quick_run
    document = json.loads((directory / "compare.json").read_text())
    smallest = min(t["num_inducing"] for t in document["trials"])
    row = [t for t in document["trials"] if t["num_inducing"] == smallest]
    assert {t["method"] for t in row} == {"tf_function", "tf_function_jit", "tfmem"}
    assert all(t["status"] == "ok" and t["peak_bytes"] > 0 for t in row), row
    # The same model and data give the same fit, whichever way it is compiled.
    rmses = [t["value"]["rmse"] for t in row]
    assert max(rmses) - min(rmses) < 1e-6 * max(rmses)


@pytest.mark.background("compare_quick")
def test_quick_output_says_where_it_wrote_and_what_ran(quick_run) -> None:
    _, out, err, directory = quick_run
    assert out.count(render(json.loads((directory / "compare.json").read_text()))) == 1
    assert f"Wrote {directory / 'compare.json'} and {directory / 'compare.png'}" in out
    assert (directory / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Progress: a line per finished trial naming it, its status and its time.
    assert re.search(r"\[\d/6\] tfmem M=\d+: ok \(\d+ s\)", err), err
    document = json.loads((directory / "compare.json").read_text())
    assert document["mode"] == "quick" and document["code"]  # which commit produced it


def test_quick_run_writes_to_its_own_directory_and_says_when_it_replaces(tmp_path: Path) -> None:
    from gpflow_integration.settings import load_settings

    full, _ = load_settings(REPO / "configs" / "sgpr.yaml")
    quick, _ = load_settings(REPO / "configs" / "sgpr.yaml", quick=True)
    assert quick.output_dir == f"{full.output_dir}-quick"
    earlier = tmp_path / "compare.json"
    assert compare._earlier_run(earlier) == ""
    earlier.write_text(json.dumps({"mode": "full", "created": "2026-01-01T00:00:00+00:00"}))
    assert "replacing the full run of 2026-01-01T00:00:00+00:00" in compare._earlier_run(earlier)


def test_timeouts_are_reported_as_timeouts_not_oom_or_errors() -> None:
    trials = [
        {"num_inducing": 10, "method": "tfmem", "label": "tfmem", "status": "ok", "peak_bytes": 2**20,
         "error": None, "value": {}},
        {"num_inducing": 20, "method": "tfmem", "label": "tfmem", "status": "timeout", "peak_bytes": None,
         "error": "no result within 240 s after start-up", "value": {}},
    ]
    limits = compare._oom_points(["tfmem"], trials)
    assert limits["tfmem"]["first_oom"] is None and limits["tfmem"]["first_timeout"] == 20
    assert limits["tfmem"]["summary"] == "M=10 (timed out at M=20, not out of memory; raise --timeout_seconds)"
    text = render({"trials": trials, "memory_budget_bytes": 2**24, "oom_points": limits, "notes": []})
    assert "timeout at M=20, tfmem: no result within 240 s" in text
    assert " oom " not in text and "error" not in text


def test_missing_optional_parts_are_skipped_in_one_line_each(tmp_path: Path, capsys, monkeypatch) -> None:
    """Without matplotlib and tqdm the sweep still finishes and says what it skipped and how to get it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm", None)
    status = main(["tfmem compare", "--quick", "--methods", "tfmem", "--inducing_points", "20",
                   "--timeout_seconds", "none", "--output_dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert (tmp_path / "compare.json").exists() and not (tmp_path / "compare.png").exists()
    skipped = [line for line in captured.out.splitlines() if line.startswith("Skipped compare.png")]
    assert skipped == [f"Skipped compare.png: matplotlib is not installed ({compare._INSTALL})"]
    assert f"Progress bar skipped: tqdm is not installed ({compare._INSTALL})." in captured.err
    assert "[1/1] tfmem M=20: ok" in captured.err
    assert f"Wrote {tmp_path / 'compare.json'} (" in captured.out


def test_readme_example_output_is_the_committed_compare_json() -> None:
    """The README's table is `render` of docs/compare.json, the result of a real full run."""
    document = json.loads((REPO / "docs" / "compare.json").read_text())
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```text\n(.*?)```", readme, flags=re.S)
    assert render(document) + "\n" in blocks, "README table differs from render(docs/compare.json)"
    assert document["mode"] == "full" and not document["code"].endswith("-dirty")
    assert all(t["status"] in ("ok", "oom", "skipped") for t in document["trials"])


def test_show_prints_a_saved_run(capsys) -> None:
    assert main(["tfmem compare", "--show", str(REPO / "docs" / "compare.json")]) == 0
    document = json.loads((REPO / "docs" / "compare.json").read_text())
    assert capsys.readouterr().out == render(document) + "\n"


def run_main(capsys, *args: str) -> tuple[int, str]:
    status = main(["tfmem compare", *args])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--model", "gpr"], "model not supported"),
    (["--quick", "--memory_budget", "1kB"], "smaller than the data itself"),
    (["--quick", "--memory_budget", "-64MB"], "memory_budget: a size must not be negative, got '-64MB'"),
    (["--quick", "--inducing_points", "20,10"], "increasing"),
    (["--quick", "--methods", "tf_function,pytorch"], "methods"),
    (["--quick", "--dataset", "diamond"], "unknown data set (did you mean 'diamonds'?)"),
    (["--quick", "--timeout_seconds", "soon"], "timeout_seconds: expected a number of seconds or none"),
    (["--no_such_flag"], "no_such_flag"),
    (["stray"], "unexpected argument"),
    (["--show", "/no/such/compare.json"], "cannot read"),
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
    assert status == 2 and f"config file '{bad}', section 'tfmem': tensor_split_size" in err

    bad.write_text("compare:\n  inducing_pionts: [1, 2]\n")
    status, err = run_main(capsys, "--config", str(bad))
    assert status == 2 and "'inducing_pionts' (did you mean 'inducing_points'?)" in err


def test_help(capsys):
    assert main(["tfmem compare", "--help"]) == 0
    assert "--memory_budget" in capsys.readouterr().out


def test_runs_as_a_module_and_fails_cleanly():
    proc = subprocess.run([sys.executable, "-m", "gpflow_integration.compare", "--model", "svgp"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "model not supported" in proc.stderr and "Traceback" not in proc.stderr
