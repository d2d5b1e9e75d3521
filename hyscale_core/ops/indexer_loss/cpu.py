"""CPU backend of the indexer's sparse-stage loss (Numba), parallel over queries.

Backend contract (a ``gpu.py`` with the same three functions drops in):

    indexer_scores_at(q, k, w, indices) -> scores
        q [N, H, D], k [Nk, D], w [N, H]: C-contiguous, any accepted float
        dtype each (w finite); indices int32 [N, kk], validated (-1 or in
        [0, Nk)). Returns float32 [N, kk], -inf at -1 slots.
    indexer_scores_at_backward(q, k, w, indices, dscores) -> (dq, dk, dw)
        as above plus dscores [N, kk] (finite, any float dtype). Returns dq
        in q's dtype, dk in k's dtype (bitwise reproducible), dw in w's dtype.
    indexer_kl_loss(scores_at, probs) -> (loss, dscores)
        scores_at [N, kk] (finite or -inf), probs [N, kk] (finite, >= 0), any
        float dtypes. Returns the loss as a Python float and dscores float32
        [N, kk].

Precision: as sparse attention (see ops/sparse_attention/cpu.py): float64
when the float inputs that carry the computation (q and k; scores_at and
probs) are all float64, float32 with float32 accumulation otherwise. Every
sum has a fixed order: dot products in blocks of features (gather_dots),
the head sum of a score ascending and compensated, dq/dw over a row's slots
in compensated blocks, dk per key in ascending (query, slot) order
(keymajor.py), the KL row sums compensated. The loss adds its per-row
values in float64.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..._dtypes import compute_dtype
from ..sparse_attention.cpu import SLOT_BLOCK, gather_dots, valid_slots
from ..sparse_attention.keymajor import FMA, accumulate_by_key, flush, key_major, rows_per_chunk


@njit(cache=True, fastmath=FMA, inline="always")
def _kahan(total, comp, x):
    """One compensated add: returns the new ``(total, comp)``."""
    y = x - comp
    t = total + y
    return t, (t - total) - y


@njit(cache=True, parallel=True, fastmath=FMA)
def _scores_at(q, k, w, indices, scores):
    """scores[t, i] = sum_h w[t, h] * relu(q[t, h] . k[s]), heads in ascending
    order with compensation."""
    n_h = q.shape[1]
    zero = q.dtype.type(0)
    for t in prange(q.shape[0]):
        idx_row = indices[t]
        slots = np.empty(idx_row.shape[0], np.int64)
        m = valid_slots(idx_row, slots)
        scores[t, :] = -np.inf
        dots = np.empty((m, n_h), q.dtype)
        gather_dots(q[t], k, idx_row, slots, m, dots)
        for a in range(m):
            acc, comp = zero, zero
            for h in range(n_h):
                x = dots[a, h]
                acc, comp = _kahan(acc, comp, w[t, h] * (x if x > zero else zero))  # relu(NaN) = 0
            scores[t, slots[a]] = acc


def indexer_scores_at(q, k, w, indices) -> np.ndarray:
    """float32 [N, kk] scores at the selected keys, -inf at -1 slots."""
    dt = compute_dtype(q, k)
    q_c, k_c, w_c = (np.ascontiguousarray(a, dtype=dt) for a in (q, k, w))
    scores = np.empty(indices.shape, np.float32)
    _scores_at(q_c, k_c, w_c, indices, scores)
    return scores


@njit(cache=True, fastmath=FMA)
def _backward_row(q_t, k, w_t, idx_row, g_row, dq_t, dw_t, coef_t):
    """One query's dq_t [H, D], dw_t [H] and key-side weights coef_t [kk, H].

    coef_t[i, h] = dscores[t, i] * w[t, h] * relu'(x), x = q[t, h] . k[s].
    Sums over slots run in blocks of SLOT_BLOCK, compensated across blocks.
    """
    n_h = q_t.shape[0]
    zero = q_t.dtype.type(0)
    slots = np.empty(idx_row.shape[0], np.int64)
    m = valid_slots(idx_row, slots)
    dq_t[:] = 0
    dots = np.empty((m, n_h), q_t.dtype)
    gather_dots(q_t, k, idx_row, slots, m, dots)
    dw_2d = np.zeros((1, n_h), q_t.dtype)
    dw_part, dw_comp = np.zeros((1, n_h), q_t.dtype), np.zeros((1, n_h), q_t.dtype)
    dq_part, dq_comp = np.zeros(dq_t.shape, q_t.dtype), np.zeros(dq_t.shape, q_t.dtype)
    for a in range(m):
        g = g_row[slots[a]]
        key_row = k[idx_row[slots[a]]]
        for h in range(n_h):
            x = dots[a, h]
            c_h = zero
            if x > zero:
                dw_part[0, h] += g * x
                c_h = g * w_t[h]
            coef_t[slots[a], h] = c_h
            if c_h != zero:
                row = dq_part[h]
                for c in range(row.shape[0]):
                    row[c] += c_h * key_row[c]
        if (a + 1) % SLOT_BLOCK == 0 or a == m - 1:
            flush(dw_part, dw_2d, dw_comp)
            flush(dq_part, dq_t, dq_comp)
    dw_t[:] = dw_2d[0]


@njit(cache=True, parallel=True, fastmath=FMA)
def _backward_rows(q, k, w, indices, dscores, dq, dw, coef):
    for t in prange(q.shape[0]):
        _backward_row(q[t], k, w[t], indices[t], dscores[t], dq[t], dw[t], coef[t])


def indexer_scores_at_backward(q, k, w, indices, dscores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq [N, H, D] q.dtype, dk [Nk, D] k.dtype, dw [N, H] w.dtype)``; dk deterministic.

    Query chunks (ascending): a parallel query pass writes dq, dw and the
    chunk's coef [T, kk, H]; the chunk's pairs then add coef * q rows to dk
    key by key (keymajor.py).
    """
    dt = compute_dtype(q, k)
    q_c, k_c, w_c, g_c = (np.ascontiguousarray(a, dtype=dt) for a in (q, k, w, dscores))
    n, n_h, dim = q.shape
    kk = indices.shape[1]
    dq = np.empty((n, n_h, dim), dt)
    dw = np.empty((n, n_h), dt)
    dk = np.zeros((k.shape[0], dim), dt)
    dk_comp = np.zeros_like(dk)
    widths = np.full(n_h, dim, dtype=np.int64)
    step = rows_per_chunk(n, kk, n_h)
    for t0 in range(0, n, step):
        t1 = min(t0 + step, n)
        coef = np.empty((t1 - t0, kk, n_h), dt)
        _backward_rows(q_c[t0:t1], k_c, w_c[t0:t1], indices[t0:t1], g_c[t0:t1], dq[t0:t1], dw[t0:t1], coef)
        accumulate_by_key(key_major(indices[t0:t1]), coef, q_c[t0:t1], widths, dk, dk_comp)
    return dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dw.astype(w.dtype, copy=False)


@njit(cache=True, fastmath=FMA)
def _kl_row(s, probs, inv_n, d_row):
    """One row's KL(target || softmax(s)) over its finite slots; writes d_row [kk].

    The row's sums (target mass, softmax normaliser, loss) are compensated.
    """
    zero = s.dtype.type(0)
    d_row[:] = 0
    top = s.dtype.type(-np.inf)
    mass, c_mass = zero, zero
    for i in range(s.shape[0]):
        if s[i] > -np.inf:
            top = max(top, s[i])
            mass, c_mass = _kahan(mass, c_mass, probs[i])
    if top == -np.inf or not mass > zero:
        return zero
    total, c_total = zero, zero
    for i in range(s.shape[0]):
        if s[i] > -np.inf:
            total, c_total = _kahan(total, c_total, np.exp(s[i] - top))
    log_total = np.log(total)
    loss, c_loss = zero, zero
    for i in range(s.shape[0]):
        if s[i] > -np.inf:
            target = probs[i] / mass
            if target > zero:
                loss, c_loss = _kahan(loss, c_loss, target * (np.log(target) - (s[i] - top - log_total)))
            d_row[i] = (np.exp(s[i] - top) / total - target) * inv_n
    return loss


@njit(cache=True, parallel=True, fastmath=FMA)
def _kl_rows(scores, probs, inv_n, row_loss, dscores):
    for t in prange(scores.shape[0]):
        row_loss[t] = _kl_row(scores[t], probs[t], inv_n, dscores[t])


def indexer_kl_loss(scores_at, probs) -> tuple[float, np.ndarray]:
    """``(loss, dscores float32 [N, kk])``: mean over all N rows, empty rows count 0."""
    dt = compute_dtype(scores_at, probs)
    s_c, p_c = (np.ascontiguousarray(a, dtype=dt) for a in (scores_at, probs))
    n = s_c.shape[0]
    row_loss = np.empty(n, dt)
    dscores = np.empty(s_c.shape, np.float32)
    _kl_rows(s_c, p_c, dt.type(1.0 / max(n, 1)), row_loss, dscores)
    loss = float(np.sum(row_loss, dtype=np.float64) / n) if n else 0.0
    return loss, dscores
