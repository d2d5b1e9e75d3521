"""hs.indexer_scores_at (+ backward) and hs.indexer_kl_loss: the indexer's sparse-stage loss.

Accuracy as in test_sparse_attention: against a float64 reference, at most
twice the error of the same computation done naively in the input
precision; every gradient by name against finite differences in float64.
Error is the maximum absolute difference.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

import hyscale_core as hs
from helpers import assert_within_twice_naive, finite_difference, on, same_bits, to_host
from hyscale_core.ops.indexer_loss import reference
from hyscale_core.ops.sparse_attention import keymajor
from indexer_loss_cases import (
    BACKENDS,
    DTYPES,
    SHAPES,
    check_scores,
    check_scores_backward,
    grid_inputs,
    make_inputs,
    make_loss_inputs,
    naive_kl,
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, k", SHAPES)
def test_scores_at_within_twice_naive_error(backend, heads, k):
    check_scores(backend, *grid_inputs(heads, k))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, k", SHAPES)
def test_scores_at_backward_within_twice_naive_error(backend, heads, k):
    check_scores_backward(backend, *grid_inputs(heads, k))


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
