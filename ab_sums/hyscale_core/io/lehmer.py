"""Lehmer code of partial permutations: the rank order of a selection row.

A row of ``order`` lists, for each of the row's ``count`` valid entries in
ascending index order, the column (rank) that holds it: ``count`` distinct
columns out of ``k``. Its Lehmer code replaces each column by how many
columns not yet used lie below it:

    L[j] = order[j] - #{i < j : order[i] < order[j]}        0 <= L[j] < k - j

so digit ``j`` takes only ``k - j`` values. Stored digit-major (all rows'
digit ``j`` together) the shrinking ranges compress to about log2(k!)/k bits
per entry (9.6 for k = 2048) instead of log2(k) = 11 for the columns
themselves. Digits ``j >= count`` are 0.

The Numba kernels (parallel over rows, a Fenwick tree per row, O(k log k))
are checked against the plain NumPy references below.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, inline="always")
def _prefix(tree: np.ndarray, i: int) -> int:
    """Sum of the Fenwick tree over positions 1..i."""
    s = 0
    while i > 0:
        s += tree[i]
        i -= i & -i
    return s


@njit(cache=True, inline="always")
def _add(tree: np.ndarray, i: int, delta: int) -> None:
    n = tree.shape[0] - 1
    while i <= n:
        tree[i] += delta
        i += i & -i


@njit(cache=True, parallel=True)
def encode_rows(order: np.ndarray, count: np.ndarray, out: np.ndarray) -> None:
    """Lehmer digits of every row: ``out[r, j]`` for ``order[r, :count[r]]``.

    ``order`` int [n, k] (distinct columns in [0, k) per row, unchecked:
    callers pass a permutation made by a sort), ``count`` int [n],
    ``out`` unsigned [n, k], written in full (0 after ``count[r]``).
    """
    n, k = order.shape
    for r in prange(n):
        tree = np.zeros(k + 1, np.int32)
        for j in range(k):
            out[r, j] = 0
        for j in range(count[r]):
            x = order[r, j]
            out[r, j] = x - _prefix(tree, x)
            _add(tree, x + 1, 1)


@njit(cache=True, inline="always")
def _decode_row(r: int, count, first, gaps, digits, top: int, tree, out) -> bool:
    """Row ``r`` of the table into ``out[r]``; False if it is out of range."""
    k = digits.shape[1]
    c = np.int64(count[r])
    if c > k:
        return False
    for i in range(1, k + 1):
        tree[i] = i & -i  # every column unused: the tree of k ones
    for j in range(k):
        out[r, j] = -1
    value = np.int64(first[r])
    for j in range(c):
        d = np.int64(digits[r, j])
        if d >= k - j:
            return False
        if j > 0:
            value += np.int64(gaps[r, j - 1])
        if value < 0 or value > 2147483647:
            return False
        want = d + 1
        pos = 0
        step = top
        while step > 0:  # the largest pos with prefix(pos) < want
            if pos + step <= k and tree[pos + step] < want:
                pos += step
                want -= tree[pos]
            step >>= 1
        out[r, pos] = value
        _add(tree, pos + 1, -1)
    return True


@njit(cache=True, parallel=True)
def decode_table(count, first, gaps, digits, out) -> int:
    """Rows of a selection table from its encoded arrays (codec.py), row-major.

    ``count`` uint [n], ``first`` int32 [n], ``gaps`` uint [n, >= k-1] and
    ``digits`` (Lehmer) uint [n, k]; ``out`` int32 [n, k] is written in
    full. Returns the first row whose arrays are out of range (count > k, a
    digit ``>= k - j``, an index outside [0, 2**31)), or -1 when every row
    decoded.
    """
    n, k = digits.shape
    top = 1
    while top * 2 <= k:
        top *= 2
    bad = np.full(n, False)
    for r in prange(n):
        tree = np.zeros(k + 1, np.int64)
        bad[r] = not _decode_row(r, count, first, gaps, digits, top, tree, out)
    for r in range(n):
        if bad[r]:
            return r
    return -1


def encode_reference(order: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Plain NumPy :func:`encode_rows` (O(n k^2)): int64 [n, k]."""
    n, k = order.shape
    out = np.zeros((n, k), dtype=np.int64)
    for r in range(n):
        cols = order[r, : count[r]].astype(np.int64)
        for j, x in enumerate(cols):
            out[r, j] = x - np.count_nonzero(cols[:j] < x)
    return out


def decode_reference(digits: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Plain NumPy inverse of :func:`encode_rows`: the columns, int64 [n, k],
    from row-major digits [n, k]; -1 after ``count[r]``."""
    n, k = digits.shape
    out = np.full((n, k), -1, dtype=np.int64)
    for r in range(n):
        unused = list(range(k))
        for j in range(count[r]):
            out[r, j] = unused.pop(int(digits[r, j]))
    return out
