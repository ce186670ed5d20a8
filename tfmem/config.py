"""`Config`: the limits and switches that steer tfmem, and where they come from.

A config is a frozen dataclass. It can be built in code, from a YAML file, from
`TFMEM_*` environment variables or from absl flags, and every route goes through the
same validation, so a bad value is reported the same way whatever its source:
`ValueError` naming the key and the value.

Example:
    >>> cfg = Config(tensor_size_threshold="1GB", tensor_split_size="256MiB")
    >>> cfg.tensor_size_threshold, cfg.split_size
    (1000000000, 268435456)
    >>> with config_scope(cfg):
    ...     assert active_config() is cfg
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

# The pipeline stages, in the order the PassManager runs them. A rewrite module
# registers its pass under one of these names; `Config.passes` switches stages on.
PASS_STAGES: tuple[str, ...] = ("cleanup", "match_and_replace", "reorder", "split")

_DECIMAL = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_UNITS: dict[str, int] = {**_DECIMAL, **_BINARY}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

ENV_PREFIX = "TFMEM_"


def parse_size(value: Any, *, key: str = "size") -> int | None:
    """Parses a byte size: an int, or a string with a decimal or binary unit.

    kB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024 (case-insensitive);
    decimals are allowed and the result is rounded down to whole bytes. `None`, "",
    "none" and 0 mean "no limit" and return None.

    Example:
        >>> parse_size("1.5GB"), parse_size("512MiB"), parse_size(4096)
        (1500000000, 536870912, 4096)

    Raises:
        ValueError: naming `key` and the value, for negative, non-finite or malformed sizes.
    """
    if value is None or isinstance(value, bool) and value is False:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size in bytes or a string like '512MiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        if value.strip().lower() in ("", "none", "null"):
            return None
        match = _SIZE_RE.match(value)
        if not match:
            raise ValueError(
                f"{key}: cannot parse size {value!r}; use bytes or a number with one of "
                f"{', '.join(u for u in SIZE_UNITS if u)} (e.g. '1.5GB', '512MiB')"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit not in SIZE_UNITS:
            raise ValueError(f"{key}: unknown size unit {match.group(2)!r} in {value!r}; "
                             f"known units: {', '.join(u for u in SIZE_UNITS if u)}")
    else:
        raise ValueError(f"{key}: expected a size, got {type(value).__name__} {value!r}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{key}: size must be a finite number >= 0, got {value!r}")
    size = int(number * SIZE_UNITS[unit])
    return size or None


def check_keys(values: Any, known: tuple[str, ...], *, source: str) -> None:
    """Raises ValueError, naming `source`, unless `values` is a mapping of only `known` keys."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{source}: expected a mapping of keys, got {type(values).__name__}")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"known keys: {', '.join(known)}")


def format_size(nbytes: int | None) -> str:
    """Formats bytes with a binary unit for humans: `format_size(3 * 2**20) == '3.0 MiB'`."""
    if nbytes is None:
        return "-"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _parse_bool(value: Any, *, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{key}: expected true or false, got {value!r}")


def _parse_float(value: Any, *, key: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(number) or number < 0:
        raise ValueError(f"{key}: expected a finite number >= 0, got {value!r}")
    return number


def _parse_passes(value: Any, *, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        names = list(value)
    else:
        raise ValueError(f"{key}: expected a list of pass stages, got {value!r}")
    for name in names:
        if name not in PASS_STAGES:
            raise ValueError(f"{key}: unknown pass stage {name!r}; known stages: {', '.join(PASS_STAGES)}")
    return tuple(name for name in PASS_STAGES if name in names)  # run order is fixed


@dataclasses.dataclass(frozen=True)
class Config:
    """What tfmem may do to a function, and the memory limits it works to.

    Attributes:
        tensor_size_threshold: a tensor larger than this (bytes) is split; None = never split.
        tensor_split_size: the largest tensor a split loop body may hold; None = the threshold.
        memory_budget: after splitting, keep splitting the largest tensors live at the
            static peak until the estimate fits this many bytes; None = no budget.
        passes: the pipeline stages that run, a subset of `PASS_STAGES`.
        jit_compile: compile the rewritten graph with XLA.
        strict: raise instead of falling back to the original function when tfmem cannot
            rewrite, import or run a graph.
        verify: on the first call of each signature, run the original and the rewritten
            function and compare their outputs (skipped, with a warning, for functions
            that write variables).
        verify_rtol, verify_atol: tolerances of that comparison.

    Sizes accept bytes or strings such as "1.5GB" (powers of 1000) or "512MiB" (of 1024).

    Example:
        >>> Config.from_mapping({"tensor_size_threshold": "64MB", "passes": ["split"]}).passes
        ('split',)
    """

    tensor_size_threshold: int | None = None
    tensor_split_size: int | None = None
    memory_budget: int | None = None
    passes: tuple[str, ...] = PASS_STAGES
    jit_compile: bool = True
    strict: bool = False
    verify: bool = False
    verify_rtol: float = 1e-6
    verify_atol: float = 1e-8

    def __post_init__(self) -> None:
        # One validation path for every source: values from code are normalised too.
        normalise = {
            "tensor_size_threshold": parse_size,
            "tensor_split_size": parse_size,
            "memory_budget": parse_size,
            "passes": _parse_passes,
            "jit_compile": _parse_bool,
            "strict": _parse_bool,
            "verify": _parse_bool,
            "verify_rtol": _parse_float,
            "verify_atol": _parse_float,
        }
        for key, parse in normalise.items():
            object.__setattr__(self, key, parse(getattr(self, key), key=key))
        threshold, split = self.tensor_size_threshold, self.tensor_split_size
        if split is not None and threshold is None:
            raise ValueError(f"tensor_split_size: set to {split} bytes but tensor_size_threshold is "
                             "not set; the split size only applies once a threshold is set")
        if self.memory_budget is not None and threshold is None:
            raise ValueError(f"memory_budget: set to {self.memory_budget} bytes but tensor_size_threshold "
                             "is not set; the budget is met by splitting, which the threshold turns on")
        if split is not None and threshold is not None and split > threshold:
            raise ValueError(f"tensor_split_size: {split} bytes is larger than "
                             f"tensor_size_threshold ({threshold} bytes); it must be <= the threshold")

    @property
    def split_size(self) -> int | None:
        """The chunk budget in bytes: `tensor_split_size`, or the threshold when unset."""
        return self.tensor_split_size or self.tensor_size_threshold

    # --- constructors -------------------------------------------------------------

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: Config | None = None,
                     source: str = "config") -> Config:
        """Builds a config from a mapping of key → value, on top of `base` (default: defaults).

        Raises:
            ValueError: for an unknown key (naming it and `source`) or a bad value.
        """
        check_keys(values, cls.keys(), source=source)
        return dataclasses.replace(base or cls(), **dict(values))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, base: Config | None = None) -> Config:
        """Reads a YAML file of `key: value` lines (see `configs/default.yaml`).

        Raises:
            ValueError: if the file cannot be read or parsed, or holds a bad key or value.
        """
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        return cls.from_mapping(values or {}, base=base, source=f"config file {str(path)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, base: Config | None = None) -> Config:
        """Reads `TFMEM_CONFIG` (a YAML path) and then `TFMEM_<KEY>` overrides.

        Example: `TFMEM_TENSOR_SIZE_THRESHOLD=1GB TFMEM_PASSES=cleanup,split python train.py`.
        """
        environ = os.environ if environ is None else environ
        config = base or cls()
        if environ.get(f"{ENV_PREFIX}CONFIG"):
            config = cls.from_yaml(environ[f"{ENV_PREFIX}CONFIG"], base=config)
        values = {key: environ[f"{ENV_PREFIX}{key.upper()}"] for key in cls.keys()
                  if f"{ENV_PREFIX}{key.upper()}" in environ}
        unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX)
                         and name[len(ENV_PREFIX):].lower() not in (*cls.keys(), "config"))
        if unknown:
            raise ValueError(f"environment: unknown variable(s) {', '.join(unknown)}; known: "
                             + ", ".join(f"{ENV_PREFIX}{k.upper()}" for k in ("config", *cls.keys())))
        return cls.from_mapping(values, base=config, source="environment")

    @classmethod
    def from_flags(cls, flag_values: Any = None, *, base: Config | None = None) -> Config:
        """Reads the `--tfmem_*` absl flags defined by `define_flags` (only those set).

        Example:
            >>> from absl import flags
            >>> fv = flags.FlagValues(); define_flags(fv)
            >>> fv(["prog", "--tfmem_tensor_size_threshold=2GiB"])  # doctest: +ELLIPSIS
            [...]
            >>> Config.from_flags(fv).tensor_size_threshold
            2147483648
        """
        from absl import flags

        flag_values = flags.FLAGS if flag_values is None else flag_values
        config = base or cls()
        if flag_values["tfmem_config"].present:
            config = cls.from_yaml(flag_values.tfmem_config, base=config)
        values = {key: flag_values[f"tfmem_{key}"].value for key in cls.keys()
                  if flag_values[f"tfmem_{key}"].present}
        return cls.from_mapping(values, base=config, source="flags")


def define_flags(flag_values: Any = None) -> None:
    """Defines `--tfmem_config` and one `--tfmem_<key>` string flag per config key."""
    from absl import flags

    flag_values = flags.FLAGS if flag_values is None else flag_values
    flags.DEFINE_string("tfmem_config", None, "YAML config file for tfmem.", flag_values=flag_values)
    for field in dataclasses.fields(Config):
        flags.DEFINE_string(f"tfmem_{field.name}", None,
                            f"tfmem config key {field.name!r} (overrides --tfmem_config).",
                            flag_values=flag_values)


_ACTIVE: contextvars.ContextVar[Config | None] = contextvars.ContextVar("tfmem_config", default=None)


def active_config() -> Config:
    """The config set by the innermost `config_scope`, else one read from `TFMEM_*` variables.

    Every call of a wrapped function asks for it, so the environment's config is built
    once per distinct set of `TFMEM_*` values (a `TFMEM_CONFIG` file is read then).
    """
    config = _ACTIVE.get()
    if config is not None:
        return config
    return _config_from_env(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIX))))


@functools.lru_cache(maxsize=8)
def _config_from_env(items: tuple[tuple[str, str], ...]) -> Config:
    return Config.from_env(dict(items))


@contextlib.contextmanager
def config_scope(config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Iterator[Config]:
    """Makes `config` (a Config, a mapping, or a YAML path) the active config in a `with` block.

    Example:
        >>> with config_scope({"tensor_size_threshold": "64MB"}) as cfg:
        ...     cfg.tensor_size_threshold
        64000000
    """
    if isinstance(config, Mapping):
        config = Config.from_mapping(config)
    elif not isinstance(config, Config):
        config = Config.from_yaml(config)
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)
