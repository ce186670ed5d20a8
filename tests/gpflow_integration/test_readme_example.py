"""The README's "GPflow users" example runs as printed and does what the text says."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpflow_users_example_runs_and_splits() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## GPflow users"):]
    (code,) = re.findall(r"```python\n(.*?)```", section[:section.index("\n## ", 3)], flags=re.S)
    printed = io.StringIO()
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md (GPflow users)", "exec"), namespace)  # noqa: S102 - our own README
    out = printed.getvalue()
    report = namespace["opt"].reports()[0]  # type: ignore[attr-defined]
    assert report.status == "rewritten"
    assert report.splits, out  # the [M, N] tensors went into chunks
    assert report.fits and report.summary().startswith("fits 64.0 MiB"), out  # memory_budget: 64MiB
    assert report.memory_after.peak_bytes < report.memory_before.peak_bytes
    assert report.memory_after.peak_bytes <= namespace["opt"].config.memory_budget  # type: ignore[attr-defined]
    assert "SplitOversizedRegions fired at" in out
    rmse = float(re.search(r"test RMSE: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert rmse < 1.0  # standardised targets: better than predicting the mean
