"""The corpus acceptance test: `memory_budget` alone makes real programs fit, with the same answers.

For each CI program of `benchmarks/corpus/programs.py`, one fresh process under a BFC
limit equal to the program's budget (`benchmarks.corpus.trial:tfmem_trial`) runs:
  - XLA's buffer assignment for stock `tf.function(jit_compile=True)` at `big` (compiled only);
  - tfmem with `Config(memory_budget=<budget>)` and nothing else at the `big` size;
  - stock and tfmem at the `small` size, under the budget and under a tight budget (half
    the unchanged program's static estimate) that forces the split code paths.
The four tests per program read that process's record (if the process dies, the steps
run again in two processes, so that the crash is pinned on the step that crashed).

The processes of all selected programs start when collection ends (`tests/conftest.py`
calls `start_selected` and moves this file's tests last), so they run beside the rest of
the suite, in the suite's background pool (`tests/background.py`: `TFMEM_TEST_JOBS` at a
time, default 1 beside other tests, 2 when only background tests run); each has its own
allocator limit. A process stopped by the hang guard
(`CORPUS_TIMEOUT` seconds, default 1800) fails its tests as a *timeout*, never as
tfmem running out of memory or answering wrongly.

CI time: the whole file, `python -m pytest -q tests/benchmarks/test_corpus.py`, is measured
in benchmarks/corpus/README.md.
"""
from __future__ import annotations

import concurrent.futures
import os
import sys
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from benchmarks.corpus.programs import CI_PROGRAMS, PROGRAMS
from benchmarks.corpus.run import failure_reason, start_trials, tfmem_step
from benchmarks.corpus.trial import compare, moved_by_one_rounding
from tests import background
from tfmem.config import format_size

_TIMEOUT = float(os.environ.get("CORPUS_TIMEOUT", "1800"))
Trials = dict[str, concurrent.futures.Future[dict[str, Any]]]
_started: Trials | None = None


def start_selected(items: list[pytest.Item]) -> None:
    """Starts the trial processes of the programs whose tests are among `items` (-k aware)."""
    global _started
    if _started is not None:
        return
    mine = [item for item in items if getattr(item, "module", None) is sys.modules[__name__]]
    selected = {item.callspec.params["name"] for item in mine
                if hasattr(item, "callspec") and "name" in item.callspec.params}
    names = [name for name in CI_PROGRAMS if name in selected]
    futures = start_trials([(name, "tfmem", "budget") for name in names], timeout=_TIMEOUT, pool=background.pool())
    _started = dict(zip(names, futures))


def cancel_pending() -> None:
    """Cancels the trials that have not started (a running one finishes on its own)."""
    for future in (_started or {}).values():
        future.cancel()


@pytest.fixture(scope="module")
def trials(request: pytest.FixtureRequest) -> Trials:
    """Every selected program's trial process (started at collection by `start_selected`)."""
    start_selected(request.session.items)
    assert _started is not None
    return _started


def _step(trials: Trials, name: str, step: str) -> dict[str, Any]:
    """One step of the program's trial record (waiting for its process if it still runs)."""
    trial = trials[name].result()
    if trial["process_status"] == "timeout":
        pytest.fail(f"timeout (not a tfmem failure): the trial process of {name} was stopped after "
                    f"{_TIMEOUT:.0f} s; raise CORPUS_TIMEOUT on a slow machine")
    return tfmem_step(trial, step)


def test_ci_corpus_is_large_enough() -> None:
    assert len(set(CI_PROGRAMS)) == len(CI_PROGRAMS) >= 25
    assert set(CI_PROGRAMS) <= set(PROGRAMS) and len(PROGRAMS) >= 30


def test_compare_catches_wrong_values_indices_and_shapes() -> None:
    program = PROGRAMS["knn_cosine"]  # rtol 1e-4, index mismatch up to 2e-3
    want = [np.array([[1.0, 2.0]]), np.arange(1000)]
    assert compare([want[0] * (1 + 5e-5), want[1]], want, program)["equal"]
    assert not compare([want[0] * (1 + 5e-4), want[1]], want, program)["equal"]
    shifted = want[1].copy()
    shifted[:3] += 1
    assert not compare([want[0], shifted], want, program)["equal"]  # 3e-3 of the indices differ
    assert not compare([want[0][:, :1], want[1]], want, program)["equal"]
    assert not compare([None, want[1]], want, program)["equal"]


def test_compare_takes_rounding_noise_as_zero_but_not_a_small_output() -> None:
    program = PROGRAMS["vgp_matern52_grad"]  # rtol 1e-6; its lengthscale gradients are rounding noise
    loss, noise = np.array(3.6e3), np.array([-9.9e-14, -5.0e-14, -2.0e-14])
    assert compare([loss, noise * [1.0, 0.1, 0.4]], [loss, noise], program)["equal"]  # both ~1e-16 of 3.6e3
    small = np.array([2.0e-3, -1.0e-3, 5.0e-4])  # small, but far above the noise: compared relatively
    assert not compare([loss, small * 1.01], [loss, small], program)["equal"]
    assert not compare([loss, small], [loss, noise], program)["equal"]  # noise on one side only
    assert not compare([loss, noise], [loss, small], program)["equal"]


def test_compare_allows_stock_own_spread_on_programs_that_amplify_rounding() -> None:
    program = PROGRAMS["conjugate_gradients"]  # rtol 1e-8; 15 unconverged CG steps
    want = [np.array([1.0, -2.0])]
    off = [want[0] * (1 + 3e-5)]
    assert not compare(off, want, program)["equal"]
    assert compare(off, want, program, spread=1e-5)["equal"]  # TF and XLA differ by a third as much
    assert not compare(off, want, program, spread=5e-6)["equal"]  # more than SPREAD_FACTOR times stock's spread
    assert not compare([want[0] * 1.5], want, program, spread=1.0)["equal"]  # capped: 1e5 · rtol


def test_the_inputs_moved_by_one_rounding_move_each_nonzero_float_one_ulp() -> None:
    x = tf.constant(np.linspace(-3.0, 3.0, 2001)[1:].reshape(1000, 2))  # one zero among them
    x32, index = tf.constant(np.arange(1.0, 7.0, dtype=np.float32)), tf.constant([3, 1])
    moved, moved32, moved_index = moved_by_one_rounding((x, x32, index), seed=0)
    before, after = x.numpy(), moved.numpy()
    nonzero = before != 0
    up, down = np.nextafter(before, np.inf), np.nextafter(before, -np.inf)
    assert np.all(((after == up) | (after == down))[nonzero])  # the neighbouring float, one way or the other
    assert np.all(after[~nonzero] == 0.0) and np.count_nonzero(~nonzero) == 1
    assert 0.3 < np.mean(after[nonzero] > before[nonzero]) < 0.7  # both directions drawn
    assert moved32.dtype == tf.float32 and np.all(moved32.numpy() != x32.numpy())
    assert moved_index is index
    again, *_ = moved_by_one_rounding((x,), seed=0)
    assert np.array_equal(again.numpy(), after)  # the draw is fixed by the seed


@pytest.mark.parametrize("name", CI_PROGRAMS)
def test_stock_xla_does_not_fit_big(trials: Trials, name: str) -> None:
    program = PROGRAMS[name]
    planned = _step(trials, name, "stock_planned")
    assert planned["status"] == "ok", planned.get("error")
    assert planned["planned_bytes"] > program.budget_bytes, (
        f"stock XLA plans {format_size(planned['planned_bytes'])} at {program.big}, within the "
        f"{program.budget} budget: the program does not test tfmem")


@pytest.mark.parametrize("name", CI_PROGRAMS)
def test_tfmem_budget_only_runs_big(trials: Trials, name: str) -> None:
    program = PROGRAMS[name]
    big = _step(trials, name, "big")
    reason = failure_reason(big, blank=False)
    assert reason is None, f"{name} at {program.big} under {program.budget}: {reason}\n{big.get('unsplit', '')}"
    assert big["peak_bytes"] <= program.budget_bytes


@pytest.mark.parametrize("name", CI_PROGRAMS)
def test_tfmem_budget_only_equals_stock_small(trials: Trials, name: str) -> None:
    _assert_equal(trials, name, "budget")


@pytest.mark.parametrize("name", CI_PROGRAMS)
def test_tfmem_tight_budget_splits_and_equals_stock_small(trials: Trials, name: str) -> None:
    tight = _assert_equal(trials, name, "tight")
    assert tight["splits"] >= 1, f"no split under a tight budget: the comparison is vacuous ({tight['unsplit']})"


def _assert_equal(trials: Trials, name: str, key: str) -> dict[str, Any]:
    program = PROGRAMS[name]
    equality = _step(trials, name, "equality")
    assert equality["stock"]["status"] == "ok", f"stock does not run at the small size: {equality['stock']}"
    record = equality[key]
    reason = failure_reason(record, compared=True, blank=False)
    assert reason is None, (f"{name} at {program.small} (budget {format_size(record['budget_bytes'])}): {reason}; "
                            f"max rel err {record.get('max_rel_err')} (rtol {program.rtol}) at "
                            f"{record.get('detail')}, index mismatch {record.get('index_mismatch')}, tolerance "
                            f"{record.get('tolerance')} (stock's spread {equality.get('stock_spread')}, "
                            f"samples {equality.get('stock_spreads')}"
                            f"{', not measured: ' + str(equality.get('stock_spread_error')) if equality.get('stock_spread_error') else ''})")
    return record
