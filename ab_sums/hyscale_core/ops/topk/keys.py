"""Order-preserving integer keys for every dtype ``topk`` accepts.

A key is an unsigned integer of the dtype's width whose unsigned order is the
selection order: larger key = ranked first when ``largest=True``. Floats map
sign-magnitude bits to keys with every NaN above +inf (one key for all NaN
payloads) and -0.0 equal to +0.0; integers flip the sign bit. For
``largest=False`` the key is complemented, so NaN ranks last there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..._dtypes import bfloat16


@dataclass(frozen=True)
class KeySpec:
    """How one dtype's bits become keys.

    bits_dtype : unsigned dtype of the same width, to view the data through.
    width      : bits per element (16, 32 or 64).
    sign       : the sign bit.
    exp_mask   : exponent bits (floats only; 0 for integers).
    mant_mask  : mantissa bits (floats only; 0 for integers).
    is_float   : whether NaN and -0.0 folding applies.
    """

    bits_dtype: np.dtype
    width: int
    sign: int
    exp_mask: int
    mant_mask: int
    is_float: bool

    @property
    def all_ones(self) -> int:
        return (1 << self.width) - 1


_SPECS = {
    np.dtype(np.float16): KeySpec(np.dtype(np.uint16), 16, 1 << 15, 0x7C00, 0x03FF, True),
    bfloat16: KeySpec(np.dtype(np.uint16), 16, 1 << 15, 0x7F80, 0x007F, True),
    np.dtype(np.float32): KeySpec(np.dtype(np.uint32), 32, 1 << 31, 0x7F800000, 0x007FFFFF, True),
    np.dtype(np.float64): KeySpec(
        np.dtype(np.uint64), 64, 1 << 63, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF, True
    ),
    np.dtype(np.int32): KeySpec(np.dtype(np.uint32), 32, 1 << 31, 0, 0, False),
    np.dtype(np.int64): KeySpec(np.dtype(np.uint64), 64, 1 << 63, 0, 0, False),
}


def key_spec(dtype: np.dtype) -> KeySpec:
    """The :class:`KeySpec` of a supported dtype."""
    return _SPECS[np.dtype(dtype)]


def sortable_keys(a, largest: bool, xp=np):
    """Keys of ``a`` (any shape) as uint64, computed with array module ``xp``."""
    spec = key_spec(a.dtype)
    bits = a.view(spec.bits_dtype).astype(xp.uint64)
    sign = xp.uint64(spec.sign)
    ones = xp.uint64(spec.all_ones)
    if spec.is_float:
        exp_mask, mant_mask = xp.uint64(spec.exp_mask), xp.uint64(spec.mant_mask)
        is_nan = ((bits & exp_mask) == exp_mask) & ((bits & mant_mask) != 0)
        bits = xp.where(bits == sign, xp.uint64(0), bits)
        keys = xp.where((bits & sign) != 0, ~bits & ones, bits | sign)
        keys = xp.where(is_nan, ones, keys)
    else:
        keys = bits ^ sign
    return keys if largest else ~keys & ones
