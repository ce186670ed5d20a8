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
import difflib
import functools
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tfmem.errors import first_line

# The pipeline stages, in the order the PassManager runs them. A rewrite module
# registers its pass under one of these names; `Config.passes` switches stages on.
PASS_STAGES: tuple[str, ...] = ("cleanup", "match_and_replace", "reorder", "split")

_DECIMAL = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_UNITS: dict[str, int] = {**_DECIMAL, **_BINARY}
_SIZE_RE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

ENV_PREFIX = "TFMEM_"
# The section of a sectioned YAML file (see `ConfigFile`) that holds `Config` keys.
SECTION = "tfmem"


def did_you_mean(word: Any, known: Any) -> str:
    """" (did you mean 'x'?)" for the closest of `known` to a mistyped `word`, else "".

    Example:
        >>> did_you_mean("tensor_size_treshold", ["tensor_size_threshold", "strict"])
        " (did you mean 'tensor_size_threshold'?)"
    """
    close = difflib.get_close_matches(str(word), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Strings that mean "no size given" (`parse_size` returns None for them, as for None).
_NO_SIZE = ("", "none", "null")


def parse_size(value: Any, *, key: str = "size") -> int | None:
    """Parses a byte size: an int, or a string with a decimal or binary unit.

    kB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024 (case-insensitive);
    decimals are allowed and the result is rounded down to whole bytes. `None`, "",
    "none" and 0 mean "no limit" and return None.

    Example:
        >>> parse_size("1.5GB"), parse_size("512MiB"), parse_size(4096)
        (1500000000, 536870912, 4096)
        >>> parse_size("-64MB", key="tensor_size_threshold")
        Traceback (most recent call last):
        ...
        ValueError: tensor_size_threshold: a size must not be negative, got '-64MB'

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
        if value.strip().lower() in _NO_SIZE:
            return None
        match = _SIZE_RE.match(value)
        if not match:
            raise ValueError(
                f"{key}: cannot parse size {value!r}; use bytes or a number with one of "
                f"{', '.join(u for u in SIZE_UNITS if u)} (e.g. '1.5GB', '512MiB')"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit not in SIZE_UNITS:
            units = [u for u in SIZE_UNITS if u]
            raise ValueError(f"{key}: unknown size unit {match.group(2)!r} in {value!r}"
                             f"{did_you_mean(unit, units)}; known units: {', '.join(units)}")
    else:
        raise ValueError(f"{key}: expected a size, got {type(value).__name__} {value!r}")
    if number < 0:
        raise ValueError(f"{key}: a size must not be negative, got {value!r}")
    if not math.isfinite(number):
        raise ValueError(f"{key}: a size must be finite, got {value!r}")
    size = int(number * SIZE_UNITS[unit])
    return size or None


def check_keys(values: Any, known: tuple[str, ...], *, source: str) -> None:
    """Raises ValueError, naming `source`, unless `values` is a mapping of only `known` keys.

    Example:
        >>> check_keys({"strcit": True}, ("strict", "verify"), source="config file 'my.yaml'")
        Traceback (most recent call last):
        ...
        ValueError: config file 'my.yaml': unknown key 'strcit' (did you mean 'strict'?); known keys: strict, verify
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"{source}: expected a mapping of keys, got {type(values).__name__}")
    unknown = sorted((key for key in values if key not in known), key=str)
    if unknown:
        named = ", ".join(f"{key!r}{did_you_mean(key, known)}" for key in unknown)
        raise ValueError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {named}; "
                         f"known keys: {', '.join(known)}")


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """A YAML config file, read once, as named sections of keys.

    Two layouts are understood, and every reader of config files goes through here:

    - flat: `key: value` lines of `Config` keys only (`configs/default.yaml`); it is
      read as a file whose only section is `tfmem`.
    - sectioned: top-level mappings, one per tool (`configs/sgpr.yaml` has `tfmem:` and
      `compare:`). `Config` reads the `tfmem:` section (absent = the defaults); other
      tools read their own sections with `section(name)`.

    A file is sectioned when it has a `tfmem:` key or any top-level mapping; then every
    top-level key must be a section.

    Example:
        >>> file = ConfigFile.read("configs/sgpr.yaml")
        >>> file.sectioned, sorted(file.sections)
        (True, ['compare', 'tfmem'])
        >>> file.where("compare")
        "config file 'configs/sgpr.yaml', section 'compare'"
        >>> Config.from_file(file).passes
        ('cleanup', 'match_and_replace', 'reorder', 'split')
    """

    path: str
    sections: Mapping[str, Mapping[str, Any]]
    sectioned: bool

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ConfigFile:
        """Reads and parses `path`.

        Raises:
            ValueError: one line naming the file, for an unreadable file, invalid YAML, or
                a layout that is neither flat nor sectioned.
        """
        name = str(path)
        where = f"config file {name!r}"
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"{where}: cannot be read: {err.strerror or err}") from None
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{where}: not valid YAML{_yaml_problem(err)}") from None
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise ValueError(f"{where}: expected keys at the top level, got {type(values).__name__} "
                             f"{_short(values)}")
        if SECTION not in values and not any(isinstance(v, Mapping) for v in values.values()):
            return cls(name, {SECTION: dict(values)}, sectioned=False)
        sections: dict[str, Mapping[str, Any]] = {}
        for key, section in values.items():
            if section is not None and not isinstance(section, Mapping):
                hint = f"; put it under '{SECTION}:'" if key in Config.keys() else ""
                raise ValueError(f"{where}: key {key!r} is not a section (a mapping of keys), got "
                                 f"{_short(section)}{hint}")
            sections[str(key)] = dict(section or {})
        return cls(name, sections, sectioned=True)

    def where(self, section: str) -> str:
        """Where a key of `section` comes from, for error messages."""
        return f"config file {self.path!r}" + (f", section {section!r}" if self.sectioned else "")

    def section(self, name: str) -> Mapping[str, Any]:
        """The keys of section `name`; empty if the file has no such section."""
        return self.sections.get(name, {})

    def check_sections(self, known: tuple[str, ...]) -> None:
        """Raises ValueError, naming the file, for a section outside `known` (e.g. a typo)."""
        check_keys(self.sections, known, source=f"config file {self.path!r}: sections")


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or first_line(err)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at}: {problem}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


# `memory_budget: off`: no bound at all, not even the device's (the paper's per-tensor
# semantics, for those who want them). YAML reads a bare `off` as false.
BUDGET_OFF = "off"


def _parse_budget(value: Any, *, key: str) -> int | str | None:
    """A size, None (the device's), or `BUDGET_OFF` for "off" / false."""
    if value is False or isinstance(value, str) and value.strip().lower() in (BUDGET_OFF, "false"):
        return BUDGET_OFF
    size = parse_size(value, key=key)
    unset = value is None or isinstance(value, str) and value.strip().lower() in _NO_SIZE
    if size is None and not unset:
        # parse_size reads 0 as "no limit"; for a budget that would silently mean the
        # device's, which is not what a zero says.
        raise ValueError(f"{key}: a budget of {value!r} bytes cannot hold anything; set a size like "
                         f"'512MiB', '{BUDGET_OFF}' for no budget, or leave it unset for the device's")
    return size


def _parse_float(value: Any, *, key: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    if number < 0:
        raise ValueError(f"{key}: must not be negative, got {value!r}")
    return number


def _parse_directory(value: Any, *, key: str) -> str | None:
    """A directory path ("~" expanded); None or "" for none."""
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{key}: expected a directory path, got {value!r}")
    path = os.path.expanduser(os.fspath(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{key}: {path!r} exists and is not a directory")
    return path


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
            raise ValueError(f"{key}: unknown pass stage {name!r}{did_you_mean(name, PASS_STAGES)}; "
                             f"known stages: {', '.join(PASS_STAGES)}")
    return tuple(name for name in PASS_STAGES if name in names)  # run order is fixed


@dataclasses.dataclass(frozen=True)
class Config:
    """What tfmem may do to a function, and the memory limits it works to.

    Attributes:
        memory_budget: the one knob: tfmem splits, and sizes chunks, until the whole
            program's estimated peak fits this many bytes. None = the device's (a GPU's
            memory, or the CPU allocator's `TF_CPU_BFC_MEM_LIMIT_IN_MB`; see `tfmem.budget`),
            or no budget when the device offers none. "off" = no bound at all, not even
            the device's: only the thresholds split (the paper's per-tensor semantics).
        tensor_size_threshold: expert override: a tensor larger than this (bytes) is split
            whether or not the budget needs it; None = let the budget decide. It adds
            splits; it never lifts the budget.
        tensor_split_size: expert override: the largest tensor a split loop body may
            hold, beside a threshold or a budget (the budget never grows a chunk past
            it); None = the threshold, or whatever fits the budget.
        passes: the pipeline stages that run, a subset of `PASS_STAGES`.
        jit_compile: compile the rewritten graph with XLA (and the program as written, where it
            falls back, as stock `tf.function(jit_compile=True)` would).
        strict: raise instead of falling back to the original function when tfmem cannot
            rewrite, import or run a graph, and instead of warning when the program may
            not fit its budget.
        verify: on the first call of each signature, run the original and the rewritten
            function and compare their outputs (skipped, with a warning, for functions
            that write variables, and where the original runs out of memory).
        verify_rtol, verify_atol: tolerances of that comparison: each element within
            `atol` + `rtol` × the output's largest magnitude, `rtol` at least 100
            epsilons of the output's dtype.
        plan_cache: a directory where each signature's plan (the rewritten graph, the
            verdict, XLA's checked plan) is kept, so that a later process running the
            same program under the same config skips rewriting and XLA's check
            (`tfmem.plan_cache`); None (the default) keeps nothing.

    Sizes accept bytes or strings such as "1.5GB" (powers of 1000) or "512MiB" (of 1024).

    Example:
        >>> Config.from_mapping({"tensor_size_threshold": "64MB", "passes": ["split"]}).passes
        ('split',)
    """

    tensor_size_threshold: int | None = None
    tensor_split_size: int | None = None
    memory_budget: int | str | None = None  # bytes, None (the device's) or BUDGET_OFF
    passes: tuple[str, ...] = PASS_STAGES
    jit_compile: bool = True
    strict: bool = False
    verify: bool = False
    verify_rtol: float = 1e-6
    verify_atol: float = 1e-8
    plan_cache: str | None = None

    def __post_init__(self) -> None:
        # One validation path for every source: values from code are normalised too.
        normalise = {
            "tensor_size_threshold": parse_size,
            "tensor_split_size": parse_size,
            "memory_budget": _parse_budget,
            "passes": _parse_passes,
            "jit_compile": _parse_bool,
            "strict": _parse_bool,
            "verify": _parse_bool,
            "verify_rtol": _parse_float,
            "verify_atol": _parse_float,
            "plan_cache": _parse_directory,
        }
        for key, parse in normalise.items():
            object.__setattr__(self, key, parse(getattr(self, key), key=key))
        threshold, split = self.tensor_size_threshold, self.tensor_split_size
        if split is not None and threshold is None and self.memory_budget in (None, BUDGET_OFF):
            raise ValueError(f"tensor_split_size: set to {split} bytes but neither tensor_size_threshold "
                             "nor memory_budget is set; the split size only applies once one is")
        if split is not None and threshold is not None and split > threshold:
            raise ValueError(f"tensor_split_size: {split} bytes is larger than "
                             f"tensor_size_threshold ({threshold} bytes); it must be <= the threshold")

    @property
    def budget_off(self) -> bool:
        """`memory_budget: off`: no bound, not even the device's."""
        return self.memory_budget == BUDGET_OFF

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
            ValueError: one line naming `source`, the key and the problem, for an unknown
                key (with the closest known key) or a bad value.
        """
        check_keys(values, cls.keys(), source=source)
        try:
            return dataclasses.replace(base or cls(), **dict(values))
        except ValueError as err:  # the message names the key; say where it came from
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, base: Config | None = None) -> Config:
        """Reads a YAML file: flat `key: value` lines, or the `tfmem:` section of a sectioned file.

        See `ConfigFile` for the two layouts; `configs/` holds one of each.

        Example:
            >>> Config.from_yaml("configs/low-memory.yaml").memory_budget
            201326592

        Raises:
            ValueError: one line naming the file, the key and the problem.
        """
        return cls.from_file(ConfigFile.read(path), base=base)

    @classmethod
    def from_file(cls, file: ConfigFile, *, base: Config | None = None) -> Config:
        """The config in an already read `ConfigFile` (its `tfmem` section)."""
        if file.sectioned and SECTION not in file.sections:
            # A section named like ours is a typo, not another tool's section.
            typo = difflib.get_close_matches(SECTION, list(file.sections), n=1, cutoff=0.6)
            if typo:
                raise ValueError(f"config file {file.path!r}: no {SECTION!r} section; is section "
                                 f"{typo[0]!r} a typo of {SECTION!r}?")
        return cls.from_mapping(file.section(SECTION), base=base, source=file.where(SECTION))

    @classmethod
    def coerce(cls, value: Config | Mapping[str, Any] | str | os.PathLike[str] | None) -> Config | None:
        """The one conversion of what users pass as `config=`: a Config, a mapping of its
        keys, or a YAML path (flat or sectioned); None stays None (= the active config).

        Example:
            >>> Config.coerce({"tensor_size_threshold": "64MB"}).tensor_size_threshold
            64000000
            >>> Config.coerce("configs/sgpr.yaml") == Config.from_yaml("configs/sgpr.yaml")
            True
            >>> Config.coerce(None) is None
            True

        Raises:
            ValueError: for a bad file, key or value (one line naming where it came from).
            TypeError: for anything else.
        """
        if value is None or isinstance(value, Config):
            return value
        if isinstance(value, Mapping):
            return cls.from_mapping(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_yaml(value)
        raise TypeError(f"config: expected a tfmem.Config, a mapping of its keys or a YAML path, "
                        f"got {type(value).__name__}")

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
        known = tuple(f"{ENV_PREFIX}{k.upper()}" for k in ("config", *cls.keys()))
        unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)
        if unknown:
            named = ", ".join(f"{name}{did_you_mean(name, known)}" for name in unknown)
            raise ValueError(f"environment: unknown variable{'s' if len(unknown) > 1 else ''} {named}; "
                             f"known: {', '.join(known)}")
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


def _keys_checked(init: Any) -> Any:
    """`Config.__init__`, naming a mistyped keyword as the file and mapping loaders do
    (dataclasses' own error says only "unexpected keyword argument")."""
    @functools.wraps(init)
    def checked(self: Config, *args: Any, **kwargs: Any) -> None:
        try:
            check_keys(kwargs, Config.keys(), source="Config")
        except ValueError as err:  # a wrong keyword argument: Python's own error type
            raise TypeError(str(err)) from None
        init(self, *args, **kwargs)

    return checked


Config.__init__ = _keys_checked(Config.__init__)  # type: ignore[method-assign]


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
    config = Config.coerce(config)
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)
