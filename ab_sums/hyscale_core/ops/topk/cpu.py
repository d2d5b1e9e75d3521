"""CPU backend of ``topk``: an exact radix select per row, parallel over rows.

Per row: keys from the bits (keys.py), then the histogram of their top
11-bit digit; a second pass takes every key above the k-th key's bucket
and collects the bucket's members, among which an MSB-first radix select
finds the k-th key ``thr``; keys equal to it are taken lower index first.
``sorted=True`` then orders the k picks by (key descending, index
ascending) with a stable LSD radix sort.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .keys import key_spec

DIGIT_BITS = 11


@njit(cache=True, inline="always")
def sort_key(bits, width_ones, sign, exp_mask, mant_mask, is_float, invert):
    """Key of one element's raw bits (uint64); see keys.py for the mapping."""
    zero = np.uint64(0)
    if is_float:
        if (bits & exp_mask) == exp_mask and (bits & mant_mask) != zero:
            key = width_ones
        else:
            if bits == sign:
                bits = zero
            if (bits & sign) != zero:
                key = ~bits & width_ones
            else:
                key = bits | sign
    else:
        key = bits ^ sign
    if invert:
        key = ~key & width_ones
    return key


@njit(cache=True)
def kth_largest(keys, k, width):
    """``(thr, n_above)``: the k-th largest key and how many keys exceed it.

    ``keys`` is an unsigned integer array, ``1 <= k <= len(keys)``.
    """
    hist = np.zeros(1 << DIGIT_BITS, np.int64)
    cand = keys
    k_rem = k
    n_above = 0
    shift = width
    while shift > 0:
        digit = min(DIGIT_BITS, shift)
        shift -= digit
        n_buckets = 1 << digit
        mask = np.uint64(n_buckets - 1)
        sh = np.uint64(shift)
        hist[:n_buckets] = 0
        for key in cand:
            hist[(key >> sh) & mask] += 1
        bucket = n_buckets - 1
        acc = 0
        while acc + hist[bucket] < k_rem:
            acc += hist[bucket]
            bucket -= 1
        n_above += acc
        k_rem -= acc
        size = hist[bucket]
        target = np.uint64(bucket)
        nxt = np.empty(size, keys.dtype)
        j = 0
        for key in cand:
            if ((key >> sh) & mask) == target:
                nxt[j] = key
                j += 1
        cand = nxt
        if size == k_rem:  # the whole bucket is taken: its minimum is the k-th
            thr = cand.min()
            for key in cand:
                if key > thr:
                    n_above += 1
            return thr, n_above
    return cand[0], n_above


@njit(cache=True)
def take_in_index_order(keys, k, thr, n_above, out):
    """Write the indices of the top-k keys to ``out`` in ascending order."""
    ties = k - n_above
    j = 0
    for i in range(keys.shape[0]):
        key = keys[i]
        if key > thr:
            out[j] = i
            j += 1
        elif key == thr and ties > 0:
            out[j] = i
            j += 1
            ties -= 1


@njit(cache=True)
def sort_by_key(keys, idx, width):
    """Reorder ``idx`` (ascending indices into ``keys``) by key descending.

    An LSD radix sort on complemented keys, 11-bit digits; every pass is
    stable, so equal keys keep their ascending index order.
    """
    k = idx.shape[0]
    ones = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    cur_key = np.empty(k, np.uint64)
    for j in range(k):
        cur_key[j] = ~keys[idx[j]] & ones
    cur_idx = idx.copy()
    nxt_key = np.empty(k, np.uint64)
    nxt_idx = np.empty(k, idx.dtype)
    hist = np.empty(1 << DIGIT_BITS, np.int64)
    shift = 0
    while shift < width:
        digit = min(DIGIT_BITS, width - shift)
        mask = np.uint64((1 << digit) - 1)
        sh = np.uint64(shift)
        shift += digit
        hist[: 1 << digit] = 0
        for j in range(k):
            hist[(cur_key[j] >> sh) & mask] += 1
        if hist[(cur_key[0] >> sh) & mask] == k:  # one digit value: pass is a no-op
            continue
        total = 0
        for b in range(1 << digit):
            c = hist[b]
            hist[b] = total
            total += c
        for j in range(k):
            b = (cur_key[j] >> sh) & mask
            nxt_key[hist[b]] = cur_key[j]
            nxt_idx[hist[b]] = cur_idx[j]
            hist[b] += 1
        cur_key, nxt_key = nxt_key, cur_key
        cur_idx, nxt_idx = nxt_idx, cur_idx
    idx[:] = cur_idx


@njit(cache=True)
def _merge(a, na, b, nb, out):
    """Merge two ascending index lists into ``out``."""
    i = j = 0
    for m in range(na + nb):
        if j >= nb or (i < na and a[i] < b[j]):
            out[m] = a[i]
            i += 1
        else:
            out[m] = b[j]
            j += 1


@njit(cache=True)
def select_row(keys, k, width, top_hist, out):
    """Write the top ``k`` (< len(keys)) of one row to ``out`` in ascending index order.

    ``top_hist`` is the histogram of the top digit of ``keys``. One pass
    splits the row into keys above the k-th key's bucket (all taken) and the
    bucket's members, which a radix select over the members then resolves.
    """
    top = min(DIGIT_BITS, width)
    sh = np.uint64(width - top)
    bucket = (1 << top) - 1
    above = 0
    while above + top_hist[bucket] < k:
        above += top_hist[bucket]
        bucket -= 1
    target = np.uint64(bucket)
    above_idx = np.empty(above, np.int64)
    members = np.empty(top_hist[bucket], np.int64)
    na = nm = 0
    for i in range(keys.shape[0]):
        d = keys[i] >> sh
        if d > target:
            above_idx[na] = i
            na += 1
        elif d == target:
            members[nm] = i
            nm += 1
    need = k - above
    if need == nm:
        _merge(above_idx, na, members, nm, out)
        return
    member_keys = keys[members]
    thr, n_above = kth_largest(member_keys, need, width)
    chosen = np.empty(need, np.int64)
    take_in_index_order(member_keys, need, thr, n_above, chosen)
    _merge(above_idx, na, members[chosen], need, out)


@njit(cache=True)
def top_digit_histogram(keys, sh, n_buckets):
    """Histogram (int64 [n_buckets]) of ``keys >> sh``.

    A loop of its own: counting inside the key loop kept the key transform
    from vectorising (benchmarks/cpu_breakdown.py; 0.63 -> 0.33 s for the
    whole [4096, 32768] top-k).
    """
    hist = np.zeros(n_buckets, np.int64)
    for i in range(keys.shape[0]):
        hist[keys[i] >> sh] += 1
    return hist


@njit(cache=True, parallel=True)
def _topk_rows(bits, k, width, width_ones, sign, exp_mask, mant_mask, is_float, invert, do_sort, out):
    """Row top-k; keys are held in ``bits``'s dtype (a key is as wide as the data)."""
    n_rows, n = bits.shape
    top = min(DIGIT_BITS, width)
    sh = np.uint64(width - top)
    for r in prange(n_rows):
        keys = np.empty(n, bits.dtype)
        row = bits[r]
        for i in range(n):
            keys[i] = sort_key(np.uint64(row[i]), width_ones, sign, exp_mask, mant_mask, is_float, invert)
        if k == n:
            for i in range(n):
                out[r, i] = i
        else:
            select_row(keys, k, width, top_digit_histogram(keys, sh, 1 << top), out[r])
        if do_sort:
            sort_by_key(keys, out[r], width)


def topk_rows(rows: np.ndarray, k: int, largest: bool, sort_output: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of each row of a C-contiguous 2-D array (see ``hyscale_core.topk``)."""
    n_rows = rows.shape[0]
    indices = np.empty((n_rows, k), dtype=np.int64)
    if k > 0 and n_rows > 0:
        spec = key_spec(rows.dtype)
        _topk_rows(
            rows.view(spec.bits_dtype), k, spec.width, np.uint64(spec.all_ones),
            np.uint64(spec.sign), np.uint64(spec.exp_mask), np.uint64(spec.mant_mask),
            spec.is_float, not largest, sort_output, indices,
        )
    return np.take_along_axis(rows, indices, axis=1), indices
