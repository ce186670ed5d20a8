"""Shared fixtures (a seeded numpy generator, quiet TensorFlow) and the order tests run in:
background jobs (tests/background.py) and the corpus's trials start when collection ends."""
from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA compiles the suite's programs with LLVM at -O0 (here and in every process a test starts):
# compiling is most of the suite's time, and -O0 halves it. What the tests read does not
# change: XLA assigns buffers before LLVM runs (its plans are the same bytes at -O0 and -O2,
# checked on the corpus), and tfmem and stock XLA are compiled alike.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import numpy as np
import pytest

from tests import background


# XLA's CPU JIT keeps every program it compiled mapped for the life of the process (about a
# dozen maps each), and LLVM segfaults once the process may map no more (`tests/__main__.py`
# runs the suite in parts for this). A session that nears the limit stops, saying why.
_MAPS_STOP_FRACTION = 0.92
_MAPS_CHECK_EVERY = 10  # tests; one check reads /proc/self/maps (tens of thousands of lines)
_maps_checked = 0
_maps_peak = 0


def _memory_maps() -> tuple[int, int] | None:
    """(maps this process holds, the most it may hold), or None where /proc does not say."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return maps.read().count(b"\n"), int(limit.read())
    except (OSError, ValueError):
        return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _maps_checked, _maps_peak
    _maps_checked += 1
    if _maps_checked % _MAPS_CHECK_EVERY:
        return
    counted = _memory_maps()
    if counted is None:
        return
    used, limit = counted
    _maps_peak = max(_maps_peak, used)
    if used > _MAPS_STOP_FRACTION * limit:
        pytest.exit(f"stopped before {item.nodeid}: this process holds {used:,} memory maps of the {limit:,} "
                    "Linux allows (vm.max_map_count); XLA's JIT keeps every compiled program mapped, and past "
                    "the limit LLVM segfaults. Run fewer tests per process: `python -m tests` runs the suite "
                    "in parts (tests/__main__.py: add a part to PARTS).", returncode=3)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    counted = _memory_maps()
    if counted is not None:
        used, limit = counted
        terminalreporter.write_line(f"memory maps: {max(used, _maps_peak):,} of the {limit:,} a process may hold "
                                    f"(the session stops at {_MAPS_STOP_FRACTION:.0%}: tests/__main__.py)")


def _is_corpus_test(item: pytest.Item) -> bool:
    return item.path.name == "test_corpus.py" and item.path.parent.name == "benchmarks"


def _order(item: pytest.Item) -> int:
    """0: an ordinary test; 1: it reads a background job; 2: a corpus test (the longest queue)."""
    if _is_corpus_test(item):
        return 2
    return 1 if background.job_of(item) else 0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{background.MARKER}(name): the test reads background job `name` "
                                       "(tests/background.py)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that read background jobs last, the corpus's after them: the jobs run beside the rest."""
    items.sort(key=_order)  # stable: each group keeps its order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the background jobs and the corpus trials as soon as the tests are known."""
    if session.config.option.collectonly:
        return
    background.pool(background.workers(only_background=all(_order(item) > 0 for item in session.items)))
    background.start(dict.fromkeys(job for item in session.items if (job := background.job_of(item))))
    corpus = next((item for item in session.items if _is_corpus_test(item)), None)
    if corpus is not None:
        corpus.module.start_selected(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that stops early (-x, Ctrl-C) does not wait for work nobody will read."""
    background.cancel_pending()
    corpus = next((item for item in session.items if _is_corpus_test(item)), None)
    if corpus is not None:
        corpus.module.cancel_pending()


@pytest.fixture
def rng() -> np.random.Generator:
    """A numpy Generator seeded the same way in every test."""
    return np.random.default_rng(20221122)
