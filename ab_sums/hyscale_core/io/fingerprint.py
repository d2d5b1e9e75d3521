"""The fingerprint of a selection: what a replayed selection is checked by.

Kept free of h5py so that the engine can fingerprint live selections (NumPy
or CuPy) without the log's dependencies.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from .._backend import GPU, as_array
from .._checks import check_ndim

_DOMAIN = b"hyscale-selection-v1\0"


def fingerprint(indices: Any) -> str:
    """blake2b-128 of a selection table, as 32 lowercase hex digits.

    ``indices`` is a 2-D integer array [N, k] (NumPy, CuPy or DLPack; a CuPy
    array is copied to the host) whose values fit int32. The digest covers
    the shape (N and k as little-endian int64) and the little-endian int32
    bytes in C order, so equal fingerprints mean the same table in the same
    rank order, and a table and its transpose or reshape differ.
    """
    backend, a = as_array(indices, "indices")
    if backend == GPU:
        a = a.get()
    check_ndim(a, 2, "indices", "[N, k]")
    if a.dtype.kind not in "iu":
        raise TypeError(f"indices must hold integers, got dtype {a.dtype}")
    table = np.ascontiguousarray(a, dtype="<i4")
    if a.dtype != table.dtype and a.size and not np.array_equal(table, a):
        raise ValueError(f"indices must fit int32, got values in [{a.min()}, {a.max()}]")
    digest = hashlib.blake2b(_DOMAIN, digest_size=16)
    digest.update(np.asarray(a.shape, dtype="<i8").tobytes())
    digest.update(table.reshape(-1).view(np.uint8))
    return digest.hexdigest()
