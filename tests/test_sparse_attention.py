"""hs.sparse_attention and hs.sparse_attention_backward.

Accuracy follows flash-attention's rule: against a float64 reference, the
error is at most twice that of the same computation done naively in the
input precision (each intermediate rounded to it). Every gradient is also
checked by name against finite differences in float64.
Error is the maximum absolute difference; the naive backward is the same
flash-attention backward (p recomputed from the rounded lse) done plainly.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

import hyscale_core as hs
from helpers import finite_difference, on, same_bits, to_host
from hyscale_core._dtypes import bfloat16
from hyscale_core.ops.sparse_attention import keymajor, reference
from sparse_attention_cases import (
    BACKENDS,
    DTYPES,
    D_V,
    SHAPES,
    check_backward,
    check_forward,
    grid_inputs,
    make_inputs,
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h, k", SHAPES)
def test_forward_within_twice_naive_error(backend, h, k):
    check_forward(backend, *grid_inputs(h, k))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h, k", SHAPES)
def test_backward_within_twice_naive_error(backend, h, k):
    check_backward(backend, *grid_inputs(h, k))


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
