"""Deterministic scatter-add on the GPU: the valid entries of an index table
grouped by key (``key_segments``, shared by every per-key sum of the GPU
backends) and summed in position order by cuda/segment_sum.cu."""
from __future__ import annotations

import numpy as np

from .._backend import cupy_module
from .module import get_kernel


SORT_TILE = 16 * 256  # entries per CTA of cuda/key_sort.cu
DIGIT_WIDTHS = (8, 9)  # the digit widths cuda/key_sort.cu is built for (HS_KS_BITS)
FILLER_KEY = 0x7FFFFFFF  # the sort buffer past the valid entries: sorts after every key


def _key_bits(n_keys: int) -> int:
    """Bits of the largest key, n_keys - 1 (at least one)."""
    return max(1, int(n_keys - 1).bit_length())


def digit_width(n_keys: int) -> int:
    """The digit width of the sort for keys in [0, n_keys): the one of DIGIT_WIDTHS that
    needs the fewest passes, the narrower where they tie (9-bit digits sort 2**17 and
    2**18 keys in two passes, not three; a narrower digit writes longer runs per tile)."""
    key_bits = _key_bits(n_keys)
    return min(DIGIT_WIDTHS, key=lambda bits: (-(-key_bits // bits), bits))


def _sort_pass(keys, values, shift: int, bits: int, keys_out, values_out) -> None:
    """One stable pass of cuda/key_sort.cu over int32 ``keys`` by the ``bits``-wide digit
    at ``shift``: the entries >= 0 with their values (positions where ``values`` is None)
    fill the front of ``keys_out`` / ``values_out``, in order."""
    cp = cupy_module()
    n, radix, defines = keys.size, 1 << bits, (f"HS_KS_BITS={bits}",)
    n_tiles = (n + SORT_TILE - 1) // SORT_TILE
    counts = cp.empty(radix * n_tiles, dtype=cp.int32)
    totals = cp.empty(radix, dtype=cp.int32)
    tiles = (np.int64(n), np.int32(shift), np.int32(n_tiles))
    get_kernel("key_sort", "ks_digit_counts", 0, defines)((n_tiles,), (256,), (keys,) + tiles + (counts,))
    get_kernel("key_sort", "ks_digit_offsets", 0, defines)((radix,), (256,), (counts, np.int32(n_tiles), totals))
    get_kernel("key_sort", "ks_scatter", 0, defines)((n_tiles,), (256,), (keys, values) + tiles + (
        counts, totals, keys_out, values_out))


def key_segments(indices, dtype, n_keys: int):
    """The valid entries (>= 0) of an index table grouped by key, on the device
    and without a host synchronisation.

    indices: CuPy int array [N, k], N * k < 2**31, entries in [-1, n_keys).
    Returns ``(positions, starts)``, C-contiguous arrays of ``dtype``:
    ``positions`` [N * k] holds the flat positions (t * k + i) of the valid
    entries in ascending (key, position) order, then filler (0); key s's
    positions are ``positions[starts[s]:starts[s + 1]]`` (empty for a key no
    entry holds), ``starts`` [n_keys + 1], so ``starts[n_keys]`` counts the
    valid entries. A stable radix sort (cuda/key_sort.cu, one pass per digit of
    n_keys - 1, digits of ``digit_width(n_keys)`` bits): the same table on every run.
    """
    cp = cupy_module()
    n = indices.size
    if n >= 2 ** 31:
        raise ValueError(f"key_segments takes tables of fewer than 2**31 entries, got {n}")
    if n == 0:
        return cp.zeros(0, dtype=dtype), cp.zeros(n_keys + 1, dtype=dtype)
    bits = digit_width(n_keys)
    shifts = range(0, _key_bits(n_keys), bits)
    keys, positions = cp.ascontiguousarray(indices.reshape(-1), dtype=cp.int32), None
    # The first pass fills the front of buffer 0 and leaves its filler tail, which
    # the later passes (every entry kept) carry along as the largest key.
    key_buffers = [cp.full(n, FILLER_KEY, dtype=cp.int32)]
    value_buffers = [cp.zeros(n, dtype=cp.int32)]
    if len(shifts) > 1:
        key_buffers.append(cp.empty(n, dtype=cp.int32))
        value_buffers.append(cp.empty(n, dtype=cp.int32))
    for p, shift in enumerate(shifts):
        _sort_pass(keys, positions, shift, bits, key_buffers[p % 2], value_buffers[p % 2])
        keys, positions = key_buffers[p % 2], value_buffers[p % 2]
    starts = cp.searchsorted(keys, cp.arange(n_keys + 1, dtype=cp.int32))
    return positions.astype(dtype, copy=False), starts.astype(dtype, copy=False)


def scatter_add_rows(indices, rows, out) -> None:
    """out[s] += sum of rows[t, i] over the slots with indices[t, i] == s (-1 skipped).

    indices int [N, k]; rows float32/float64 [N, k, W] (C-contiguous); out
    [n_keys, W] of rows' dtype. Each key's rows are summed in ascending
    (t, i) order, identically on every run.
    """
    cp = cupy_module()
    n_keys, width = out.shape[0], rows.shape[-1]
    if n_keys == 0 or indices.size == 0:
        return
    positions, starts = key_segments(indices, cp.int64, n_keys)
    picked = cp.ascontiguousarray(rows.reshape(-1, width)[positions])
    name = "segment_sum_f64" if rows.dtype == cp.float64 else "segment_sum_f32"
    total = n_keys * width
    get_kernel("segment_sum", name)(((total + 255) // 256,), (256,),
                                    (picked, starts, np.int32(n_keys), np.int32(width), out))
