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
    ({"memory_budget": "1GB"}, "memory_budget"),
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
    with pytest.raises(ValueError, match="expected a mapping"):
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
