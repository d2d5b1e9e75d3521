"""hs.indexer_scores and hs.indexer_topk: reference, masks, streaming == materialised."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import hyscale_core as hs
from helpers import on, same_bits, selection_agrees_up_to_tolerance, to_host
from hyscale_core._dtypes import bfloat16
from hyscale_core.ops.indexer import reference
from hyscale_core.ops.indexer.ranges import candidate_ranges

BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def make_inputs(rng, n_q, n_k, heads=4, dim=16, dtype=np.float32, repeat_keys=False):
    q = rng.standard_normal((n_q, heads, dim)).astype(dtype)
    k = rng.standard_normal((n_k, dim)).astype(dtype)
    if repeat_keys:  # exact ties in every row
        k[1::3] = k[0]
    w = rng.standard_normal((n_q, heads)).astype(np.float32)
    return q, k, w


def materialised_selection(scores, topk):
    n_k = scores.shape[1]
    kept = min(topk, n_k)
    values, indices = hs.topk(scores, kept)
    values, indices = to_host(values), to_host(indices)
    selection = np.full((scores.shape[0], topk), -1, dtype=np.int32)
    selection[:, :kept] = np.where(values == -np.inf, -1, indices)
    return selection


MASK_CASES = {
    "causal": dict(causal=True),
    "non_causal": dict(causal=False),
    "packed_1_7_300": dict(causal=True, cu_seqlens=np.array([0, 1, 8, 308])),
    "packed_non_causal": dict(causal=False, cu_seqlens=np.array([0, 1, 8, 308])),
    "packed_with_empty": dict(causal=True, cu_seqlens=np.array([0, 0, 150, 150, 308])),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_scores_match_float64_reference(backend, case):
    rng = np.random.default_rng(0)
    q, k, w = make_inputs(rng, 308, 308)
    scores = to_host(hs.indexer_scores(*on(backend, q, k, w), **MASK_CASES[case]))
    lo, hi = candidate_ranges(308, 308, **MASK_CASES[case])
    ref = reference.indexer_scores(q, k, w, lo, hi)
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(ref))
    finite = np.isfinite(ref)
    err = np.abs(scores[finite] - ref[finite]).max() / np.abs(ref[finite]).max()
    assert err < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(MASK_CASES))
@pytest.mark.parametrize("topk", [1, 7, 64, 300, 400])
def test_streaming_equals_materialised(backend, case, topk):
    rng = np.random.default_rng(topk)
    q, k, w = make_inputs(rng, 308, 308, repeat_keys=True)
    args = on(backend, q, k, w)
    scores = hs.indexer_scores(*args, **MASK_CASES[case])
    selection, picked = hs.indexer_topk(*args, topk, return_scores=True, **MASK_CASES[case])
    assert to_host(selection).dtype == np.int32 and selection.shape == (308, topk)
    np.testing.assert_array_equal(to_host(selection), materialised_selection(scores, topk))
    table = to_host(scores)
    sel = to_host(selection)
    expect = np.where(sel >= 0, np.take_along_axis(table, np.maximum(sel, 0), axis=1), -np.inf)
    assert same_bits(picked, expect.astype(np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_shards_with_q_pos(backend):
    rng = np.random.default_rng(1)
    q, k, w = make_inputs(rng, 300, 300)
    full = to_host(hs.indexer_topk(*on(backend, q, k, w), 50))
    for start, stop in [(0, 7), (7, 70), (70, 300)]:
        pos = np.arange(start, stop)
        shard = hs.indexer_topk(*on(backend, q[start:stop], k, w[start:stop]), 50, q_pos=pos)
        np.testing.assert_array_equal(to_host(shard), full[start:stop])


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_shards_score_bitwise_as_one_call(backend):
    # 64 heads x 128 features: products large enough that a BLAS may pick
    # row-count-dependent kernels; a shard puts its queries at other rows
    rng = np.random.default_rng(5)
    q, k, w = make_inputs(rng, 300, 300, heads=64, dim=128)
    full = to_host(hs.indexer_scores(*on(backend, q, k, w)))
    _, full_picked = hs.indexer_topk(*on(backend, q, k, w), 63, return_scores=True)
    for start, stop in [(0, 1), (1, 8), (8, 71), (71, 300)]:
        pos = np.arange(start, stop)
        shard = hs.indexer_scores(*on(backend, q[start:stop], k, w[start:stop]), q_pos=pos)
        assert same_bits(to_host(shard), full[start:stop])
        _, picked = hs.indexer_topk(*on(backend, q[start:stop], k, w[start:stop]), 63, q_pos=pos, return_scores=True)
        assert same_bits(to_host(picked), to_host(full_picked)[start:stop])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_shorter_than_topk_end_in_minus_one(backend):
    rng = np.random.default_rng(2)
    q, k, w = make_inputs(rng, 63, 63)
    selection = to_host(hs.indexer_topk(*on(backend, q, k, w), 40))
    for t in range(63):
        n_candidates = min(t + 1, 40)
        assert (selection[t, :n_candidates] >= 0).all()
        assert (selection[t, n_candidates:] == -1).all()
        assert set(selection[t, :n_candidates]) <= set(range(t + 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float64], ids=["float16", "bfloat16", "float64"])
def test_low_precision_inputs(backend, dtype):
    rng = np.random.default_rng(3)
    q, k, w = make_inputs(rng, 200, 200, dtype=dtype)
    args = on(backend, q, k, w)
    np.testing.assert_array_equal(
        to_host(hs.indexer_topk(*args, 32)), materialised_selection(hs.indexer_scores(*args), 32)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_selection_agrees_with_float64_reference(backend):
    rng = np.random.default_rng(4)
    q, k, w = make_inputs(rng, 257, 257, heads=8, dim=32)
    selection = to_host(hs.indexer_topk(*on(backend, q, k, w), 20))
    lo, hi = candidate_ranges(257, 257, True)
    selection_agrees_up_to_tolerance(selection, reference.indexer_scores(q, k, w, lo, hi), 20, 1e-5)


def test_streaming_memory_stays_far_below_the_table():
    rng = np.random.default_rng(5)
    n = 4096
    q, k, w = make_inputs(rng, n, n, heads=2, dim=8)
    hs.indexer_topk(q[:64], k[:64], w[:64], 16)  # compile outside the measurement
    tracemalloc.start()
    hs.indexer_topk(q, k, w, 16)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    table_bytes = n * n * 4
    assert peak < table_bytes / 8, f"peak {peak} bytes vs table {table_bytes}"


def test_no_queries():
    q, k, w = make_inputs(np.random.default_rng(6), 0, 10)
    assert hs.indexer_topk(q, k, w, 4).shape == (0, 4)
    assert hs.indexer_scores(q, k, w).shape == (0, 10)


def _bad(**changes):
    rng = np.random.default_rng(7)
    q, k, w = make_inputs(rng, 10, 12)
    args = dict(q=q, k=k, w=w, topk=4)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args, error, match",
    [
        (_bad(q=np.zeros((10, 16), np.float32)), ValueError, r"q must have 3 dimensions \[Nq, H, D\]"),
        (_bad(k=np.zeros((12, 16, 1), np.float32)), ValueError, "k must have 2 dimensions"),
        (_bad(w=np.zeros((10,), np.float32)), ValueError, "w must have 2 dimensions"),
        (_bad(k=np.zeros((12, 15), np.float32)), ValueError, "head dim D mismatch: q has 16, k has 15"),
        (_bad(w=np.zeros((9, 4), np.float32)), ValueError, "query count Nq mismatch"),
        (_bad(w=np.zeros((10, 3), np.float32)), ValueError, "head count H mismatch"),
        (_bad(q=np.zeros((10, 4, 16), np.int32)), TypeError, "q has dtype int32"),
        (_bad(w=np.zeros((10, 4), np.int64)), TypeError, "w has dtype int64"),
        (_bad(topk=-1), ValueError, "topk must be in"),
        (_bad(topk=1.5), TypeError, "topk must be an integer"),
        (_bad(causal="yes"), TypeError, "causal must be a bool"),
        (_bad(q_pos=np.arange(9)), ValueError, "q_pos has 9 entries but q has 10"),
        (_bad(q_pos=np.arange(10) + 3), ValueError, r"q_pos\[9\] = 12 is outside the key range"),
        (_bad(q_pos=np.arange(10.0)), TypeError, "q_pos must hold integers"),
        (_bad(q_pos=np.array([2**64 - 1] + [0] * 9, np.uint64)), ValueError,
         r"q_pos\[0\] = 18446744073709551615 is past int64"),
        (_bad(cu_seqlens=np.array([0, 2**63, 12], np.uint64)), ValueError,
         r"cu_seqlens\[1\] = 9223372036854775808 is past int64"),
        (_bad(cu_seqlens=np.array([0, 5, 11])), ValueError, "cu_seqlens must start at 0 and end at Nk=12"),
        (_bad(cu_seqlens=np.array([0, 8, 5, 12])), ValueError, "cu_seqlens must be non-decreasing"),
        (_bad(cu_seqlens=np.array([12])), ValueError, "cu_seqlens needs at least 2 entries"),
        (_bad(return_scores=1), TypeError, "return_scores must be a bool"),
    ],
)
def test_bad_arguments_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        hs.indexer_topk(**args)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_rejected(value):
    args = _bad()
    args["w"][3, 2] = value
    with pytest.raises(ValueError, match=r"w must be finite, got w\[3, 2\]"):
        hs.indexer_topk(**args)
    with pytest.raises(ValueError, match="w must be finite"):
        hs.indexer_scores(args["q"], args["k"], args["w"])


def test_weights_past_float32_are_rejected():
    """w is taken in float32: a float64 weight beyond its range would be inf there (NaN scores)."""
    args = _bad()
    args["w"] = args["w"].astype(np.float64)
    args["w"][2, 1] = 1e39
    with pytest.raises(ValueError, match=r"w must be finite in float32, .* got w\[2, 1\] = 1e\+39"):
        hs.indexer_topk(**args)
    with pytest.raises(ValueError, match=r"w must be finite in float32"):
        hs.indexer_scores(args["q"], args["k"], args["w"])
    args["w"][2, 1] = 3e38  # within float32's range
    assert hs.indexer_topk(**args).shape == (10, 4)


@pytest.mark.parametrize("mask", [{}, dict(causal=False), dict(cu_seqlens=np.array([0, 1, 8, 12]))])
def test_topk_zero(mask):
    """topk = 0 gives empty [Nq, 0] results, as topk(indexer_scores(...), 0) does."""
    args = _bad(topk=0, return_scores=True, **mask)
    selection, picked = hs.indexer_topk(**args)
    assert selection.shape == picked.shape == (10, 0)
    assert (selection.dtype, picked.dtype) == (np.int32, np.float32)
    values, indices = hs.topk(hs.indexer_scores(args["q"], args["k"], args["w"], **mask), 0)
    assert values.shape == indices.shape == (10, 0)


def test_more_queries_than_keys_needs_q_pos():
    rng = np.random.default_rng(8)
    q, k, w = make_inputs(rng, 12, 10)
    with pytest.raises(ValueError, match="pass q_pos"):
        hs.indexer_topk(q, k, w, 3)
    assert hs.indexer_topk(q, k, w, 3, causal=False).shape == (12, 3)


@pytest.mark.gpu
def test_mixed_backends_are_rejected():
    import cupy

    q, k, w = make_inputs(np.random.default_rng(9), 10, 10)
    with pytest.raises(TypeError, match="different backends"):
        hs.indexer_topk(cupy.asarray(q), k, w, 3)
