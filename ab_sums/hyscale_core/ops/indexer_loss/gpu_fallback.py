"""The indexer's sparse-stage loss on the GPU from CuPy primitives: the path
of gpu.py for inputs its kernels are not built for (float64 or mixed q / k
dtypes, more than 128 heads, head dims that are not a multiple of 16 up to
128), and for everything while $HYSCALE_INDEXER_LOSS_FALLBACK=1.

Same contract as cpu.py. Precision: every product and sum in float64,
rounded once to the output dtypes; relu(NaN) = 0 (fmax). dk is summed per key
in ascending (query, slot) order (gpu/segments.py): bitwise reproducible.
Memory: scores and their backward are query-chunked (gathered float64 key
rows of at most 256 MiB per chunk); the KL loss holds about ten float64
[N, kk] temporaries at once (2 GiB each at N = 131072, kk = 2048).
"""
from __future__ import annotations

from ..._backend import cupy_module
from ...gpu.convert import narrow, widen
from ...gpu.segments import scatter_add_rows
from ..sparse_attention.gpu_fallback import _chunks, _gathered


def _logits(cp, q, k, idx, dt):
    valid, sel = _gathered(cp, k, idx, dt)
    return valid, sel, widen(q, dt) @ sel.transpose(0, 2, 1)  # [C, H, kk]


def indexer_scores_at(q, k, w, indices):
    cp = cupy_module()
    dt = cp.float64
    scores = cp.empty(indices.shape, dtype=cp.float32)
    for t0, t1 in _chunks(q.shape[0], indices.shape[1], q.shape[2]):
        valid, _, logits = _logits(cp, q[t0:t1], k, indices[t0:t1], dt)
        s = (widen(w[t0:t1], dt)[:, :, None] * cp.fmax(logits, 0)).sum(axis=1)
        scores[t0:t1] = cp.where(valid, s, -cp.inf)
    return scores


def indexer_scores_at_backward(q, k, w, indices, dscores):
    cp = cupy_module()
    dt = cp.float64
    dq = cp.empty(q.shape, dtype=q.dtype)
    dw = cp.empty(w.shape, dtype=w.dtype)
    dk = cp.zeros(k.shape, dtype=dt)
    for t0, t1 in _chunks(q.shape[0], indices.shape[1], q.shape[2]):
        idx = indices[t0:t1]
        valid, sel, logits = _logits(cp, q[t0:t1], k, idx, dt)
        g = cp.where(valid, widen(dscores[t0:t1], dt), 0)[:, None, :]  # [C, 1, kk]
        w_c = widen(w[t0:t1], dt)[:, :, None]
        dw[t0:t1] = narrow((g * cp.fmax(logits, 0)).sum(axis=2), w.dtype)
        dlogit = g * w_c * (logits > 0)
        dq[t0:t1] = narrow(dlogit @ sel, q.dtype)
        rows = dlogit.transpose(0, 2, 1) @ widen(q[t0:t1], dt)
        scatter_add_rows(idx, cp.ascontiguousarray(rows), dk)
    return dq, narrow(dk, k.dtype), dw


def indexer_kl_loss(scores_at, probs):
    cp = cupy_module()
    dt = cp.float64
    s, p = widen(scores_at, dt), widen(probs, dt)
    n = s.shape[0]
    valid = s > -cp.inf
    mass = cp.where(valid, p, 0).sum(axis=1, keepdims=True)
    top = cp.where(valid, s, -cp.inf).max(axis=1, keepdims=True)
    live = valid.any(axis=1, keepdims=True) & (mass > 0)
    top = cp.where(live, top, 0)
    e = cp.where(valid, cp.exp(cp.where(valid, s, 0) - top), 0)
    total = cp.where(live, e.sum(axis=1, keepdims=True), 1)
    target = cp.where(valid & live, p / cp.where(live, mass, 1), 0)
    log_softmax = cp.where(valid, s - top - cp.log(total), 0)
    terms = cp.where(target > 0, target * (cp.log(cp.where(target > 0, target, 1)) - log_softmax), 0)
    row_loss = cp.where(live[:, 0], terms.sum(axis=1), 0)
    dscores = cp.where(valid & live, (e / total - target) / max(n, 1), 0).astype(cp.float32)
    loss = float(row_loss.astype(cp.float64).sum().get() / n) if n else 0.0
    return loss, dscores
