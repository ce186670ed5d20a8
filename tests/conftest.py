"""Shared fixtures (a seeded numpy generator, quiet TensorFlow) and the order tests run in:
background jobs (tests/background.py) and the corpus's trials start when collection ends."""
from __future__ import annotations

import os

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
