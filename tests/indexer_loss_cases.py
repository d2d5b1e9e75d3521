"""Inputs, naive and float64 references, and the accuracy checks shared by the indexer-loss tests."""
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
from hyscale_core.ops.indexer_loss import reference
from hyscale_core.ops.sparse_attention.reference import scatter_add


BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
DTYPES = [pytest.param(np.dtype(d), id=np.dtype(d).name) for d in (np.float16, bfloat16, np.float32, np.float64)]
DIM = 128
ROWS = 8  # references and naive versions go over this many queries at a time (memory)


def make_inputs(rng, n, heads, k, n_keys, dim=DIM, dtype=np.float32, skip=0.2):
    """q, k, w and an int32 selection with -1 slots (fraction ``skip``) and duplicates."""
    q = rng.standard_normal((n, heads, dim)).astype(dtype)
    keys = rng.standard_normal((n_keys, dim)).astype(dtype)
    w = rng.standard_normal((n, heads)).astype(dtype)
    indices = rng.integers(0, n_keys, size=(n, k)).astype(np.int32)
    indices[rng.random((n, k)) < skip] = -1
    return q, keys, w, indices


def _naive_parts(q, keys, w, indices, dtype):
    """``(valid, gathered keys, logits, weights)`` computed plainly in ``dtype``
    (every sum in ascending order: ``helpers.ordered_matmul``)."""
    wide, r = rounding(dtype)
    valid = indices >= 0
    sel = keys.astype(wide)[np.where(valid, indices, 0)]
    logits = r(ordered_matmul(q.astype(wide), sel.transpose(0, 2, 1)))
    return valid, sel, logits, w.astype(wide)


def naive_scores(q, keys, w, indices):
    dtype = naive_dtype(q, keys)
    wide, r = rounding(dtype)
    out = []
    for t in range(0, q.shape[0], ROWS):
        rows = slice(t, t + ROWS)
        valid, _, logits, w_ = _naive_parts(q[rows], keys, w[rows], indices[rows], dtype)
        scores = r(ordered_matmul(w_[:, None, :], r(np.maximum(logits, 0)))[:, 0])
        out.append(np.where(valid, scores, -np.inf))
    return np.concatenate(out).astype(np.float32)


def naive_scores_backward(q, keys, w, indices, dscores):
    dtype = naive_dtype(q, keys)
    wide, r = rounding(dtype)
    dq, dw, dk = [], [], np.zeros(keys.shape, wide)
    for t in range(0, q.shape[0], ROWS):
        rows = slice(t, t + ROWS)
        valid, sel, logits, w_ = _naive_parts(q[rows], keys, w[rows], indices[rows], dtype)
        g = np.where(valid, dscores[rows].astype(wide), 0)
        dw.append(r(ordered_matmul(r(np.maximum(logits, 0)), g[:, :, None])[..., 0]))
        coef = r(g[:, None, :] * w_[:, :, None]) * (logits > 0)
        dq.append(r(ordered_matmul(coef, sel)))
        dsel = r(ordered_matmul(coef.transpose(0, 2, 1), q[rows].astype(wide)))
        dk += scatter_add(indices[rows], dsel, keys.shape[0])
    return (np.concatenate(dq).astype(q.dtype), r(dk).astype(keys.dtype), np.concatenate(dw).astype(w.dtype))


def reference_scores(q, keys, w, indices):
    return np.concatenate([reference.indexer_scores_at(q[t:t + ROWS], keys, w[t:t + ROWS], indices[t:t + ROWS])
                           for t in range(0, q.shape[0], ROWS)])


def reference_scores_backward(q, keys, w, indices, dscores):
    dq, dw, dk = [], [], np.zeros(keys.shape)
    for t in range(0, q.shape[0], ROWS):
        rows = slice(t, t + ROWS)
        g_q, g_k, g_w = reference.indexer_scores_at_backward(q[rows], keys, w[rows], indices[rows], dscores[rows])
        dq.append(g_q)
        dw.append(g_w)
        dk += g_k
    return np.concatenate(dq), dk, np.concatenate(dw)


def check_scores(backend, q, keys, w, indices):
    scores = to_host(hs.indexer_scores_at(*on(backend, q, keys, w, indices)))
    assert scores.dtype == np.float32 and scores.shape == indices.shape
    ref = reference_scores(q, keys, w, indices)
    np.testing.assert_array_equal(np.isneginf(scores), indices < 0)
    assert_within_twice_naive("scores", scores, naive_scores(q, keys, w, indices), ref, indices >= 0)


def check_scores_backward(backend, q, keys, w, indices, seed=0):
    dscores = np.random.default_rng(seed).standard_normal(indices.shape).astype(np.float32)
    grads = [to_host(g) for g in hs.indexer_scores_at_backward(*on(backend, q, keys, w, indices, dscores))]
    ref = reference_scores_backward(q, keys, w, indices, dscores)
    naive = naive_scores_backward(q, keys, w, indices, dscores)
    for name, ours, like, n_grad, r_grad in zip(("dq", "dk", "dw"), grads, (q, keys, w), naive, ref):
        assert ours.dtype == like.dtype and ours.shape == like.shape, name
        assert np.isfinite(ours.astype(np.float64)).all(), name
        assert_within_twice_naive(name, ours, n_grad, r_grad)


SHAPES = HEADS_K_GRID


def grid_inputs(heads, k, dtype=np.float32, seed=0):
    """Inputs at a grid point (helpers.grid_sizes)."""
    n, n_keys = grid_sizes(heads, k, 64)
    return make_inputs(np.random.default_rng(seed), n, heads, k, n_keys, dtype=dtype)


def make_loss_inputs(rng, n, k, dtype=np.float32, skip=0.2):
    scores = (3 * rng.standard_normal((n, k))).astype(dtype)
    probs = rng.random((n, k)).astype(dtype) ** 3
    scores[rng.random((n, k)) < skip] = -np.inf
    return scores, probs


def naive_kl(scores, probs):
    """The loss computed plainly in float32 (the reference's formula)."""
    s, p = scores.astype(np.float32), probs.astype(np.float32)
    n = s.shape[0]
    valid = np.isfinite(s)
    mass = np.where(valid, p, 0).sum(axis=1)
    live = valid.any(axis=1) & (mass > 0)
    use = valid & live[:, None]
    target = np.where(use, p / np.where(live, mass, 1)[:, None], 0).astype(np.float32)
    top = np.where(live, np.where(valid, s, -np.inf).max(axis=1, initial=-np.inf), 0).astype(np.float32)
    e = np.where(use, np.exp(np.where(use, s, 0) - top[:, None]), 0).astype(np.float32)
    total = np.where(live, e.sum(axis=1), 1).astype(np.float32)
    log_q = np.where(use, s, 0) - top[:, None] - np.log(total)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(target > 0, target * (np.log(target) - log_q), 0)
    return float(terms.sum() / n), (np.where(use, e / total[:, None] - target, 0) / n).astype(np.float32)
