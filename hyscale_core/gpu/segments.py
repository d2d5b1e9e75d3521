"""Deterministic scatter-add on the GPU: the valid entries of an index table
grouped by key (``key_segments``, shared by every per-key sum of the GPU
backends) and summed in position order by cuda/segment_sum.cu."""
from __future__ import annotations

import numpy as np

from .._backend import cupy_module
from .module import get_kernel


NARROW_KEYS = 0xFFFF  # key spaces up to this size sort 16-bit keys (-1 becomes 0xFFFF and sorts last)


def key_segments(indices, dtype, n_keys: int | None = None):
    """The valid entries (>= 0) of an index table grouped by key.

    indices: CuPy int array [N, k]; n_keys: a bound on its entries (they lie
    in [-1, n_keys)), which lets tables of at most NARROW_KEYS keys sort
    16-bit keys (half the radix passes of 32-bit ones). Returns None when no
    entry is valid, else ``(positions, starts, keys)``, C-contiguous arrays of
    ``dtype``: ``positions`` are flat positions into ``indices`` (t * k + i)
    in ascending (key, position) order; segment s is
    ``positions[starts[s]:starts[s + 1]]``, whose entries all hold
    ``keys[s]``; keys ascend and ``starts`` has one entry more than ``keys``.
    """
    cp = cupy_module()
    flat = indices.reshape(-1)
    skipped = int(cp.count_nonzero(flat < 0))
    if skipped == flat.size:
        return None
    # stable sorts: each key's positions stay in ascending order
    if n_keys is not None and n_keys <= NARROW_KEYS:
        positions = cp.argsort(flat.astype(cp.uint16))[:flat.size - skipped]  # the -1 entries sort last
    else:
        positions = cp.argsort(flat)[skipped:]  # the -1 entries sort first
    keys = flat[positions]
    first = cp.flatnonzero(cp.concatenate([cp.ones(1, dtype=cp.bool_), keys[1:] != keys[:-1]]))
    starts = cp.concatenate([first, cp.asarray([keys.size])])
    return (cp.ascontiguousarray(positions.astype(dtype)), starts.astype(dtype),
            cp.ascontiguousarray(keys[first].astype(dtype)))


def scatter_add_rows(indices, rows, out) -> None:
    """out[s] += sum of rows[t, i] over the slots with indices[t, i] == s (-1 skipped).

    indices int [N, k]; rows float32/float64 [N, k, W] (C-contiguous); out
    [n_keys, W] of rows' dtype. Each key's rows are summed in ascending
    (t, i) order, identically on every run.
    """
    cp = cupy_module()
    segments = key_segments(indices, cp.int64, out.shape[0])
    if segments is None:
        return
    positions, starts, keys = segments
    width = rows.shape[-1]
    picked = cp.ascontiguousarray(rows.reshape(-1, width)[positions])
    n_seg = int(keys.size)
    name = "segment_sum_f64" if rows.dtype == cp.float64 else "segment_sum_f32"
    total = n_seg * width
    get_kernel("segment_sum", name)(((total + 255) // 256,), (256,),
                                    (picked, starts, keys, np.int32(n_seg), np.int32(width), out))
