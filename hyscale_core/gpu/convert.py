"""Dtype conversion on the GPU that also covers bfloat16 (ml_dtypes), by bits:
CuPy's own casts do not handle every path for that dtype. Each bfloat16
conversion is one elementwise kernel (one read and one write of the data)."""
from __future__ import annotations

import functools

import numpy as np

from .._backend import cupy_module
from .._dtypes import bfloat16


@functools.lru_cache(maxsize=None)
def _bf16_kernels():
    """(widen to float32, widen to float64, narrow): uint16 bfloat16 bits -> float32 or
    float64, and float32 bits (uint32) -> rounded uint16 bits.

    CuPy compiles its kernels with -ftz=true, under which a float32 -> float64
    conversion flushes subnormal inputs to zero; the float64 widening therefore
    builds subnormals (exponent 0: mantissa * 2^-133) in float64 arithmetic."""
    cp = cupy_module()
    to_f32 = cp.ElementwiseKernel("uint16 b", "float32 y", "y = __uint_as_float((unsigned int)b << 16)",
                                  "hs_bf16_widen_f32")
    to_f64 = cp.ElementwiseKernel(
        "uint16 b", "float64 y",
        "const unsigned int mag = b & 0x7FFFu;"
        "y = mag < 0x80u ? ((b & 0x8000u) ? -1.0 : 1.0) * (double)mag * 0x1p-133"
        " : (double)__uint_as_float((unsigned int)b << 16)",
        "hs_bf16_widen_f64")
    # Round to nearest, ties to even; a NaN keeps its sign and top payload bits and stays quiet (0x40).
    narrow_bits = cp.ElementwiseKernel(
        "uint32 x", "uint16 b",
        "b = (x & 0x7FFFFFFFu) > 0x7F800000u ? (unsigned short)((x >> 16) | 0x40u)"
        " : (unsigned short)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16)",
        "hs_bf16_narrow")
    return to_f32, to_f64, narrow_bits


def widen(x, dtype):
    """x (any float dtype) as ``dtype`` (float32/float64); bfloat16 exactly via its bits."""
    cp = cupy_module()
    if x.dtype == bfloat16:
        bits = x.view(cp.uint16)
        if np.dtype(dtype) == np.float64:
            return _bf16_kernels()[1](bits)
        x = _bf16_kernels()[0](bits)
    return x.astype(dtype, copy=False)


def narrow(x, dtype):
    """x (float32/float64) rounded to ``dtype`` (a new array); bfloat16 round-to-nearest-even
    by bits. float64 is first rounded to float32 by CuPy, which flushes results
    below float32's smallest normal (1.2e-38) to zero."""
    cp = cupy_module()
    if dtype != bfloat16:
        return x.astype(dtype)
    bits = x.astype(cp.float32, copy=False).view(cp.uint32)
    return _bf16_kernels()[2](bits).view(bfloat16)
