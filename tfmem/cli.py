"""The `tfmem` command line.

    tfmem explain MODULE:FUNCTION [--inputs MODULE:FACTORY] [--config PATH] [--pbtxt F] [--logdir D]
    tfmem config [--config PATH]
    tfmem COMMAND ...            (commands installed by other packages, e.g. `tfmem compare`)
    tfmem --help | tfmem COMMAND --help

`explain` needs example inputs. By default it calls `<FUNCTION>_inputs()`, else
`example_inputs()`, from the same module; `--inputs MODULE:FACTORY` names another. The
factory returns a tuple of positional arguments, or `(args, kwargs)` as a pair whose
second item is a dict. Modules are looked up in the current directory first. The
bundled example: `tfmem explain tfmem.examples:kernel_matmul`.

More commands come from packages that declare a `tfmem.commands` entry point, a
`main(argv) -> exit status` whose docstring's first line is its help line; tfmem's own
setup.py declares `compare = gpflow_integration.compare:main`. The engine does not
import them: it finds them through the installed package metadata.

Example:
    >>> main(["tfmem", "config"])  # doctest: +ELLIPSIS
    tensor_size_threshold: None
    ...
    0
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags

from tfmem._tf_startup import import_tensorflow_quietly
from tfmem.errors import first_line

# Before anything imports TensorFlow (a plugin command may): hide its C++ info logs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ENTRY_POINT_GROUP = "tfmem.commands"
_HELP_ARGS = ("-h", "--help", "-help", "--helpfull")


def _load(reference: str) -> Any:
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise app.UsageError(f"expected MODULE:NAME, got {reference!r}")
    # A console script's sys.path does not hold the current directory; users expect
    # `tfmem explain mymodule:f` to find ./mymodule.py as `python -c` would.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
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


def _config(path: str | None) -> Any:
    from tfmem.config import Config

    return Config.from_env() if path is None else Config.from_yaml(path, base=Config.from_env())


def _explain_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("config", None, "YAML config file: flat tfmem keys, or a file with a 'tfmem:' "
                        "section such as configs/sgpr.yaml.", flag_values=fv)
    flags.DEFINE_string("inputs", None, "MODULE:FACTORY returning example inputs.", flag_values=fv)
    flags.DEFINE_string("pbtxt", None, "Write the rewritten GraphDef here as text.", flag_values=fv)
    flags.DEFINE_string("logdir", None, "Write the rewritten graph for TensorBoard here.", flag_values=fv)
    flags.DEFINE_bool("xla", True, "Also compile with XLA and report its planned bytes.", flag_values=fv)
    flags.DEFINE_string("xla_heaps", None, "Let XLA allocate its temporaries in heaps of at most this size "
                        "(e.g. 32MiB; tfmem.limit_xla_heaps), where one block finds no room.", flag_values=fv)


def _explain(argv: Sequence[str], fv: flags.FlagValues) -> int:
    """Rewrite a function on its example inputs and report what fired, what was split, and memory."""
    if len(argv) != 1:
        raise app.UsageError("explain takes one MODULE:FUNCTION")
    config = _config(fv.config)
    import_tensorflow_quietly()
    import tfmem

    if fv.xla_heaps:  # before anything compiles: XLA reads its flags once
        try:
            tfmem.limit_xla_heaps(fv.xla_heaps)
        except (ValueError, tfmem.TfmemError) as err:
            raise app.UsageError(f"--xla_heaps: {err}") from err
    target = _load(argv[0])
    args, kwargs = _example_inputs(argv[0], fv.inputs)
    wrapped = tfmem.function(getattr(target, "python_function", target), config=config)
    report = wrapped.explain(*args, **kwargs) if fv.xla else wrapped.report(*args, **kwargs)
    print(report)
    note = _nothing_to_split(config)
    if note:
        print(f"Note: {note}")
    if fv.pbtxt:
        print(f"rewritten graph written to {report.write_pbtxt(fv.pbtxt)}")
    if fv.logdir:
        report.write_tensorboard(fv.logdir)
        print(f"TensorBoard graph written to {fv.logdir} (tensorboard --logdir {fv.logdir})")
    return 0


def _nothing_to_split(config: Any) -> str | None:
    """Why the config lets tfmem split nothing, if it does; the report alone would not say."""
    if "split" not in config.passes:
        return "the config leaves out the 'split' stage, so no tensor was split."
    if config.tensor_size_threshold is None and (config.memory_budget is None or config.budget_off):
        return ("no tensor_size_threshold or memory_budget is set, so no tensor was split; set one with "
                "--config FILE or e.g. TFMEM_TENSOR_SIZE_THRESHOLD=64MB (see configs/default.yaml).")
    return None


def _config_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("config", None, "YAML config file: flat tfmem keys, or a file with a 'tfmem:' "
                        "section such as configs/sgpr.yaml.", flag_values=fv)


def _show_config(argv: Sequence[str], fv: flags.FlagValues) -> int:
    """Print the effective config: defaults, then TFMEM_* variables, then --config."""
    if argv:
        raise app.UsageError(f"config takes no arguments, got {' '.join(argv)}")
    config = _config(fv.config)
    for field in dataclasses.fields(config):
        print(f"{field.name}: {getattr(config, field.name)}")
    return 0


@dataclasses.dataclass(frozen=True)
class _Builtin:
    run: Callable[[Sequence[str], flags.FlagValues], int]
    define_flags: Callable[[flags.FlagValues], None]
    usage: str


_BUILTINS: dict[str, _Builtin] = {
    "explain": _Builtin(_explain, _explain_flags, "explain MODULE:FUNCTION [flags]"),
    "config": _Builtin(_show_config, _config_flags, "config [--config PATH]"),
}


def plugin_commands() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed `tfmem.commands` entry points by name (tfmem's own commands win a clash)."""
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name: ep for ep in sorted(found, key=lambda ep: ep.name) if ep.name not in _BUILTINS}


def _overview() -> str:
    rows = [(name, first_line(builtin.run.__doc__)) for name, builtin in _BUILTINS.items()]
    for name, entry_point in plugin_commands().items():
        try:
            rows.append((name, first_line(entry_point.load().__doc__) or f"(from {entry_point.value})"))
        except Exception as err:  # noqa: BLE001 - a broken plugin must not break `tfmem --help`
            rows.append((name, f"unavailable: {type(err).__name__}: {first_line(str(err))}"))
    width = max(len(name) for name, _ in rows)
    commands = "\n".join(f"  {name:<{width}}  {line}" for name, line in rows)
    return (f"usage: tfmem COMMAND [flags]    (tfmem COMMAND --help for a command's flags)\n\n"
            f"commands:\n{commands}")


def _flags_help(fv: flags.FlagValues) -> str:
    defined = {flag.name: flag for module_flags in fv.flags_by_module_dict().values() for flag in module_flags}
    lines = []
    for name, flag in sorted(defined.items()):
        default = f" (default: {flag.default_as_str})" if flag.default is not None else ""
        lines.append(f"  --{'[no]' if flag.boolean else ''}{name}: {flag.help}{default}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """Runs a subcommand; returns the exit code. `argv[0]` is the program name."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    program = "tfmem"
    if len(argv) < 2 or argv[1] in (*_HELP_ARGS, "help"):
        print(_overview(), file=sys.stdout if len(argv) >= 2 else sys.stderr)
        return 0 if len(argv) >= 2 else 2
    command, rest = argv[1], list(argv[2:])
    if command not in _BUILTINS:
        plugins = plugin_commands()
        if command not in plugins:
            print(f"{program}: unknown command {command!r}\n{_overview()}", file=sys.stderr)
            return 2
        return int(plugins[command].load()([f"{program} {command}", *rest]))
    builtin = _BUILTINS[command]
    fv = flags.FlagValues()
    builtin.define_flags(fv)
    if any(arg in _HELP_ARGS for arg in rest):
        print(f"usage: {program} {builtin.usage}\n\n{first_line(builtin.run.__doc__)}\n\nflags:\n"
              f"{_flags_help(fv)}")
        return 0
    try:
        positional = fv([f"{program} {command}", *rest])[1:]
        return builtin.run(positional, fv)
    except (flags.Error, app.UsageError, ValueError) as err:
        print(f"{program} {command}: {first_line(str(err)) or type(err).__name__}", file=sys.stderr)
        return 2


def run() -> None:
    """Console-script entry point."""
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run()
