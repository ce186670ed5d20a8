"""Isolated runs the test suite starts when collection ends, beside its other tests.

Some tests check the result of a long run in a process of its own: `tfmem compare
--quick`, the benchmark harness's quick sweep, a strategy over two logical CPUs, the
corpus's memory-limited trials. The test process would only wait for them; CI has two
cores. So a module declares such a run as a *job*,

    @background.job("compare_quick")
    def compare_quick() -> dict[str, Any]:
        ...                      # starts a process, waits, returns what the tests read

and the tests that read it are marked `@pytest.mark.background("compare_quick")` and call
`background.result("compare_quick")` (usually from a module fixture). When collection
ends, `tests/conftest.py` starts the jobs of the selected tests, in the order their
tests come, `workers()` at a time, and moves the marked tests last (then the corpus's):
by the time they run, their jobs have run beside everything else.

A job is a thread waiting on its process, so the test process's own work is not slowed
by it; the process has its own memory limit, if any. A job that raises, raises in every
test that reads it.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

MARKER = "background"
_JOBS: dict[str, Callable[[], Any]] = {}
_started: dict[str, concurrent.futures.Future[Any]] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def job(name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Registers `fn` as the background job `name` (a decorator)."""
    def register(fn: Callable[[], Any]) -> Callable[[], Any]:
        if name in _JOBS and _JOBS[name] is not fn:
            raise ValueError(f"background job {name!r} is registered twice")
        _JOBS[name] = fn
        return fn
    return register


def job_of(item: pytest.Item) -> str | None:
    """The job a test reads (its `background` marker's argument), or None."""
    marker = item.get_closest_marker(MARKER)
    return marker.args[0] if marker is not None else None


def workers(only_background: bool) -> int:
    """Jobs at a time: `TFMEM_TEST_JOBS`, else one beside the other tests (CI has two
    cores: one for the test process, one for a job) and two when only they run."""
    return int(os.environ.get("TFMEM_TEST_JOBS", "2" if only_background else "1"))


def pool(count: int = 1) -> concurrent.futures.ThreadPoolExecutor:
    """The one pool every job and corpus trial runs in (made on first use, `count` workers)."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, count), thread_name_prefix="background")
    return _pool


def start(names: Iterable[str]) -> None:
    """Starts the named jobs not started yet, in order (after what the pool already holds)."""
    for name in names:
        if name not in _started:
            if name not in _JOBS:
                raise KeyError(f"no background job {name!r}; registered: {sorted(_JOBS)}")
            _started[name] = pool().submit(_JOBS[name])


def result(name: str) -> Any:
    """The job's result, waiting for it (started now if collection did not start it)."""
    start([name])
    return _started[name].result()


def run_command(args: Sequence[str], *, cwd: str | None = None, timeout: float = 3600.0) -> subprocess.CompletedProcess:
    """Runs a command for a job, its output captured; a run that fails raises with its stderr.

    `timeout` is a hang guard, not a speed check: a run it stops raises a timeout, which
    names itself as one (never a tfmem failure or an out-of-memory).
    """
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        proc = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise TimeoutError(f"timeout (not a tfmem failure): {' '.join(args)} was stopped after {timeout:.0f} s; "
                           "a slow machine may need more") from err
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def scratch_directory(prefix: str) -> str:
    """A fresh directory for a job's output, removed when the test process exits (the
    tests read it after the job returns, so it cannot be removed with the job)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def cancel_pending() -> None:
    """Cancels the jobs that have not started (a session that stops early)."""
    for future in _started.values():
        future.cancel()
