"""Inputs, naive and float64 references, and the accuracy checks shared by the sparse-attention tests."""
from __future__ import annotations

import numpy as np
import pytest

import hyscale_core as hs
from helpers import (
    HEADS_K_GRID,
    assert_within_twice_naive,
    grid_sizes,
    naive_dtype,
    on,
    ordered_matmul,
    rounding,
    to_host,
)
from hyscale_core._dtypes import bfloat16
from hyscale_core.ops.sparse_attention import reference


BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
DTYPES = [pytest.param(np.dtype(d), id=np.dtype(d).name) for d in (np.float16, bfloat16, np.float32, np.float64)]
D_QK, D_V = 576, 512


def make_inputs(rng, n, h, k, n_kv, d_qk=D_QK, dtype=np.float32, skip=0.2):
    """q, kv and an int32 selection with -1 slots (fraction ``skip``) and duplicates."""
    q = rng.standard_normal((n, h, d_qk)).astype(dtype)
    kv = rng.standard_normal((n_kv, d_qk)).astype(dtype)
    indices = rng.integers(0, n_kv, size=(n, k)).astype(np.int32)
    indices[rng.random((n, k)) < skip] = -1
    return q, kv, indices


def _naive_logits(q, kv, indices, scale, dtype):
    """``(valid, gathered keys, logits)`` computed plainly in ``dtype`` (-inf at -1
    slots; every sum in ascending order: ``helpers.ordered_matmul``)."""
    wide, r = rounding(dtype)
    valid = indices >= 0
    sel = kv.astype(wide)[np.where(valid, indices, 0)]
    logits = r(r(ordered_matmul(q.astype(wide), sel.transpose(0, 2, 1))) * wide.type(scale))
    return valid, sel, np.where(valid[:, None, :], logits, -np.inf)


def naive_forward(q, kv, indices, d_v, scale, dtype):
    """The forward computed plainly in ``dtype``: ``(out, lse, probs)``."""
    wide, r = rounding(dtype)
    _, sel, logits = _naive_logits(q, kv, indices, scale, dtype)
    top = logits.max(axis=2, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0)
    e = r(np.exp(logits - top))
    total = r(e.sum(axis=2, keepdims=True))
    p = r(e / np.where(total > 0, total, 1))
    with np.errstate(divide="ignore"):
        lse = r(top[..., 0] + np.log(total[..., 0]))
    out = r(ordered_matmul(p, sel[:, :, :d_v])).astype(q.dtype)
    return out, lse.astype(np.float32), r(p.sum(axis=1)).astype(np.float32)


def naive_backward(q, kv, indices, dout, d_v, scale, dtype):
    """The same flash-attention backward computed plainly in ``dtype`` from its
    own naive forward: p recomputed as exp(logit - lse), lse rounded to
    ``dtype`` as the forward saves it (float32 for float32 inputs). dkv sums
    the pairs in (query, slot) order, ROWS queries at a time."""
    wide, r = rounding(dtype)
    dq, dkv = [], np.zeros(kv.shape, wide)
    for t in range(0, q.shape[0], ROWS):
        rows = slice(t, t + ROWS)
        g_q, dsel = _naive_backward_rows(q[rows], kv, indices[rows], dout[rows], d_v, scale, dtype)
        dq.append(g_q)
        dkv += reference.scatter_add(indices[rows], dsel, kv.shape[0])
    return np.concatenate(dq).astype(q.dtype), r(dkv).astype(kv.dtype)


def _naive_backward_rows(q, kv, indices, dout, d_v, scale, dtype):
    """``(dq, dsel [N, k, d_qk])`` of a few rows, plainly in ``dtype``."""
    wide, r = rounding(dtype)
    out, lse, _ = naive_forward(q, kv, indices, d_v, scale, dtype)
    valid, sel, logits = _naive_logits(q, kv, indices, scale, dtype)
    with np.errstate(invalid="ignore"):
        p = np.where(valid[:, None, :], r(np.exp(r(logits - lse[:, :, None]))), 0)
    q_, dout_ = q.astype(wide), dout.astype(wide)
    dp = r(ordered_matmul(dout_, sel[:, :, :d_v].transpose(0, 2, 1)))
    dlogit = r(p * r(dp - r((dout_ * out.astype(wide)).sum(axis=2))[:, :, None]))
    dq = r(r(ordered_matmul(dlogit, sel)) * wide.type(scale))
    dsel = r(r(ordered_matmul(dlogit.transpose(0, 2, 1), q_)) * wide.type(scale))
    dsel[:, :, :d_v] = r(dsel[:, :, :d_v] + r(ordered_matmul(p.transpose(0, 2, 1), dout_)))
    return dq, dsel


ROWS = 4  # references and naive versions go over this many queries at a time (memory)


def reference_forward(q, kv, indices, d_v, scale):
    parts = [reference.sparse_attention(q[t:t + ROWS], kv, indices[t:t + ROWS], d_v, scale)
             for t in range(0, q.shape[0], ROWS)]
    return tuple(np.concatenate(p) for p in zip(*parts))


def naive_forward_rows(q, kv, indices, d_v, scale):
    parts = [naive_forward(q[t:t + ROWS], kv, indices[t:t + ROWS], d_v, scale, naive_dtype(q, kv))
             for t in range(0, q.shape[0], ROWS)]
    return tuple(np.concatenate(p) for p in zip(*parts))


def reference_backward(q, kv, indices, dout, d_v, scale):
    out, lse, _ = reference_forward(q, kv, indices, d_v, scale)
    dq, dkv = [], np.zeros(kv.shape)
    for t in range(0, q.shape[0], ROWS):
        rows = slice(t, t + ROWS)
        g_q, g_kv = reference.sparse_attention_backward(q[rows], kv, indices[rows], out[rows], lse[rows],
                                                        dout[rows], d_v, scale)
        dq.append(g_q)
        dkv += g_kv
    return np.concatenate(dq), dkv


def check_forward(backend, q, kv, indices, d_v=D_V, scale=None):
    scale_value = scale if scale is not None else 1 / np.sqrt(q.shape[2])
    out, lse, probs = (to_host(x) for x in hs.sparse_attention(*on(backend, q, kv, indices), d_v=d_v, scale=scale,
                                                              return_probs=True))
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], d_v)
    assert lse.dtype == np.float32 and probs.dtype == np.float32 and probs.shape == indices.shape
    ref_out, ref_lse, ref_probs = reference_forward(q, kv, indices, d_v, scale_value)
    n_out, n_lse, n_probs = naive_forward_rows(q, kv, indices, d_v, scale_value)
    live = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~live)
    assert_within_twice_naive("out", out, n_out, ref_out)
    if live.any():
        assert_within_twice_naive("lse", lse, n_lse, ref_lse, live)
    assert_within_twice_naive("probs", probs, n_probs, ref_probs)
    return out, lse


def check_backward(backend, q, kv, indices, d_v=D_V, scale=None, seed=0, precise_dkv=False):
    scale_value = scale if scale is not None else 1 / np.sqrt(q.shape[2])
    dout = np.random.default_rng(seed).standard_normal((q.shape[0], q.shape[1], d_v)).astype(q.dtype)
    args = on(backend, q, kv, indices)
    out, lse = hs.sparse_attention(*args, d_v=d_v, scale=scale)
    dq, dkv = (to_host(g) for g in hs.sparse_attention_backward(*args, out, lse, *on(backend, dout), d_v=d_v,
                                                               scale=scale, precise_dkv=precise_dkv))
    assert dq.dtype == q.dtype and dq.shape == q.shape
    assert dkv.dtype == kv.dtype and dkv.shape == kv.shape
    ref = reference_backward(q, kv, indices, dout, d_v, scale_value)
    naive = naive_backward(q, kv, indices, dout, d_v, scale_value, naive_dtype(q, kv))
    for name, ours, n_grad, r_grad in zip(("dq", "dkv"), (dq, dkv), naive, ref):
        assert np.isfinite(ours.astype(np.float64)).all(), name
        assert_within_twice_naive(name, ours, n_grad, r_grad)


SHAPES = HEADS_K_GRID


def grid_inputs(h, k, dtype=np.float32, seed=0):
    """Inputs at a grid point (helpers.grid_sizes)."""
    n, n_kv = grid_sizes(h, k, 32)
    return make_inputs(np.random.default_rng(seed), n, h, k, n_kv, dtype=dtype)
