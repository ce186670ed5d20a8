"""The bundled configs parse, every key is documented, and bad files say what is wrong."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import tfmem
from gpflow_integration.settings import CompareSettings, load_settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


BUNDLED = sorted(path.name for path in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_configs_load(name, quick):
    """compare reads the same tfmem config as tfmem itself (one loader), from every bundled file."""
    settings, config = load_settings(CONFIGS / name, quick=quick)
    assert isinstance(config, tfmem.Config)
    assert settings.model == "sgpr"
    sections = yaml.safe_load((CONFIGS / name).read_text())
    if not quick or "quick" not in sections.get("compare", {}):
        assert config == tfmem.Config.from_yaml(CONFIGS / name)
    if "compare" in sections:
        assert set(sections["compare"]) - {"quick"} <= set(CompareSettings.keys())


@pytest.mark.parametrize("name", ["sgpr.yaml", "low-memory.yaml"])
def test_every_key_has_a_comment(name):
    lines = (CONFIGS / name).read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[a-z_]+:", line) and not re.match(r"^(compare|tfmem):", line):
            above = next((prev.strip() for prev in reversed(lines[:i]) if prev.strip()), "")
            assert above.startswith("#") or "#" in line or _in_quick_block(lines, i), \
                f"{name}:{i + 1}: key without a comment: {line.strip()}"


def _in_quick_block(lines: list[str], index: int) -> bool:
    """Keys of `compare.quick` are documented by the comment above `quick:`."""
    for prev in reversed(lines[:index]):
        if re.match(r"^\s{2}quick:", prev):
            return True
        if re.match(r"^\s{0,2}[a-z_]+:", prev):
            return False
    return False


def test_quick_overrides_and_flags():
    settings, config = load_settings(CONFIGS / "sgpr.yaml", quick=True, overrides={"memory_budget": "64MiB"})
    assert settings.dataset == "synthetic"
    assert settings.memory_budget == 64 * 2**20
    # The bundled quick run keeps the tfmem section: the trial's allocator limit is the budget.
    assert config == tfmem.Config.from_yaml(CONFIGS / "sgpr.yaml")
    assert config.memory_budget is None and config.tensor_size_threshold is None
    settings, _ = load_settings(CONFIGS / "sgpr.yaml", quick=True, overrides={"output_dir": "mine"})
    assert settings.output_dir == "mine"


def test_quick_tfmem_keys_replace_the_tfmem_section(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("compare:\n  quick:\n    tfmem:\n      tensor_size_threshold: 1MB\n"
                    "tfmem:\n  jit_compile: false\n")
    _, quick = load_settings(path, quick=True)
    _, full = load_settings(path)
    assert quick.tensor_size_threshold == 10**6 and full.tensor_size_threshold is None
    assert not quick.jit_compile and not full.jit_compile  # the rest comes from the tfmem section


def test_flat_tfmem_file_is_a_tfmem_section(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text("tensor_size_threshold: 1GB\njit_compile: false\n")
    settings, config = load_settings(path)
    assert config.tensor_size_threshold == 10**9 and not config.jit_compile
    assert settings == CompareSettings()


@pytest.mark.parametrize("text, message", [
    ("compare:\n  modle: sgpr\n", "section 'compare': unknown key 'modle' \\(did you mean 'model'\\?\\)"),
    ("compare:\n  model: gpr\n", "model not supported"),
    ("tfmem:\n  tensor_size_threshold: lots\n", "section 'tfmem'.*cannot parse size"),
    ("tfmem:\n  threshold: 1GB\n", "unknown key.*threshold"),
    ("compare: {}\nextra: 1\n", "key 'extra' is not a section"),
    ("compare: {}\ncompar: {}\n", "sections: unknown key 'compar' \\(did you mean 'compare'\\?\\)"),
    ("compare:\n  quick:\n    tfmem:\n      strict: maybe\n", "section 'compare.quick.tfmem': strict"),
    ("compare:\n  quick:\n    num_trian: 5\n", "section 'compare.quick': unknown key 'num_trian'"),
    ("compare:\n  memory_budget: -1GB\n", "memory_budget: a size must not be negative"),
    ("compare:\n  inducing_points: [400, 200]\n", "increasing"),
    ("compare:\n  memory_budget: 0\n", "budget is required"),
    ("compare: [\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected keys at the top level"),
])
def test_bad_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_settings(path)


def test_unreadable_file(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_settings(tmp_path / "missing.yaml")


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CompareSettings().model = "gpr"  # type: ignore[misc]


@pytest.mark.parametrize("name", BUNDLED)
def test_wrappers_take_the_tfmem_section_of_a_config_file(name):
    from gpflow_integration import Scipy

    _, config = load_settings(CONFIGS / name)
    assert Scipy(config=CONFIGS / name).config == config
    assert Scipy(config=str(CONFIGS / name)).config == config
