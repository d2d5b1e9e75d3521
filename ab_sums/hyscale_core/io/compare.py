"""Drift between two selections of the same queries: which keys differ."""
from __future__ import annotations

import numpy as np

from .._checks import check_dtype, check_ndim

_ROW_SHIFT = 32  # a row's sort key: row << 32 | index (index < 2**31)


def _row_sets(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique row << 32 | index keys of the valid entries, set size per row)."""
    rows, cols = np.nonzero(table >= 0)
    keys = np.unique((rows.astype(np.int64) << _ROW_SHIFT) | table[rows, cols].astype(np.int64))
    return keys, np.bincount(keys >> _ROW_SHIFT, minlength=table.shape[0])


def row_drift(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, the fraction of selected keys that differ between two tables.

    ``a`` int32 [N, ka], ``b`` int32 [N, kb]: the same N queries, selections
    with -1 for "no key" (rank order and duplicates do not matter: each row
    is the set of its valid indices). Returns float64 [N]:

        drift[r] = 1 - |A_r & B_r| / max(|A_r|, |B_r|)      (0 when both are empty)

    0 means the same keys, 1 no key in common.
    """
    for name, t in (("a", a), ("b", b)):
        check_ndim(t, 2, name, "[N, k]")
        check_dtype(t, (np.dtype(np.int32),), name)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a and b must select for the same queries, got {a.shape[0]} and {b.shape[0]} rows")
    keys_a, size_a = _row_sets(a)
    keys_b, size_b = _row_sets(b)
    common = np.intersect1d(keys_a, keys_b, assume_unique=True)
    shared = np.bincount(common >> _ROW_SHIFT, minlength=a.shape[0])
    larger = np.maximum(size_a, size_b)
    return np.where(larger > 0, 1.0 - shared / np.maximum(larger, 1), 0.0)
