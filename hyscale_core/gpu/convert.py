"""Dtype conversion on the GPU that also covers bfloat16 (ml_dtypes), by bits:
CuPy's own casts do not handle every path for that dtype. Each bfloat16
conversion is one elementwise kernel (one read and one write of the data)."""
from __future__ import annotations

import functools

from .._backend import cupy_module
from .._dtypes import bfloat16


@functools.lru_cache(maxsize=None)
def _bf16_kernels():
    """(widen, narrow): uint16 bfloat16 bits -> float32, and float32 bits (uint32) -> rounded uint16 bits."""
    cp = cupy_module()
    widen_bits = cp.ElementwiseKernel("uint16 b", "float32 y", "y = __uint_as_float((unsigned int)b << 16)",
                                      "hs_bf16_widen")
    # Round to nearest, ties to even; a NaN keeps its sign and top payload bits and stays quiet (0x40).
    narrow_bits = cp.ElementwiseKernel(
        "uint32 x", "uint16 b",
        "b = (x & 0x7FFFFFFFu) > 0x7F800000u ? (unsigned short)((x >> 16) | 0x40u)"
        " : (unsigned short)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16)",
        "hs_bf16_narrow")
    return widen_bits, narrow_bits


def widen(x, dtype):
    """x (any float dtype) as ``dtype`` (float32/float64); bfloat16 exactly via its bits."""
    cp = cupy_module()
    if x.dtype == bfloat16:
        x = _bf16_kernels()[0](x.view(cp.uint16))
    return x.astype(dtype, copy=False)


def narrow(x, dtype):
    """x (float32/float64) rounded to ``dtype`` (a new array); bfloat16 round-to-nearest-even
    by bits (float64 is first rounded to float32)."""
    cp = cupy_module()
    if dtype != bfloat16:
        return x.astype(dtype)
    bits = x.astype(cp.float32, copy=False).view(cp.uint32)
    return _bf16_kernels()[1](bits).view(bfloat16)
