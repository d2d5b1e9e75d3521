"""Key-major (transposed) index tables and the deterministic per-key accumulation.

The gradient of a gathered table (``dkv`` of sparse attention, ``dk`` of the
indexer) receives one contribution from every (query, slot) that selected a
key. Scattering them with float atomics makes the sum depend on thread
timing. Instead the selection is transposed: a stable sort of the flattened
index table groups the (query, slot) pairs by key, in ascending (query,
slot) order inside each key, and one worker per key sums its pairs in that
order. The result is bitwise reproducible and independent of the number of
threads.

Backward passes go over the queries in chunks (ascending); each chunk's
key-side weights live in a buffer ``coef [T, k, J]``, and its pairs are added
to the gradient rows key by key, with a Kahan compensation per gradient
element kept across chunks. Because chunks come in ascending query order
and every key's pairs are added in ascending order inside a chunk, each
gradient element sees the same sequence of compensated adds, in global
ascending (query, slot) order, whatever the chunk size: chunking bounds
memory without changing a bit.
"""
from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange

# The only fast-math freedom the kernels take: a * b + c may become one fused
# multiply-add (one rounding instead of two). No reassociation, no NaN/inf
# assumptions: every sum keeps its stated order, and the compiled code is
# the same on every run, so results stay bitwise reproducible.
FMA = {"contract"}

# A pair's sum over j runs in blocks of HEAD_BLOCK (see flush).
HEAD_BLOCK = 32

# Elements of one chunk's coefficient buffer (coef [T, k, J]): 2**22 floats,
# 16 MiB in float32.
COEF_BUDGET = 1 << 22


class KeyMajor(NamedTuple):
    """A selection grouped by key.

    keys   int64 [U]      the distinct selected keys, ascending.
    starts int64 [U + 1]  key ``keys[u]`` owns ``pairs[starts[u]:starts[u + 1]]``.
    pairs  int64 [P]      flat positions ``t * k + i`` of the valid slots,
                          ascending inside each key (-1 slots are dropped).
    """

    keys: np.ndarray
    starts: np.ndarray
    pairs: np.ndarray


def key_major(indices: np.ndarray) -> KeyMajor:
    """Transpose an int32 [T, k] selection (entries -1 or >= 0) into a :class:`KeyMajor`."""
    flat = np.ascontiguousarray(indices).reshape(-1)
    order = np.argsort(flat, kind="stable")  # ties keep ascending flat position
    sorted_keys = flat[order]
    first = int(np.searchsorted(sorted_keys, 0))  # the -1 slots sort first
    order, sorted_keys = order[first:], sorted_keys[first:]
    if order.size == 0:
        return KeyMajor(np.empty(0, np.int64), np.zeros(1, np.int64), np.empty(0, np.int64))
    bounds = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
    starts = np.concatenate(([0], bounds, [order.size])).astype(np.int64)
    keys = sorted_keys[starts[:-1]].astype(np.int64)
    return KeyMajor(keys, starts, order.astype(np.int64))


def rows_per_chunk(n_rows: int, k: int, n_coef: int) -> int:
    """Queries per backward chunk: a ``[T, k, n_coef]`` buffer within ``COEF_BUDGET``.

    At least one query, and at least one per thread so the query pass stays
    parallel. The results do not depend on this choice (module docstring).
    """
    per_row = max(1, k * n_coef)
    rows = max(COEF_BUDGET // per_row, numba.get_num_threads(), 1)
    return max(1, min(rows, n_rows))


@njit(cache=True, fastmath=FMA)
def flush(part, total, comp):
    """Close a block: total += part with Kahan compensation comp; part = 0.

    part, total and comp are 2-D of one shape; comp starts at 0 with total.
    Only adds and subtracts, so the FMA flag leaves the compensation intact.
    """
    for j in range(part.shape[0]):
        for c in range(part.shape[1]):
            y = part[j, c] - comp[j, c]
            t = total[j, c] + y
            comp[j, c] = (t - total[j, c]) - y
            total[j, c] = t
            part[j, c] = 0


@njit(cache=True, fastmath=FMA)
def _pair_sum(coef_ti, rows_t, widths, lanes, part, pair, comp):
    """pair[0, :] = sum_j coef_ti[j] * rows_t[j, :widths[j]].

    Blocks of HEAD_BLOCK heads; inside a block head j feeds lane j % 4, the
    lanes are added pairwise, and block sums are compensated (flush), as
    the feature sums of sparse_attention.cpu.gather_dots.
    """
    n_j = coef_ti.shape[0]
    pair[:] = 0
    comp[:] = 0
    for j0 in range(0, n_j, HEAD_BLOCK):
        for j in range(j0, min(j0 + HEAD_BLOCK, n_j)):
            c_j = coef_ti[j]
            if c_j != 0:  # an exact zero weight adds nothing
                src = rows_t[j]
                lane = lanes[(j - j0) % 4]
                for c in range(widths[j]):
                    lane[c] += c_j * src[c]
        for c in range(part.shape[1]):
            part[0, c] = (lanes[0, c] + lanes[1, c]) + (lanes[2, c] + lanes[3, c])
        lanes[:] = 0
        flush(part, pair, comp)


@njit(cache=True, parallel=True, fastmath=FMA)
def _accumulate(keys, starts, pairs, coef, rows, widths, out, comp):
    k = coef.shape[1]
    for u in prange(keys.shape[0]):
        key = keys[u]
        lanes = np.zeros((4, rows.shape[2]), out.dtype)
        part = np.zeros((1, rows.shape[2]), out.dtype)
        pair = np.zeros((1, rows.shape[2]), out.dtype)
        pair_comp = np.zeros((1, rows.shape[2]), out.dtype)
        for e in range(starts[u], starts[u + 1]):
            t = pairs[e] // k
            i = pairs[e] - t * k
            _pair_sum(coef[t, i], rows[t], widths, lanes, part, pair, pair_comp)
            flush(pair, out[key:key + 1], comp[key:key + 1])


def accumulate_by_key(table: KeyMajor, coef: np.ndarray, rows: np.ndarray, widths: np.ndarray,
                      out: np.ndarray, comp: np.ndarray) -> None:
    """In place, for every pair (t, i) of key s in ``table`` (in its order):

        out[s, :widths[j]] += coef[t, i, j] * rows[t, j, :widths[j]]   for j = 0 .. J-1

    coef [T, k, J] and rows [T, J, W] (same float dtype as ``out``) are the
    chunk's key-side weights and vectors; ``table`` is ``key_major`` of the
    chunk's [T, k] selection; widths int64 [J] with widths[j] <= W ==
    out.shape[1]; out [N_keys, W] accumulates and comp [N_keys, W] holds its
    Kahan compensation (zeros with out, kept across chunks), both
    C-contiguous. One thread per key, so no two threads write one row.

    Sums go in fixed order: a pair's sum over j (blocks of HEAD_BLOCK in 4
    lanes, compensated across blocks), then pair by pair into ``out`` with
    the compensation carried in ``comp``. Both depend only on the pair and
    the key's earlier pairs, never on where a chunk starts.
    """
    _accumulate(table.keys, table.starts, table.pairs, coef, rows, widths, out, comp)
