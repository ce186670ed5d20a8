"""Tests for `rewrites.einsum_matmul`: two-operand einsums that are matrix products, as products."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from rewrites.einsum_matmul import EinsumAsMatMul, Product, product_of
from rewrites.matmul_chain import ReorderMatMulChain
from tfmem.graph import Graph
from tfmem.testing import assert_close, with_gradient

LETTERS = {"i": 6, "j": 5, "k": 4, "b": 3}


def _operand(rng: np.random.Generator, letters: str, dtype: tf.DType) -> tf.Tensor:
    return tf.constant(rng.normal(size=[LETTERS[c] for c in letters]), dtype)


# Every placement of the summed letter, both output orders, with and without a batch letter.
EQUATIONS = ["ij,jk->ik", "ji,jk->ik", "ij,kj->ik", "ji,kj->ik", "ij,jk->ki", "ji,kj->ki",
             "bij,bjk->bik", "bji,bkj->bki", "bij,bkj->bki"]


@pytest.mark.parametrize("gradient", [False, True], ids=["value", "gradient"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("equation", EQUATIONS)
def test_an_einsum_product_equals_its_matmul(equation: str, dtype: tf.DType, gradient: bool,
                                             rng: np.random.Generator) -> None:
    left, right = equation.split("->")[0].split(",")
    args = [_operand(rng, left, dtype), _operand(rng, right, dtype)]

    def fn(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.einsum(equation, a, b)

    program = with_gradient(fn) if gradient else fn
    function = tfmem.TfmemFunction(program, passes=[EinsumAsMatMul()], lint=True, config={"strict": True})
    fired = [r for r in function.report(*args).records if r.pass_name == EinsumAsMatMul.name and r.status == "fired"]
    assert fired
    if not gradient:
        assert Graph(function.report(*args).rewritten_graph_def).op_counts().get("Einsum", 0) == 0
    assert_close(function(*args), program(*args), dtype)


@pytest.mark.parametrize("equation, words", [
    ("ij,jk->ijk", "not the batch letters"),
    ("ii,ij->j", "repeats"),
    ("ijk,jk->i", "not matrices"),
    ("ij,ij->i", "share 2 letters"),
    ("...ij,...jk->...ik", "ellipsis"),
])
def test_what_is_not_a_product_says_why(equation: str, words: str) -> None:
    reason = product_of(equation)
    assert isinstance(reason, str) and words in reason


def test_product_of_reads_the_transposes() -> None:
    assert product_of("kl,jk->lj") == Product(0, 1, True, True, 0)
    assert product_of("bij,bjk->bik") == Product(0, 1, False, False, 1)


def test_an_einsum_chain_reorders_as_the_same_chain_written_with_matmul(rng: np.random.Generator) -> None:
    """Issue 19: a chain of einsums over [n, d], [d, n], [n, 5], nested as written (no
    opt_einsum across them), formed the [n, n] product; `(a @ b) @ c` is reordered."""
    n = 2000
    a, b, c = (tf.constant(rng.normal(size=s)) for s in ([n, 8], [8, n], [n, 5]))

    def fn(a: tf.Tensor, b: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
        return tf.einsum("ik,kl->il", tf.einsum("ij,jk->ik", a, b), c)

    function = tfmem.TfmemFunction(fn, passes=[EinsumAsMatMul(), ReorderMatMulChain()], lint=True,
                                   config={"strict": True})
    report = function.report(a, b, c)
    assert report.memory_before.peak_bytes >= n * n * 8  # (a b) c forms [n, n]
    assert report.memory_after.peak_bytes < n * n * 8 / 20
    assert any(r.pass_name == ReorderMatMulChain.name and r.status == "fired" for r in report.records)
    assert_close(function(a, b, c), fn(a, b, c), tf.float64)
