"""hs.indexer_scores_at (+ backward) and hs.indexer_kl_loss: the indexer's sparse-stage loss.

Accuracy as in test_sparse_attention: against a float64 reference, at most
twice the error of the same computation done naively in the input
precision; every gradient by name against finite differences in float64.
Error is the maximum absolute difference.
"""
from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

import hyscale_core as hs
from helpers import assert_within_twice_naive, finite_difference, rounding, same_bits, to_host
from hyscale_core._dtypes import bfloat16
from hyscale_core.ops.indexer_loss import reference
from hyscale_core.ops.sparse_attention import keymajor
from hyscale_core.ops.sparse_attention.reference import scatter_add

BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
DTYPES = [pytest.param(np.dtype(d), id=np.dtype(d).name) for d in (np.float16, bfloat16, np.float32, np.float64)]
DIM = 128
ROWS = 8  # references and naive versions go over this many queries at a time (memory)


def on(backend, *arrays):
    if backend == "gpu":
        import cupy

        return tuple(cupy.asarray(a) for a in arrays)
    return arrays


def make_inputs(rng, n, heads, k, n_keys, dim=DIM, dtype=np.float32, skip=0.2):
    """q, k, w and an int32 selection with -1 slots (fraction ``skip``) and duplicates."""
    q = rng.standard_normal((n, heads, dim)).astype(dtype)
    keys = rng.standard_normal((n_keys, dim)).astype(dtype)
    w = rng.standard_normal((n, heads)).astype(dtype)
    indices = rng.integers(0, n_keys, size=(n, k)).astype(np.int32)
    indices[rng.random((n, k)) < skip] = -1
    return q, keys, w, indices


def naive_dtype(*arrays):
    return max((np.dtype(a.dtype) for a in arrays), key=lambda d: float(ml_dtypes.finfo(d).eps))


def _naive_parts(q, keys, w, indices, dtype):
    """``(valid, gathered keys, logits, weights)`` computed plainly in ``dtype``."""
    wide, r = rounding(dtype)
    valid = indices >= 0
    sel = keys.astype(wide)[np.where(valid, indices, 0)]
    logits = r(q.astype(wide) @ sel.transpose(0, 2, 1))
    return valid, sel, logits, w.astype(wide)


def naive_scores(q, keys, w, indices):
    dtype = naive_dtype(q, keys)
    wide, r = rounding(dtype)
    out = []
    for t in range(0, q.shape[0], ROWS):
        rows = slice(t, t + ROWS)
        valid, _, logits, w_ = _naive_parts(q[rows], keys, w[rows], indices[rows], dtype)
        scores = r(np.einsum("th,thi->ti", w_, r(np.maximum(logits, 0))))
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
        dw.append(r(np.einsum("ti,thi->th", g, r(np.maximum(logits, 0)))))
        coef = r(g[:, None, :] * w_[:, :, None]) * (logits > 0)
        dq.append(r(coef @ sel))
        dsel = r(coef.transpose(0, 2, 1) @ q[rows].astype(wide))
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


SHAPES = [pytest.param(h, k, id=f"h{h}-k{k}") for h in (1, 16, 64, 128) for k in (1, 7, 2048)]


def _grid_inputs(heads, k, dtype=np.float32, seed=0):
    """Enough queries for a stable max error; few keys when k is small, so
    keys are shared by many queries and duplicated inside rows."""
    rng = np.random.default_rng(seed)
    n, n_keys = (max(2, 64 // heads), 3000) if k > 64 else (max(8, 256 // heads), 9)
    return make_inputs(rng, n, heads, k, n_keys, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, k", SHAPES)
def test_scores_at_within_twice_naive_error(backend, heads, k):
    check_scores(backend, *_grid_inputs(heads, k))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, k", SHAPES)
def test_scores_at_backward_within_twice_naive_error(backend, heads, k):
    check_scores_backward(backend, *_grid_inputs(heads, k))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_within_twice_naive_error(backend, dtype):
    inputs = make_inputs(np.random.default_rng(1), 12, 16, 64, 100, dtype=dtype)
    check_scores(backend, *inputs)
    check_scores_backward(backend, *inputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_at_are_the_indexer_scores_at_the_selection(backend):
    rng = np.random.default_rng(2)
    q, keys, w, _ = make_inputs(rng, 200, 8, 1, 200, dim=32)
    args = on(backend, q, keys, w)
    selection, picked = hs.indexer_topk(*args, 50, return_scores=True)
    table = to_host(hs.indexer_scores(*args))
    scores = to_host(hs.indexer_scores_at(*args, selection))
    sel = to_host(selection)
    expect = np.where(sel >= 0, np.take_along_axis(table, np.maximum(sel, 0), axis=1), -np.inf)
    np.testing.assert_array_equal(np.isneginf(scores), sel < 0)
    np.testing.assert_allclose(scores, expect, rtol=1e-5, atol=1e-5 * np.abs(table[np.isfinite(table)]).max())
    np.testing.assert_allclose(scores, to_host(picked), rtol=1e-5, atol=1e-5 * np.abs(expect[sel >= 0]).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logits_add_nothing(backend):
    """relu(NaN) = 0 on every backend and in the reference: a NaN in q[2, 5] or
    in a selected key row leaves every score finite, equal to the reference."""
    q, keys, w, indices = make_inputs(np.random.default_rng(35), 6, 16, 70, 200)
    s = int(indices[0, np.flatnonzero(indices[0] >= 0)[0]])
    q[2, 5, 9] = np.nan
    keys[s, 4] = np.nan
    scores = to_host(hs.indexer_scores_at(*on(backend, q, keys, w, indices)))
    expect = reference.indexer_scores_at(q, keys, w, indices)
    assert not np.isnan(scores).any() and not np.isnan(expect).any()
    np.testing.assert_array_equal(np.isneginf(scores), indices < 0)
    finite = np.isfinite(expect)
    np.testing.assert_allclose(scores[finite], expect[finite], rtol=1e-4, atol=1e-4 * np.abs(expect[finite]).max())


def _fd_case():
    rng = np.random.default_rng(3)
    q, keys, w, _ = make_inputs(rng, 4, 3, 4, 5, dim=6, dtype=np.float64)
    indices = np.array([[0, 2, -1, 2], [3, 3, 1, 4], [-1, -1, -1, -1], [4, 0, 4, 1]], dtype=np.int32)
    dscores = rng.standard_normal((4, 4))
    return q, keys, w, indices, dscores


@pytest.mark.parametrize("name", ["dq", "dk", "dw"])
def test_scores_at_gradient_matches_finite_differences(name):
    q, keys, w, indices, dscores = _fd_case()
    live = indices >= 0

    def loss():
        return float((reference.indexer_scores_at(q, keys, w, indices)[live] * dscores[live]).sum())

    got = dict(zip(("dq", "dk", "dw"), reference.indexer_scores_at_backward(q, keys, w, indices, dscores)))[name]
    expect = finite_difference(loss, {"dq": q, "dk": keys, "dw": w}[name])
    np.testing.assert_allclose(got, expect, rtol=1e-7, atol=1e-7)
    # The CPU backend computes float64 inputs in float64: it matches the reference.
    cpu = dict(zip(("dq", "dk", "dw"), hs.indexer_scores_at_backward(q, keys, w, indices, dscores)))[name]
    assert cpu.dtype == np.float64
    np.testing.assert_allclose(cpu, got, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_at_backward_is_bitwise_reproducible(backend):
    q, keys, w, indices = make_inputs(np.random.default_rng(4), 40, 16, 64, 30)
    g = np.random.default_rng(5).standard_normal(indices.shape).astype(np.float32)
    args = on(backend, q, keys, w, indices, g)
    first = hs.indexer_scores_at_backward(*args)
    for _ in range(3):
        again = hs.indexer_scores_at_backward(*args)
        assert all(same_bits(a, b) for a, b in zip(first, again))


def test_dk_bits_do_not_depend_on_threads_or_chunking(monkeypatch):
    q, keys, w, indices = make_inputs(np.random.default_rng(6), 33, 8, 50, 20, dim=24)
    g = np.random.default_rng(7).standard_normal(indices.shape).astype(np.float32)
    base = hs.indexer_scores_at_backward(q, keys, w, indices, g)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one_thread = hs.indexer_scores_at_backward(q, keys, w, indices, g)
    finally:
        numba.set_num_threads(threads)
    monkeypatch.setattr(keymajor, "COEF_BUDGET", 1)
    chunked = hs.indexer_scores_at_backward(q, keys, w, indices, g)
    for other in (one_thread, chunked):
        assert all(same_bits(a, b) for a, b in zip(base, other))


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicates_and_rows_of_only_minus_one(backend):
    rng = np.random.default_rng(8)
    q, keys, w, _ = make_inputs(rng, 3, 4, 3, 6, dim=16)
    indices = np.array([[2, 2, -1], [-1, -1, -1], [5, 2, 5]], dtype=np.int32)
    scores = to_host(hs.indexer_scores_at(*on(backend, q, keys, w, indices)))
    assert scores[0, 0] == scores[0, 1] and scores[2, 0] == scores[2, 2]
    assert np.isneginf(scores[1]).all() and np.isneginf(scores[0, 2])
    g = rng.standard_normal((3, 3)).astype(np.float32)
    dq, dk, dw = (to_host(x) for x in hs.indexer_scores_at_backward(*on(backend, q, keys, w, indices, g)))
    assert (dq[1] == 0).all() and (dw[1] == 0).all()
    ref = reference.indexer_scores_at_backward(q, keys, w, indices, g)
    for name, ours, expect in zip(("dq", "dk", "dw"), (dq, dk, dw), ref):
        np.testing.assert_allclose(ours, expect, rtol=1e-5, atol=1e-5, err_msg=name)
    empty = on(backend, q, keys, w, np.zeros((3, 0), np.int32))
    assert hs.indexer_scores_at(*empty).shape == (3, 0)
    dq, dk, dw = (to_host(x) for x in hs.indexer_scores_at_backward(*empty, *on(backend, np.zeros((3, 0)))))
    assert not dq.any() and not dk.any() and not dw.any()


# --- KL loss -----------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 7, 2048])
def test_kl_loss_within_twice_naive_error(backend, k):
    scores, probs = make_loss_inputs(np.random.default_rng(k), 64, k)
    loss, dscores = hs.indexer_kl_loss(*on(backend, scores, probs))
    dscores = to_host(dscores)
    assert dscores.dtype == np.float32 and dscores.shape == scores.shape
    ref_loss, ref_d = reference.indexer_kl_loss(scores, probs)
    naive_loss, naive_d = naive_kl(scores, probs)
    assert_within_twice_naive("dscores", dscores, naive_d, ref_d)
    # One number: a float32 tolerance rather than a ratio of two rounding accidents.
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(abs(ref_loss), 1.0), (float(loss), ref_loss, naive_loss)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_kl_gradient_matches_finite_differences(impl):
    scores, probs = make_loss_inputs(np.random.default_rng(9), 5, 6, dtype=np.float64)
    scores[2] = -np.inf  # an empty row
    fn = reference.indexer_kl_loss if impl == "reference" else hs.indexer_kl_loss
    loss, dscores = fn(scores, probs)
    assert isinstance(loss, float)
    live = np.isfinite(scores)
    x = np.where(live, scores, 0.0)

    def f():
        return fn(np.where(live, x, -np.inf), probs)[0]

    expect = finite_difference(f, x)
    tol = 1e-8 if impl == "reference" else 2e-7  # the CPU backend returns float32 dscores
    np.testing.assert_allclose(np.where(live, dscores, 0), np.where(live, expect, 0), rtol=tol, atol=tol)
    assert (np.asarray(dscores)[~live] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_conventions(backend):
    rng = np.random.default_rng(10)
    scores, probs = make_loss_inputs(rng, 4, 9)
    loss = float(hs.indexer_kl_loss(*on(backend, scores, probs))[0])
    # Rows without a valid slot or without target mass add 0 and still count in the mean.
    padded_s = np.concatenate([scores, np.full((1, 9), -np.inf, np.float32), scores[:1]])
    padded_p = np.concatenate([probs, probs[:1], np.zeros((1, 9), np.float32)])
    padded_loss, padded_d = hs.indexer_kl_loss(*on(backend, padded_s, padded_p))
    np.testing.assert_allclose(float(padded_loss), loss * 4 / 6, rtol=1e-6)
    assert (to_host(padded_d)[4:] == 0).all()
    # Targets are normalised per row; probs at -inf slots are ignored.
    scaled = probs * np.array([[1.0], [3.0], [0.5], [7.0]], np.float32)
    scaled[np.isneginf(scores)] = 5.0
    np.testing.assert_allclose(float(hs.indexer_kl_loss(*on(backend, scores, scaled))[0]), loss, rtol=1e-5)
    # The gradient of each row sums to zero; a perfect indexer has loss 0 and gradient 0.
    d = to_host(hs.indexer_kl_loss(*on(backend, scores, probs))[1])
    np.testing.assert_allclose(d.sum(axis=1), 0, atol=1e-7)
    target = np.where(np.isneginf(scores), 0, probs)
    perfect = np.where(np.isneginf(scores), -np.inf, np.log(target + 1e-30) + 2.0).astype(np.float32)
    zero_loss, zero_d = hs.indexer_kl_loss(*on(backend, perfect, probs))
    assert abs(float(zero_loss)) < 1e-6 and np.abs(to_host(zero_d)).max() < 1e-7
    none_loss, none_d = hs.indexer_kl_loss(*on(backend, np.zeros((0, 9), np.float32), np.zeros((0, 9), np.float32)))
    assert float(none_loss) == 0.0 and none_d.shape == (0, 9)


def test_training_step_gradient_through_scores_and_kl():
    """indexer_scores_at -> indexer_kl_loss -> backward against finite
    differences of the float64 reference chain (probs from sparse_attention)."""
    rng = np.random.default_rng(11)
    q, keys, w, indices = make_inputs(rng, 5, 3, 6, 8, dim=8, dtype=np.float64)
    q_mla = rng.standard_normal((5, 2, 12))
    kv = rng.standard_normal((8, 12))
    _, _, probs = hs.sparse_attention(q_mla, kv, indices, d_v=8, return_probs=True)
    scores = hs.indexer_scores_at(q, keys, w, indices)
    _, dscores = hs.indexer_kl_loss(scores, probs)
    grads = hs.indexer_scores_at_backward(q, keys, w, indices, dscores)

    def loss():
        return reference.indexer_kl_loss(reference.indexer_scores_at(q, keys, w, indices), probs)[0]

    for name, got, x in zip(("dq", "dk", "dw"), grads, (q, keys, w)):
        expect = finite_difference(loss, x)
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-6 * np.abs(expect).max(), err_msg=name)


def _bad(**changes):
    q, keys, w, indices = make_inputs(np.random.default_rng(12), 3, 2, 4, 12, dim=16)
    args = dict(q=q, k=keys, w=w, indices=indices)
    args.update(changes)
    return args


SCORE_ERRORS = [
    (_bad(q=np.zeros((3, 16), np.float32)), ValueError, r"q must have 3 dimensions \[N, H, D\]"),
    (_bad(k=np.zeros((12, 16, 1), np.float32)), ValueError, r"k must have 2 dimensions \[Nk, D\]"),
    (_bad(w=np.zeros(3, np.float32)), ValueError, r"w must have 2 dimensions \[N, H\]"),
    (_bad(indices=np.zeros(3, np.int32)), ValueError, r"indices must have 2 dimensions \[N, kk\]"),
    (_bad(k=np.zeros((12, 15), np.float32)), ValueError, "head dim D mismatch: q has 16, k has 15"),
    (_bad(w=np.zeros((4, 2), np.float32)), ValueError, "query count N mismatch: q has 3, w has 4"),
    (_bad(w=np.zeros((3, 5), np.float32)), ValueError, "head count H mismatch: q has 2, w has 5"),
    (_bad(indices=np.zeros((2, 4), np.int32)), ValueError, "query count N mismatch: q has 3, indices has 2"),
    (_bad(q=np.zeros((3, 2, 16), np.int64)), TypeError, "q has dtype int64"),
    (_bad(w=np.zeros((3, 2), np.int32)), TypeError, "w has dtype int32"),
    (_bad(indices=np.zeros((3, 4), np.int64)), TypeError, "indices has dtype int64, expected one of: int32"),
    (_bad(indices=np.array([[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 2, 12]], np.int32)), ValueError,
     r"indices\[2, 3\] = 12 is out of range: entries must be -1 \(skip\) or key indices in \[0, 12\)"),
    (_bad(indices=np.array([[0, -5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], np.int32)), ValueError,
     r"indices\[0, 1\] = -5 is out of range"),
    (_bad(w=np.array([[1, 1], [1, np.nan], [1, 1]], np.float32)), ValueError, r"w must be finite, got w\[1, 1\] = nan"),
]


@pytest.mark.parametrize("args, error, match", SCORE_ERRORS)
def test_bad_score_arguments_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        hs.indexer_scores_at(**args)
    with pytest.raises(error, match=match):
        hs.indexer_scores_at_backward(**args, dscores=np.zeros((3, 4), np.float32))


@pytest.mark.parametrize(
    "dscores, error, match",
    [
        (np.zeros((3, 5), np.float32), ValueError, r"dscores must have shape \[N, kk\] = \(3, 4\), got \(3, 5\)"),
        (np.zeros(3, np.float32), ValueError, "dscores must have 2 dimensions"),
        (np.zeros((3, 4), np.int32), TypeError, "dscores has dtype int32"),
        (np.array([[0, 0, 0, 0], [0, np.inf, 0, 0], [0, 0, 0, 0]], np.float32), ValueError,
         r"dscores must be finite, got dscores\[1, 1\] = inf"),
    ],
)
def test_bad_dscores_name_the_argument(dscores, error, match):
    with pytest.raises(error, match=match):
        hs.indexer_scores_at_backward(**_bad(), dscores=dscores)


@pytest.mark.parametrize(
    "scores, probs, error, match",
    [
        (np.zeros(4, np.float32), np.zeros((1, 4), np.float32), ValueError, r"scores_at must have 2 dimensions"),
        (np.zeros((2, 4), np.float32), np.zeros((2, 4, 1), np.float32), ValueError, "probs must have 2 dimensions"),
        (np.zeros((2, 4), np.float32), np.zeros((3, 4), np.float32), ValueError,
         "query count N mismatch: scores_at has 2, probs has 3"),
        (np.zeros((2, 4), np.float32), np.zeros((2, 5), np.float32), ValueError,
         "slot count kk mismatch: scores_at has 4, probs has 5"),
        (np.zeros((2, 4), np.int32), np.zeros((2, 4), np.float32), TypeError, "scores_at has dtype int32"),
        (np.zeros((2, 4), np.float32), np.zeros((2, 4), np.int64), TypeError, "probs has dtype int64"),
        (np.array([[0, 0, 0, 0], [0, 0, np.nan, 0]], np.float32), np.ones((2, 4), np.float32), ValueError,
         r"scores_at must be finite or -inf \(skipped slot\), got scores_at\[1, 2\] = nan"),
        (np.array([[0, np.inf, 0, 0], [0, 0, 0, 0]], np.float32), np.ones((2, 4), np.float32), ValueError,
         r"scores_at\[0, 1\] = inf"),
        (np.zeros((2, 4), np.float32), np.array([[1, 1, 1, 1], [1, np.nan, 1, 1]], np.float32), ValueError,
         r"probs must be finite, got probs\[1, 1\] = nan"),
        (np.zeros((2, 4), np.float32), np.array([[1, 1, 1, -0.5], [1, 1, 1, 1]], np.float32), ValueError,
         r"probs must be >= 0, got probs\[0, 3\] = -0.5"),
    ],
)
def test_bad_loss_arguments_name_the_argument(scores, probs, error, match):
    with pytest.raises(error, match=match):
        hs.indexer_kl_loss(scores, probs)


def test_values_past_float32_are_rejected_where_the_call_runs_in_float32():
    """Float64 values beyond float32's range are infinite in a float32 call
    (w, dscores with float32 q and k; scores_at, probs unless both are float64):
    errors, not NaN or a silently skipped slot. In a float64 call they are taken."""
    args = _bad()
    args["w"] = args["w"].astype(np.float64)
    args["w"][1, 0] = 1e39
    with pytest.raises(ValueError, match=r"w must be finite in float32, .* got w\[1, 0\] = 1e\+39"):
        hs.indexer_scores_at(**args)
    dscores = np.zeros((3, 4))
    dscores[2, 3] = -1e39
    with pytest.raises(ValueError, match=r"dscores must be finite in float32, .* got dscores\[2, 3\] = -1e\+39"):
        hs.indexer_scores_at_backward(**_bad(), dscores=dscores)
    wide = {name: a.astype(np.float64) if name != "indices" else a for name, a in args.items()}
    assert np.isfinite(hs.indexer_scores_at_backward(**wide, dscores=dscores)[2]).all()
    probs = np.ones((1, 2), np.float32)
    for value in (1e39, -1e39):
        scores = np.array([[value, 0.0]])
        with pytest.raises(ValueError, match=r"scores_at must be finite or -inf \(skipped slot\) in float32"):
            hs.indexer_kl_loss(scores, probs)
        loss, dscores_at = hs.indexer_kl_loss(scores, probs.astype(np.float64))
        assert np.isfinite(loss) and loss > 1e38 and np.isfinite(dscores_at).all()
    with pytest.raises(ValueError, match=r"probs must be finite in float32, .* got probs\[0, 1\] = 1e\+39"):
        hs.indexer_kl_loss(np.zeros((1, 2), np.float32), np.array([[1.0, 1e39]]))


def test_missing_dscores_is_named():
    with pytest.raises(TypeError, match="dscores must be an array, got None"):
        hs.indexer_scores_at_backward(**_bad(), dscores=None)


# --- GPU kernels (cuda/indexer_loss*.cu) ---------------------------------------------------------------------

GPU_DTYPES = [pytest.param(bfloat16, id="bfloat16"), pytest.param(np.dtype(np.float32), id="float32")]
BACKEND_FUNCTIONS = ("indexer_scores_at", "indexer_scores_at_backward", "indexer_kl_loss")


def _gpu_backend():
    from hyscale_core.ops.indexer_loss import gpu, gpu_fallback

    return gpu, gpu_fallback


@pytest.fixture
def kernels_only(monkeypatch):
    """The GPU kernels must serve every call: gpu_fallback raises if it is reached."""
    gpu, fallback = _gpu_backend()
    monkeypatch.delenv(gpu.FALLBACK_ENV, raising=False)

    def refuse(*args):
        raise AssertionError("gpu_fallback served a call the kernels are built for")

    for name in BACKEND_FUNCTIONS:
        monkeypatch.setattr(fallback, name, refuse)
    return gpu


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs (and the backward's dk rows) start as NaN, so unwritten entries show."""
    gpu, _ = _gpu_backend()
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(bfloat16, id="bfloat16"), pytest.param(np.dtype(np.float16),
                                                                                      id="float16")])
@pytest.mark.parametrize("heads", [64, 32])
def test_gpu_kernels_at_dsa_shapes_within_twice_naive_error(kernels_only, poisoned, dtype, heads):
    """D = 128, kk = 2048 in 16-bit (the tensor-core path), with a row of only
    -1, a row of duplicates and -1 slots, every output against the float64
    reference."""
    q, keys, w, indices = make_inputs(np.random.default_rng(20), 4, heads, 2048, 3000, dtype=dtype)
    indices[1] = -1
    indices[2, 100:] = 11
    check_scores("gpu", q, keys, w, indices)
    check_scores_backward("gpu", q, keys, w, indices)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("heads, dim, k", [(20, 48, 100), (64, 128, 130), (3, 16, 7)])
def test_gpu_kernels_write_every_output(kernels_only, poisoned, dtype, heads, dim, k):
    """Padded heads, kk not a multiple of 64, a row of only -1, a whole block of
    -1, duplicates: every output written (finite), -inf exactly at -1 slots,
    zeros for the empty row, values within twice the naive error."""
    q, keys, w, indices = make_inputs(np.random.default_rng(21), 9, heads, k, 40, dim=dim, dtype=dtype)
    indices[3] = -1
    indices[5, :k // 2 + 1] = 7
    indices[6, :64] = -1
    check_scores("gpu", q, keys, w, indices)
    check_scores_backward("gpu", q, keys, w, indices)
    g = np.random.default_rng(22).standard_normal(indices.shape).astype(np.float32)
    dq, _, dw = (to_host(x) for x in hs.indexer_scores_at_backward(*on("gpu", q, keys, w, indices, g)))
    assert not dq[3].astype(np.float64).any() and not dw[3].astype(np.float64).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_kernel_bits_do_not_depend_on_runs_or_chunking(kernels_only, monkeypatch, dtype):
    """Few keys shared by many queries, so each key's sum crosses query chunks."""
    gpu = kernels_only
    q, keys, w, indices = make_inputs(np.random.default_rng(23), 37, 32, 200, 50, dtype=dtype)
    g = np.random.default_rng(24).standard_normal(indices.shape).astype(np.float32)
    args = on("gpu", q, keys, w, indices, g)
    scores = hs.indexer_scores_at(*args[:4])
    assert same_bits(scores, hs.indexer_scores_at(*args[:4]))
    base = hs.indexer_scores_at_backward(*args)
    runs = [hs.indexer_scores_at_backward(*args)]
    for rows_bytes in (1, 5 * 200 * DIM * 4):  # one query per chunk; five (the last chunk shorter)
        monkeypatch.setattr(gpu, "ROWS_BYTES", rows_bytes)
        runs.append(hs.indexer_scores_at_backward(*args))
    for other in runs:
        assert all(same_bits(a, b) for a, b in zip(base, other))
    loss, dscores = hs.indexer_kl_loss(scores, on("gpu", np.random.default_rng(25).random(indices.shape))[0])
    again = hs.indexer_kl_loss(scores, on("gpu", np.random.default_rng(25).random(indices.shape))[0])
    assert loss == again[0] and same_bits(dscores, again[1])


@pytest.mark.gpu
@pytest.mark.parametrize("s_dtype, p_dtype", [(np.float32, np.float32), (np.float32, np.float64),
                                              (np.float64, np.float32), (np.float64, np.float64),
                                              (bfloat16, np.float16)])
def test_gpu_kl_kernel_is_the_float64_formula_rounded_once(kernels_only, poisoned, s_dtype, p_dtype):
    """The KL kernel computes in float64 for every input dtype: dscores is the
    float64 reference rounded once to float32; empty rows give 0."""
    scores, probs = make_loss_inputs(np.random.default_rng(26), 33, 300)
    scores[4] = -np.inf
    probs[5] = 0
    s, p = scores.astype(s_dtype), probs.astype(p_dtype)
    loss, dscores = hs.indexer_kl_loss(*on("gpu", s, p))
    dscores = to_host(dscores)
    ref_loss, ref_d = reference.indexer_kl_loss(s.astype(np.float64), p.astype(np.float64))
    assert np.isfinite(dscores).all() and not dscores[4].any() and not dscores[5].any()
    np.testing.assert_allclose(dscores, ref_d, rtol=2e-7, atol=1e-15)
    assert abs(float(loss) - ref_loss) <= 1e-12 * max(abs(ref_loss), 1.0)


@pytest.mark.gpu
def test_gpu_fallback_switch_routes_every_call_to_the_primitive_path(monkeypatch):
    """HYSCALE_INDEXER_LOSS_FALLBACK=1 sends all three functions to gpu_fallback,
    which agrees with the kernels."""
    gpu, fallback = _gpu_backend()
    calls = []

    def spy(name):
        original = getattr(fallback, name)
        return lambda *args: calls.append(name) or original(*args)

    for name in BACKEND_FUNCTIONS:
        monkeypatch.setattr(fallback, name, spy(name))
    q, keys, w, indices = make_inputs(np.random.default_rng(27), 6, 64, 300, 500, dtype=bfloat16)
    g = np.random.default_rng(28).standard_normal(indices.shape).astype(np.float32)
    probs = np.random.default_rng(29).random(indices.shape).astype(np.float32)
    args = on("gpu", q, keys, w, indices, g, probs)

    def run():
        scores = hs.indexer_scores_at(*args[:4])
        return (scores, *hs.indexer_scores_at_backward(*args[:5]), hs.indexer_kl_loss(scores, args[5])[1])

    kernels = run()
    assert calls == []
    monkeypatch.setenv(gpu.FALLBACK_ENV, "1")
    primitives = run()
    assert calls == list(BACKEND_FUNCTIONS)
    for name, a, b in zip(("scores", "dq", "dk", "dw", "dscores"), kernels, primitives):
        a, b = to_host(a).astype(np.float64), to_host(b).astype(np.float64)
        finite = np.isfinite(b)
        np.testing.assert_array_equal(np.isfinite(a), finite, err_msg=name)
        np.testing.assert_allclose(a[finite], b[finite], rtol=2e-2, atol=1e-2 * np.abs(b[finite]).max(),
                                   err_msg=name)


def _peak_hook():
    """A CuPy memory hook that tracks the peak of the bytes held from the pool."""
    import cupy

    class Peak(cupy.cuda.MemoryHook):
        name = "IndexerLossPeakBytes"

        def __init__(self):
            self.held, self.now, self.peak = {}, 0, 0

        def malloc_postprocess(self, **kw):
            size = kw.get("mem_size", kw.get("rounded_size", 0))
            self.held[kw["mem_ptr"]] = size
            self.now += size
            self.peak = max(self.peak, self.now)

        def free_postprocess(self, **kw):
            self.now -= self.held.pop(kw["mem_ptr"], 0)

    return Peak()


@pytest.mark.gpu
def test_gpu_kernel_memory_stays_within_the_stated_bounds(kernels_only, monkeypatch):
    """Scores allocate their [N, kk] float32 output (and w as float32); the
    backward its outputs, one chunk of float32 dk rows and the chunk's sort;
    the KL loss its float32 dscores and N float64 row losses. A materialised
    [N, kk, D] or [N, kk] float64 temporary would exceed each bound."""
    gpu = kernels_only
    monkeypatch.setattr(gpu, "ROWS_BYTES", 4 << 20)
    n, heads, kk, dim, slack = 1024, 16, 2048, 64, 1 << 20
    q, keys, w, indices = make_inputs(np.random.default_rng(30), n, heads, kk, n, dim=dim, dtype=bfloat16)
    g = np.random.default_rng(31).standard_normal(indices.shape).astype(np.float32)
    probs = np.random.default_rng(32).random(indices.shape).astype(np.float32)
    q, keys, w, indices, g, probs = on("gpu", q, keys, w, indices, g, probs)
    with _peak_hook() as hook:
        scores = gpu.indexer_scores_at(q, keys, w, indices)
    assert hook.peak <= n * kk * 4 + n * heads * 4 + slack, hook.peak
    with _peak_hook() as hook:
        gpu.indexer_scores_at_backward(q, keys, w, indices, g)
    pairs = (gpu.ROWS_BYTES // (kk * dim * 4)) * kk
    small = q.nbytes + 12 * (keys.shape[0] * dim * 4 + n * heads * 4)  # dq; dk, its error, dw, w, conversions
    assert hook.peak <= gpu.ROWS_BYTES + 128 * pairs + small + slack, hook.peak
    with _peak_hook() as hook:
        gpu.indexer_kl_loss(scores, probs)
    assert hook.peak <= n * kk * 4 + n * 8 + slack, hook.peak


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def kernel_backend(request):
    """"cpu", or "gpu" held to the kernels with poisoned outputs (``kernels_only`` and ``poisoned``)."""
    if request.param == "gpu":
        request.getfixturevalue("kernels_only")
        request.getfixturevalue("poisoned")
    return request.param


@pytest.mark.parametrize("dtype", [pytest.param(bfloat16, id="bfloat16"), pytest.param(np.dtype(np.float16),
                                   id="float16"), pytest.param(np.dtype(np.float32), id="float32")])
@pytest.mark.parametrize("n, k", [(8, 63), (6, 65), (4, 300)])
def test_kernel_shapes_slot_counts_around_a_block(kernel_backend, dtype, n, k):
    """kk one slot short of and one past a 64-slot block, and a partial fifth block: scores, their
    backward and the KL loss."""
    q, keys, w, indices = make_inputs(np.random.default_rng(40 + k), n, 16, k, 500, dtype=dtype)
    check_scores(kernel_backend, q, keys, w, indices)
    check_scores_backward(kernel_backend, q, keys, w, indices)
    scores, probs = make_loss_inputs(np.random.default_rng(41 + k), n, k)
    loss, dscores = hs.indexer_kl_loss(*on(kernel_backend, scores, probs))
    ref_loss, ref_d = reference.indexer_kl_loss(scores, probs)
    assert_within_twice_naive("dscores", to_host(dscores), naive_kl(scores, probs)[1], ref_d)
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(abs(ref_loss), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_kernels_and_fallback_agree_on_nan_inputs(monkeypatch, dtype):
    """Both GPU paths take relu(NaN) = 0: a NaN in q[2, 5] or in key row s leaves every score
    finite, and the backward's NaNs (dq at that feature for queries selecting s, dk at q's NaN
    feature for query 2's keys) fall on the same entries."""
    gpu, _ = _gpu_backend()
    monkeypatch.delenv(gpu.FALLBACK_ENV, raising=False)
    q, keys, w, indices = make_inputs(np.random.default_rng(33), 6, 16, 70, 200, dtype=dtype)
    s = int(indices[0, np.flatnonzero(indices[0] >= 0)[0]])
    q[2, 5, 9] = np.nan
    keys[s, 4] = np.nan
    g = np.random.default_rng(34).standard_normal(indices.shape).astype(np.float32)
    args = on("gpu", q, keys, w, indices, g)
    assert gpu.config(args[0], args[1]) is not None

    def run():
        return (hs.indexer_scores_at(*args[:4]), *hs.indexer_scores_at_backward(*args))

    kernels = [to_host(x).astype(np.float64) for x in run()]
    monkeypatch.setenv(gpu.FALLBACK_ENV, "1")
    primitives = [to_host(x).astype(np.float64) for x in run()]
    assert not np.isnan(kernels[0]).any() and np.isnan(kernels[1][0, :, 4]).all()
    assert np.isnan(kernels[2][indices[2][indices[2] >= 0], 9]).all()
    for name, a, b in zip(("scores", "dq", "dk", "dw"), kernels, primitives):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=name)
        finite = np.isfinite(b)
        np.testing.assert_allclose(a[finite], b[finite], rtol=2e-2, atol=1e-2 * np.abs(b[finite]).max(),
                                   err_msg=name)
