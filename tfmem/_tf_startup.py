"""Import TensorFlow without its C++ start-up chatter (for the command line, not the library).

On TF 2.21 `import tensorflow` prints, whatever `TF_CPP_MIN_LOG_LEVEL` says, the lines
its shared libraries log before absl's logging is initialised:

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:... port.cc:153] oneDNN custom operations are on. ...
    I0000 00:00:... cudart_stub.cc:31] Could not find cuda drivers on your machine, ...

and the first device set-up adds `E0000 ... cuda_platform.cc:52] failed call to cuInit`
on machines without a GPU driver. No environment variable reaches those lines (absl
writes everything to stderr until `absl::InitializeLog()`, which only C++ can call), so
the command line imports TensorFlow and sets up its devices with file descriptor 2
pointed at a temporary file, then writes back every captured line that is not one of
these: real errors and Python warnings still reach the user, after the import.
Later lines obey `TF_CPP_MIN_LOG_LEVEL`, which is set to 2 (warnings and errors
hidden) unless the user chose a level.

Example:
    >>> import_tensorflow_quietly().__name__
    'tensorflow'
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

# absl's INFO and WARNING lines ("I0000 00:00:1795417334.176316   14593 port.cc:153] ..."),
# its banner, the CPU-feature notice's second line, and the cuInit error of driverless machines.
_NOISE = re.compile(
    r"^(?:[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] "
    r"|E\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] failed call to cuInit"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.)")


def import_tensorflow_quietly() -> ModuleType:
    """Imports TensorFlow (once) and sets up its devices, dropping the start-up noise above."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    with _filtered_stderr():
        import tensorflow as tf

        tf.config.list_logical_devices()  # device set-up: where cuInit complains
    return tf


@contextlib.contextmanager
def _filtered_stderr() -> Iterator[None]:
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (e.g. captured by a test runner)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not _NOISE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
