"""Where the memory budget comes from: the config, the GPU, the CPU allocator's limit, or nowhere."""
from __future__ import annotations

import pytest

from tfmem import budget as budget_module
from tfmem.budget import (CPU_SAFETY_FRACTION, GPU_SAFETY_FRACTION, PLANNING_FRACTION, Budget, device_budget,
                          resolve_budget)
from tfmem.config import Config

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
    assert svgp.xla_overshoot(177 * 2**20, 166 * 2**20, held_peak=25 * 2**20) > 1.2
    # A block that fits in the largest region an earlier, larger program grew (at least
    # half its peak: regions double) fits; a larger one does not.
    assert budget.xla_overshoot(total_bytes=600, largest_bytes=250, held_peak=900) == pytest.approx(600 / 950)
    assert budget.xla_overshoot(total_bytes=600, largest_bytes=500, held_peak=900) == pytest.approx(500 / 450)


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
    assert budget.fits_xla_plan(total, output, held_peak=10 * mib)  # the old reading
    assert not budget.fits_xla_plan(total, block, held_peak=10 * mib, other_bytes=output)
    # A block with small outputs before it is judged as before.
    assert budget.fits_xla_plan(int(70 * mib), int(68.7 * mib), held_peak=20 * mib, other_bytes=mib // 4)


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
