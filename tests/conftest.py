"""Shared fixtures: a seeded numpy generator and quiet TensorFlow."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest


def _is_corpus_test(item: pytest.Item) -> bool:
    return item.path.name == "test_corpus.py" and item.path.parent.name == "benchmarks"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The corpus tests last: their isolated processes run beside every other test first."""
    items.sort(key=_is_corpus_test)  # stable: each group keeps its order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the corpus trial processes as soon as the tests are known (see test_corpus.py)."""
    corpus = next((item for item in session.items if _is_corpus_test(item)), None)
    if corpus is not None and not session.config.option.collectonly:
        corpus.module.start_selected(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that stops early (-x, Ctrl-C) does not wait for trials nobody will read."""
    corpus = next((item for item in session.items if _is_corpus_test(item)), None)
    if corpus is not None:
        corpus.module.cancel_pending()


@pytest.fixture
def rng() -> np.random.Generator:
    """A numpy Generator seeded the same way in every test."""
    return np.random.default_rng(20221122)
