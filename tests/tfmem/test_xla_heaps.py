"""XLA's temporaries in heaps of bounded size (tfmem.xla_heaps): the process-wide flag,
set before anything compiles, and the verdict on a plan in several heaps, both ways
under a real limit."""
from __future__ import annotations

from typing import Any

import pytest

import tfmem
from tfmem.budget import Budget, Held
from tfmem.memory import XlaPlan
from tfmem.xla_heaps import FLAG, requested_heap_bytes, with_heap_flag

MiB = 1 << 20


def test_the_flag_is_read_from_and_written_into_xla_flags() -> None:
    assert requested_heap_bytes("") is None
    assert requested_heap_bytes(f"--{FLAG}=-1") is None  # XLA's "no constraint"
    assert requested_heap_bytes(f"--{FLAG}=100 --xla_dump_to=x --{FLAG}=200") == 200  # the last wins
    assert with_heap_flag(f"--{FLAG}=100 --xla_dump_to=x", 300) == f"--xla_dump_to=x --{FLAG}=300"


@pytest.mark.parametrize("size", ["0", "-1MiB", "3GiB", "lots"])
def test_a_size_out_of_the_flags_range_is_refused_by_name(size: str) -> None:
    with pytest.raises(ValueError, match="heap size"):
        tfmem.limit_xla_heaps(size)


def test_another_heap_size_in_xla_flags_is_not_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", f"--{FLAG}={16 * MiB}")
    with pytest.raises(tfmem.TfmemError, match="already sets"):
        tfmem.limit_xla_heaps("32MiB")


def test_a_plan_made_under_another_heap_limit_is_another_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    cache, config, budget = tfmem.PlanCache("unused"), tfmem.Config(memory_budget="64MiB"), Budget(64 * MiB, "config")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    one_block = cache.key("digest", config, budget)
    monkeypatch.setenv("XLA_FLAGS", f"--{FLAG}={32 * MiB}")
    assert cache.key("digest", config, budget) != one_block


def heaps_after_compiling(compile_first: bool) -> dict[str, Any]:
    """Sets heaps of 4 MiB, after an XLA compilation or before any, and reports what XLA
    then plans for a program with four float64 [500, 500] (1.9 MiB) temporaries alive at once."""
    import os

    import tensorflow as tf

    if compile_first:
        tf.function(lambda x: x * 2.0, jit_compile=True)(tf.ones([2]))
    before = os.environ.get("XLA_FLAGS", "")
    try:
        tfmem.limit_xla_heaps("4MiB")
        error = ""
    except tfmem.TfmemError as err:
        error = str(err)

    @tf.function(jit_compile=True)
    def solves(a: tf.Tensor) -> tf.Tensor:
        k = a @ tf.transpose(a) + 500.0 * tf.eye(500, dtype=a.dtype)
        low = tf.linalg.cholesky(k)
        s = tf.linalg.triangular_solve(low, k)
        return tf.reduce_sum(tf.linalg.triangular_solve(low, s, adjoint=True) * k) + tf.reduce_sum(s * low)

    plan = tfmem.xla_plan(solves, tf.ones([500, 500], tf.float64))
    return {"error": error, "heaps": list(plan.heap_bytes), "flags_kept": os.environ.get("XLA_FLAGS", "") == before}


def test_heaps_set_before_anything_compiles_split_the_block_and_after_is_a_clear_error() -> None:
    first = tfmem.run_isolated(heaps_after_compiling, False, timeout=None)
    assert first.ok, first.error
    assert not first.value["error"]
    big = [h for h in first.value["heaps"] if h > MiB]
    assert len(big) >= 2 and max(big) <= 4 * MiB, first.value  # one block of ~7.6 MiB without the flag
    late = tfmem.run_isolated(heaps_after_compiling, True, timeout=None)
    assert late.ok, late.error
    assert "did not take effect" in late.value["error"] and "before this call" in late.value["error"]
    assert late.value["flags_kept"], late.value  # XLA_FLAGS as it was
    assert len([h for h in late.value["heaps"] if h > MiB]) == 1, late.value


def test_every_heap_must_find_room_not_only_the_largest() -> None:
    grown = Held(in_use=8 * MiB, peak=62 * MiB)  # regions of 2 + 4 + 8 + 16 + 32 MiB
    budget = Budget(64 * MiB, "config")
    five = XlaPlan(48 * MiB, 8 * MiB, temp_bytes=8 * MiB, heap_bytes=(8 * MiB,) * 5)
    assert budget.fits_plan(five, grown)
    eight = XlaPlan(72 * MiB, 8 * MiB, temp_bytes=8 * MiB, heap_bytes=(8 * MiB,) * 8)
    assert not budget.fits_plan(eight, grown) and budget.plan_overshoot(eight, grown) > 1
    assert "XLA's heap" in budget.why_not(eight, grown)
    # One block is judged by the room it finds in one piece, as before.
    assert budget.heaps_replay(XlaPlan(48 * MiB, 40 * MiB, temp_bytes=40 * MiB, heap_bytes=(40 * MiB,)), grown) is None


def test_the_other_heaps_are_the_replays_not_regions_grown_before_the_largest() -> None:
    # Measured: a Cholesky and two solves at n=2000 (float64) in 31 MiB heaps under a real
    # 248 MiB limit, in a fresh process: XLA planned 201.2 MiB in six heaps and it ran (real
    # peak 175.0 MiB). Counted as buffers allocated before the largest heap, the other five
    # would each have grown a region of twice their size, and the verdict said "does NOT fit".
    heaps = tuple(int(h * MiB) for h in (15.83, 31.0, 30.97, 30.97, 30.97, 30.99))
    plan = XlaPlan(int(201.25 * MiB), 31 * MiB, temp_bytes=31 * MiB, output_bytes=256, heap_bytes=heaps)
    fresh = Held(in_use=44 * 1024, regions=2 * MiB)
    budget = Budget(248 * MiB, "config")
    assert budget.fits_plan(plan, fresh)
    assert budget.plan_overshoot(plan, fresh) > 1  # planning judges the largest heap as strictly as one block
    # Under 150 MiB the heaps do not all find room, and the verdict names the one that finds none.
    assert not Budget(150 * MiB, "config").fits_plan(plan, fresh)
    assert "the allocator finds no room for XLA's heap" in Budget(150 * MiB, "config").why_not(plan, fresh)


def five_solves(a: Any) -> Any:
    """Five float64 [n, n] matrices alive at once: a kernel, its factor and three solves."""
    import tensorflow as tf

    n = tf.shape(a)[0]
    k = a @ tf.transpose(a) + tf.cast(n, a.dtype) * tf.eye(n, dtype=a.dtype)
    low = tf.linalg.cholesky(k)
    s = tf.linalg.triangular_solve(low, k)
    t = tf.linalg.triangular_solve(low, s, adjoint=True)
    u = tf.linalg.triangular_solve(low, t)
    return tf.reduce_sum(t * k) + tf.reduce_sum(s * low) + tf.reduce_sum(u * s)


def five_solves_after_a_32_mib_tensor(heaps: str | None) -> dict[str, Any]:
    """The verdict on, and a call of, `five_solves` at n=1000 (7.6 MiB matrices) under a
    64 MiB budget, after the process held a 32 MiB tensor (the allocator keeps its region)."""
    import numpy as np
    import tensorflow as tf

    if heaps:
        tfmem.limit_xla_heaps(heaps)
    a = tf.constant(np.random.default_rng(0).normal(size=(1000, 1000)))
    grown = tf.zeros([(32 * MiB) // 8], tf.float64)
    del grown
    wrapped = tfmem.function(five_solves, config=tfmem.Config(memory_budget="64MiB"))
    report = wrapped.report(a)
    try:
        wrapped(a)
        ran = True
    except tf.errors.ResourceExhaustedError:
        ran = False
    plan = report.compiled.checked_plan
    return {"fits": report.fits, "summary": report.summary(), "ran": ran, "heaps": list(plan.heap_bytes)}


def test_heaps_let_a_block_that_finds_no_room_in_one_piece_run_both_ways_under_a_real_limit() -> None:
    # The 32 MiB tensor grew regions of up to 32 MiB, and the 64 MiB limit leaves too little
    # to grow: XLA's one block of temporaries (about 36 MiB) finds no room, as the verdict
    # says, and tells which heap limit would help. In heaps of 8 MiB (one matrix each) they
    # all find room in the regions held, and the program runs.
    one = tfmem.run_isolated(five_solves_after_a_32_mib_tensor, None, memory_limit_mb=64, timeout=None)
    assert one.ok, one.error
    assert not one.value["fits"] and not one.value["ran"], one.value
    assert "finds only" in one.value["summary"] and "limit_xla_heaps('8MiB')" in one.value["summary"], one.value
    heaps = tfmem.run_isolated(five_solves_after_a_32_mib_tensor, "8MiB", memory_limit_mb=64, timeout=None)
    assert heaps.ok, heaps.error
    assert len(heaps.value["heaps"]) > 1 and max(heaps.value["heaps"]) <= 8 * MiB, heaps.value
    assert heaps.value["fits"] and heaps.value["ran"], heaps.value
    assert f"in {len(heaps.value['heaps'])} heaps of up to" in heaps.value["summary"], heaps.value
