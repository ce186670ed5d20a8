"""Every docstring example in the packages runs, and shows what it really prints.

Each module of `tfmem`, `gpflow_integration` and `benchmarks` is either doctested here or
on `NOT_RUN_YET` with the reason; a new module is doctested by default. Examples run from
the repository root (they name `configs/...`). The `gpflow_integration` examples use
the small data named in that package's docstring, made by `_gpflow_names`.
"""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path
from typing import Any

import pytest

from tests import background

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tfmem", "gpflow_integration", "benchmarks")

# Engine modules being rewritten for issue 12 (stages, one rewrite shape, Graph owning
# GraphDef structure). Their examples are not run until that lands; then take them off
# this list and make their examples true.
NOT_RUN_YET: dict[str, str] = {
    "tfmem": "façade example prints a full report with no expected output (issue 12 reshapes Report)",
    "tfmem.graph": "engine module under rewrite (issue 12, part 3)",
    "tfmem.wrapper": "engine module under rewrite (issue 12, part 2: stages)",
    "tfmem.memory": "engine module under rewrite (issue 12, part 3)",
}


def _modules() -> dict[str, Path]:
    """Module name → source file, for every module of `PACKAGES`."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


# Modules whose examples run under `tf.distribute` on the CPU split into two logical
# devices (`tfmem.distribute.split_cpu`). TensorFlow allows that only before it
# initialises its devices, which the other modules' examples (and the GPflow models
# below) do: each of these runs in a fresh process (`tfmem.run_isolated`) that splits
# the CPU first, as a script using them would, and reports its failures here. Their
# examples also get that process's one `strategy` (a second MirroredStrategy's
# all-reduces would collide with the first's: see gpflow_integration.distributed).
ON_SPLIT_CPU: dict[str, str] = {
    "tfmem.distribute": "MirroredStrategy over two logical CPUs",
    "gpflow_integration.distributed": "DataParallelSGPR/SVGP over two logical CPUs",
}

# Modules whose examples start processes of their own (trials under real memory limits): their
# examples run in a process of their own too, beside the other tests (tests/background.py).
IN_BACKGROUND: dict[str, str] = {
    "benchmarks.harness": "OOM searches in processes under real limits",
    "tfmem.isolation": "trials in processes under real limits",
}

# rewrites/* are all engine passes under rewrite (issue 12, part 1): not scanned yet.
ALL = _modules()
WITH_EXAMPLES = [name for name, path in ALL.items() if name not in NOT_RUN_YET and ">>>" in path.read_text()]


def test_the_not_yet_list_names_real_modules() -> None:
    assert set(NOT_RUN_YET) <= set(ALL)
    assert set(ON_SPLIT_CPU) | set(IN_BACKGROUND) <= set(WITH_EXAMPLES)


def _gpflow_names() -> dict[str, Any]:
    import gpflow
    import numpy as np
    import tensorflow as tf

    import gpflow_integration

    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 3))  # noqa: N806 - GPflow's names
    Y = np.sin(X[:, :1]) + 0.1 * rng.standard_normal((200, 1))  # noqa: N806
    X_test = rng.standard_normal((50, 3))  # noqa: N806
    Y_test = np.sin(X_test[:, :1]) + 0.1 * rng.standard_normal((50, 1))  # noqa: N806
    Z = X[:20].copy()  # noqa: N806
    kernel = gpflow.kernels.SquaredExponential
    return {
        "gpflow": gpflow, "np": np, "tf": tf, "gpflow_integration": gpflow_integration,
        "X": X, "Y": Y, "N": len(X), "Z": Z, "X_test": X_test, "Y_test": Y_test,
        "sgpr": gpflow.models.SGPR((X, Y), kernel(), inducing_variable=Z),
        "gpr": gpflow.models.GPR((X, Y), kernel()),
        "svgp": gpflow.models.SVGP(kernel(), gpflow.likelihoods.Gaussian(), Z, num_data=len(X)),
    }


def _failures(name: str, names: dict[str, Any] | None = None) -> list[str]:
    """Runs the examples of module `name` (from the repository root), with `names` besides
    the module's own; the failure reports."""
    module = importlib.import_module(name)
    extra = {**(_gpflow_names() if name.startswith("gpflow_integration") else {}), **(names or {})}
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, name, extraglobs=extra) if t.examples]
    assert tests, f"{name} has '>>>' in its source but no doctest was found"
    failures: list[str] = []
    for test in tests:
        result = runner.run(test, out=failures.append)
        assert result.attempted > 0
    return failures


def _failures_on_split_cpu(name: str) -> list[str]:
    """`_failures` in a process whose CPU is split into two logical devices first (run
    isolated), with `strategy`, a MirroredStrategy over them."""
    import os

    import tensorflow as tf

    from tfmem.distribute import split_cpu

    os.chdir(REPO)  # the examples run from the repository root
    strategy = tf.distribute.MirroredStrategy(split_cpu(2))
    return _failures(name, {"strategy": strategy})


def _failures_from_the_repository(name: str) -> list[str]:
    """`_failures`, in a process of its own (run isolated): from the repository root."""
    import os

    os.chdir(REPO)
    return _failures(name)


def _background_job(name: str) -> str:
    """The background job (tests/background.py) that runs `name`'s examples in a process of
    their own: on a split CPU (`ON_SPLIT_CPU`), or as they are (`IN_BACKGROUND`)."""
    target = "_failures_on_split_cpu" if name in ON_SPLIT_CPU else "_failures_from_the_repository"

    def run() -> list[str]:
        from tfmem.isolation import run_isolated

        result = run_isolated(f"tests.test_doctests:{target}", name, timeout=900)
        assert result.ok, f"{name}: the examples' process ended {result.status}: {result.error}"
        return result.value

    background.job(f"doctests:{name}")(run)
    return f"doctests:{name}"


IN_A_PROCESS = {**ON_SPLIT_CPU, **IN_BACKGROUND}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.background(_background_job(name)))
                                  if name in IN_A_PROCESS else name for name in WITH_EXAMPLES])
def test_docstring_examples(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    failures = background.result(f"doctests:{name}") if name in IN_A_PROCESS else _failures(name)
    assert not failures, "".join(failures)
