"""Dtype conversion on the GPU that also covers bfloat16 (ml_dtypes), by bits:
CuPy's own casts do not handle every path for that dtype."""
from __future__ import annotations

from .._backend import cupy_module
from .._dtypes import bfloat16


def widen(x, dtype):
    """x (any float dtype) as ``dtype`` (float32/float64); bfloat16 exactly via its bits."""
    cp = cupy_module()
    if x.dtype == bfloat16:
        x = (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return x.astype(dtype, copy=False)


def narrow(x, dtype):
    """x (float32/float64) rounded to ``dtype``; bfloat16 round-to-nearest-even by bits."""
    cp = cupy_module()
    if dtype != bfloat16:
        return x.astype(dtype)
    bits = cp.ascontiguousarray(x.astype(cp.float32)).view(cp.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return cp.where(nan, (bits >> 16) | 0x40, rounded).astype(cp.uint16).view(bfloat16)
