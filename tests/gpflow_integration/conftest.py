"""Small GPflow problems shared by the gpflow_integration tests."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def regression_data(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """200 noisy samples of a smooth function of 3 inputs: X [200, 3], Y [200, 1]."""
    X = rng.standard_normal((200, 3))  # noqa: N806
    Y = np.sin(X[:, :1]) + 0.5 * np.cos(X[:, 1:2]) + 0.1 * rng.standard_normal((200, 1))  # noqa: N806
    return X, Y
