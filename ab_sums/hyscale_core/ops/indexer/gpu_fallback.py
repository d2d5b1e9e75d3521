"""GPU indexer for shapes the fused kernel does not cover, from CuPy primitives.

Queries go in blocks of ``Q_BLOCK``; a block's scores are produced key tile
by key tile (cuBLAS float32 products, CuPy ReLU and head sum) into a panel
[Q_BLOCK, Nk], from which ``indexer_scores`` fills the table and
``indexer_topk`` selects with the GPU ``topk``. Both use the same tile code
on the same shapes, so their scores are bitwise identical.
"""
from __future__ import annotations

import numpy as np

from ..._backend import cupy_module
from ..topk import gpu as topk_gpu

Q_BLOCK = 256
K_TILE = 8192


def _panel(cp, q_block, k32, w_block, lo, hi):
    """float32 [T, Nk] scores of one query block, -inf outside [lo, hi)."""
    n_t, n_heads, dim = q_block.shape
    n_k = k32.shape[0]
    queries = q_block.astype(cp.float32).reshape(-1, dim)
    panel = cp.full((n_t, n_k), -cp.inf, dtype=cp.float32)
    first, last = int(lo.min()), int(hi.max())
    lo_d, hi_d = cp.asarray(lo)[:, None], cp.asarray(hi)[:, None]
    for s0 in range((first // K_TILE) * K_TILE, last, K_TILE):
        s1 = min(s0 + K_TILE, n_k)
        if not np.any((lo < s1) & (hi > s0)):
            continue
        logits = (queries @ k32[s0:s1].T).reshape(n_t, n_heads, s1 - s0)
        tile = (w_block[:, :, None] * cp.maximum(logits, 0)).sum(axis=1)
        s = cp.arange(s0, s1)[None, :]
        panel[:, s0:s1] = cp.where((s >= lo_d) & (s < hi_d), tile, -cp.inf)
    return panel


def _panels(q, k, w, lo, hi):
    cp = cupy_module()
    k32 = cp.ascontiguousarray(k, dtype=cp.float32)
    w32 = cp.ascontiguousarray(w, dtype=cp.float32)
    for t0 in range(0, q.shape[0], Q_BLOCK):
        t1 = min(t0 + Q_BLOCK, q.shape[0])
        yield t0, t1, _panel(cp, q[t0:t1], k32, w32[t0:t1], lo[t0:t1], hi[t0:t1])


def indexer_scores(q, k, w, lo, hi):
    """float32 [Nq, Nk] score table on the device."""
    cp = cupy_module()
    table = cp.empty((q.shape[0], k.shape[0]), dtype=cp.float32)
    for t0, t1, panel in _panels(q, k, w, lo, hi):
        table[t0:t1] = panel
    return table


def indexer_topk(q, k, w, topk: int, lo, hi, want_scores: bool):
    """``(indices int32 [Nq, topk], scores float32 [Nq, topk] or None)`` on the device."""
    return select_from_panels(_panels(q, k, w, lo, hi), q.shape[0], k.shape[0], topk, want_scores)


def select_from_panels(panels, n_q: int, n_k: int, topk: int, want_scores: bool):
    """Each row's top ``topk`` of score panels ``(t0, t1, float32 [t1 - t0, n_k])``
    that cover queries 0 .. n_q - 1: ``(indices int32 [n_q, topk], scores
    float32 [n_q, topk] or None)``, -1 and -inf past a row's finite scores."""
    cp = cupy_module()
    indices = cp.full((n_q, topk), -1, dtype=cp.int32)
    scores = cp.full((n_q, topk), -cp.inf, dtype=cp.float32)
    kept = min(topk, n_k)
    for t0, t1, panel in panels:
        values, picked = topk_gpu.topk_rows(panel, kept, True, True)
        masked = values == -cp.inf
        indices[t0:t1, :kept] = cp.where(masked, -1, picked).astype(cp.int32)
        scores[t0:t1, :kept] = values
    return indices, (scores if want_scores else None)
