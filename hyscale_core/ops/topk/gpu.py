"""GPU backend of ``topk`` (CuPy)."""
from __future__ import annotations

from ..._backend import cupy_module
from . import gpu_sort


def topk_rows(rows, k: int, largest: bool, sort_output: bool):
    """Top-k of each row of a C-contiguous 2-D CuPy array (see ``hyscale_core.topk``)."""
    cp = cupy_module()
    n_rows = rows.shape[0]
    if k == 0 or n_rows == 0:
        indices = cp.empty((n_rows, k), dtype=cp.int64)
        return cp.empty((n_rows, k), dtype=rows.dtype), indices
    return gpu_sort.topk_rows(cp, rows, k, largest, sort_output)
