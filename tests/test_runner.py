"""`python -m tests` (tests/__main__.py) runs every test file once, in parts."""
from __future__ import annotations

from collections import Counter

from tests import __main__ as runner


def test_every_test_file_runs_in_exactly_one_part() -> None:
    files = runner.test_files()
    split = runner.parts(files)
    counts = Counter(path for part in split for path in part)
    assert set(counts) == set(files) and set(counts.values()) == {1}, counts
    assert len(split) == len(runner.PARTS)  # no pattern matches nothing, and the rest is a part
    assert sum(not patterns for patterns in runner.PARTS) == 1
    named = [path for path in files if path.name == "test_runner.py"]
    rest = [i for i, patterns in enumerate(runner.PARTS) if not patterns][0]
    assert named and named[0] in split[rest]  # a file no pattern names runs at the rest's place
