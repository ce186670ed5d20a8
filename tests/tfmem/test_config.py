"""Config: size units, every error path, and each way of building one."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from absl import flags

from tfmem.config import PASS_STAGES, Config, active_config, config_scope, define_flags, format_size, parse_size

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, expected", [
    (0, None),
    (None, None),
    ("none", None),
    (4096, 4096),
    ("4096", 4096),
    ("1kB", 1000),
    ("1KiB", 1024),
    ("64MB", 64_000_000),
    ("512MiB", 512 * 2**20),
    ("1GB", 10**9),
    ("1gb", 10**9),
    ("1GiB", 2**30),
    ("1.5GB", 1_500_000_000),
    ("0.5GiB", 2**29),
    (" 2 TiB ", 2 * 2**40),
    ("1e3", 1000),
    ("10b", 10),
])
def test_parse_size_units(text: object, expected: int | None) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("values, key", [
    ({"tensor_size_threshold": "-1GB"}, "tensor_size_threshold"),
    ({"tensor_size_threshold": -5}, "tensor_size_threshold"),
    ({"tensor_size_threshold": "12 parsecs"}, "tensor_size_threshold"),
    ({"tensor_size_threshold": "GB"}, "tensor_size_threshold"),
    ({"tensor_size_threshold": "1..5GB"}, "tensor_size_threshold"),
    ({"tensor_size_threshold": [1]}, "tensor_size_threshold"),
    ({"tensor_size_threshold": True}, "tensor_size_threshold"),
    ({"tensor_size_threshold": float("inf")}, "tensor_size_threshold"),
    ({"tensor_size_threshold": "1GB", "tensor_split_size": "2GB"}, "tensor_split_size"),
    ({"tensor_split_size": "1MB"}, "tensor_split_size"),
    ({"tensor_size_threshold": "1GB", "memory_budget": "lots"}, "memory_budget"),
    ({"tensor_size_treshold": "1GB"}, "tensor_size_treshold"),
    ({"passes": ["cleanup", "fold_everything"]}, "passes"),
    ({"passes": 3}, "passes"),
    ({"jit_compile": "maybe"}, "jit_compile"),
    ({"strict": 2}, "strict"),
    ({"verify": None}, "verify"),
    ({"verify_rtol": -1e-3}, "verify_rtol"),
    ({"verify_atol": "small"}, "verify_atol"),
])
def test_bad_config_names_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        Config.from_mapping(values)


def test_sizes_in_code_are_normalised() -> None:
    config = Config(tensor_size_threshold="1GiB", tensor_split_size="256MiB")
    assert (config.tensor_size_threshold, config.tensor_split_size) == (2**30, 2**28)
    assert config.split_size == 2**28
    assert Config(tensor_size_threshold="1GB").split_size == 10**9


def test_passes_run_in_pipeline_order() -> None:
    assert Config(passes=["split", "cleanup"]).passes == ("cleanup", "split")
    assert Config(passes="reorder, cleanup").passes == ("cleanup", "reorder")
    assert Config(passes=[]).passes == ()


def test_default_yaml_documents_every_key_at_its_default() -> None:
    path = REPO / "configs" / "default.yaml"
    values = yaml.safe_load(path.read_text())
    assert set(values) == set(Config.keys())
    assert Config.from_yaml(path) == Config()
    text = path.read_text()
    for key in Config.keys():  # each key has a comment right above it
        lines = text.splitlines()
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        assert lines[index - 1].startswith("#"), key


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        Config.from_yaml(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("tensor_size_threshold: [1GB\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        Config.from_yaml(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected keys at the top level"):
        Config.from_yaml(listing)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("tensor_size_threshold: 1GB\nchunk: 3\n")
    with pytest.raises(ValueError, match="'chunk'.*unknown.yaml|unknown.yaml.*'chunk'"):
        Config.from_yaml(unknown)


def test_from_env_reads_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tensor_size_threshold: 2GB\nstrict: true\n")
    env = {"TFMEM_CONFIG": str(path), "TFMEM_TENSOR_SIZE_THRESHOLD": "1GiB", "TFMEM_VERIFY": "yes",
           "PATH": "/bin"}
    config = Config.from_env(env)
    assert (config.tensor_size_threshold, config.strict, config.verify) == (2**30, True, True)
    with pytest.raises(ValueError, match="TFMEM_THRESHOLD"):
        Config.from_env({"TFMEM_THRESHOLD": "1GB"})
    with pytest.raises(ValueError, match="tensor_size_threshold"):
        Config.from_env({"TFMEM_TENSOR_SIZE_THRESHOLD": "lots"})


def test_from_flags() -> None:
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    flag_values(["prog", "--tfmem_tensor_size_threshold=64MB", "--tfmem_passes=cleanup,split",
                 "--tfmem_jit_compile=false"])
    config = Config.from_flags(flag_values)
    assert config.tensor_size_threshold == 64_000_000
    assert config.passes == ("cleanup", "split")
    assert config.jit_compile is False


def test_config_scope_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TFMEM_TENSOR_SIZE_THRESHOLD", raising=False)
    outer = active_config()
    with config_scope({"tensor_size_threshold": "1MB"}) as config:
        assert active_config() is config
        with config_scope(Config(strict=True)):
            assert active_config().strict
        assert active_config() is config
    assert active_config() == outer


def test_config_is_frozen_and_hashable() -> None:
    config = Config(tensor_size_threshold="1GB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.strict = True  # type: ignore[misc]
    assert hash(config) == hash(Config(tensor_size_threshold=10**9))
    assert Config().passes == PASS_STAGES


@pytest.mark.parametrize("nbytes, text", [(None, "-"), (512, "512 B"), (3 * 2**20, "3.0 MiB"),
                                          (int(1.5 * 2**30), "1.5 GiB")])
def test_format_size(nbytes: int | None, text: str) -> None:
    assert format_size(nbytes) == text


def test_memory_budget_alone_is_a_complete_config() -> None:
    config = Config(memory_budget="1GB")
    assert (config.memory_budget, config.tensor_size_threshold) == (10**9, None)
    assert Config(memory_budget="1GB", tensor_split_size="64MB").tensor_split_size == 64 * 10**6


@pytest.mark.parametrize("zero", [0, "0", "0MiB", 0.0])
def test_a_zero_memory_budget_is_refused_not_read_as_the_devices(zero: object) -> None:
    """A size of 0 means "no limit" for the thresholds; for the budget it would silently
    have meant the device's budget. It is refused, naming the key and the two ways out."""
    with pytest.raises(ValueError, match=r"memory_budget: a budget of .* cannot hold anything.*'off'.*unset"):
        Config(memory_budget=zero)
    assert Config(memory_budget=None).memory_budget is None and Config(memory_budget="none").memory_budget is None


# --- one loader for every config file, one coercion for every `config=` -----------------

BUNDLED = sorted(path.name for path in (REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_config_loads_everywhere_it_is_documented(name: str) -> None:
    """`tfmem.function(config=)`, `config_scope`, `TFMEM_CONFIG`, `--tfmem_config`, `Config.from_yaml`
    and `Config.coerce` all read a bundled file the same way (the CLI's `--config` and
    `gpflow_integration` are checked in their own tests)."""
    from tfmem.wrapper import TfmemFunction

    path = REPO / "configs" / name
    expected = Config.from_yaml(path)
    assert Config.coerce(path) == Config.coerce(str(path)) == expected
    assert TfmemFunction(lambda x: x, config=str(path)).config == expected
    with config_scope(path) as scoped:
        assert scoped == expected
    assert Config.from_env({"TFMEM_CONFIG": str(path)}) == expected
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    flag_values(["prog", f"--tfmem_config={path}"])
    assert Config.from_flags(flag_values) == expected
    values = yaml.safe_load(path.read_text())
    if "tfmem" in values:  # a sectioned file: the tfmem section, and nothing else, is the config
        assert expected == Config.from_mapping(values["tfmem"])
    else:
        assert expected == Config.from_mapping(values)


def test_sectioned_file_reads_its_tfmem_section(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("tfmem:\n  tensor_size_threshold: 64MB\nother_tool:\n  anything: [1, 2]\n")
    assert Config.from_yaml(path) == Config(tensor_size_threshold="64MB")
    only_other = tmp_path / "other.yaml"
    only_other.write_text("other_tool:\n  anything: 1\n")
    assert Config.from_yaml(only_other) == Config()  # no tfmem section: the defaults


def test_coerce_keeps_configs_and_none_and_rejects_other_types() -> None:
    config = Config(strict=True)
    assert Config.coerce(config) is config
    assert Config.coerce(None) is None
    assert Config.coerce({"strict": True}) == config
    with pytest.raises(TypeError, match="expected a tfmem.Config, a mapping of its keys or a YAML path"):
        Config.coerce(3)


def _one_line_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "my.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        Config.from_yaml(path)
    message = str(caught.value)
    assert "\n" not in message, message
    assert str(path) in message, message
    return message


@pytest.mark.parametrize("text, expected", [
    ("tensor_size_treshold: 1GB\n", "unknown key 'tensor_size_treshold' (did you mean 'tensor_size_threshold'?)"),
    ("tfmem:\n  strcit: true\n", "section 'tfmem': unknown key 'strcit' (did you mean 'strict'?)"),
    ("tfmem:\n  tensor_size_threshold: -64MB\n",
     "section 'tfmem': tensor_size_threshold: a size must not be negative, got '-64MB'"),
    ("tensor_size_threshold: -5\n", "tensor_size_threshold: a size must not be negative, got -5"),
    ("verify_rtol: -0.1\n", "verify_rtol: must not be negative"),
    ("tensor_size_threshold: 64MBB\n", "unknown size unit 'MBB' in '64MBB' (did you mean 'mb'?)"),
    ("passes: [cleanup, splt]\n", "unknown pass stage 'splt' (did you mean 'split'?)"),
    ("tfme:\n  strict: true\n", "no 'tfmem' section; is section 'tfme' a typo of 'tfmem'?"),
    ("tfmem:\n  strict: true\ntensor_size_threshold: 1GB\n",
     "key 'tensor_size_threshold' is not a section (a mapping of keys), got '1GB'; put it under 'tfmem:'"),
    ("tensor_size_threshold: [1GB\n", "not valid YAML at line 2, column 1"),
    ("- 1\n- 2\n", "expected keys at the top level, got list"),
])
def test_file_errors_are_one_line_naming_file_key_and_problem(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _one_line_error(tmp_path, text)


def test_unknown_environment_variable_suggests_the_right_one() -> None:
    with pytest.raises(ValueError, match=r"TFMEM_TENSOR_SIZE_TRESHOLD \(did you mean 'TFMEM_TENSOR_SIZE_THRESHOLD'\?\)"):
        Config.from_env({"TFMEM_TENSOR_SIZE_TRESHOLD": "1GB"})


def test_a_mistyped_keyword_names_the_key_and_the_closest_one() -> None:
    with pytest.raises(TypeError, match=r"unknown key 'memroy_budget' \(did you mean 'memory_budget'\?\); known keys"):
        Config(memroy_budget="1GiB")
    assert Config(memory_budget="1GiB") == dataclasses.replace(Config(), memory_budget="1GiB")
