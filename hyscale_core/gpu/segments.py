"""Deterministic scatter-add on the GPU: the valid entries of an index table
grouped by key (``key_segments``, shared by every per-key sum of the GPU
backends) and summed in position order by cuda/segment_sum.cu."""
from __future__ import annotations

import numpy as np

from .._backend import cupy_module
from .module import get_kernel


SORT_TILE = 16 * 256  # entries per CTA of cuda/key_sort.cu
DIGIT_BITS = 8


def _sort_pass(keys, values, shift: int, keys_out, values_out):
    """One stable pass of cuda/key_sort.cu over int32 ``keys`` by the digit at
    ``shift``: the entries >= 0 with their values (positions where ``values``
    is None) fill the front of ``keys_out`` / ``values_out``, whose other keys
    must be -1. Returns the [256] int32 device array of the digits' totals."""
    cp = cupy_module()
    n = keys.size
    n_tiles = (n + SORT_TILE - 1) // SORT_TILE
    counts = cp.empty(256 * n_tiles, dtype=cp.int32)
    totals = cp.empty(256, dtype=cp.int32)
    tiles = (np.int64(n), np.int32(shift), np.int32(n_tiles))
    get_kernel("key_sort", "ks_digit_counts")((n_tiles,), (256,), (keys,) + tiles + (counts,))
    get_kernel("key_sort", "ks_digit_offsets")((256,), (256,), (counts, np.int32(n_tiles), totals))
    get_kernel("key_sort", "ks_scatter")((n_tiles,), (256,), (keys, values) + tiles + (counts, totals, keys_out,
                                                                                        values_out))
    return totals


def key_segments(indices, dtype, n_keys: int | None = None):
    """The valid entries (>= 0) of an index table grouped by key.

    indices: CuPy int array [N, k] with N * k < 2**31; n_keys: a bound on its
    entries (they lie in [-1, n_keys)); it sets the number of 8-bit radix
    passes (one per digit of n_keys - 1; four without it). Returns None when
    no entry is valid, else ``(positions, starts, keys)``, C-contiguous arrays
    of ``dtype``: ``positions`` are flat positions into ``indices`` (t * k + i)
    in ascending (key, position) order; segment s is
    ``positions[starts[s]:starts[s + 1]]``, whose entries all hold
    ``keys[s]``; keys ascend and ``starts`` has one entry more than ``keys``.
    Deterministic: a stable radix sort (cuda/key_sort.cu), no atomics on order.
    """
    cp = cupy_module()
    if indices.size >= 2 ** 31:
        raise ValueError(f"key_segments takes tables of fewer than 2**31 entries, got {indices.size}")
    if indices.size == 0:
        return None
    key_bits = 31 if n_keys is None else max(1, int(n_keys - 1).bit_length())
    keys, positions = cp.ascontiguousarray(indices.reshape(-1), dtype=cp.int32), None
    # two buffers in turn; their keys past the kept entries stay -1
    key_buffers = [cp.full(keys.size, -1, dtype=cp.int32) for _ in range(2)]
    value_buffers = [cp.empty(keys.size, dtype=cp.int32) for _ in range(2)]
    for p, shift in enumerate(range(0, key_bits, DIGIT_BITS)):
        totals = _sort_pass(keys, positions, shift, key_buffers[p % 2], value_buffers[p % 2])
        keys, positions = key_buffers[p % 2], value_buffers[p % 2]
        if p == 0:
            kept_per_digit = totals
    kept = int(kept_per_digit.sum())
    if kept == 0:
        return None
    keys, positions = keys[:kept], positions[:kept]
    first = cp.flatnonzero(cp.concatenate([cp.ones(1, dtype=cp.bool_), keys[1:] != keys[:-1]]))
    starts = cp.concatenate([first, cp.asarray([keys.size])])
    return positions.astype(dtype, copy=False), starts.astype(dtype), keys[first].astype(dtype)


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
