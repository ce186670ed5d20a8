"""How tfmem tells the user something went wrong: an error in strict mode, a warning otherwise.

A fallback (the original function runs unchanged) or a budget tfmem cannot meet must be
seen without configuring logging, so it goes out as a `TfmemWarning` through Python's
`warnings` module (shown once per message by default; silence it with
`warnings.filterwarnings("ignore", category=tfmem.TfmemWarning)`). In strict mode the
same text is raised as a `TfmemError`.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn("tfmem: running f unchanged: argument 'x' has dynamic shape (None, 3)")
    >>> caught[0].category.__name__
    'TfmemWarning'
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

logger = logging.getLogger(__name__)

# Frames from these directories are tfmem's (or TensorFlow's, calling back into tfmem
# during tracing); a warning points at the first frame outside them: the user's call.
_TFMEM_DIR = os.path.dirname(os.path.abspath(__file__))
_INTERNAL_DIRS = (_TFMEM_DIR + os.sep, os.path.join(os.path.dirname(_TFMEM_DIR), "rewrites") + os.sep)


class TfmemError(RuntimeError):
    """Raised in strict mode where tfmem would otherwise fall back or miss the budget."""


class TfmemWarning(UserWarning):
    """A fallback to the original function, or a memory budget tfmem could not meet."""


def first_line(message: BaseException | str | None) -> str:
    """The first line of an error's message or a text (TensorFlow's errors run to pages);
    for an error with no message, its type name; "" for no text.

    Example:
        >>> first_line(ValueError("bad shape\\n  at node x"))
        'bad shape'
    """
    text = (message if isinstance(message, str) or message is None else str(message)) or ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(message).__name__ if isinstance(message, BaseException) else ""
    if lines[0] != "in user code:":
        return lines[0]
    # AutoGraph lists the user's stack first and "<Type>: <message>" of the original error last.
    last = lines[-1].removeprefix(f"{type(message).__name__}: ")
    return last.split(". ")[0]


def warn(message: str) -> None:
    """Shows `message` as a TfmemWarning at the user's call site, and logs it."""
    logger.info("%s", message)
    warnings.warn(message, TfmemWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    internal = _INTERNAL_DIRS + (_tensorflow_dir(),)
    frame, level = sys._getframe(2), 2  # noqa: SLF001 - the documented way to walk the stack
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def _tensorflow_dir() -> str:
    path = getattr(sys.modules.get("tensorflow"), "__file__", None)
    return os.path.dirname(path) + os.sep if path else "\0"  # "\0" starts no file name
