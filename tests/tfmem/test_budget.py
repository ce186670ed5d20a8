"""Where the memory budget comes from: the config, the GPU, the CPU allocator's limit, or nowhere."""
from __future__ import annotations

import pytest

from tfmem import budget as budget_module
from tfmem.budget import (CPU_SAFETY_FRACTION, GPU_SAFETY_FRACTION, PLANNING_FRACTION, REPLAN_MARGIN, Budget, Held,
                          device_budget, resolve_budget)
from tfmem.config import Config
from tfmem.memory import XlaPlan

BFC_1GIB = {"TF_CPU_ALLOCATOR_USE_BFC": "1", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "1024"}


@pytest.fixture(autouse=True)
def nothing_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # These tests are about the arithmetic: the allocators hold nothing yet.
    monkeypatch.setattr(budget_module, "_memory_info", lambda device: (0, 0))


def no_gpus() -> dict[str, int]:
    return {}


def two_gpus() -> dict[str, int]:
    return {"GPU:0": 80 * 2**30, "GPU:1": 16 * 2**30}


def test_config_budget_wins_over_the_device() -> None:
    budget = resolve_budget(Config(memory_budget="2GiB"), environ=BFC_1GIB, gpu_limits=two_gpus)
    assert budget == Budget(2 * 2**30, "config")


def test_a_threshold_does_not_lift_the_device_bound() -> None:
    # Thresholds add splits; the device's limit still bounds the whole program.
    with_threshold = resolve_budget(Config(tensor_size_threshold="64MB"), "CPU:0", environ=BFC_1GIB,
                                    in_use=lambda device: (0, 0))
    assert with_threshold == resolve_budget(Config(), "CPU:0", environ=BFC_1GIB, in_use=lambda device: (0, 0))
    assert with_threshold.nbytes == CPU_1GIB and with_threshold.origin == "90% of TF_CPU_BFC_MEM_LIMIT_IN_MB=1024"
    explicit = resolve_budget(Config(tensor_size_threshold="64MB", memory_budget="2GiB"), environ=BFC_1GIB)
    assert explicit == Budget(2 * 2**30, "config") and explicit.origin == "memory_budget"


@pytest.mark.parametrize("off", ["off", "OFF", False, "false"])
def test_memory_budget_off_opts_out_of_every_bound(off) -> None:
    config = Config(tensor_size_threshold="64MB", memory_budget=off)
    assert config.budget_off and config.memory_budget == "off"
    assert resolve_budget(config, "CPU:0", environ=BFC_1GIB, in_use=lambda device: (0, 0)) is None
    assert resolve_budget(config, environ=BFC_1GIB, gpu_limits=two_gpus) is None


def test_memory_budget_off_from_yaml_where_a_bare_off_reads_as_false(tmp_path) -> None:
    path = tmp_path / "per_tensor.yaml"
    path.write_text("tensor_size_threshold: 64MB\nmemory_budget: off\n")
    assert Config.from_yaml(path).budget_off
    with pytest.raises(ValueError, match="tensor_split_size"):
        Config(tensor_split_size="1MB", memory_budget="off")  # nothing for a split size to apply to


def test_no_split_stage_means_no_budget() -> None:
    assert resolve_budget(Config(passes=["cleanup"]), environ=BFC_1GIB, gpu_limits=two_gpus) is None


CPU_1GIB = int(2**30 * CPU_SAFETY_FRACTION)


def test_cpu_budget_is_a_share_of_the_bfc_limit_in_mib() -> None:
    budget = resolve_budget(Config(), "CPU:0", environ=BFC_1GIB, gpu_limits=no_gpus)
    assert budget == Budget(CPU_1GIB, "90% of TF_CPU_BFC_MEM_LIMIT_IN_MB=1024")
    assert budget.plan_bytes == int(CPU_1GIB * PLANNING_FRACTION)


@pytest.mark.parametrize("environ", [
    {},  # the default allocator: no limit to work to
    {"TF_CPU_BFC_MEM_LIMIT_IN_MB": "1024"},  # a limit without the BFC allocator is not applied by TF
    {"TF_CPU_ALLOCATOR_USE_BFC": "0", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "1024"},
    {"TF_CPU_ALLOCATOR_USE_BFC": "1"},  # BFC without a limit
    {"TF_CPU_ALLOCATOR_USE_BFC": "1", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "lots"},
])
def test_cpu_without_an_enforced_limit_has_no_budget(environ: dict[str, str]) -> None:
    assert device_budget("CPU:0", environ=environ, gpu_limits=no_gpus) is None


def test_gpu_budget_is_a_safety_fraction_of_its_allocator_limit() -> None:
    budget = device_budget("/job:localhost/replica:0/task:0/device:GPU:1", environ={}, gpu_limits=two_gpus)
    assert budget is not None and budget.nbytes == int(16 * 2**30 * GPU_SAFETY_FRACTION)
    assert "GPU:1" in budget.source


def test_default_device_is_the_first_gpu_if_any_else_the_cpu() -> None:
    on_gpu = device_budget(None, environ=BFC_1GIB, gpu_limits=two_gpus)
    assert on_gpu is not None and on_gpu.nbytes == int(80 * 2**30 * GPU_SAFETY_FRACTION)
    assert device_budget(None, environ=BFC_1GIB, gpu_limits=no_gpus).nbytes == CPU_1GIB


def test_unknown_gpu_has_no_budget() -> None:
    assert device_budget("GPU:7", environ={}, gpu_limits=two_gpus) is None


def test_xla_plan_fits_when_it_fits_whole_and_its_block_finds_room() -> None:
    budget = Budget(1000, "config")  # XLA may plan 950
    assert budget.xla_overshoot(total_bytes=950, largest_bytes=950) == 1
    assert budget.xla_overshoot(total_bytes=1900, largest_bytes=1900) == 2
    # The block needs room beside regions of twice the plan's other buffers ...
    assert budget.xla_overshoot(total_bytes=900, largest_bytes=800) == pytest.approx(800 / 750)
    # ... or of twice what the allocator held before (SVGP's refused block, in MiB):
    svgp = Budget(192 * 2**20, "config")
    assert svgp.xla_overshoot(177 * 2**20, 166 * 2**20, held=Held(peak=25 * 2**20)) > 1.2
    # A block that fits in the largest region an earlier, larger program grew (at least
    # half its peak: regions double) fits; a larger one does not.
    assert budget.xla_overshoot(total_bytes=600, largest_bytes=250, held=Held(peak=900)) == pytest.approx(600 / 950)
    assert budget.xla_overshoot(total_bytes=600, largest_bytes=500, held=Held(peak=900)) == pytest.approx(500 / 450)


def test_only_an_allocator_that_grows_in_regions_counts_its_peak() -> None:
    grows = budget_module._grows_in_regions
    assert grows("CPU", 0, environ={"TF_CPU_ALLOCATOR_USE_BFC": "1"})
    assert not grows("CPU", 0, environ={})
    assert grows("GPU", 0, environ={"TF_FORCE_GPU_ALLOW_GROWTH": "true"})


def test_budget_prints_its_size_and_source() -> None:
    assert str(Budget(2**30, "config")) == "1.0 GiB (config)"


def test_what_the_allocator_already_holds_is_not_on_offer() -> None:
    mib = 2**20
    budget = device_budget("CPU:0", environ=BFC_1GIB, gpu_limits=no_gpus, in_use=lambda d: (100 * mib, 100 * mib))
    assert budget is not None and budget.nbytes == int(924 * mib * CPU_SAFETY_FRACTION)
    assert budget.source == "90% of TF_CPU_BFC_MEM_LIMIT_IN_MB=1024, less 100.0 MiB in use"


def test_on_cpu_a_later_program_fits_where_earlier_ones_grew_the_allocator() -> None:
    # TF's CPU allocator keeps the regions it grew: after a program that peaked at 700 MiB,
    # the next one's block must fit in those (700 MiB) or in the 324 MiB left to grow.
    mib = 2**20
    budget = device_budget("CPU:0", environ=BFC_1GIB, gpu_limits=no_gpus, in_use=lambda d: (10 * mib, 700 * mib))
    assert budget is not None and budget.nbytes == int(700 * mib * CPU_SAFETY_FRACTION)
    assert "one block may take 700.0 MiB (peak so far 700.0 MiB)" in budget.source
    # A GPU's allocator gives free regions back: only what is in use is not on offer.
    gpu = device_budget("GPU:0", environ={}, gpu_limits=lambda: {"GPU:0": 1000 * mib},
                        in_use=lambda d: (10 * mib, 700 * mib))
    assert gpu is not None and gpu.nbytes == int(1000 * mib * GPU_SAFETY_FRACTION) - 10 * mib


def test_replicas_sharing_an_allocator_share_its_budget() -> None:
    budget = resolve_budget(Config(), "/device:CPU:1", sharing=2, environ=BFC_1GIB, gpu_limits=no_gpus)
    assert budget is not None and budget.nbytes == CPU_1GIB // 2 and "shared by 2 replicas" in budget.source
    # A configured budget is per replica already.
    assert resolve_budget(Config(memory_budget="1GiB"), "CPU:1", sharing=2).nbytes == 2**30


def test_an_output_allocated_before_the_block_grows_regions_too() -> None:
    # SGPR predict_f(full_cov=True) at 3,000 points under 128 MiB (in MiB): XLA planned 83.9,
    # a 68.7 output and a 14.8 block of temporaries, and the call ran out of memory asking
    # for the block: the output had taken a region under twice its size, all of it. Judged
    # as one block, the output fit; allocated first, its region counts as held.
    mib = 2**20
    budget = Budget(128 * mib, "config")
    total, output, block = int(83.9 * mib), int(68.7 * mib), int(14.8 * mib)
    assert budget.fits_xla_plan(total, output, held=Held(peak=10 * mib))  # the old reading
    assert not budget.fits_xla_plan(total, block, held=Held(peak=10 * mib), other_bytes=output)
    # A block with small outputs before it is judged as before.
    assert budget.fits_xla_plan(int(70 * mib), int(68.7 * mib), held=Held(peak=20 * mib), other_bytes=mib // 4)


def test_a_plan_reads_its_block_and_outputs_from_xla(rng) -> None:
    import tensorflow as tf

    import tfmem

    x = tf.constant(rng.normal(size=(1000, 3)))
    f = tf.function(lambda x: tf.exp(-tf.matmul(x, x, transpose_b=True)) @ x, jit_compile=True)
    plan = tfmem.xla_plan(f, x)
    assert plan.output_bytes >= 1000 * 3 * 8 and plan.block_bytes >= 1000 * 1000 * 8
    assert plan.total_bytes >= plan.block_bytes + plan.output_bytes


def test_an_overshoot_with_no_room_left_is_said_in_words() -> None:
    budget = Budget(128 * 2**20, "config")
    # A 68.7 MiB output under 128 MiB leaves no room for a 14.8 MiB block: the ratio is
    # the block's size over one byte, a number that means nothing to a reader.
    overshoot = budget.xla_overshoot(83_600_000, 15_500_000, other_bytes=72_000_000)
    assert overshoot > 1e6
    assert budget.describe_overshoot(overshoot) == "overshoot: no room for its block of temporaries"
    assert budget.describe_overshoot(1.0734) == "overshoot 1.073"


MIB = 2**20
# A Gram-matrix loss with gradients, ((AᵀA − BᵀB)/N)² over two [20000, 64] float64 inputs, under
# memory_budget 62.5 MiB and a 63 MiB allocator limit (bytes as measured). XLA planned 53.7 MiB:
# the two 9.8 MiB inputs, two 9.8 MiB gradients (outputs) and a 14.6 MiB block of temporaries.
GRAM_BUDGET = Budget(65_536_000, "config")
GRAM_PLAN = XlaPlan(total_bytes=56_258_948, largest_bytes=20_480_032, temp_bytes=15_298_848, output_bytes=20_480_032)
# The allocator held the inputs in a whole 16 MiB region each: 32 MiB in use, its peak.
GRAM_HELD = Held(in_use=33_615_872, peak=33_647_872)


def test_what_the_allocator_holds_counts_against_a_configured_budget() -> None:
    # The call ran out of memory asking for its block: 32 MiB held + 19.5 outputs + 14.6 block is
    # over 63 MiB. Judged by its peak alone, the largest region (at least half of it) had room.
    assert not GRAM_BUDGET.fits_plan(GRAM_PLAN, GRAM_HELD)
    assert GRAM_BUDGET.plan_overshoot(GRAM_PLAN, GRAM_HELD) > 1
    # The old reading, its peak with nothing in use and the block alone, found the block room.
    assert GRAM_BUDGET.block_room(GRAM_PLAN.total_bytes, GRAM_PLAN.block_bytes, Held(peak=GRAM_HELD.peak)) \
        >= GRAM_PLAN.block_bytes
    assert "beside the 32.1 MiB the allocator holds already" in GRAM_BUDGET.why_not(GRAM_PLAN, GRAM_HELD)
    # A budget from the device left out what its allocator held then: only what came since counts.
    from_device = Budget(GRAM_BUDGET.nbytes, "TF_CPU_BFC_MEM_LIMIT_IN_MB=…", in_use_excluded=GRAM_HELD.in_use)
    assert from_device.beside(GRAM_HELD) == 0 and from_device.beside(Held(GRAM_HELD.in_use + MIB)) == MIB


def test_the_regions_an_allocator_grew_hold_what_is_in_use_there() -> None:
    budget = Budget(1000, "config")
    # A 900-byte peak grew a region of at least 450: free for a block of 400 while nothing is in
    # use; with 300 bytes in use (perhaps all of them there), 150 is all it surely has.
    assert budget.block_room(600, 400, Held(in_use=0, peak=900)) == 450
    assert budget.block_room(600, 400, Held(in_use=300, peak=900)) == 150
    assert not budget.fits_xla_plan(600, 400, Held(in_use=300, peak=900))


def test_a_device_budget_excludes_what_its_allocator_holds() -> None:
    budget = device_budget("CPU:0", environ=BFC_1GIB, gpu_limits=no_gpus, in_use=lambda d: (100 * MIB, 100 * MIB))
    assert budget is not None and budget.in_use_excluded == 100 * MIB
    assert resolve_budget(Config(memory_budget="1GiB")).in_use_excluded == 0


def test_a_re_plan_takes_off_what_xla_must_shed_instead_of_scaling_by_the_overshoot() -> None:
    # A 45 MiB output under 100 MiB leaves a 20 MiB block 5 MiB of room (95 − 2 × 45): the overshoot
    # is 4, and dividing the 90 MiB target by it asked for 21.4 MiB, under the output alone. The
    # block must shed 15 of XLA's 65 MiB: the estimate comes down by as large a share, less the margin.
    budget = Budget(100 * MIB, "config")
    plan = XlaPlan(65 * MIB, 45 * MIB, temp_bytes=20 * MIB, output_bytes=45 * MIB)
    assert budget.plan_overshoot(plan) == pytest.approx(4.0)
    assert budget.replan_target(plan, 65 * MIB) == pytest.approx(50 * MIB * REPLAN_MARGIN, abs=1)
    # Where XLA plans twice the estimate, the estimate sheds half as many bytes.
    assert budget.replan_target(plan, 32 * MIB + MIB // 2) == pytest.approx(25 * MIB * REPLAN_MARGIN, abs=1)


def test_a_larger_budget_does_not_plan_lower_than_a_smaller_one() -> None:
    # GPR predict_f(full_cov=True), n=1500, 2000 test points (bytes as measured): under 5 × 30.5 MiB
    # the first plan's XLA block (212 MiB) found 83.8 MiB of room beside the 30.5 MiB output; the
    # target divided by that overshoot (51.6 MiB) was under the 54.9 MiB a 2 × budget plans to.
    larger, smaller = Budget(160_000_000, "config"), Budget(64_000_000, "config")
    first = XlaPlan(254_350_633, 222_264_736, temp_bytes=222_264_736, output_bytes=32_016_016)
    target = larger.replan_target(first, 142_433_136)
    assert target is not None and target > smaller.plan_bytes
    assert larger.plan_bytes / larger.plan_overshoot(first) * REPLAN_MARGIN < smaller.plan_bytes  # the old rule


def test_no_re_plan_target_when_the_rest_leaves_the_temporaries_no_room() -> None:
    # The Gram loss without an allocator limit (its first plan, in bytes): the inputs and outputs
    # (39.1 MiB), in regions of up to twice their size, leave no room under 59.4 MiB however small
    # the temporaries. The overshoot is the block over one byte; scaled by it, the target was 1 B.
    first = XlaPlan(total_bytes=74_613_060, largest_bytes=33_652_960, temp_bytes=33_652_960,
                    output_bytes=20_480_032)
    assert GRAM_BUDGET.plan_overshoot(first) > 1e6
    assert GRAM_BUDGET.replan_target(first, 51_275_776) is None
    why = GRAM_BUDGET.why_not(first, limit=GRAM_BUDGET.xla_bytes)
    assert "its block of temporaries (32.1 MiB) finds no room in one piece" in why, why
    assert "(parameters, outputs, constants), 39.1 MiB, leave none of 59.4 MiB" in why, why
    # What the allocator holds can take the room too (the Gram loss under its 63 MiB limit).
    assert GRAM_BUDGET.replan_target(GRAM_PLAN, 51_275_776, GRAM_HELD) is None


def test_outputs_allocated_first_may_take_the_largest_region_whole() -> None:
    # Measured (MiB): a [3000, 3000] float64 output (68.7) and a 2.3 MiB block, XLA plans 71.0,
    # under 128 after an earlier call had grown a 126 MiB region: the output took the region
    # whole (BFC splits a chunk only at twice the request), and the block found no room.
    budget = Budget(128 * MIB, "config")
    total, block, output = int(71.0 * MIB), int(2.3 * MIB), int(68.7 * MIB)
    grown = Held(in_use=int(0.1 * MIB), peak=int(126.1 * MIB))
    assert budget.block_room(total, block, grown) > 60 * MIB  # the block alone: the region is free
    assert budget.block_room(total, block, grown, other_bytes=output) == 0
    assert not budget.fits_xla_plan(total, block, grown, other_bytes=output)
    # Outputs under half the region leave it less by what they take.
    small = 10 * MIB
    assert budget.block_room(total, block, grown, other_bytes=small) == pytest.approx(126.1 * MIB / 2 - 0.1 * MIB - small,
                                                                                      rel=1e-6)


def output_after_a_grown_region(limit_mb: int) -> dict[str, object]:
    """In a fresh process under a `limit_mb` BFC limit: an earlier call grows a region of
    nearly the whole limit (its output takes it), then tfmem's verdict on a program with a
    [3000, 3000] float64 output and a small block, and that program's run."""
    import numpy as np
    import tensorflow as tf

    import tfmem

    x = tf.constant(np.random.default_rng(0).normal(size=(3000, 3)))
    w = tf.constant(np.random.default_rng(1).normal(size=(3, 100)))

    def gram(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        t = tf.exp(0.1 * (x @ w))
        return tf.matmul(t, t, transpose_b=True)

    earlier = tf.zeros([(limit_mb - 4) * 2**20 // 8], tf.float64)  # grows one region, nearly all the limit
    del earlier
    wrapped = tfmem.function(gram, config=tfmem.Config(memory_budget=f"{limit_mb}MiB"))
    fits = wrapped.report(x, w).fits
    try:
        wrapped(x, w)
        ran = "ok"
    except tf.errors.ResourceExhaustedError:
        ran = "oom"
    return {"fits": fits, "ran": ran}


def test_a_verdict_after_an_earlier_call_grew_the_regions_is_right_under_a_real_limit() -> None:
    from tfmem.isolation import run_isolated

    result = run_isolated(output_after_a_grown_region, 128, memory_limit_mb=128, timeout=None)
    assert result.status == "ok", result.error
    assert result.value == {"fits": False, "ran": "oom"}


def test_the_allocators_first_region_is_held_once_anything_is() -> None:
    # Measured (MiB): a CG solve's gradient under 76, XLA plans 74.3 with a 74.24 block beside
    # 0.2 of inputs. Twice 0.2 left the block 75.6; the allocator's first region is 2 MiB, and
    # the call ran out of memory asking for the block.
    budget = Budget(76 * MIB, "config")
    total, block = int(74.3 * MIB), int(74.24 * MIB)
    held = Held(in_use=int(0.1 * MIB), peak=int(0.2 * MIB), regions=2 * MIB)  # as `allocator_held` reads it
    assert budget.block_room(total, block, held, limit=budget.nbytes) == 74 * MIB
    assert not budget.fits_xla_plan(total, block, held)
    assert "(at least the allocator's first, 2.0 MiB)" in budget.why_not(XlaPlan(total, block), held)
    assert budget.fits_xla_plan(int(72 * MIB), int(71.9 * MIB), held)
