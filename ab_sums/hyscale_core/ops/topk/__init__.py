"""Exact top-k along one axis: ``hs.topk``."""
from __future__ import annotations

import math
from typing import Any

from ..._backend import CPU, as_array, xp_for
from ..._checks import check_axis, check_dtype, check_int
from ..._dtypes import TOPK_DTYPES
from . import gpu  # light; the CPU backend (Numba) is imported on first use


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def topk(a: Any, k: int, axis: int = -1, *, largest: bool = True, sorted: bool = True) -> tuple[Any, Any]:
    """Exact top-k of ``a`` along ``axis``.

    Parameters
    ----------
    a : array [..., n, ...]
        NumPy array (CPU backend), CuPy array (GPU backend) or any object with
        ``__dlpack__`` (imported zero-copy). dtype float16, bfloat16
        (``ml_dtypes``), float32, float64, int32 or int64.
    k : int
        Number of elements to keep, ``0 <= k <= a.shape[axis]``.
    axis : int
        Axis to select along (default last).
    largest : bool
        Keep the largest (default) or the smallest values.
    sorted : bool
        ``True``: results ordered by value (descending when ``largest``),
        equal values lower index first. ``False``: the same set in ascending
        index order.

    Returns
    -------
    values : array, ``a.dtype``, shape of ``a`` with ``n`` replaced by ``k``
    indices : array, int64, same shape

    Order contract: NaN ranks above +inf (so NaNs are taken first when
    ``largest`` and last otherwise), -0.0 equals +0.0, equal values go lower
    index first. The result is exact and identical on every run; the CPU
    and GPU backends return bitwise-identical indices for the same input.
    """
    backend, a = as_array(a, "a")
    check_dtype(a, TOPK_DTYPES, "a")
    if a.ndim == 0:
        raise ValueError("a must have at least one dimension, got a 0-d array")
    axis = check_axis(axis, a.ndim)
    n = a.shape[axis]
    k = check_int(k, "k", 0, n)
    largest = _check_flag(largest, "largest")
    sort_output = _check_flag(sorted, "sorted")

    xp = xp_for(backend)
    moved = a if axis == a.ndim - 1 else xp.moveaxis(a, axis, -1)
    lead = moved.shape[:-1]
    rows = moved if moved.flags.c_contiguous else xp.ascontiguousarray(moved)
    if rows.ndim != 2:
        rows = rows.reshape(math.prod(lead), n)
    if backend == CPU:
        from . import cpu

        values, indices = cpu.topk_rows(rows, k, largest, sort_output)
    else:
        values, indices = gpu.topk_rows(rows, k, largest, sort_output)
    if values.shape[:-1] != lead:
        values, indices = values.reshape(lead + (k,)), indices.reshape(lead + (k,))
    if axis != a.ndim - 1:
        values, indices = xp.moveaxis(values, -1, axis), xp.moveaxis(indices, -1, axis)
    return values, indices
