"""hs.sparse_attention and hs.sparse_attention_backward.

Accuracy follows flash-attention's rule: against a float64 reference, the
error is at most twice that of the same computation done naively in the
input precision (each intermediate rounded to it). Every gradient is also
checked by name against finite differences in float64.
Error is the maximum absolute difference; the naive backward is the same
flash-attention backward (p recomputed from the rounded lse) done plainly.
"""
from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

import hyscale_core as hs
from helpers import assert_within_twice_naive, finite_difference, rounding, same_bits, to_host
from hyscale_core._dtypes import bfloat16
from hyscale_core.ops.sparse_attention import keymajor, reference

BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
DTYPES = [pytest.param(np.dtype(d), id=np.dtype(d).name) for d in (np.float16, bfloat16, np.float32, np.float64)]
D_QK, D_V = 576, 512


def on(backend, *arrays):
    if backend == "gpu":
        import cupy

        return tuple(cupy.asarray(a) for a in arrays)
    return arrays


def make_inputs(rng, n, h, k, n_kv, d_qk=D_QK, dtype=np.float32, skip=0.2):
    """q, kv and an int32 selection with -1 slots (fraction ``skip``) and duplicates."""
    q = rng.standard_normal((n, h, d_qk)).astype(dtype)
    kv = rng.standard_normal((n_kv, d_qk)).astype(dtype)
    indices = rng.integers(0, n_kv, size=(n, k)).astype(np.int32)
    indices[rng.random((n, k)) < skip] = -1
    return q, kv, indices


def naive_dtype(q, kv):
    """The precision a naive computation on q and kv runs in: the coarser one."""
    return max((np.dtype(q.dtype), np.dtype(kv.dtype)), key=lambda d: float(ml_dtypes.finfo(d).eps))


def _naive_logits(q, kv, indices, scale, dtype):
    """``(valid, gathered keys, logits)`` computed plainly in ``dtype`` (-inf at -1 slots)."""
    wide, r = rounding(dtype)
    valid = indices >= 0
    sel = kv.astype(wide)[np.where(valid, indices, 0)]
    logits = r(r(q.astype(wide) @ sel.transpose(0, 2, 1)) * wide.type(scale))
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
    out = r(p @ sel[:, :, :d_v]).astype(q.dtype)
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
    dp = r(dout_ @ sel[:, :, :d_v].transpose(0, 2, 1))
    dlogit = r(p * r(dp - r((dout_ * out.astype(wide)).sum(axis=2))[:, :, None]))
    dq = r(r(dlogit @ sel) * wide.type(scale))
    dsel = r(r(dlogit.transpose(0, 2, 1) @ q_) * wide.type(scale))
    dsel[:, :, :d_v] = r(dsel[:, :, :d_v] + r(p.transpose(0, 2, 1) @ dout_))
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


SHAPES = [pytest.param(h, k, id=f"h{h}-k{k}") for h in (1, 16, 64, 128) for k in (1, 7, 2048)]


def _grid_inputs(h, k, dtype=np.float32, seed=0):
    """Enough queries for a stable max error; few keys when k is small, so
    keys are shared by many queries and duplicated inside rows."""
    rng = np.random.default_rng(seed)
    n, n_kv = (max(2, 32 // h), 3000) if k > 64 else (max(8, 256 // h), 9)
    return make_inputs(rng, n, h, k, n_kv, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h, k", SHAPES)
def test_forward_within_twice_naive_error(backend, h, k):
    check_forward(backend, *_grid_inputs(h, k))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h, k", SHAPES)
def test_backward_within_twice_naive_error(backend, h, k):
    check_backward(backend, *_grid_inputs(h, k))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_within_twice_naive_error(backend, dtype):
    q, kv, indices = make_inputs(np.random.default_rng(1), 6, 16, 64, 100, dtype=dtype)
    check_forward(backend, q, kv, indices)
    check_backward(backend, q, kv, indices)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_and_custom_scale_and_d_v(backend):
    rng = np.random.default_rng(2)
    q, kv, indices = make_inputs(rng, 5, 4, 7, 11, d_qk=40)
    kv = kv.astype(bfloat16)
    check_forward(backend, q, kv, indices, d_v=24, scale=0.3)
    check_backward(backend, q, kv, indices, d_v=24, scale=0.3)
    check_backward(backend, q, kv, indices, d_v=40, scale=0.3)


def test_float64_backward_with_float64_lse_is_float64_accurate():
    """With float64 inputs the backend computes in float64; the float32 lse of
    the forward limits the gradients to ~1e-7, a float64 lse lifts that."""
    rng = np.random.default_rng(3)
    q, kv, indices = make_inputs(rng, 4, 3, 6, 8, d_qk=12, dtype=np.float64)
    dout = rng.standard_normal((4, 3, 8))
    ref_out, ref_lse, _ = reference.sparse_attention(q, kv, indices, 8, 0.5)
    out, _ = hs.sparse_attention(q, kv, indices, d_v=8, scale=0.5)
    np.testing.assert_allclose(out, ref_out, rtol=1e-13, atol=1e-13)
    grads = hs.sparse_attention_backward(q, kv, indices, out, ref_lse, dout, d_v=8, scale=0.5)
    ref = reference.sparse_attention_backward(q, kv, indices, ref_out, ref_lse, dout, 8, 0.5)
    for name, ours, expect in zip(("dq", "dkv"), grads, ref):
        np.testing.assert_allclose(ours, expect, rtol=1e-12, atol=1e-12, err_msg=name)


def _fd_case():
    rng = np.random.default_rng(4)
    q, kv, _ = make_inputs(rng, 4, 2, 3, 5, d_qk=6, dtype=np.float64)
    indices = np.array([[0, 2, -1], [3, 3, 1], [-1, -1, -1], [4, 0, 4]], dtype=np.int32)
    dout = rng.standard_normal((4, 2, 4))
    return q, kv, indices, dout


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("name", ["dq", "dkv"])
def test_gradient_matches_finite_differences(impl, name):
    q, kv, indices, dout = _fd_case()
    if impl == "reference":
        def forward():
            return reference.sparse_attention(q, kv, indices, 4, 0.7)

        out, lse, _ = forward()
        grads = reference.sparse_attention_backward(q, kv, indices, out, lse, dout, 4, 0.7)
        tol = 1e-8
    else:
        def forward():
            return hs.sparse_attention(q, kv, indices, d_v=4, scale=0.7)

        out, lse = forward()
        grads = hs.sparse_attention_backward(q, kv, indices, out, lse, dout, d_v=4, scale=0.7)
        tol = 1e-5  # the float32 lse bounds the float64 backward
    x = {"dq": q, "dkv": kv}[name]
    expect = finite_difference(lambda: float((forward()[0] * dout).sum()), x)
    got = dict(zip(("dq", "dkv"), grads))[name]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_runs_are_bitwise_identical(backend):
    q, kv, indices = make_inputs(np.random.default_rng(5), 40, 16, 64, 30)
    dout = np.random.default_rng(6).standard_normal((40, 16, D_V)).astype(np.float32)
    args = on(backend, q, kv, indices)
    first = hs.sparse_attention(*args, return_probs=True)
    grads = hs.sparse_attention_backward(*args, *first[:2], *on(backend, dout))
    for _ in range(3):
        again = hs.sparse_attention(*args, return_probs=True)
        assert all(same_bits(a, b) for a, b in zip(first, again))
        regrads = hs.sparse_attention_backward(*args, *again[:2], *on(backend, dout))
        assert same_bits(grads[0], regrads[0]) and same_bits(grads[1], regrads[1])


def test_dkv_bits_do_not_depend_on_threads_or_chunking(monkeypatch):
    q, kv, indices = make_inputs(np.random.default_rng(7), 33, 8, 50, 20, d_qk=48)
    dout = np.random.default_rng(8).standard_normal((33, 8, 32)).astype(np.float32)
    out, lse = hs.sparse_attention(q, kv, indices, d_v=32)
    base = hs.sparse_attention_backward(q, kv, indices, out, lse, dout, d_v=32)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one_thread = hs.sparse_attention_backward(q, kv, indices, out, lse, dout, d_v=32)
    finally:
        numba.set_num_threads(threads)
    monkeypatch.setattr(keymajor, "COEF_BUDGET", 1)  # one chunk per thread's worth of queries
    chunked = hs.sparse_attention_backward(q, kv, indices, out, lse, dout, d_v=32)
    for other in (one_thread, chunked):
        assert same_bits(base[0], other[0]) and same_bits(base[1], other[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicated_indices_are_separate_slots(backend):
    rng = np.random.default_rng(9)
    q, kv, _ = make_inputs(rng, 2, 4, 3, 6, d_qk=16)
    indices = np.array([[2, 2, -1], [2, 2, 5]], dtype=np.int32)
    out, lse, probs = (to_host(x) for x in hs.sparse_attention(*on(backend, q, kv, indices), d_v=8,
                                                              return_probs=True))
    # Row 0 selects key 2 twice: the output is its value, each copy weighs 1/2.
    np.testing.assert_allclose(out[0], np.broadcast_to(kv[2, :8], (4, 8)), rtol=1e-6, atol=1e-6)
    logit = q[0].astype(np.float64) @ kv[2].astype(np.float64) / 4.0
    np.testing.assert_allclose(lse[0], logit + np.log(2.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(probs[0], [2.0, 2.0, 0.0], rtol=1e-6)
    # Row 1: both copies of key 2 carry the same probability.
    assert probs[1, 0] == probs[1, 1]
    np.testing.assert_allclose(probs.sum(axis=1), [4.0, 4.0], rtol=1e-6)
    check_backward(backend, q, kv, indices, d_v=8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_only_minus_one(backend):
    rng = np.random.default_rng(10)
    q, kv, indices = make_inputs(rng, 6, 4, 7, 9, d_qk=16)
    indices[[1, 4]] = -1
    args = on(backend, q, kv, indices)
    out, lse, probs = (to_host(x) for x in hs.sparse_attention(*args, d_v=8, return_probs=True))
    assert (out[[1, 4]] == 0).all() and np.isneginf(lse[[1, 4]]).all() and (probs[[1, 4]] == 0).all()
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    dout = rng.standard_normal((6, 4, 8)).astype(np.float32)
    dq, dkv = (to_host(g) for g in hs.sparse_attention_backward(*args, *on(backend, out, lse, dout), d_v=8))
    assert (dq[[1, 4]] == 0).all() and np.isfinite(dq).all() and np.isfinite(dkv).all()
    check_backward(backend, q, kv, indices, d_v=8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_selections(backend):
    q, kv, _ = make_inputs(np.random.default_rng(11), 3, 2, 1, 4, d_qk=8)
    for indices in (np.zeros((3, 0), np.int32), np.full((3, 5), -1, np.int32)):
        args = on(backend, q, kv, indices)
        out, lse, probs = (to_host(x) for x in hs.sparse_attention(*args, d_v=4, return_probs=True))
        assert (out == 0).all() and np.isneginf(lse).all() and probs.shape == indices.shape
        dout = np.ones((3, 2, 4), np.float32)
        dq, dkv = (to_host(g) for g in hs.sparse_attention_backward(*args, *on(backend, out, lse, dout), d_v=4))
        assert (dq == 0).all() and (dkv == 0).all()
    none = on(backend, q[:0], kv, np.zeros((0, 5), np.int32))
    out, lse = hs.sparse_attention(*none, d_v=4)
    assert out.shape == (0, 2, 4) and lse.shape == (0, 2)


def test_key_major_table_groups_pairs_in_ascending_order():
    indices = np.array([[3, -1, 0], [0, 3, 3]], dtype=np.int32)
    table = keymajor.key_major(indices)
    np.testing.assert_array_equal(table.keys, [0, 3])
    np.testing.assert_array_equal(table.starts, [0, 2, 5])
    np.testing.assert_array_equal(table.pairs, [2, 3, 0, 4, 5])
    empty = keymajor.key_major(np.full((2, 2), -1, np.int32))
    assert empty.keys.size == 0 and empty.pairs.size == 0 and list(empty.starts) == [0]


def _check_key_table(got, indices, n_keys, dtype):
    """key_segments' (positions, starts) against NumPy's stable sort."""
    positions, starts = (to_host(x) for x in got)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[0].flags.c_contiguous
    flat = indices.reshape(-1)
    order = np.argsort(flat, kind="stable")
    order = order[flat[order] >= 0]
    counts = np.bincount(flat[flat >= 0], minlength=n_keys)
    np.testing.assert_array_equal(starts, np.concatenate([[0], np.cumsum(counts)]))
    assert positions.shape == (flat.size,)
    np.testing.assert_array_equal(positions[:order.size], order)
    assert np.all(positions[order.size:] == 0)  # the filler stays a valid position


@pytest.mark.gpu
@pytest.mark.parametrize("n_keys", [1, 70, 256, 257, 512, 513, 0xFFFF, 70000, 1 << 18, (1 << 18) + 1])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (50, 300), (7, 4096 + 63)])
def test_gpu_key_segments_match_a_stable_sort(n_keys, shape):
    """One to three radix passes, of 8- or 9-bit digits, give NumPy's stable sort: each key's positions
    ascending, -1 entries left out, unselected keys empty; a run of one key
    spans the sort's tiles; int64 tables give the same."""
    import cupy

    from hyscale_core.gpu.segments import key_segments

    rng = np.random.default_rng(24)
    indices = rng.integers(-1, n_keys, size=shape).astype(np.int32)
    indices.reshape(-1)[:shape[1] // 2 + 1] = n_keys - 1
    if shape[0] > 1:
        indices[1] = indices[0]
    for table in (indices, indices.astype(np.int64)):
        _check_key_table(key_segments(cupy.asarray(table), cupy.int32, n_keys), indices, n_keys, cupy.int32)
    for empty in (np.full((2, 3), -1, np.int32), np.zeros((0, 3), np.int32)):
        _check_key_table(key_segments(cupy.asarray(empty), cupy.int32, n_keys), empty, n_keys, cupy.int32)


@pytest.mark.gpu
def test_gpu_key_segments_one_key_everywhere_and_int64_positions():
    """A table of one repeated key (every entry a tie, across many tiles) keeps
    position order; dtype=int64 returns the table in int64."""
    import cupy

    from hyscale_core.gpu.segments import key_segments

    indices = np.full((9, 5000), 3, np.int32)
    indices[::2, ::3] = -1
    _check_key_table(key_segments(cupy.asarray(indices), cupy.int64, 4), indices, 4, cupy.int64)


def _bad(**changes):
    q, kv, indices = make_inputs(np.random.default_rng(12), 3, 2, 4, 12, d_qk=16)
    args = dict(q=q, kv=kv, indices=indices, d_v=8)
    args.update(changes)
    return args


FORWARD_ERRORS = [
    (_bad(q=np.zeros((3, 16), np.float32)), ValueError, r"q must have 3 dimensions \[N, h, d_qk\]"),
    (_bad(kv=np.zeros((12, 16, 1), np.float32)), ValueError, r"kv must have 2 dimensions \[N_kv, d_qk\]"),
    (_bad(indices=np.zeros(3, np.int32)), ValueError, r"indices must have 2 dimensions \[N, k\]"),
    (_bad(kv=np.zeros((12, 15), np.float32)), ValueError, "head dim d_qk mismatch: q has 16, kv has 15"),
    (_bad(indices=np.zeros((4, 4), np.int32)), ValueError, "query count N mismatch: q has 3, indices has 4"),
    (_bad(q=np.zeros((3, 0, 16), np.float32)), ValueError, "q needs at least one head"),
    (_bad(q=np.zeros((3, 2, 16), np.int32)), TypeError, "q has dtype int32"),
    (_bad(kv=np.zeros((12, 16), np.complex64)), TypeError, "kv has dtype complex64"),
    (_bad(indices=np.zeros((3, 4), np.int64)), TypeError, "indices has dtype int64, expected one of: int32"),
    (_bad(indices=np.zeros((3, 4), np.float32)), TypeError, "indices has dtype float32"),
    (_bad(indices=np.array([[0, 1, 2, 3], [0, 1, 12, 3], [0, 0, 0, 0]], np.int32)), ValueError,
     r"indices\[1, 2\] = 12 is out of range: entries must be -1 \(skip\) or key indices in \[0, 12\)"),
    (_bad(indices=np.array([[0, 1, 2, 3], [0, 1, 2, 3], [0, -2, 99, 0]], np.int32)), ValueError,
     r"indices\[2, 1\] = -2 is out of range"),
    (_bad(d_v=0), ValueError, r"d_v must be in \[1, 16\], got 0"),
    (_bad(d_v=17), ValueError, r"d_v must be in \[1, 16\], got 17"),
    (_bad(d_v=8.0), TypeError, "d_v must be an integer"),
    (_bad(scale=0.0), ValueError, "scale must be finite and > 0, got 0.0"),
    (_bad(scale=-1), ValueError, "scale must be finite and > 0, got -1"),
    (_bad(scale=float("nan")), ValueError, "scale must be finite and > 0, got nan"),
    (_bad(scale=float("inf")), ValueError, "scale must be finite and > 0, got inf"),
    (_bad(scale="0.1"), TypeError, "scale must be a real number, got '0.1'"),
    (_bad(scale=True), TypeError, "scale must be a real number, got True"),
    (_bad(scale=1e300), ValueError, "scale must be finite and > 0 in float32, .* got 1e[+]300"),
    (_bad(scale=1e-50), ValueError, "scale must be finite and > 0 in float32, .* got 1e-50"),
    (_bad(scale=10**400), ValueError, "scale must be finite and > 0, got 1000"),  # an int past float's range
]


@pytest.mark.parametrize("args, error, match", FORWARD_ERRORS)
def test_bad_arguments_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        hs.sparse_attention(**args)
    saved = dict(out=np.zeros((3, 2, 8), np.float32), lse=np.zeros((3, 2), np.float32),
                 dout=np.zeros((3, 2, 8), np.float32))
    with pytest.raises(error, match=match):
        hs.sparse_attention_backward(**args, **saved)


def test_a_scale_float64_holds_is_taken_with_float64_inputs():
    """scale = 1e300 overflows float32 (rejected above) but not the float64 the
    call runs in when q and kv are float64: the larger logit takes all the weight."""
    q = np.array([[[1.0, -1.0]]])
    kv = np.array([[1.0, 0.0], [0.0, 1.0]])
    out, lse = hs.sparse_attention(q, kv, np.array([[0, 1]], np.int32), d_v=2, scale=1e300)
    np.testing.assert_array_equal(out, [[[1.0, 0.0]]])
    assert np.isposinf(lse[0, 0])  # lse is float32 whatever the inputs (Precision): 1e300 is past its range


def test_more_slots_than_int32_holds_are_refused():
    """k past 2**31 - 1 (the kernels' slot numbers are int32): a ValueError before
    anything reads the table (a zero-strided view: no 8 GiB allocated)."""
    wide = np.broadcast_to(np.int32(0), (1, 2**31))
    q, kv = np.zeros((1, 1, 16), np.float32), np.zeros((2, 16), np.float32)
    with pytest.raises(ValueError, match="indices has 2147483648 columns"):
        hs.sparse_attention(q, kv, wide, d_v=8)
    with pytest.raises(ValueError, match="indices has 2147483648 columns"):
        hs.indexer_scores_at(q, kv, np.ones((1, 1), np.float32), wide)


def test_missing_saved_tensors_are_named():
    args = _saved()
    for name in ("out", "lse", "dout"):
        with pytest.raises(TypeError, match=f"{name} must be an array, got None"):
            hs.sparse_attention_backward(**{**args, name: None})


def test_return_probs_must_be_a_bool():
    with pytest.raises(TypeError, match="return_probs must be a bool, got 1"):
        hs.sparse_attention(**_bad(), return_probs=1)


def test_precise_dkv_must_be_a_bool_and_changes_nothing_on_the_cpu():
    args = _saved()
    with pytest.raises(TypeError, match="precise_dkv must be a bool, got 'yes'"):
        hs.sparse_attention_backward(**args, precise_dkv="yes")
    default = hs.sparse_attention_backward(**args)
    precise = hs.sparse_attention_backward(**args, precise_dkv=True)
    assert all(same_bits(a, b) for a, b in zip(default, precise))


def _saved(**changes):
    args = _bad()
    out, lse = hs.sparse_attention(**args)
    args.update(out=out, lse=lse, dout=np.ones_like(out))
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args, error, match",
    [
        (_saved(out=np.zeros((3, 2, 9), np.float32)), ValueError,
         r"out must have shape \[N, h, d_v\] = \(3, 2, 8\), got \(3, 2, 9\)"),
        (_saved(dout=np.zeros((3, 8), np.float32)), ValueError, "dout must have 3 dimensions"),
        (_saved(dout=np.zeros((3, 2, 8), np.int64)), TypeError, "dout has dtype int64"),
        (_saved(lse=np.zeros((3, 3), np.float32)), ValueError, r"lse must have shape \[N, h\] = \(3, 2\)"),
        (_saved(lse=np.array([[0, 0], [0, np.nan], [0, 0]], np.float32)), ValueError,
         r"lse must be finite on rows with a valid slot, got lse\[1, 1\] = nan"),
        (_saved(lse=np.array([[0, 0], [0, 0], [-np.inf, 0]], np.float32)), ValueError,
         r"lse\[2, 0\] = -inf \(indices row 2 selects a key\)"),
    ],
)
def test_bad_saved_tensors_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        hs.sparse_attention_backward(**args)


@pytest.mark.gpu
def test_mixed_backends_are_rejected():
    import cupy

    q, kv, indices = make_inputs(np.random.default_rng(13), 3, 2, 4, 12, d_qk=16)
    with pytest.raises(TypeError, match="different backends"):
        hs.sparse_attention(cupy.asarray(q), kv, indices, d_v=8)


# GPU tensor-core kernels (cuda/sparse_attention.cu): bfloat16 and float16 at
# d_qk = 576, d_v = 512. The fixture makes the CuPy-primitive fallback raise,
# so these tests fail if the kernels do not run, and poisons the outputs
# (NaN), so an entry the kernels leave unwritten shows.

KERNEL_DTYPES = [pytest.param(bfloat16, id="bfloat16"), pytest.param(np.dtype(np.float16), id="float16")]


@pytest.fixture
def kernels(monkeypatch):
    from hyscale_core.ops.sparse_attention import gpu, gpu_fallback

    def refuse(*args, **kwargs):
        raise AssertionError("the CuPy-primitive fallback ran instead of the kernels")

    monkeypatch.setattr(gpu_fallback, "sparse_attention", refuse)
    monkeypatch.setattr(gpu_fallback, "sparse_attention_backward", refuse)
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)
    return gpu


def _f64(x):
    return to_host(x).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("h, k", SHAPES)
def test_kernels_forward_within_twice_naive_error(kernels, dtype, h, k):
    check_forward("gpu", *_grid_inputs(h, k, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("h, k", SHAPES)
def test_kernels_backward_within_twice_naive_error(kernels, dtype, h, k):
    check_backward("gpu", *_grid_inputs(h, k, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128, 150])
def test_kernels_precise_dkv_within_twice_naive_error(kernels, h):
    """precise_dkv=True: float32 dkv rows (the default rounds them to bfloat16)."""
    check_backward("gpu", *_grid_inputs(h, 2048, bfloat16), precise_dkv=True)


@pytest.mark.gpu
@pytest.mark.parametrize("keys", [1, 64, 65, 129, 1000])
def test_kernels_forward_rows_ending_in_empty_blocks(kernels, keys):
    """The forward takes blocks of 64 slots in pairs and stops after the last
    block holding a key: rows whose keys fill only the first `keys` of k =
    2048 slots (one block, an odd count, a lone slot in its block), and one
    row without keys."""
    q, kv, indices = make_inputs(np.random.default_rng(30), 4, 64, 2048, 3000, dtype=bfloat16, skip=0.1)
    indices[:, keys:] = -1
    indices[2] = -1
    check_forward("gpu", q, kv, indices)


@pytest.mark.gpu
@pytest.mark.parametrize("late_slot", [100, 1300, 1400, 2047])
def test_kernels_forward_row_bases_rising_late(kernels, late_slot):
    """The forward raises a row's base only where a block's maximum passes it by
    more than RAISE_SLACK (8 in base 2), which random logits do only in a row's
    first block. Here each query's rows 0, 20, 40 and 63 meet a key whose logit
    is about 12 (17 in base 2) at `late_slot` (in a block of warpgroup 1, 0, 1,
    and the last slot), after a key at half that slot that lifts them by less
    than the slack: o and l are rescaled after many blocks, by either warpgroup."""
    rng = np.random.default_rng(31)
    q, kv, indices = make_inputs(rng, 4, 64, 2048, 3000, skip=0.1)
    indices[indices >= 2970] = 0  # the keys set below appear only where placed
    for t in range(4):
        lift = q[t, [0, 20, 40, 63]].sum(axis=0)
        kv[2990 + t], kv[2980 + t] = 0.5 * lift, 0.25 * lift
        indices[t, late_slot], indices[t, late_slot // 2] = 2990 + t, 2980 + t
    check_forward("gpu", q.astype(bfloat16), kv.astype(bfloat16), indices)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [100, 150])
def test_kernels_partial_head_group_and_custom_scale(kernels, h):
    """h = 100: a full group of 64 heads and one of 36 (probs add the groups;
    one dkv-rows pass sums both); h = 150: groups of 64, 64, 22, so the dkv
    rows take two passes, the second of one partial group."""
    q, kv, indices = make_inputs(np.random.default_rng(20), 3, h, 300, 500, dtype=bfloat16)
    check_forward("gpu", q, kv, indices, scale=0.07)
    check_backward("gpu", q, kv, indices, scale=0.07)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernels_duplicates_and_rows_of_only_minus_one(kernels, dtype):
    rng = np.random.default_rng(21)
    q, kv, _ = make_inputs(rng, 4, 16, 3, 6, dtype=dtype)
    indices = np.array([[2, 2, -1], [2, 2, 5], [-1, -1, -1], [5, 0, 5]], dtype=np.int32)
    args = on("gpu", q, kv, indices)
    out, lse, probs = (_f64(x) for x in hs.sparse_attention(*args, return_probs=True))
    # Row 0 selects key 2 twice: the output is its value exactly, each copy weighs 1/2 per head.
    np.testing.assert_array_equal(out[0], np.broadcast_to(kv[2, :D_V].astype(np.float64), (16, D_V)))
    np.testing.assert_allclose(probs[0], [8.0, 8.0, 0.0], rtol=1e-5)
    assert probs[1, 0] == probs[1, 1] and probs[3, 0] == probs[3, 2]
    np.testing.assert_allclose(probs[[0, 1, 3]].sum(axis=1), 16.0, rtol=1e-5)
    # Row 2 selects nothing: out 0, lse -inf, probs 0, no NaN anywhere.
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all() and (probs[2] == 0).all()
    assert not np.isnan(out).any() and not np.isnan(lse).any() and np.isfinite(lse[[0, 1, 3]]).all()
    dout = rng.standard_normal((4, 16, D_V)).astype(dtype)
    fwd = hs.sparse_attention(*args)
    dq, dkv = (_f64(g) for g in hs.sparse_attention_backward(*args, *fwd, *on("gpu", dout)))
    assert (dq[2] == 0).all() and np.isfinite(dq).all() and np.isfinite(dkv).all()
    assert (dkv[[1, 3, 4]] == 0).all()  # keys nobody selected
    check_backward("gpu", q, kv, indices)


@pytest.mark.gpu
@pytest.mark.parametrize("precise_dkv", [False, True])
@pytest.mark.parametrize("h", [64, 128])
def test_kernels_are_bitwise_reproducible_and_chunk_invariant(kernels, monkeypatch, h, precise_dkv):
    """Repeated runs give the same bits; so does a backward split into one-query
    chunks, with the sums on a few SMs beside the dq kernel or on one stream."""
    rng = np.random.default_rng(22)
    q, kv, indices = make_inputs(rng, 24, h, 256, 200, dtype=bfloat16)  # every key shared by many slots
    dout = rng.standard_normal((24, h, D_V)).astype(bfloat16)
    args = on("gpu", q, kv, indices)
    first = hs.sparse_attention(*args, return_probs=True)
    grads = hs.sparse_attention_backward(*args, *first[:2], *on("gpu", dout), precise_dkv=precise_dkv)
    for _ in range(2):
        again = hs.sparse_attention(*args, return_probs=True)
        assert all(same_bits(a, b) for a, b in zip(first, again))
        regrads = hs.sparse_attention_backward(*args, *again[:2], *on("gpu", dout), precise_dkv=precise_dkv)
        assert same_bits(grads[0], regrads[0]) and same_bits(grads[1], regrads[1])
    monkeypatch.setattr(kernels, "ROWS_BYTES", 1)
    import cupy

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for spare in (24, 1, 2 * sms, 0):  # chunk c's sums on set-aside SMs beside chunk c + 1's dq kernel; 0: one stream
        monkeypatch.setattr(kernels, "SET_ASIDE_SMS", spare)
        chunked = hs.sparse_attention_backward(*args, *first[:2], *on("gpu", dout), precise_dkv=precise_dkv)
        assert same_bits(grads[0], chunked[0]) and same_bits(grads[1], chunked[1])
    out, lse, probs = kernels.sparse_attention(*args, D_V, 1 / 24, want_probs=False)
    assert probs is None and same_bits(out, first[0]) and same_bits(lse, first[1])


@pytest.mark.gpu
@pytest.mark.parametrize("passes", [1, 2])
def test_gpu_set_aside_sums_match_the_per_key_sums(passes):
    """sa_dkv_segments_set_aside_bf16 on 1 and 3 SMs gives the bits of
    sa_dkv_segments_bf16 (one CTA per key), and a float32 NumPy sum in the same
    order: keys with 0, 1, 7, 8, 9, 63 and 300 terms per pass (its loads go
    eight at a time), rows with NaN, +-inf and -0.0, one or two head passes."""
    import cupy

    from hyscale_core.gpu.segments import key_segments
    from hyscale_core.ops.sparse_attention import gpu

    rng = np.random.default_rng(41)
    counts = [0, 1, 7, 8, 9, 63, 300, 2, 0, 5] + [3] * 15  # slots per key; 25 keys: a lane of 1 SM takes several
    k, n_keys = 64, len(counts)
    flat = np.full(-(-sum(counts) // k) * k, -1, dtype=np.int32)
    flat[: sum(counts)] = rng.permutation(np.repeat(np.arange(n_keys, dtype=np.int32), counts))
    indices = flat.reshape(-1, k)
    rows = rng.standard_normal((indices.size * passes, D_QK)).astype(bfloat16)
    rows[rng.integers(0, rows.shape[0], 6), rng.integers(0, D_QK, 6)] = [np.nan, np.inf, -np.inf, -0.0, np.nan, 0.0]
    dkv0 = rng.standard_normal((n_keys, D_QK)).astype(np.float32)
    pairs, starts = key_segments(cupy.asarray(indices), cupy.int32, n_keys)
    bits = cupy.asarray(rows).view(cupy.uint16)
    defines = ("HS_SA_F16=0",)
    full = cupy.asarray(dkv0)
    gpu.sum_rows_by_key(bits, pairs, starts, k, passes, full, defines)
    expected = dkv0.copy()  # row (t * passes + p) * k + i for slot i of query t, passes in order
    for t, i in sorted(zip(*np.nonzero(indices >= 0)), key=lambda ti: (indices[ti], ti[0], ti[1])):
        for p in range(passes):
            expected[indices[t, i]] += rows[(t * passes + p) * k + i].astype(np.float32)
    got_full = cupy.asnumpy(full)
    np.testing.assert_array_equal(np.isnan(got_full), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert same_bits(got_full[finite], expected[finite])
    for sms in (1, 3):
        aside = cupy.asarray(dkv0)
        gpu.sum_rows_by_key(bits, pairs, starts, k, passes, aside, defines, sms=sms)
        assert same_bits(aside, full)
    with pytest.raises(ValueError, match="bfloat16 rows"):
        gpu.sum_rows_by_key(cupy.zeros((indices.size * passes, D_QK), cupy.float32), pairs, starts, k, passes,
                            cupy.asarray(dkv0), defines, sms=1)


@pytest.mark.gpu
def test_rows_budget_takes_a_share_of_free_memory_within_its_bounds(kernels, monkeypatch):
    import cupy

    free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
    expected = min(kernels.MAX_ROWS_BYTES, max(kernels.MIN_ROWS_BYTES, free // kernels.FREE_SHARE))
    assert abs(kernels.rows_budget() - expected) <= 64 << 20  # free memory moves a little between the reads
    monkeypatch.setattr(kernels, "ROWS_BYTES", 12345)
    assert kernels.rows_budget() == 12345
    per_query = 2048 * D_QK * 2  # one bfloat16 row per slot
    monkeypatch.setattr(kernels, "ROWS_BYTES", 3 * per_query)
    assert list(kernels.query_chunks(7, 2048, np.uint16)) == [(0, 3), (3, 6), (6, 7)]
    monkeypatch.setattr(kernels, "ROWS_BYTES", 6 * per_query)  # two chunks of at most 6: split evenly
    assert list(kernels.query_chunks(7, 2048, np.uint16)) == [(0, 4), (4, 7)]
    assert list(kernels.query_chunks(0, 2048, np.uint16)) == []
    assert list(kernels.query_chunks(7, 2048, np.uint16, at_least=3)) == [(0, 3), (3, 6), (6, 7)]
    assert list(kernels.query_chunks(2, 2048, np.uint16, at_least=3)) == [(0, 1), (1, 2)]


@pytest.mark.gpu
def test_kernels_empty_selections(kernels):
    q, kv, _ = make_inputs(np.random.default_rng(23), 3, 16, 1, 4, dtype=bfloat16)
    dout = np.ones((3, 16, D_V), bfloat16)
    for indices in (np.zeros((3, 0), np.int32), np.full((3, 70), -1, np.int32)):
        args = on("gpu", q, kv, indices)
        out, lse, probs = (_f64(x) for x in hs.sparse_attention(*args, return_probs=True))
        assert (out == 0).all() and np.isneginf(lse).all() and probs.shape == indices.shape and (probs == 0).all()
        dq, dkv = (_f64(g) for g in hs.sparse_attention_backward(*args, *on("gpu", out.astype(bfloat16),
                                                                             lse.astype(np.float32), dout)))
        assert (dq == 0).all() and (dkv == 0).all()
    out, lse = hs.sparse_attention(*on("gpu", q[:0], kv, np.zeros((0, 5), np.int32)))
    assert out.shape == (0, 16, D_V) and lse.shape == (0, 16)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def kernel_backend(request):
    """"cpu", or "gpu" held to the kernels (as the ``kernels`` fixture: fallback refused, outputs poisoned)."""
    if request.param == "gpu":
        request.getfixturevalue("kernels")
    return request.param


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n, k", [(1, 63), (5, 65), (3, 300)])
def test_kernel_shapes_slot_counts_around_a_block(kernel_backend, dtype, n, k):
    """k one slot short of and one past a 64-slot block, and a partial fifth block; down to one query."""
    q, kv, indices = make_inputs(np.random.default_rng(26 + k), n, 16, k, 500, dtype=dtype)
    check_forward(kernel_backend, q, kv, indices)
    check_backward(kernel_backend, q, kv, indices)


def _changed(a, b, lead):
    """Where a and b differ in any bit, over their first ``lead`` axes (bool)."""
    a, b = to_host(a), to_host(b)
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    diff = a.view(width) != b.view(width)
    return diff.reshape(diff.shape[:lead] + (-1,)).any(axis=-1)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_shapes_nan_stays_in_the_rows_it_reaches(kernel_backend, dtype):
    """A NaN in q[t, j] makes out[t, j] all NaN and lse[t, j] not finite; a NaN in kv row s does so
    for every head of every query selecting s; a NaN in dout[t, j] makes dq[t, j] all NaN and the dkv
    rows of t's keys NaN. Every other output keeps the bits of the run without the NaN (probs of a
    touched query aside: its heads are summed)."""
    rng = np.random.default_rng(29)
    q, kv, indices = make_inputs(rng, 6, 16, 70, 200, dtype=dtype)
    dout = rng.standard_normal((6, 16, D_V)).astype(dtype)
    clean = hs.sparse_attention(*on(kernel_backend, q, kv, indices), return_probs=True)
    s = int(indices[0, np.flatnonzero(indices[0] >= 0)[0]])
    q_nan, kv_nan = q.copy(), kv.copy()
    q_nan[2, 5, 100] = np.nan
    kv_nan[s, 550] = np.nan
    reached_q = np.zeros((6, 16), bool)
    reached_q[2, 5] = True
    reached_kv = np.broadcast_to((indices == s).any(axis=1)[:, None], (6, 16))
    for q_run, kv_run, reached in ((q_nan, kv, reached_q), (q, kv_nan, reached_kv)):
        out, lse, probs = hs.sparse_attention(*on(kernel_backend, q_run, kv_run, indices), return_probs=True)
        out_h, lse_h = to_host(out).astype(np.float64), to_host(lse)
        assert np.isnan(out_h[reached]).all() and not np.isfinite(lse_h[reached]).any()
        np.testing.assert_array_equal(_changed(out, clean[0], 2), reached)
        np.testing.assert_array_equal(_changed(lse, clean[1], 2), reached)
        untouched = ~reached.any(axis=1)
        assert same_bits(to_host(probs)[untouched], to_host(clean[2])[untouched])
    args = on(kernel_backend, q, kv, indices)
    base = hs.sparse_attention_backward(*args, *clean[:2], *on(kernel_backend, dout))
    dout_nan = dout.copy()
    dout_nan[2, 5, 17] = np.nan
    dq, dkv = hs.sparse_attention_backward(*args, *clean[:2], *on(kernel_backend, dout_nan))
    assert np.isnan(to_host(dq)[2, 5].astype(np.float64)).all()
    np.testing.assert_array_equal(_changed(dq, base[0], 2), reached_q)
    keys_of_2 = np.zeros(kv.shape[0], bool)
    keys_of_2[indices[2][indices[2] >= 0]] = True
    assert np.isnan(to_host(dkv)[keys_of_2].astype(np.float64)).all()
    np.testing.assert_array_equal(_changed(dkv, base[1], 1), keys_of_2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1), (7, 7), (5, 300), (3, 2048)])
def test_gpu_table_flags_match_the_array_checks(shape):
    """cuda/index_checks.cu flags an entry outside [-1, n_keys) in any row, and a
    non-finite lse only on a row that selects a key, as the array checks do."""
    import cupy

    from hyscale_core.gpu.checks import table_flags

    rng = np.random.default_rng(31)
    n, k = shape
    n_keys = 50
    for trial in range(6):
        indices = rng.integers(-1, n_keys, size=shape).astype(np.int32)
        lse = rng.standard_normal((n, 3)).astype(np.float32)
        t = int(rng.integers(0, n))
        if trial == 1:
            indices[t, int(rng.integers(0, k))] = n_keys
        if trial == 2:
            indices[t, int(rng.integers(0, k))] = -2
        if trial in (3, 4):
            lse[t, int(rng.integers(0, 3))] = [np.nan, -np.inf][trial - 3]
        if trial == 4:
            indices[t] = -1  # a row that selects nothing may have any lse
        if trial == 5:
            indices[t, 0] = np.iinfo(np.int32).max
        out_of_range = bool(((indices < -1) | (indices >= n_keys)).any())
        bad_lse = bool((~np.isfinite(lse) & (indices >= 0).any(axis=1)[:, None]).any())
        assert table_flags(cupy.asarray(indices), n_keys, cupy.asarray(lse)) == (out_of_range, bad_lse)
        assert table_flags(cupy.asarray(indices), n_keys) == (out_of_range, False)
    fortran = table_flags(cupy.asarray(indices, order="F"), n_keys)
    if 1 in shape:  # a single row or column is C-contiguous in either order: the kernel takes it
        assert fortran == (out_of_range, False)
    else:
        assert fortran is None
    assert table_flags(cupy.asarray(indices), n_keys, cupy.asarray(lse, dtype=cupy.float64)) is None
    assert table_flags(cupy.asarray(indices, dtype=cupy.int64), n_keys) is None


@pytest.mark.gpu
def test_gpu_calls_name_the_bad_index_and_lse():
    """The public calls on CuPy arrays report the same errors as on NumPy
    arrays, the index range first, through the one-kernel checks and through
    the array checks they fall back to (a Fortran-ordered table, float64 lse)."""
    import cupy

    q, kv, indices = make_inputs(np.random.default_rng(12), 3, 2, 4, 12, d_qk=16)
    out, lse = hs.sparse_attention(q, kv, indices, d_v=8)
    saved = dict(out=cupy.asarray(out), dout=cupy.asarray(np.ones_like(out)), d_v=8)
    g = dict(q=cupy.asarray(q), kv=cupy.asarray(kv))
    for layout in ("C", "F"):
        for value, where in ((12, "1, 2"), (-2, "2, 1")):
            bad = indices.copy()
            bad[tuple(int(i) for i in where.split(", "))] = value
            match = rf"indices\[{where}\] = {value} is out of range"
            table = cupy.asarray(bad, order=layout)
            with pytest.raises(ValueError, match=match):
                hs.sparse_attention(**g, indices=table, d_v=8)
            nan_lse = cupy.asarray(lse).copy()
            nan_lse[0, 0] = cupy.nan
            with pytest.raises(ValueError, match=match):  # the index error comes before the lse error
                hs.sparse_attention_backward(**g, indices=table, lse=nan_lse, **saved)
        for lse_dtype in (np.float32, np.float64):
            bad_lse = lse.astype(lse_dtype)
            bad_lse[1, 1] = np.nan
            indices_ok = indices.copy()
            indices_ok[1, 0] = 3  # row 1 selects a key
            with pytest.raises(ValueError, match=r"lse must be finite on rows with a valid slot, got lse\[1, 1\]"):
                hs.sparse_attention_backward(**g, indices=cupy.asarray(indices_ok, order=layout),
                                             lse=cupy.asarray(bad_lse), **saved)
            empty_row = indices.copy()
            empty_row[1] = -1  # a row without keys may have any lse
            hs.sparse_attention_backward(**g, indices=cupy.asarray(empty_row, order=layout),
                                         lse=cupy.asarray(bad_lse), **saved)
