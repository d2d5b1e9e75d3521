"""Deterministic scatter-add on the GPU: contributions grouped by key with a
sort on (key, position) and summed in position order by cuda/segment_sum.cu."""
from __future__ import annotations

import numpy as np

from .._backend import cupy_module
from .module import get_kernel


def scatter_add_rows(indices, rows, out) -> None:
    """out[s] += sum of rows[t, i] over the slots with indices[t, i] == s (-1 skipped).

    indices int [N, k]; rows float32/float64 [N, k, W] (C-contiguous); out
    [n_keys, W] of rows' dtype. Each key's rows are summed in ascending
    (t, i) order, identically on every run.
    """
    cp = cupy_module()
    flat_idx = indices.reshape(-1).astype(cp.int64)
    valid = cp.flatnonzero(flat_idx >= 0)
    if valid.size == 0:
        return
    keys = flat_idx[valid]
    order = cp.argsort(keys * np.int64(flat_idx.size) + valid)  # unique: any sort gives one order
    keys, positions = keys[order], valid[order]
    width = rows.shape[-1]
    picked = cp.ascontiguousarray(rows.reshape(-1, width)[positions])
    boundary = cp.flatnonzero(cp.concatenate([cp.ones(1, dtype=cp.bool_), keys[1:] != keys[:-1]]))
    starts = cp.concatenate([boundary, cp.asarray([keys.size])]).astype(cp.int64)
    seg_keys = cp.ascontiguousarray(keys[boundary])
    n_seg = int(boundary.size)
    name = "segment_sum_f64" if rows.dtype == cp.float64 else "segment_sum_f32"
    total = n_seg * width
    get_kernel("segment_sum", name)(((total + 255) // 256,), (256,),
                                    (picked, starts, seg_keys, np.int32(n_seg), np.int32(width), out))
