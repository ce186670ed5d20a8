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
pattern matches form the part at `REST`'s place, so no file is ever left out. Parts run
`lanes()` at a time (two on CI's two cores), each taking the next part when one ends, in
the order of `PARTS`, chosen so that the lanes end together (on CI at 57905e7 the parts
took 903, 644, 429, 330, 440 and 297 s in that order: 1,530 s beside 1,513 s; with the
rest last, one lane ran alone for its last 300 s). A part's output is printed whole when
it ends. A test process alone keeps about 1.5 of two cores busy (XLA compiles
on one thread, TensorFlow runs ops on both): two at once finish a fifth to a third sooner
than one after the other (measured: two budget pipelines, 30 s at once, 37 s in turn).
A background job is read by one file only, so each job runs once. With test paths among
the arguments, one pytest process runs just those.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
# The part with no patterns: it holds the files no pattern matches, at its place in `PARTS`.
REST: tuple[str, ...] = ()
# Patterns relative to the repository root, as pathlib's `match` reads them, in the order
# the lanes take them (each part's seconds are printed when it ends).
PARTS: tuple[tuple[str, ...], ...] = (
    # The benchmark tests: they mostly wait on the corpus's trial processes (`tests/background.py`).
    ("tests/benchmarks/test_*.py",),
    ("tests/rewrites/test_[a-r]*.py",),
    ("tests/rewrites/test_split*.py",),
    ("tests/tfmem/test_*.py",),
    REST,  # the GPflow integration, the doctests and the runner
    ("tests/rewrites/test_*.py",),
)
LANES_VARIABLE = "TFMEM_TEST_LANES"


def test_files() -> list[Path]:
    """Every test file of the suite, relative to the repository root, sorted."""
    return sorted(path.relative_to(ROOT) for path in (ROOT / "tests").rglob("test_*.py"))


def parts(files: list[Path]) -> list[list[Path]]:
    """`files` split by `PARTS`, the files no pattern matches at `REST`'s place (empty parts
    dropped).

    >>> parts([Path("tests/rewrites/test_split.py"), Path("tests/tfmem/test_graph.py"),
    ...        Path("tests/benchmarks/test_corpus.py"), Path("tests/rewrites/test_sink.py"),
    ...        Path("tests/test_doctests.py")])
    [[PosixPath('tests/benchmarks/test_corpus.py')], [PosixPath('tests/rewrites/test_split.py')], [PosixPath('tests/tfmem/test_graph.py')], [PosixPath('tests/test_doctests.py')], [PosixPath('tests/rewrites/test_sink.py')]]
    """
    split: list[list[Path]] = [[] for _ in PARTS]
    rest = next(i for i, patterns in enumerate(PARTS) if not patterns)
    for path in files:
        index = next((i for i, patterns in enumerate(PARTS) if any(path.match(p) for p in patterns)), rest)
        split[index].append(path)
    return [part for part in split if part]


def _names_tests(arg: str) -> bool:
    return not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists()


def lanes() -> int:
    """Parts at a time: `TFMEM_TEST_LANES`, else two (one where the machine has one core)."""
    value = os.environ.get(LANES_VARIABLE)
    if value is None:
        return min(2, os.cpu_count() or 1)
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"{LANES_VARIABLE}={value!r}: give a whole number of parts at a time, at least 1")
    return int(value)


def _pytest(args: list[str], files: list[Path], log: IO[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pytest", *args, *map(str, files)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)


def main(args: list[str]) -> int:
    """Runs each part with `args` added; returns 0 when every part passed, else the first
    failing part's exit code (every part runs either way)."""
    if any(_names_tests(arg) for arg in args):
        return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=ROOT)
    runs = parts(test_files())
    width = lanes()
    print(f"== tests: {len(runs)} parts, {width} at a time; each part's output comes when it ends", flush=True)
    start = time.perf_counter()
    waiting = list(enumerate(runs, 1))
    running: dict[int, tuple[subprocess.Popen, IO[str], float]] = {}
    codes: dict[int, int] = {}
    while waiting or running:
        while waiting and len(running) < width:
            number, files = waiting.pop(0)
            print(f"== tests part {number} of {len(runs)} starts: {len(files)} files ({files[0]} … {files[-1]})",
                  flush=True)
            log = tempfile.TemporaryFile(mode="w+")
            running[number] = (_pytest(args, files, log), log, time.perf_counter())
        time.sleep(0.5)
        for number, (process, log, began) in list(running.items()):
            if process.poll() is None:
                continue
            del running[number]
            codes[number] = process.returncode
            log.seek(0)
            print(f"== tests part {number} of {len(runs)} ended ({time.perf_counter() - began:.0f} s):", flush=True)
            sys.stdout.write(log.read())
            sys.stdout.flush()
            log.close()
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
