"""Plain reference for ``topk``: Python's sort on explicit rank tuples.

Slow and obvious on purpose; it uses no bit tricks, so it checks the key
transform of the fast backends as well as their selection.
"""
from __future__ import annotations

import math

import numpy as np

from ..._dtypes import is_float


def _rank(value, index: int, largest: bool) -> tuple:
    # NaN above +inf; -0.0 == +0.0 holds for Python floats already.
    if isinstance(value, float) and math.isnan(value):
        return (0 if largest else 1, 0, index)
    return (1 if largest else 0, -value if largest else value, index)


def topk_rows(rows: np.ndarray, k: int, largest: bool, sort_output: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of each row of a 2-D array: ``(values [R, k], indices int64 [R, k])``."""
    exact = rows.astype(np.float64) if is_float(rows.dtype) else rows.astype(np.int64)
    indices = np.empty((rows.shape[0], k), dtype=np.int64)
    for r, row in enumerate(exact.tolist()):
        ranked = sorted(_rank(v, i, largest) for i, v in enumerate(row))
        picked = [i for *_, i in ranked][:k]
        indices[r] = picked if sort_output else np.sort(np.asarray(picked, dtype=np.int64))
    return np.take_along_axis(rows, indices, axis=1), indices
