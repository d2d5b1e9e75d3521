"""Plain float64 NumPy reference of the indexer's sparse-stage loss.

    I[t, i]   = sum_h w[t, h] * relu(dot(q[t, h, :], k[s, :]))   s = indices[t, i] >= 0
              = -inf                                             at -1 slots
                                                                 (relu(NaN) = 0, fmax)
    target[t] = probs[t] / sum of probs[t] over the valid slots
    loss      = mean over t of KL(target[t] || softmax(I[t]))     (0 for rows without target mass)
"""
from __future__ import annotations

import numpy as np

from ..sparse_attention.reference import scatter_add


def _gather(q, k, indices):
    """``(valid [N, kk], selected float64 [N, kk, D], logits float64 [N, H, kk])``."""
    valid = indices >= 0
    sel = np.asarray(k, dtype=np.float64)[np.where(valid, indices, 0)]
    logits = np.einsum("thd,tid->thi", np.asarray(q, dtype=np.float64), sel)
    return valid, sel, logits


def indexer_scores_at(q: np.ndarray, k: np.ndarray, w: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """float64 [N, kk] indexer scores at the selected keys, -inf at -1 slots."""
    valid, _, logits = _gather(q, k, indices)
    scores = np.einsum("th,thi->ti", np.asarray(w, dtype=np.float64), np.fmax(logits, 0.0))
    return np.where(valid, scores, -np.inf)


def indexer_scores_at_backward(q: np.ndarray, k: np.ndarray, w: np.ndarray, indices: np.ndarray,
                               dscores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq [N, H, D], dk [Nk, D], dw [N, H])`` float64 of ``sum(I * dscores)``
    over the valid slots, with relu'(x) = 1 for x > 0 else 0."""
    valid, sel, logits = _gather(q, k, indices)
    g = np.where(valid, np.asarray(dscores, dtype=np.float64), 0.0)
    w64 = np.asarray(w, dtype=np.float64)
    dw = np.einsum("ti,thi->th", g, np.fmax(logits, 0.0))
    coef = g[:, None, :] * w64[:, :, None] * (logits > 0)
    dq = np.einsum("thi,tid->thd", coef, sel)
    dsel = np.einsum("thi,thd->tid", coef, np.asarray(q, dtype=np.float64))
    return dq, scatter_add(indices, dsel, k.shape[0]), dw


def indexer_kl_loss(scores_at: np.ndarray, probs: np.ndarray) -> tuple[float, np.ndarray]:
    """``(loss, dscores float64 [N, kk])``; valid slots are the finite scores."""
    s = np.asarray(scores_at, dtype=np.float64)
    n = s.shape[0]
    valid = np.isfinite(s)
    mass = np.where(valid, probs, 0.0).sum(axis=1)
    live = valid.any(axis=1) & (mass > 0)
    use = valid & live[:, None]
    target = np.where(use, probs / np.where(live, mass, 1.0)[:, None], 0.0)
    top = np.where(live, np.where(valid, s, -np.inf).max(axis=1, initial=-np.inf), 0.0)
    e = np.where(use, np.exp(np.where(use, s, 0.0) - top[:, None]), 0.0)
    total = np.where(live, e.sum(axis=1), 1.0)
    log_q = np.where(use, s, 0.0) - top[:, None] - np.log(total)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(target > 0, target * (np.log(target) - log_q), 0.0)
    loss = float(terms.sum() / n) if n else 0.0
    dscores = np.where(use, e / total[:, None] - target, 0.0) / max(n, 1)
    return loss, dscores
