"""The public GPU calls' checks of an index table and of the forward's lse in
one kernel launch and one transfer (cuda/index_checks.cu): the host waits for
the device once per call, where CuPy reductions made it wait once per
reduction and launched several small kernels in between."""
from __future__ import annotations

import numpy as np

from .._backend import cupy_module
from .module import get_kernel

THREADS = 256  # cuda/index_checks.cu


def table_flags(indices, n_keys: int, lse=None) -> tuple[bool, bool] | None:
    """``(out_of_range, bad_lse)`` for a C-contiguous int32 CuPy table
    [N, k] and, optionally, a C-contiguous float32 CuPy lse [N, h]:
    out_of_range: an entry is outside [-1, n_keys); bad_lse: a row that selects
    a key (an entry >= 0) has an lse entry that is not finite (False without
    lse). None where this path does not take the inputs (other dtypes or
    layouts); the caller then checks them with array operations."""
    cp = cupy_module()
    if indices.ndim != 2 or not indices.flags.c_contiguous or indices.dtype != cp.int32:
        return None
    if lse is not None and (lse.dtype != cp.float32 or not lse.flags.c_contiguous or lse.shape[0] != indices.shape[0]):
        return None
    n, k = indices.shape
    if n == 0 or k == 0:
        return False, False
    flags = cp.zeros(2, dtype=cp.int32)
    lse_arg, h = (lse, np.int32(lse.shape[1])) if lse is not None else (np.uint64(0), np.int32(0))
    args = (indices, np.int32(k), np.int64(n_keys), lse_arg, h, flags)
    get_kernel("index_checks", "hs_check_rows")((n,), (THREADS,), args)
    out_of_range, bad_lse = flags.get().tolist()
    return bool(out_of_range), bool(bad_lse)
