"""The test helpers that other tests' bounds rest on: ``ordered_matmul``,
the naive whose error sets the within-twice-naive bounds, must sum in
ascending order, round every step to the inputs' dtype, and keep batch
shapes."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import ordered_matmul
from hyscale_core._dtypes import bfloat16


def test_sums_in_ascending_order_rounding_each_step():
    ones = np.ones((3, 1), np.float32)
    # 1 + 1e8 rounds to 1e8 in float32, so ascending order loses the 1 ...
    assert ordered_matmul(np.array([[1, 1e8, -1e8]], np.float32), ones)[0, 0] == 0
    # ... and keeps it when the large terms cancel first.
    assert ordered_matmul(np.array([[1e8, -1e8, 1]], np.float32), ones)[0, 0] == 1


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, bfloat16])
def test_batched_shapes_dtype_and_exact_sums(dtype):
    rng = np.random.default_rng(0)
    # Small integers: every product and partial sum is exact in each dtype.
    a = rng.integers(-3, 4, (2, 5, 4, 7)).astype(dtype)
    b = rng.integers(-3, 4, (2, 5, 7, 3)).astype(dtype)
    got = ordered_matmul(a, b)
    assert got.shape == (2, 5, 4, 3) and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float64), a.astype(np.float64) @ b.astype(np.float64))


def test_broadcasts_a_row_against_a_batch():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1, 3)).astype(np.float64)
    b = rng.standard_normal((4, 3, 2)).astype(np.float64)
    np.testing.assert_allclose(ordered_matmul(a, b), a @ b, rtol=1e-14, atol=1e-14)
