"""Sparse attention on the GPU from CuPy primitives (cuBLAS batched products
over gathered kv rows), query-chunked to bound memory: the path of gpu.py for
inputs its tensor-core kernels are not built for (float32/float64 data, q
and kv of different dtypes, head dims other than d_qk = 576, d_v = 512).

Same contract as cpu.py. Precision: every product and sum runs in float64
(cuBLAS double products; the H200 runs them at about 67 TFLOP/s), then
results are rounded once to their output dtypes, so errors stay at the
input precision's rounding. dkv is summed per key in
ascending (query, slot) order within each query chunk (gpu/segments.py) and
chunks are added in order: bitwise reproducible, no float atomics.
"""
from __future__ import annotations

from ..._backend import cupy_module
from ...gpu.convert import narrow, widen
from ...gpu.segments import scatter_add_rows

CHUNK_BYTES = 256 << 20  # gathered rows per query chunk


def _chunks(n: int, k: int, d_qk: int):
    rows = max(1, CHUNK_BYTES // max(1, k * d_qk * 8))
    for t0 in range(0, n, rows):
        yield t0, min(n, t0 + rows)


def _gathered(cp, kv, idx, dt):
    valid = idx >= 0
    return valid, widen(kv, dt)[cp.where(valid, idx, 0)]


def _probabilities(cp, logits, valid, lse=None):
    """(p [C, h, k], lse [C, h]) with p = 0 at -1 slots and on rows without slots."""
    logits = cp.where(valid[:, None, :], logits, -cp.inf)
    if lse is None:
        if logits.shape[2] == 0:
            return cp.zeros(logits.shape, logits.dtype), cp.full(logits.shape[:2], -cp.inf, logits.dtype)
        top = logits.max(axis=2, keepdims=True)
        top = cp.where(cp.isfinite(top), top, 0)
        e = cp.exp(logits - top)
        total = e.sum(axis=2, keepdims=True)
        has_slots = total[..., 0] > 0
        lse = cp.where(has_slots, top[..., 0] + cp.log(cp.where(has_slots, total[..., 0], 1)), -cp.inf)
        return e / cp.where(total > 0, total, 1), lse
    lse_b = lse[..., None]
    p = cp.where(cp.isfinite(lse_b), cp.exp(logits - cp.where(cp.isfinite(lse_b), lse_b, 0)), 0)
    return p, lse


def sparse_attention(q, kv, indices, d_v: int, scale: float):
    cp = cupy_module()
    n, h, d_qk = q.shape
    dt = cp.float64
    out = cp.empty((n, h, d_v), dtype=q.dtype)
    lse = cp.empty((n, h), dtype=cp.float32)
    probs = cp.empty(indices.shape, dtype=cp.float32)
    for t0, t1 in _chunks(n, indices.shape[1], d_qk):
        valid, sel = _gathered(cp, kv, indices[t0:t1], dt)
        logits = dt(scale) * (widen(q[t0:t1], dt) @ sel.transpose(0, 2, 1))
        p, lse_c = _probabilities(cp, logits, valid)
        out[t0:t1] = narrow(p @ sel[:, :, :d_v], q.dtype)
        lse[t0:t1] = lse_c
        probs[t0:t1] = p.sum(axis=1)
    return out, lse, probs


def sparse_attention_backward(q, kv, indices, out, lse, dout, d_v: int, scale: float):
    cp = cupy_module()
    n, h, d_qk = q.shape
    dt = cp.float64
    dq = cp.empty(q.shape, dtype=q.dtype)
    dkv = cp.zeros(kv.shape, dtype=dt)
    for t0, t1 in _chunks(n, indices.shape[1], d_qk):
        idx = indices[t0:t1]
        valid, sel = _gathered(cp, kv, idx, dt)
        q_c, do_c = widen(q[t0:t1], dt), widen(dout[t0:t1], dt)
        logits = dt(scale) * (q_c @ sel.transpose(0, 2, 1))
        p, _ = _probabilities(cp, logits, valid, widen(lse[t0:t1], dt))
        dp = do_c @ sel[:, :, :d_v].transpose(0, 2, 1)
        delta = (do_c * widen(out[t0:t1], dt)).sum(axis=2, keepdims=True)
        dlogit = p * (dp - delta)
        dq[t0:t1] = narrow(dt(scale) * (dlogit @ sel), q.dtype)
        rows = dt(scale) * (dlogit.transpose(0, 2, 1) @ q_c)
        rows[:, :, :d_v] += p.transpose(0, 2, 1) @ do_c
        scatter_add_rows(idx, cp.ascontiguousarray(rows), dkv)
    return dq, narrow(dkv, kv.dtype)
