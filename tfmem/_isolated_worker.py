"""Entry point of the child process `run_isolated` starts: `python -m tfmem._isolated_worker REQ RESP`."""
from __future__ import annotations

import sys

from tfmem.isolation import _child_main

if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
