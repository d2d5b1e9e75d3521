"""Plain float64 reference of the DSA indexer scores.

    I[t, s] = sum_h w[t, h] * relu(dot(q[t, h, :], k[s, :]))   for lo[t] <= s < hi[t]
            = -inf                                             elsewhere

with relu(NaN) = 0 on every backend (fmax semantics).
"""
from __future__ import annotations

import numpy as np


def indexer_scores(q: np.ndarray, k: np.ndarray, w: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """float64 [Nq, Nk] scores from float64 copies of q [Nq, H, D], k [Nk, D], w [Nq, H]."""
    q64, k64, w64 = (np.asarray(x, dtype=np.float64) for x in (q, k, w))
    logits = np.einsum("thd,sd->ths", q64, k64)
    scores = np.einsum("th,ths->ts", w64, np.fmax(logits, 0.0))
    s = np.arange(k.shape[0])
    visible = (s[None, :] >= lo[:, None]) & (s[None, :] < hi[:, None])
    return np.where(visible, scores, -np.inf)
