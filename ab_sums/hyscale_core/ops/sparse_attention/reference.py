"""Plain float64 NumPy reference of sparse attention and its backward.

For query t, head j and slot i with key s = indices[t, i] >= 0:

    logit[t, j, i] = scale * dot(q[t, j, :], kv[s, :])
    p[t, j, :]     = softmax of the row's logits over its valid slots
    out[t, j, :]   = sum_i p[t, j, i] * kv[s, :d_v]
    lse[t, j]      = log(sum_i exp(logit[t, j, i]))     (-inf without valid slots)
    probs[t, i]    = sum_j p[t, j, i]                   (0 at -1 slots)

Everything is materialised ([N, h, k] logits, [N, k, d_qk] gathered keys)
and multiplied as batched float64 matrices: obvious, for tests on small N.
"""
from __future__ import annotations

import numpy as np


def _gather(kv: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(valid bool [N, k], selected float64 [N, k, d_qk])``; -1 slots hold key 0."""
    valid = indices >= 0
    return valid, np.asarray(kv, dtype=np.float64)[np.where(valid, indices, 0)]


def scatter_add(indices: np.ndarray, rows: np.ndarray, n_keys: int) -> np.ndarray:
    """``out[s] = sum of rows[t, i] over the slots with indices[t, i] == s`` (-1 skipped).

    rows [N, k, W] -> out [n_keys, W] in rows' dtype; each key's rows are
    added in ascending (t, i) order, as ``np.add.at`` would, but grouped by
    a stable sort and ``np.add.reduceat`` (much faster).
    """
    valid = indices >= 0
    keys, vals = indices[valid], rows[valid]
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], vals[order]
    out = np.zeros((n_keys, rows.shape[-1]), dtype=rows.dtype)
    if keys.size:
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        out[keys[starts]] = np.add.reduceat(vals, starts, axis=0)
    return out


def _logits(q: np.ndarray, sel: np.ndarray, valid: np.ndarray, scale: float) -> np.ndarray:
    """float64 [N, h, k] logits, -inf at -1 slots."""
    logits = scale * (np.asarray(q, dtype=np.float64) @ sel.transpose(0, 2, 1))
    return np.where(valid[:, None, :], logits, -np.inf)


def sparse_attention(q: np.ndarray, kv: np.ndarray, indices: np.ndarray, d_v: int, scale: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(out float64 [N, h, d_v], lse float64 [N, h], probs float64 [N, k])``."""
    valid, sel = _gather(kv, indices)
    logits = _logits(q, sel, valid, scale)
    top = logits.max(axis=2, initial=-np.inf, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(logits - top)  # exactly 0 at -1 slots
    total = e.sum(axis=2, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, top[..., 0] + np.log(total[..., 0]), -np.inf)
    out = p @ sel[:, :, :d_v]
    return out, lse, p.sum(axis=1)


def sparse_attention_backward(q: np.ndarray, kv: np.ndarray, indices: np.ndarray, out: np.ndarray,
                              lse: np.ndarray, dout: np.ndarray, d_v: int, scale: float
                              ) -> tuple[np.ndarray, np.ndarray]:
    """``(dq float64 [N, h, d_qk], dkv float64 [N_kv, d_qk])`` of ``sum(out * dout)``.

    Flash-attention backward from the saved ``lse``: p = exp(logit - lse),
    D = rowsum(dout * out), dlogit = p * (dout . v - D).
    """
    q64, out64, dout64 = (np.asarray(x, dtype=np.float64) for x in (q, out, dout))
    valid, sel = _gather(kv, indices)
    lse64 = np.asarray(lse, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # -inf - -inf in rows without valid slots
        p = np.exp(_logits(q64, sel, valid, scale) - lse64[:, :, None])
    p = np.where(valid[:, None, :], p, 0.0)
    big_d = (dout64 * out64).sum(axis=2)
    dp = dout64 @ sel[:, :, :d_v].transpose(0, 2, 1)
    dlogit = p * (dp - big_d[:, :, None])
    dq = scale * (dlogit @ sel)
    dsel = scale * (dlogit.transpose(0, 2, 1) @ q64)
    dsel[:, :, :d_v] += p.transpose(0, 2, 1) @ dout64
    return dq, scatter_add(indices, dsel, kv.shape[0])
