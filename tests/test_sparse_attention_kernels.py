"""The GPU tensor-core kernels of hs.sparse_attention and its backward (cuda/sparse_attention*.cu).

Accuracy as in test_sparse_attention; besides, bitwise reproducibility, chunk
invariance, the key-major tables and the in-kernel index checks.
"""
from __future__ import annotations

import numpy as np
import pytest

import hyscale_core as hs
from helpers import on, same_bits, to_host
from hyscale_core._dtypes import bfloat16
from sparse_attention_cases import (
    D_QK,
    D_V,
    SHAPES,
    check_backward,
    check_forward,
    grid_inputs,
    make_inputs,
)


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
    check_forward("gpu", *grid_inputs(h, k, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("h, k", SHAPES)
def test_kernels_backward_within_twice_naive_error(kernels, dtype, h, k):
    check_backward("gpu", *grid_inputs(h, k, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128, 150])
def test_kernels_precise_dkv_within_twice_naive_error(kernels, h):
    """precise_dkv=True: float32 dkv rows (the default rounds them to bfloat16)."""
    check_backward("gpu", *grid_inputs(h, 2048, bfloat16), precise_dkv=True)


@pytest.mark.gpu
@pytest.mark.parametrize("k, keys", [(2048, 1), (2048, 64), (2048, 65), (2048, 129), (2048, 1000), (2348, 2049),
                                     (2348, 2348)])
def test_kernels_forward_rows_ending_in_empty_blocks(kernels, k, keys):
    """The forward takes blocks of 64 slots in pairs and stops after the last
    block holding a key: rows whose keys fill only the first `keys` of k
    slots (one block, an odd count, a lone slot in its block; past k = 2048
    the block count reads the row's tail in a second round of loads), and
    one row without keys."""
    q, kv, indices = make_inputs(np.random.default_rng(30), 4, 64, k, 3000, dtype=bfloat16, skip=0.1)
    indices[:, keys:] = -1
    indices[:, keys - 1] = np.arange(4)  # the last slot with a key is `keys` - 1, whatever the skips
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
