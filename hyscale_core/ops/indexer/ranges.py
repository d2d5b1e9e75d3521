"""Which keys each query may select: one contiguous range per query.

Every mask the indexer supports (causal, ``q_pos``, packed ``cu_seqlens``)
reduces to a half-open range ``[lo[t], hi[t])`` in the key axis: query ``t``
at key position ``p = q_pos[t]`` belongs to the packed sequence holding key
``p`` and sees that sequence's keys at positions ``<= p`` (causal) or all of
them (non-causal). Ranges are computed on the host and are validated there.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..._backend import GPU, as_array
from ..._checks import check_ndim


def host_ints(x: Any, name: str) -> np.ndarray:
    backend, x = as_array(x, name)
    if backend == GPU:
        x = x.get()
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
    if x.dtype.kind == "u" and x.size and int(x.max()) > np.iinfo(np.int64).max:  # would wrap in int64
        pos = tuple(int(i) for i in np.argwhere(x > np.iinfo(np.int64).max)[0])
        raise ValueError(f"{name}[{', '.join(map(str, pos))}] = {int(x[pos])} is past int64: no key position")
    return x.astype(np.int64)


def query_positions(q_pos: Any, n_q: int, n_k: int) -> np.ndarray:
    """Validated key-axis position of each query (int64 [n_q])."""
    if q_pos is None:
        if n_q > n_k:
            raise ValueError(
                f"q has {n_q} queries but k has only {n_k} keys; pass q_pos to place the queries"
            )
        return np.arange(n_k - n_q, n_k, dtype=np.int64)
    pos = host_ints(q_pos, "q_pos")
    check_ndim(pos, 1, "q_pos", "[Nq]")
    if pos.shape[0] != n_q:
        raise ValueError(f"q_pos has {pos.shape[0]} entries but q has {n_q} queries")
    bad = np.flatnonzero((pos < 0) | (pos >= n_k))
    if bad.size:
        raise ValueError(f"q_pos[{bad[0]}] = {pos[bad[0]]} is outside the key range [0, {n_k})")
    return pos


def sequence_bounds(cu_seqlens: Any, n_k: int) -> np.ndarray:
    """Validated packed-sequence boundaries (int64 [B+1])."""
    cu = host_ints(cu_seqlens, "cu_seqlens")
    check_ndim(cu, 1, "cu_seqlens", "[B+1]")
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries, got {cu.shape[0]}")
    if cu[0] != 0 or cu[-1] != n_k:
        raise ValueError(f"cu_seqlens must start at 0 and end at Nk={n_k}, got {cu[0]} ... {cu[-1]}")
    drops = np.flatnonzero(np.diff(cu) < 0)
    if drops.size:
        i = drops[0]
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={cu[i]} > "
                         f"cu_seqlens[{i + 1}]={cu[i + 1]}")
    return cu


def candidate_ranges(
    n_q: int, n_k: int, causal: bool, q_pos: Any = None, cu_seqlens: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``, int64 [n_q]: query ``t`` may select keys ``lo[t] <= s < hi[t]``."""
    if not causal and cu_seqlens is None:
        if q_pos is not None:
            query_positions(q_pos, n_q, n_k)  # validated even where it changes nothing
        return np.zeros(n_q, dtype=np.int64), np.full(n_q, n_k, dtype=np.int64)
    pos = query_positions(q_pos, n_q, n_k)
    if cu_seqlens is None:
        lo = np.zeros(n_q, dtype=np.int64)
        end = np.full(n_q, n_k, dtype=np.int64)
    else:
        cu = sequence_bounds(cu_seqlens, n_k)
        seq = np.searchsorted(cu, pos, side="right") - 1
        lo, end = cu[seq], cu[seq + 1]
    hi = pos + 1 if causal else end
    return lo, hi
