"""Shared fixtures: a seeded numpy generator and quiet TensorFlow."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A numpy Generator seeded the same way in every test."""
    return np.random.default_rng(20221122)
