"""CPU backend of sparse attention (Numba), parallel over queries and keys.

Backend contract (a ``gpu.py`` with the same two functions drops in):

    sparse_attention(q, kv, indices, d_v, scale) -> (out, lse, probs)
        q [N, h, d_qk], kv [N_kv, d_qk]: C-contiguous, any accepted float dtype
        (float16, bfloat16, float32, float64; q and kv may differ);
        indices int32 [N, k], validated (-1 or in [0, N_kv)); d_v int in
        [1, d_qk]; scale a positive Python float.
        Returns out [N, h, d_v] in q's dtype, lse float32 [N, h],
        probs float32 [N, k].
    sparse_attention_backward(q, kv, indices, out, lse, dout, d_v, scale) -> (dq, dkv)
        as above, plus out and dout [N, h, d_v] and lse [N, h] (any float
        dtype, C-contiguous). Returns dq [N, h, d_qk] in q's dtype and
        dkv [N_kv, d_qk] in kv's dtype; dkv is bitwise reproducible.

Precision: inputs are upcast once to the compute dtype, float64 when q and kv
are both float64, float32 otherwise, and every product and sum runs in it
(float32 accumulation for float16/bfloat16/float32 inputs; a * b + c may be
one fused multiply-add). Every sum has a fixed order: dot products over
features and softmax/output/dq sums over a row's slots in ascending
blocks (DOT_BLOCK, SLOT_BLOCK below), dkv per key in ascending (query,
slot) order (keymajor.py). Results are rounded once to their output dtype.
The backward recomputes p = exp(logit - lse) from the lse it is given;
with the float32 lse of the forward, float64 gradients are accurate to
about 1e-7 relative (pass a float64 lse for float64 accuracy).

Per query, ``gather_dots`` computes a [slots, heads] block of dot products
with the query's heads transposed, so the innermost loop runs over heads
(vectorisable without reassociation) while each dot keeps its own order.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..._dtypes import compute_dtype
from .keymajor import FMA, accumulate_by_key, flush, key_major, rows_per_chunk

# Blocked accumulation, in float32 for 16- and 32-bit inputs: sums over
# features go in blocks of DOT_BLOCK (in 4 interleaved lanes, as SIMD BLAS
# kernels do), sums over a row's slots in blocks of SLOT_BLOCK. Each block
# sums plainly (fused multiply-adds) in its own partial; the partials enter
# the total in order with a compensated (Kahan) add, so the total carries
# about one block's rounding error rather than count's. The order is fixed,
# so results are reproducible.
DOT_BLOCK = 32
SLOT_BLOCK = 32


@njit(cache=True, fastmath=FMA)
def valid_slots(idx_row, slots):
    """Write the positions of the row's entries >= 0 into ``slots``; return their count."""
    m = 0
    for i in range(idx_row.shape[0]):
        if idx_row[i] >= 0:
            slots[m] = i
            m += 1
    return m


@njit(cache=True, fastmath=FMA)
def gather_dots(rows_t, table, idx_row, slots, m, out):
    """out[a, j] = dot(rows_t[j, :W], table[idx_row[slots[a]], :W]) for a < m.

    rows_t [J, W], table [N, >= W], out [>= m, J], all one float dtype.
    Each dot goes over blocks of DOT_BLOCK features; inside a block, feature
    c feeds lane c % 4 (fused multiply-adds), the lanes are added pairwise,
    and the block sums enter the total with compensation (flush).
    """
    n_j, width = rows_t.shape
    rows_tr = np.ascontiguousarray(rows_t.T)  # [W, J]: the inner loop runs over j
    lanes = np.zeros((4, n_j), out.dtype)
    part = np.zeros((1, n_j), out.dtype)
    comp = np.empty((1, n_j), out.dtype)
    for a in range(m):
        key_row = table[idx_row[slots[a]]]
        acc = out[a:a + 1, :]
        acc[:] = 0
        comp[:] = 0
        for c0 in range(0, width, DOT_BLOCK):
            for c in range(c0, min(c0 + DOT_BLOCK, width)):
                x = key_row[c]
                lane = lanes[(c - c0) % 4]
                for j in range(n_j):
                    lane[j] += rows_tr[c, j] * x
            for j in range(n_j):
                part[0, j] = (lanes[0, j] + lanes[1, j]) + (lanes[2, j] + lanes[3, j])
            lanes[:] = 0
            flush(part, acc, comp)


@njit(cache=True, fastmath=FMA)
def _softmax_slots(logits, m, lse_t):
    """In place over logits[:m, j] for every head j: logits -> probabilities.

    Writes lse_t[j] = max + log(sum exp(logit - max)); the sum runs over
    blocks of ``SLOT_BLOCK`` slots (two-level, compensated).
    """
    n_h = logits.shape[1]
    top = np.empty((1, n_h), logits.dtype)
    part = np.zeros((1, n_h), logits.dtype)
    total = np.zeros((1, n_h), logits.dtype)
    comp = np.zeros((1, n_h), logits.dtype)
    top[:] = -np.inf
    for a in range(m):
        for j in range(n_h):
            if logits[a, j] > top[0, j]:
                top[0, j] = logits[a, j]
    for a in range(m):
        for j in range(n_h):
            e = np.exp(logits[a, j] - top[0, j])
            logits[a, j] = e
            part[0, j] += e
        if (a + 1) % SLOT_BLOCK == 0 or a == m - 1:
            flush(part, total, comp)
    for a in range(m):
        for j in range(n_h):
            logits[a, j] /= total[0, j]
    for j in range(n_h):
        lse_t[j] = top[0, j] + np.log(total[0, j])


@njit(cache=True, fastmath=FMA)
def _forward_row(q_t, kv, idx_row, d_v, scale, out_t, lse_t, probs_t):
    """One query: out_t [h, d_v] (compute dtype), lse_t [h], probs_t [k] (float32)."""
    n_h = q_t.shape[0]
    slots = np.empty(idx_row.shape[0], np.int64)
    m = valid_slots(idx_row, slots)
    out_t[:] = 0
    probs_t[:] = 0
    if m == 0:
        lse_t[:] = -np.inf
        return
    p = np.empty((m, n_h), q_t.dtype)
    gather_dots(q_t, kv, idx_row, slots, m, p)
    for a in range(m):
        for j in range(n_h):
            p[a, j] *= scale
    _softmax_slots(p, m, lse_t)
    part = np.zeros((n_h, d_v), q_t.dtype)
    comp = np.zeros((n_h, d_v), q_t.dtype)
    for a in range(m):
        v = kv[idx_row[slots[a]]]
        mass = q_t.dtype.type(0)
        for j in range(n_h):
            p_aj = p[a, j]
            mass += p_aj
            o = part[j]
            for c in range(d_v):
                o[c] += p_aj * v[c]
        probs_t[slots[a]] = mass
        if (a + 1) % SLOT_BLOCK == 0 or a == m - 1:
            flush(part, out_t, comp)


@njit(cache=True, parallel=True, fastmath=FMA)
def _forward(q, kv, indices, d_v, scale, out, lse, probs):
    for t in prange(q.shape[0]):
        _forward_row(q[t], kv, indices[t], d_v, scale, out[t], lse[t], probs[t])


def sparse_attention(q, kv, indices, d_v: int, scale: float, want_probs: bool = True
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(out [N, h, d_v] q.dtype, lse float32 [N, h], probs float32 [N, k] or None)``.

    probs come out of the same pass (they cost no extra pass here); None
    unless ``want_probs``.
    """
    dt = compute_dtype(q, kv)
    q_c, kv_c = (np.ascontiguousarray(a, dtype=dt) for a in (q, kv))
    n, n_h, _ = q.shape
    out = np.empty((n, n_h, d_v), dt)
    lse = np.empty((n, n_h), np.float32)
    probs = np.empty(indices.shape, np.float32)
    _forward(q_c, kv_c, indices, d_v, dt.type(scale), out, lse, probs)
    return out.astype(q.dtype, copy=False), lse, (probs if want_probs else None)


@njit(cache=True, fastmath=FMA)
def _backward_row(q_t, kv, idx_row, out_t, lse_t, dout_t, scale, dq_t, coef_t):
    """One query's dq_t [h, d_qk] and key-side weights coef_t [k, 2h].

    For each valid slot i: coef_t[i, j] = scale * dlogit[j, i] (weight of
    q[t, j] in dkv) and coef_t[i, h + j] = p[j, i] (weight of dout[t, j]).
    """
    n_h, d_v = dout_t.shape
    slots = np.empty(idx_row.shape[0], np.int64)
    m = valid_slots(idx_row, slots)
    dq_t[:] = 0
    if m == 0:
        return
    p = np.empty((m, n_h), q_t.dtype)
    dp = np.empty((m, n_h), q_t.dtype)
    gather_dots(q_t, kv, idx_row, slots, m, p)
    gather_dots(dout_t, kv, idx_row, slots, m, dp)
    big_d = np.empty((n_h, 1), q_t.dtype)
    rows_dots(dout_t, out_t, big_d)
    part = np.zeros(dq_t.shape, q_t.dtype)
    comp = np.zeros(dq_t.shape, q_t.dtype)
    for a in range(m):
        key_row = kv[idx_row[slots[a]]]
        for j in range(n_h):
            p_aj = np.exp(p[a, j] * scale - lse_t[j])
            dlogit = p_aj * (dp[a, j] - big_d[j, 0])
            coef_t[slots[a], j] = scale * dlogit
            coef_t[slots[a], n_h + j] = p_aj
            g = part[j]
            for c in range(g.shape[0]):
                g[c] += dlogit * key_row[c]
        if (a + 1) % SLOT_BLOCK == 0 or a == m - 1:
            flush(part, dq_t, comp)
    for j in range(n_h):
        for c in range(dq_t.shape[1]):
            dq_t[j, c] *= scale


@njit(cache=True, fastmath=FMA)
def rows_dots(a, b, out):
    """out[j, 0] = dot(a[j], b[j]) for 2-D a, b of one shape, summed exactly as
    gather_dots sums (so dout . out equals dout . v bitwise when out = v)."""
    first = np.zeros(1, np.int64)
    for j in range(a.shape[0]):
        gather_dots(a[j:j + 1], b[j:j + 1], first, first, 1, out[j:j + 1])


@njit(cache=True, parallel=True, fastmath=FMA)
def _backward_rows(q, kv, indices, out, lse, dout, scale, dq, coef):
    for t in prange(q.shape[0]):
        _backward_row(q[t], kv, indices[t], out[t], lse[t], dout[t], scale, dq[t], coef[t])


def sparse_attention_backward(q, kv, indices, out, lse, dout, d_v: int, scale: float, precise_dkv: bool = False
                              ) -> tuple[np.ndarray, np.ndarray]:
    """``(dq [N, h, d_qk] q.dtype, dkv [N_kv, d_qk] kv.dtype)``; dkv deterministic.
    ``precise_dkv`` changes nothing here: every contribution stays in the
    compute dtype (float32 or float64) until its key's sum.

    Query chunks (ascending): a parallel query pass writes dq and the chunk's
    coef [T, k, 2h]; the chunk's pairs are then added to dkv key by key, the
    q rows with weights coef[..., :h] and the dout rows (first d_v columns)
    with weights coef[..., h:].
    """
    dt = compute_dtype(q, kv)
    q_c, kv_c, out_c, lse_c, dout_c = (np.ascontiguousarray(a, dtype=dt) for a in (q, kv, out, lse, dout))
    n, n_h, d_qk = q.shape
    k = indices.shape[1]
    dq = np.empty((n, n_h, d_qk), dt)
    dkv = np.zeros((kv.shape[0], d_qk), dt)
    dkv_comp = np.zeros_like(dkv)
    widths = np.array([d_qk] * n_h + [d_v] * n_h, dtype=np.int64)
    step = rows_per_chunk(n, k, 2 * n_h)
    for t0 in range(0, n, step):
        t1 = min(t0 + step, n)
        coef = np.empty((t1 - t0, k, 2 * n_h), dt)
        _backward_rows(q_c[t0:t1], kv_c, indices[t0:t1], out_c[t0:t1], lse_c[t0:t1], dout_c[t0:t1],
                       dt.type(scale), dq[t0:t1], coef)
        rows = np.zeros((t1 - t0, 2 * n_h, d_qk), dt)
        rows[:, :n_h] = q_c[t0:t1]
        rows[:, n_h:, :d_v] = dout_c[t0:t1]
        accumulate_by_key(key_major(indices[t0:t1]), coef, rows, widths, dkv, dkv_comp)
    return dq.astype(q.dtype, copy=False), dkv.astype(kv.dtype, copy=False)
