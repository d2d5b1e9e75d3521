"""The fused GPU indexer (cuda/indexer.cu) on shapes it is built for."""
from __future__ import annotations

import numpy as np
import pytest

import hyscale_core as hs
from helpers import same_bits, selection_agrees_up_to_tolerance, to_host
from hyscale_core._dtypes import bfloat16
from hyscale_core.ops.indexer import reference
from hyscale_core.ops.indexer.ranges import candidate_ranges

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    from hyscale_core.ops.indexer import gpu

    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


def device_inputs(n_q, n_k, heads, dim, dtype=bfloat16, seed=0, repeat_keys=False, rising=False):
    import cupy

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_q, heads, dim)).astype(dtype)
    k = rng.standard_normal((n_k, dim))
    if rising:  # later keys score higher: every key beats the threshold
        k = np.abs(k) * np.linspace(0.5, 2.0, n_k)[:, None]
        q = np.abs(q.astype(np.float32)).astype(dtype)
    k = k.astype(dtype)
    if repeat_keys:
        k[1::3] = k[0]
    w = (rng.standard_normal((n_q, heads)) / np.sqrt(heads)).astype(np.float32)
    if rising:
        w = np.abs(w)
    return tuple(cupy.asarray(a) for a in (q, k, w)), (q, k, w)


def materialised(scores, topk):
    kept = min(topk, scores.shape[1])
    values, indices = hs.topk(scores, kept)
    values, indices = to_host(values), to_host(indices)
    out = np.full((scores.shape[0], topk), -1, dtype=np.int32)
    out[:, :kept] = np.where(values == -np.inf, -1, indices)
    return out


MASKS = {
    "causal": {},
    "non_causal": dict(causal=False),
    "packed_1_7_300": dict(cu_seqlens=np.array([0, 1, 8, 308, 1000])),
    "packed_63_64_65": dict(cu_seqlens=np.array([0, 63, 127, 192, 1000])),  # around the 64-key tile
}


@pytest.mark.parametrize("heads, dim", [(64, 128), (32, 128), (128, 64), (256, 64), (8, 64), (64, 192), (16, 256)])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("topk", [1, 7, 64, 2048])
def test_streaming_equals_materialised(heads, dim, mask, topk):
    (q, k, w), _ = device_inputs(1000, 1000, heads, dim, repeat_keys=True, seed=topk)
    assert_streaming_equals_materialised(q, k, w, topk, MASKS[mask])


def assert_streaming_equals_materialised(q, k, w, topk, mask):
    """indexer_topk's indices equal topk of the table's, and its scores are the table's at them, bit for bit."""
    selection, picked = hs.indexer_topk(q, k, w, topk, return_scores=True, **mask)
    table = hs.indexer_scores(q, k, w, **mask)
    np.testing.assert_array_equal(to_host(selection), materialised(table, topk))
    sel, host_table = to_host(selection), to_host(table)
    expect = np.where(sel >= 0, np.take_along_axis(host_table, np.maximum(sel, 0), axis=1), -np.inf)
    assert same_bits(picked, expect.astype(np.float32))


@pytest.mark.parametrize("heads, dim", [(64, 128), (4, 32)], ids=["fused", "fallback"])
def test_topk_zero(heads, dim):
    """topk = 0: empty [Nq, 0] results from the fused kernel's shapes and from gpu_fallback's."""
    (q, k, w), _ = device_inputs(300, 300, heads, dim)
    selection, picked = hs.indexer_topk(q, k, w, 0, return_scores=True)
    assert selection.shape == picked.shape == (300, 0)
    assert (selection.dtype, picked.dtype) == (np.int32, np.float32)
    assert_streaming_equals_materialised(q, k, w, 0, {})


@pytest.mark.parametrize("heads, dim", [(64, 128), (32, 256), (8, 64)])
@pytest.mark.parametrize("topk", [2049, 2528, 2529, 4096])
def test_streaming_equals_materialised_above_2048(heads, dim, topk):
    """k past 2048 (the in-kernel sort holds 32 D picks: 4096 at D = 128, 2048 at D = 64, where these
    select from blocks of the score table): rows shorter and longer than k, prunes of buffers held in
    registers (2k + 64 <= 5120) and read from memory, final sorts of more than 2048 picks."""
    (q, k, w), _ = device_inputs(6000, 6000, heads, dim, repeat_keys=True, seed=topk)
    for mask in ({}, dict(cu_seqlens=np.array([0, 1, 8, 308, 3000, 6000]))):
        assert_streaming_equals_materialised(q, k, w, topk, mask)


def test_topk_past_the_kernel_sort_selects_from_the_kernel_scores(monkeypatch):
    """k = 5000 at D = 128 (past the sort's 4096): the table blocks come from the fused score kernel,
    never from gpu_fallback's cuBLAS products, whose rounding differs; small blocks split the queries."""
    from hyscale_core.ops.indexer import gpu, gpu_fallback

    def refuse(*args, **kwargs):
        raise AssertionError("gpu_fallback's scores served a shape the fused kernel is built for")

    monkeypatch.setattr(gpu_fallback, "indexer_topk", refuse)
    monkeypatch.setattr(gpu_fallback, "indexer_scores", refuse)
    monkeypatch.setattr(gpu, "TABLE_BLOCK_BYTES", 4 * 6000 * 700)  # blocks of 700 queries
    (q, k, w), _ = device_inputs(6000, 6000, 64, 128, repeat_keys=True, seed=9)
    for mask in ({}, dict(cu_seqlens=np.array([0, 1, 8, 308, 3000, 6000]))):
        assert_streaming_equals_materialised(q, k, w, 5000, mask)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
def test_other_input_dtypes(dtype):
    (q, k, w), _ = device_inputs(600, 600, 64, 128, dtype=dtype)
    np.testing.assert_array_equal(to_host(hs.indexer_topk(q, k, w, 100)), materialised(hs.indexer_scores(q, k, w), 100))


def test_query_shards_and_rising_scores():
    (q, k, w), _ = device_inputs(4096, 4096, 64, 128, rising=True)
    full = to_host(hs.indexer_topk(q, k, w, 256))
    np.testing.assert_array_equal(full, materialised(hs.indexer_scores(q, k, w), 256))
    for start, stop in [(0, 7), (7, 1000), (1000, 4096)]:
        shard = hs.indexer_topk(q[start:stop], k, w[start:stop], 256, q_pos=np.arange(start, stop))
        np.testing.assert_array_equal(to_host(shard), full[start:stop])


@pytest.mark.parametrize("repeat_keys", [False, True], ids=["distinct", "repeated_keys"])
@pytest.mark.parametrize("buffer_ks", [2, 3])
def test_long_sequence_with_many_prunes(monkeypatch, buffer_ks, repeat_keys):
    """The buffer size only decides when prunes happen, never what is selected. At k = 2048 a
    buffer of 2k + 64 is pruned from registers, one of 3k + 64 from global memory; with every
    third key repeated, ties straddle the k-th score in many prunes."""
    from hyscale_core.ops.indexer import gpu

    monkeypatch.setattr(gpu, "BUFFER_KS", buffer_ks)
    (q, k, w), _ = device_inputs(8192, 8192, 64, 128, seed=3, repeat_keys=repeat_keys)
    np.testing.assert_array_equal(to_host(hs.indexer_topk(q, k, w, 2048)),
                                  materialised(hs.indexer_scores(q, k, w), 2048))


def counted_reselections(monkeypatch, **settings):
    """Patch the guess settings of the GPU indexer; return the list that collects how many rows
    each call selects again after a failed guess."""
    from hyscale_core.ops.indexer import gpu

    for name, value in settings.items():
        monkeypatch.setattr(gpu, name, value)
    counts, select_again = [], gpu._select_again

    def counting(q, k, w, lo, hi, rows, indices, scores):
        counts.append(len(rows))
        select_again(q, k, w, lo, hi, rows, indices, scores)

    monkeypatch.setattr(gpu, "_select_again", counting)
    return counts


def falling_inputs(n, seed=11):
    """Positive q, k and w with keys that shrink by e every 300 positions: every query's early keys
    score highest, so a threshold guessed from a row's first keys is too high."""
    import cupy

    _, (q, k, w) = device_inputs(n, n, 64, 128, seed=seed)
    k = np.abs(k.astype(np.float32)) * np.exp(-np.arange(n, dtype=np.float32) / 300)[:, None]
    q = np.abs(q.astype(np.float32)).astype(bfloat16)
    return tuple(cupy.asarray(a) for a in (q, k.astype(bfloat16), np.abs(w)))


@pytest.mark.parametrize("guess_min", [4, 48])
def test_failed_guesses_are_selected_again(monkeypatch, guess_min):
    """Falling scores: every guess made fails, and those rows are selected again from the score
    table; the result still equals the materialised top-k bit for bit, with and without scores. At
    k = 64 and GUESS_MIN = 4 a guess is due once a row has seen 1/28 of its keys, before any prune
    (rows longer than about 120 keys make one); at GUESS_MIN = 48 once it has seen 3/7, after
    regular prunes in rows longer than about 450 keys."""
    counts = counted_reselections(monkeypatch, GUESS_MIN=guess_min)
    q, k, w = falling_inputs(4096)
    for mask in ({}, dict(cu_seqlens=np.array([0, 1, 8, 308, 3000, 4096]))):
        assert_streaming_equals_materialised(q, k, w, 64, mask)
        np.testing.assert_array_equal(to_host(hs.indexer_topk(q, k, w, 64, **mask)),
                                      materialised(hs.indexer_scores(q, k, w, **mask), 64))
    assert len(counts) == 4 and min(counts) > 3000, counts


def test_no_guess_when_turned_off(monkeypatch):
    counts = counted_reselections(monkeypatch, GUESS_BETA=0.0, GUESS_MIN=4)
    q, k, w = falling_inputs(4096)
    assert_streaming_equals_materialised(q, k, w, 64, {})
    assert counts == []


@pytest.mark.parametrize("topk, guess_min", [(256, 64), (2048, 96)])
def test_guesses_on_exchangeable_scores(monkeypatch, topk, guess_min):
    """Random scores: the guessed thresholds hold for (nearly) every row, and the selection is the
    materialised one whether or not some rows were selected again."""
    counts = counted_reselections(monkeypatch, GUESS_MIN=guess_min)
    (q, k, w), _ = device_inputs(16384, 16384, 64, 128, seed=topk)
    np.testing.assert_array_equal(to_host(hs.indexer_topk(q, k, w, topk)),
                                  materialised(hs.indexer_scores(q, k, w), topk))
    assert sum(counts) < 16384 // 100, counts


@pytest.mark.parametrize("topk", [7, 63, 300])
def test_guesses_with_ties_nan_and_short_rows(monkeypatch, topk):
    """A guess forced on almost every row (GUESS_MIN = 4, so r is a few candidates and many guesses
    fail) over repeated keys (ties at the guessed threshold), NaN and inf scores, and packed
    sequences of 1, 7, 63 and 300 keys beside long ones: still the materialised top-k, bit for bit."""
    import cupy

    counts = counted_reselections(monkeypatch, GUESS_MIN=4)
    _, (q, k, w) = device_inputs(4096, 4096, 64, 128, seed=topk, repeat_keys=True)
    q[3, 5, 7] = np.nan
    k[100] = np.nan
    k[500, 0] = np.inf
    q, k, w = (cupy.asarray(a) for a in (q, k, w))
    for mask in ({}, dict(cu_seqlens=np.array([0, 1, 8, 71, 371, 2000, 4096]))):
        assert_streaming_equals_materialised(q, k, w, topk, mask)
    assert counts, "no guess failed: the reselection path went untested"


@pytest.mark.parametrize("mask", ["causal", "non_causal"])
@pytest.mark.parametrize("topk", [64, 300, 2048])
def test_runs_of_tied_picks(mask, topk):
    """Keys repeated in blocks of 1 to 65, so the picks hold runs of equal scores of those lengths: the
    final sort ranks the indices within runs of up to 32 (TIE_RUN_MAX), and sorts again by index
    where a run is longer. Either way the rows equal the materialised selection."""
    import cupy

    rng = np.random.default_rng(topk)
    lengths = np.resize([1, 2, 3, 31, 32, 33, 34, 65], 90)
    distinct = rng.standard_normal((lengths.size, 128))
    k = np.repeat(distinct, lengths, axis=0)[rng.permutation(lengths.sum())].astype(bfloat16)
    n = k.shape[0]
    q = rng.standard_normal((n, 64, 128)).astype(bfloat16)
    w = (rng.standard_normal((n, 64)) / 8).astype(np.float32)
    q, k, w = (cupy.asarray(a) for a in (q, k, w))
    assert_streaming_equals_materialised(q, k, w, topk, MASKS[mask])


def test_every_score_tied():
    """q = 0: every visible key scores exactly 0, so every prune cuts a buffer of
    candidates that share all their bits and keeps the lowest indices."""
    import cupy

    (_, k, w), (host_q, _, _) = device_inputs(1000, 1000, 64, 128, seed=7)
    q = cupy.asarray(np.zeros(host_q.shape, dtype=host_q.dtype))
    for mask in MASKS:
        table = hs.indexer_scores(q, k, w, **MASKS[mask])
        host_table = to_host(table)
        assert (host_table[np.isfinite(host_table)] == 0).all()
        for topk in (1, 7, 64):
            np.testing.assert_array_equal(to_host(hs.indexer_topk(q, k, w, topk, **MASKS[mask])),
                                          materialised(table, topk), err_msg=f"{mask} topk={topk}")


def test_scores_that_underflow_below_zero_read_plus_zero():
    """Rows 0..499: every head's term, -1e-23 times a dot product of at most about 4e-24, rounds to
    -0.0 where the dot product is positive. The kernel folds such sums to +0.0 (its appends order
    fresh scores by their sign bit alone), so the table holds +0.0 there and the streaming
    selection, where every one of those keys ties, equals the materialised one."""
    import cupy

    _, (q, k, w) = device_inputs(1000, 1000, 64, 128, seed=8)
    q[:500] = np.float32(1e-25)  # rounds to the bfloat16 1.0017e-25
    w[:500] = -1e-23
    q, k, w = (cupy.asarray(a) for a in (q, k, w))
    table = to_host(hs.indexer_scores(q, k, w))
    visible = np.isfinite(table[:500])
    assert (table[:500][visible] == 0).all() and not np.signbit(table[:500][visible]).any()
    for topk in (7, 64, 300):
        np.testing.assert_array_equal(to_host(hs.indexer_topk(q, k, w, topk)), materialised(table, topk))


def test_candidate_buffers_past_32_bit_offsets_are_refused(monkeypatch):
    from hyscale_core.ops.indexer import gpu

    monkeypatch.setattr(gpu, "BUFFER_KS", 2**20)
    (q, k, w), _ = device_inputs(64, 64, 64, 128)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        hs.indexer_topk(q, k, w, 16)


# heads 256: one query's columns span both halves of the tile's products
@pytest.mark.parametrize("heads, dim", [(64, 128), (256, 64), (8, 64)])
def test_scores_match_float64_reference_and_cpu_selection(heads, dim):
    (q, k, w), (hq, hk, hw) = device_inputs(512, 512, heads, dim, seed=4)
    scores = to_host(hs.indexer_scores(q, k, w))
    lo, hi = candidate_ranges(512, 512, True)
    ref = reference.indexer_scores(hq, hk, hw, lo, hi)
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(ref))
    assert np.abs(scores[finite] - ref[finite]).max() / np.abs(ref[finite]).max() < 1e-5
    selection_agrees_up_to_tolerance(to_host(hs.indexer_topk(q, k, w, 64)), ref, 64, 1e-5)
    selection_agrees_up_to_tolerance(hs.indexer_topk(hq, hk, hw, 64), ref, 64, 1e-5)


def test_repeated_runs_are_identical():
    (q, k, w), _ = device_inputs(2048, 2048, 32, 128, seed=5)
    first = to_host(hs.indexer_topk(q, k, w, 512))
    for _ in range(3):
        np.testing.assert_array_equal(to_host(hs.indexer_topk(q, k, w, 512)), first)


def test_nan_and_inf_inputs_stream_like_materialised():
    """NaN in q or k: relu(NaN) = 0, so keys 100 and 101 (NaN) score exactly 0 for every query (a
    tie); an inf in key 500 gives +-inf and NaN scores (NaN ranks above +inf). The streaming
    selection still equals the table's top-k, and picked scores keep the table's bits."""
    import cupy

    _, (q, k, w) = device_inputs(1000, 1000, 64, 128, seed=6)
    q[3, 5, 7] = np.nan
    k[100] = np.nan
    k[101, 3] = np.nan
    k[500, 0] = np.inf
    q, k, w = (cupy.asarray(a) for a in (q, k, w))
    for mask in MASKS:
        table = to_host(hs.indexer_scores(q, k, w, **MASKS[mask]))
        if mask == "causal":
            assert (table[101:, [100, 101]] == 0).all() and np.isnan(table[500:, 500]).any()
        for topk in (1, 7, 64, 2048):
            selection, picked = hs.indexer_topk(q, k, w, topk, return_scores=True, **MASKS[mask])
            sel = to_host(selection)
            np.testing.assert_array_equal(sel, materialised(table, topk), err_msg=f"{mask} topk={topk}")
            expect = np.where(sel >= 0, np.take_along_axis(table, np.maximum(sel, 0), axis=1), -np.inf)
            assert same_bits(picked, expect.astype(np.float32))
