"""The `tfmem` command line.

    tfmem explain MODULE:FUNCTION [--inputs MODULE:FACTORY] [--config PATH] [--pbtxt F] [--logdir D]
    tfmem compare [--config PATH] [--quick] ...        (GPflow SGPR under a memory budget)
    tfmem config [--config PATH]                       (print the effective config)

`explain` needs example inputs. By default it calls `<FUNCTION>_inputs()`, else
`example_inputs()`, from the same module; `--inputs MODULE:FACTORY` names another. The
factory returns a tuple of positional arguments, or `(args, kwargs)` as a pair whose
second item is a dict. The bundled example: `tfmem explain tfmem.examples:kernel_matmul`.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys

# Before anything imports TensorFlow: keep its C++ start-up chatter out of the output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags

SUBCOMMANDS = ("explain", "compare", "config")
USAGE = __doc__.split("\n\n")[1]


def _load(reference: str) -> Any:
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise app.UsageError(f"expected MODULE:NAME, got {reference!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise app.UsageError(f"cannot import module {module_name!r}: {err}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise app.UsageError(f"module {module_name!r} has no {attribute!r}") from None


def _example_inputs(function_ref: str, inputs_ref: str | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    module_name, _, name = function_ref.partition(":")
    if inputs_ref is None:
        module = importlib.import_module(module_name)
        factory_name = next((n for n in (f"{name}_inputs", "example_inputs") if hasattr(module, n)), None)
        if factory_name is None:
            raise app.UsageError(f"{module_name} defines neither {name}_inputs() nor example_inputs(); "
                                 "pass --inputs MODULE:FACTORY")
        inputs_ref = f"{module_name}:{factory_name}"
    factory: Callable[[], Any] = _load(inputs_ref)
    produced = factory()
    if isinstance(produced, tuple) and len(produced) == 2 and isinstance(produced[1], dict):
        return tuple(produced[0]), produced[1]
    return (tuple(produced) if isinstance(produced, (tuple, list)) else (produced,)), {}


def _define_flags(subcommand: str, flag_values: flags.FlagValues) -> None:
    flags.DEFINE_string("config", None, "YAML config file (tfmem keys).", flag_values=flag_values)
    if subcommand == "explain":
        flags.DEFINE_string("inputs", None, "MODULE:FACTORY returning example inputs.",
                            flag_values=flag_values)
        flags.DEFINE_string("pbtxt", None, "Write the rewritten GraphDef here as text.",
                            flag_values=flag_values)
        flags.DEFINE_string("logdir", None, "Write the rewritten graph for TensorBoard here.",
                            flag_values=flag_values)
        flags.DEFINE_bool("xla", True, "Also compile with XLA and report its planned bytes.",
                          flag_values=flag_values)


def _config(path: str | None) -> Any:
    from tfmem.config import Config

    return Config.from_env() if path is None else Config.from_yaml(path, base=Config.from_env())


def _explain(argv: Sequence[str], fv: flags.FlagValues) -> int:
    import tfmem

    if len(argv) != 1:
        raise app.UsageError("explain takes one MODULE:FUNCTION")
    target = _load(argv[0])
    args, kwargs = _example_inputs(argv[0], fv.inputs)
    wrapped = tfmem.function(getattr(target, "python_function", target), config=_config(fv.config))
    report = wrapped.explain(*args, **kwargs) if fv.xla else wrapped.report(*args, **kwargs)
    print(report)
    if fv.pbtxt:
        print(f"rewritten graph written to {report.write_pbtxt(fv.pbtxt)}")
    if fv.logdir:
        report.write_tensorboard(fv.logdir)
        print(f"TensorBoard graph written to {fv.logdir} (tensorboard --logdir {fv.logdir})")
    return 0


def _show_config(argv: Sequence[str], fv: flags.FlagValues) -> int:
    config = _config(fv.config)
    for field in dataclasses.fields(config):
        print(f"{field.name}: {getattr(config, field.name)}")
    return 0


def main(argv: Sequence[str]) -> int:
    """Runs a subcommand; returns the exit code. `argv[0]` is the program name."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if len(argv) < 2 or argv[1] not in SUBCOMMANDS:
        print(f"usage:\n{USAGE}", file=sys.stderr)
        return 0 if len(argv) >= 2 and argv[1] in ("-h", "--help", "help") else 2
    subcommand = argv[1]
    if subcommand == "compare":
        from gpflow_integration.compare import main as compare_main  # heavy: GPflow

        return compare_main([f"{argv[0]} compare", *argv[2:]])
    fv = flags.FlagValues()
    _define_flags(subcommand, fv)
    try:
        positional = fv([f"{argv[0]} {subcommand}", *argv[2:]])[1:]
        return {"explain": _explain, "config": _show_config}[subcommand](positional, fv)
    except (flags.Error, app.UsageError, ValueError) as err:
        print(f"tfmem {subcommand}: {err}", file=sys.stderr)
        return 2


def run() -> None:
    """Console-script entry point."""
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run()
