"""Lossless compact encoding of selection index tables: "sorted-gaps-lehmer-v1".

A selection is an int32 table ``[N, k]``: per row, key indices in rank order
(best first), ``-1`` meaning "no key". It is stored as a row's *set* (its
valid indices sorted, as a first value and gaps) plus its *rank order* (the
permutation back from sorted to rank order, Lehmer-coded, see lehmer.py):

    name    shape     dtype                  contents
    count   [N]       narrowest uint for k   valid (``!= -1``) entries of row r
    first   [N]       int32                  the row's smallest valid index (0 if none)
    gaps    [k-1, N]  narrowest uint that    gaps[j, r] = s[j+1] - s[j] for j < count-1,
                      holds the largest gap  0 after; s = the row's valid indices sorted
    lehmer  [k, N]    narrowest uint for k   Lehmer digits of order[r], where order[r, j]
                                             is the column (rank) holding s[j]; 0 after

The two per-entry arrays are digit-major (one HDF5 row per position ``j``,
one column per table row), so that byte shuffling plus deflate sees long runs
of one position, whose value ranges are alike (gaps of a local window are 1;
Lehmer digit ``j`` is below ``k - j``). Columns ``a:b`` of every array are
rows ``a:b`` of the table: a row range decodes on its own.

Decoding writes ``s[j]`` into column ``order[r, j]`` of a row of ``-1``: the
exact table comes back, rank order, duplicates and ``-1`` anywhere included.
For k = 0 the per-entry arrays have shapes ``[0, N]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_dtype, check_ndim
from . import lehmer

ENCODING = "sorted-gaps-lehmer-v1"

# Each stored array's name and the axis that runs over the table's rows.
FIELDS = (("count", 0), ("first", 0), ("gaps", 1), ("lehmer", 1))

# Rows encoded or decoded at once: bounds the temporaries to about
# 8 * BLOCK_ENTRIES bytes each.
BLOCK_ENTRIES = 1 << 21

_COL_BITS = 21  # k <= 2**20 (MAX_TOPK): a column fits in 21 bits
_COL_MASK = (1 << _COL_BITS) - 1
_PAD_KEY = 1 << 31  # sorts -1 entries after every valid index (<= 2**31 - 1)

_UNSIGNED = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def narrowest_unsigned(max_value: int) -> np.dtype:
    """The narrowest of uint8/uint16/uint32 that holds ``0..max_value``."""
    for dtype in _UNSIGNED:
        if max_value <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"max_value must fit in uint32, got {max_value}")


@dataclass(frozen=True)
class Encoded:
    """The stored arrays of one table, in the layout of the module docstring."""

    count: np.ndarray  # [N]
    first: np.ndarray  # [N] int32
    gaps: np.ndarray  # [max(k-1, 0), N]
    lehmer: np.ndarray  # [k, N]

    def arrays(self) -> dict[str, np.ndarray]:
        """``{name: array}`` in the order of :data:`FIELDS`."""
        return {name: getattr(self, name) for name, _ in FIELDS}

    @property
    def nbytes(self) -> int:
        """Uncompressed size of the stored arrays, bytes."""
        return sum(a.nbytes for a in self.arrays().values())


def _block_rows(k: int) -> int:
    return max(1, BLOCK_ENTRIES // max(k, 1))


def sort_rows(block: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split an int32 block [n, k >= 1] (entries >= -1) into set and order.

    Returns ``(count int64 [n], first int32 [n], gaps int64 [n, k-1],
    order int64 [n, k])``, row-major: ``s`` = the row's valid entries sorted
    (ties by column, so the result is deterministic), ``gaps`` their
    differences and ``order[r, j]`` the column of ``s[j]``; both 0 after the
    row's count.
    """
    n, k = block.shape
    values = block.astype(np.int64)
    keys = np.where(values < 0, _PAD_KEY, values) << _COL_BITS
    keys |= np.arange(k, dtype=np.int64)
    keys.sort(axis=1)  # by value, then column; padding last
    ordered = keys >> _COL_BITS
    count = np.count_nonzero(block >= 0, axis=1)
    valid = np.arange(k) < count[:, None]
    first = np.where(count > 0, ordered[:, 0], 0).astype(np.int32)
    gaps = np.diff(ordered, axis=1)
    gaps[~valid[:, 1:]] = 0
    order = np.where(valid, keys & _COL_MASK, 0)
    return count, first, gaps, order


def _encode_block(block: np.ndarray, digit_dtype: np.dtype) -> tuple[np.ndarray, ...]:
    count, first, gaps, order = sort_rows(block)
    digits = np.empty(order.shape, dtype=digit_dtype)
    lehmer.encode_rows(order, count, digits)
    return count.astype(digit_dtype), first, gaps.T.astype(np.uint32), digits.T


def encode(indices: np.ndarray) -> Encoded:
    """Encode an int32 selection table [N, k] (entries ``>= -1``) losslessly.

    ``count`` and ``lehmer`` use the narrowest unsigned dtype holding ``k``,
    ``gaps`` the narrowest holding the table's largest gap.
    """
    check_ndim(indices, 2, "indices", "[N, k]")
    check_dtype(indices, (np.dtype(np.int32),), "indices")
    n, k = indices.shape
    bad = np.flatnonzero(indices.reshape(-1) < -1)
    if bad.size:
        r, c = divmod(int(bad[0]), k)
        raise ValueError(f"indices must be >= -1 (-1 = no key), got indices[{r}, {c}] = {indices[r, c]}")
    digit_dtype = narrowest_unsigned(k)
    step = _block_rows(k)
    parts = [_encode_block(indices[a:a + step], digit_dtype) for a in range(0, n, step)] if k else []
    if not parts:
        return Encoded(np.zeros(n, digit_dtype), np.zeros(n, np.int32),
                       np.zeros((max(k - 1, 0), n), np.uint8), np.zeros((k, n), digit_dtype))
    gap_dtype = narrowest_unsigned(max(int(p[2].max(initial=0)) for p in parts))
    return Encoded(
        count=np.concatenate([p[0] for p in parts]),
        first=np.concatenate([p[1] for p in parts]),
        gaps=np.concatenate([p[2].astype(gap_dtype) for p in parts], axis=1),
        lehmer=np.concatenate([p[3] for p in parts], axis=1),
    )


def _check_arrays(count: np.ndarray, first: np.ndarray, gaps: np.ndarray, digits: np.ndarray) -> tuple[int, int]:
    """``(N, k)`` of consistent stored arrays (integers, the shapes of one table); ValueError otherwise."""
    arrays = {"count": count, "first": first, "gaps": gaps, "lehmer": digits}
    odd = [f"{name} has dtype {a.dtype}" for name, a in arrays.items() if a.dtype.kind not in "iu"]
    if odd:
        raise ValueError(f"corrupt encoding: {', '.join(odd)}, expected integers")
    if digits.ndim != 2:
        raise ValueError(f"corrupt encoding: lehmer has shape {digits.shape}, expected [k, N]")
    k, n = digits.shape
    if count.shape != (n,) or first.shape != (n,) or gaps.shape != (max(k - 1, 0), n):
        raise ValueError(f"corrupt encoding: shapes count {count.shape}, first {first.shape}, gaps {gaps.shape}, "
                         f"lehmer {digits.shape} do not describe one [N={n}, k={k}] table")
    return n, k


def decode(count: np.ndarray, first: np.ndarray, gaps: np.ndarray, digits: np.ndarray) -> np.ndarray:
    """The int32 table [N, k] that :func:`encode` stored as these arrays.

    Takes any row range of an encoding (``count[a:b], first[a:b],
    gaps[:, a:b], lehmer[:, a:b]``). Raises ValueError when the arrays are
    inconsistent (counts, digits or indices out of range) rather than
    return a wrong table.
    """
    n, k = _check_arrays(count, first, gaps, digits)
    out = np.empty((n, k), dtype=np.int32)
    step = _block_rows(k)
    for a in range(0, n if k else 0, step):  # row-major copies of a block: the kernel reads rows
        b = min(n, a + step)
        block_gaps = np.ascontiguousarray(gaps[:, a:b].T) if k > 1 else np.zeros((b - a, 1), np.uint8)
        bad = lehmer.decode_table(count[a:b], first[a:b], block_gaps, np.ascontiguousarray(digits[:, a:b].T),
                                  out[a:b])
        if bad >= 0:
            raise ValueError(f"corrupt encoding: row {a + bad} has a count, Lehmer digit or index out of range")
    return out
