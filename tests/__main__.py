"""Runs the whole test suite in parts, each part in a pytest process of its own.

    python -m tests -q             # what CI runs (`.ci/run`): every test file, in PARTS
    python -m tests -q -k cumsum   # pytest's own options apply to every part

Why parts: XLA's CPU JIT never unmaps a program it compiled for a call (TensorFlow keeps
every compiled program for the life of the process), and each one takes about a dozen
memory maps. Linux allows a process `vm.max_map_count` maps (65,530 by default), and
LLVM dies with a segfault when it cannot map more. The whole suite in one process
reached 61,400 maps at aad6a0c, and 20 more tests crashed it (`tests/conftest.py` now
stops a session that nears the limit, saying so, and reports the count at its end).

Each test file goes to the first part one of whose patterns it matches; the files no
pattern matches form the last part, so no file is ever left out. The parts run one after
another, except the first, `BESIDE`: the benchmark tests, which mostly wait on the
corpus's trial processes (one at a time, `tests/background.py`), run beside all the
others, as the trials ran beside the other tests when the suite was one process; its
output is printed when it ends. A background job is read by one file only, so each job
runs once. With test paths among the arguments, one pytest process runs just those.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Patterns relative to the repository root, as pathlib's `match` reads them.
BESIDE = ("tests/benchmarks/test_*.py",)
PARTS: tuple[tuple[str, ...], ...] = (
    BESIDE,
    ("tests/rewrites/test_[a-r]*.py",),
    ("tests/rewrites/test_[s-z]*.py",),
    # The rest: tfmem, the GPflow integration and the doctests.
)


def test_files() -> list[Path]:
    """Every test file of the suite, relative to the repository root, sorted."""
    return sorted(path.relative_to(ROOT) for path in (ROOT / "tests").rglob("test_*.py"))


def parts(files: list[Path]) -> list[list[Path]]:
    """`files` split by `PARTS`, the files no pattern matches last (empty parts dropped).

    >>> parts([Path("tests/rewrites/test_split.py"), Path("tests/tfmem/test_graph.py"),
    ...        Path("tests/benchmarks/test_corpus.py"), Path("tests/rewrites/test_recompute.py")])
    [[PosixPath('tests/benchmarks/test_corpus.py')], [PosixPath('tests/rewrites/test_recompute.py')], [PosixPath('tests/rewrites/test_split.py')], [PosixPath('tests/tfmem/test_graph.py')]]
    """
    split: list[list[Path]] = [[] for _ in range(len(PARTS) + 1)]
    for path in files:
        index = next((i for i, patterns in enumerate(PARTS) if any(path.match(p) for p in patterns)), len(PARTS))
        split[index].append(path)
    return [part for part in split if part]


def _names_tests(arg: str) -> bool:
    return not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists()


def _pytest(args: list[str], files: list[Path], **popen: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pytest", *args, *map(str, files)], cwd=ROOT, **popen)


def main(args: list[str]) -> int:
    """Runs each part with `args` added; returns 0 when every part passed, else the first
    failing part's exit code (every part runs either way)."""
    if any(_names_tests(arg) for arg in args):
        return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=ROOT)
    runs = parts(test_files())
    start = time.perf_counter()
    beside, log = None, tempfile.TemporaryFile(mode="w+")
    if any(runs[0][0].match(p) for p in BESIDE):
        print(f"== tests part 1 of {len(runs)}, beside the others: {len(runs[0])} files "
              f"({runs[0][0]} … {runs[0][-1]}); its output comes when it ends", flush=True)
        beside = _pytest(args, runs[0], stdout=log, stderr=subprocess.STDOUT)
    codes: dict[int, int] = {}
    for number, files in enumerate(runs, 1):
        if number == 1 and beside is not None:
            continue
        print(f"== tests part {number} of {len(runs)}: {len(files)} files ({files[0]} … {files[-1]})", flush=True)
        codes[number] = _pytest(args, files).wait()
    if beside is not None:
        codes[1] = beside.wait()
        log.seek(0)
        print(f"== tests part 1 of {len(runs)} (beside the others):", flush=True)
        sys.stdout.write(log.read())
    # pytest's code 5 is "no tests collected": a -k that selects nothing in one part.
    summary = ", ".join(f"part {number}: {'passed' if code in (0, 5) else f'exit code {code}'}"
                        for number, code in sorted(codes.items()))
    print(f"== tests: {summary}; {time.perf_counter() - start:.0f} s in all", flush=True)
    failed = [code for _, code in sorted(codes.items()) if code not in (0, 5)]
    if failed:
        return failed[0]
    return 0 if 0 in codes.values() else 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
