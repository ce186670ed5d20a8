"""Package attributes loaded on first use (PEP 562), for packages whose imports are heavy.

`import tfmem` must not import TensorFlow (the CLI sets TF's log level first), and
`import gpflow_integration` must not import GPflow; both list their public names and
the module that defines each, and load a module when one of its names is first used.

Example:
    >>> __getattr__, __dir__ = lazy_exports("mypackage", {"Config": "mypackage.config"})
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`: public name → the module defining it."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
